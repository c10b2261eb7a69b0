"""The kernel's out-of-memory kills in this process's memory cgroup and the cgroups below it.

Read at the command's start and at its exit: a SIGKILL while a count went up was the OOM killer,
not someone outside. cgroup v2 keeps `oom_kill` in `memory.events` (the limit in `memory.max`);
v1 in `memory.oom_control` (the limit in `memory.limit_in_bytes`). Every folder below ours is
read, since a trainer may run in a cgroup of its own (a container runtime's, a job step's).
Blocking file reads: call from a thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_FOLDERS = 1000  # a runaway tree costs at most this many reads
_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-aligned LONG_MAX


class OomKill(NamedTuple):
    """A cgroup whose OOM-kill count went up, and its memory limit (None: none set)."""

    folder: Path
    kills: int
    limit_bytes: int | None


def own_memory_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup"),
                       root: Path = CGROUP_ROOT) -> list[Path]:
    """This process's memory cgroup folders (v2 and v1), those that exist."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        folder = base / path.lstrip("/")
        if not folder.is_dir():  # a cgroup namespace shows its root as the mount's
            folder = base
        if (folder / "memory.events").exists() or (folder / "memory.oom_control").exists():
            found.append(folder)
    return found


def oom_kill_counts(roots: list[Path]) -> dict[Path, int]:
    """The OOM-kill count of every cgroup folder at or below `roots`."""
    counts: dict[Path, int] = {}
    for root in roots:
        for folder, subfolders, _ in os.walk(root):
            if len(counts) >= MAX_FOLDERS:
                subfolders.clear()
                break
            count = _oom_kills(Path(folder))
            if count is not None:
                counts[Path(folder)] = count
    return counts


def oom_kills_since(before: dict[Path, int], roots: list[Path]) -> list[OomKill]:
    """The cgroups whose count went up since `before`, deepest first (the trainer's own)."""
    after = oom_kill_counts(roots)
    rose = [OomKill(folder, count - before.get(folder, 0), _limit(folder))
            for folder, count in after.items() if count > before.get(folder, 0)]
    return sorted(rose, key=lambda kill: len(kill.folder.parts), reverse=True)


def _oom_kills(folder: Path) -> int | None:
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (folder / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def _limit(folder: Path) -> int | None:
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            value = (folder / name).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < _UNLIMITED:
            return int(value)
        return None
    return None
