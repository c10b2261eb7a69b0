"""Files in the state dir: written so that a crash leaves the old or the new content, never
half; read back through one checked loader, so that a malformed one is set aside, never trusted
(issue 13: a `{"files": null}` crashed every start); the run's folder held by one sidecar."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from sidecar.log import log, state_write_failed


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
LOCK_FILE = "lock"  # in a run's state folder: held (flock) by the one sidecar using it


class FolderBusy(Exception):
    """Another process holds the state folder's lock."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(f"{folder} is held by PID {holder or 'unknown'}")
        self.folder = folder
        self.holder = holder or "unknown"


def claim_folder(folder: Path, *, lock: bool = True) -> int | None:
    """Create `folder`, prove that files can be written in it and, with `lock`, hold it for
    this process's life (an exclusive flock on `folder/lock`, which names our PID); returns the
    lock's descriptor, closed by `release`. OSError when the folder cannot be created or
    written; FolderBusy when another process holds it. A full disk is no such fault: it is said
    (once a minute, as every failed state write) and the run goes on without the files."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".probe.{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"probe")
        probe.unlink()
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644) if lock \
            else None
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        with contextlib.suppress(OSError):
            probe.unlink()
        state_write_failed(folder, exc)
        return None
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise FolderBusy(folder, holder) from None
    with contextlib.suppress(OSError):  # the PID is for the message of a second sidecar only
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int | None) -> None:
    """Let go of a folder `claim_folder` locked."""
    if fd is not None:
        os.close(fd)


# -- reading back: every file of the state dir is checked before it is trusted ----------------

T = TypeVar("T")


class Malformed(ValueError):
    """A state file whose content is not what it should hold; says what is wrong."""


class Kind(NamedTuple):
    """What one field of a state file must hold."""

    name: str  # for the message: "an integer", "hex text"...
    test: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(value: Any) -> bool:
    return isinstance(value, str) and len(value) % 2 == 0 and all(
        c in "0123456789abcdefABCDEF" for c in value)


INTEGER = Kind("an integer", _is_int)
COUNT = Kind("a whole number, 0 or more", lambda v: _is_int(v) and v >= 0)
TEXT = Kind("text", lambda v: isinstance(v, str))
HEX = Kind("hex text", _is_hex)
OBJECT = Kind("an object", lambda v: isinstance(v, dict))


def record(value: Any, fields: Mapping[str, Kind],
           optional: Mapping[str, Kind] | None = None) -> dict[str, Any]:
    """The schema of a state file, one object at a time: `value` must be an object whose
    `fields` are all there and of their kinds, and whose `optional` ones are, where present.
    Returns just those fields (others are ignored); Malformed names the first at fault."""
    if not isinstance(value, dict):
        raise Malformed(f"{type(value).__name__} where an object belongs")
    out = {}
    for name, kind in (*fields.items(), *(optional or {}).items()):
        if name not in value:
            if name in fields:
                raise Malformed(f"no {name!r}")
            continue
        if not kind.test(value[name]):
            raise Malformed(f"{name!r} is {value[name]!r:.40}, not {kind.name}")
        out[name] = value[name]
    return out


def load_checked(path: Path, parse: Callable[[bytes], T]) -> T | None:
    """The content of state file `path` as `parse` reads it, or None when there is none. A file
    that cannot be read or that `parse` refuses (Malformed, or any ValueError, TypeError,
    KeyError) is moved aside as NAME.bad-<time> with one WARNING, and None is returned: the
    caller carries on as if it were absent (CONTRACT 4: nothing lost, repeats allowed)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        set_aside(path, exc.strerror or exc.__class__.__name__)
        return None
    try:
        return parse(data)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        set_aside(path, str(exc) if isinstance(exc, Malformed) else
                  f"{exc.__class__.__name__}: {exc}")
        return None


def set_aside(path: Path, why: str) -> Path | None:
    """Move a malformed state file out of the way (it is kept for a person to look at), with
    one WARNING; returns where it went, or None when it could not be moved."""
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    try:
        os.replace(path, aside)
    except OSError as exc:
        log.warning("%s is malformed (%s) and cannot be moved aside (%s); carrying on as if it "
                    "were not there", path, why, exc.strerror)
        return None
    log.warning("%s is malformed (%s): moved aside to %s; carrying on as if it were not there "
                "(the ingest may see repeats, nothing is lost)", path, why, aside.name)
    return aside
