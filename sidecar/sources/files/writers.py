"""Which process, of those this one can see, holds a file open for writing (`/proc/*/fd` and
`/proc/*/fdinfo`): a checkpoint file a writer still holds so is never complete, however long
it has been quiet (a writer that pauses mid-save, a legacy pickle with no structure to check).

Limits: only processes in this PID namespace whose `/proc/PID/fd` this user may read (the
trainer's own user, or root; in a pod, `shareProcessNamespace`); a writer on another node of a
shared filesystem is invisible. The scan stops after SCAN_LIMIT_S.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection

SCAN_LIMIT_S = 1.0
_WRITE_MODES = (os.O_WRONLY, os.O_RDWR)


def open_for_writing(paths: Collection[str], proc: str = "/proc") -> str:
    """"" when no visible process holds one of `paths` (absolute) open for writing, else the
    first such: "PID (command)". Blocking: call it in a thread."""
    if not paths:
        return ""
    deadline = time.monotonic() + SCAN_LIMIT_S
    me = str(os.getpid())
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit() and name != me]
    except OSError:
        return ""
    for pid in pids:
        if time.monotonic() > deadline:
            return ""
        fd_dir = f"{proc}/{pid}/fd"
        try:
            with os.scandir(fd_dir) as fds:
                held = [fd.name for fd in fds if _target(fd.path) in paths]
        except OSError:  # gone, or not ours to read
            continue
        for fd in held:
            if _writing(f"{proc}/{pid}/fdinfo/{fd}"):
                return f"{pid} ({_command(proc, pid)})"
    return ""


def _target(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return ""


def _writing(fdinfo: str) -> bool:
    try:
        with open(fdinfo, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags:"):
                    return (int(line.split()[1], 8) & os.O_ACCMODE) in _WRITE_MODES
    except (OSError, ValueError, IndexError):
        return False
    return False


def _command(proc: str, pid: str) -> str:
    try:
        with open(f"{proc}/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"
