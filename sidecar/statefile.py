"""Files in the state dir: written so that a crash leaves the old or the new content, never
half; read back through one checked loader, so that a malformed one is set aside, never trusted
(a `{"files": null}` crashed every start), and so is anything that is not a regular file (a
directory or a FIFO where a journal belongs gave a traceback, or blocked the start for good); the
run's folder held by one sidecar, and each journal written by one process."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from sidecar.log import log, state_write_failed

# Every state file is opened so that nothing found in its place can block: not a FIFO (an open
# for reading waits for a writer, one for writing for a reader), not a device; nor followed as
# a symbolic link. What is there is looked at with lstat first.
_NO_WAIT = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


class NotAFile(OSError):
    """Something else than a regular file where a state file belongs."""


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of `path` opened with `flags` (O_CREAT creates it), never blocking;
    NotAFile when something else than a regular file is there, OSError when it cannot be
    opened."""
    fd = os.open(path, flags | _NO_WAIT, mode)
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise NotAFile(errno.EINVAL, f"{_kind(kind)} where a file belongs", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def clear_way(path: Path) -> bool:
    """Whether `path` is a regular file or absent; anything else there (lstat: nothing is
    opened) is set aside with one WARNING, and False returned when it could not be moved."""
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        return True
    if stat.S_ISREG(kind):
        return True
    return set_aside(path, f"{_kind(kind)} where a file belongs") is not None


def open_checked(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of state file `path`, the one way every file of the state folder is opened:
    anything else than a regular file there (a symbolic link, a directory, a FIFO) is first set
    aside with one WARNING (`clear_way`), and the open neither follows a link nor blocks
    (`open_regular`: NotAFile for one swapped in since). OSError when it cannot be opened."""
    clear_way(path)
    return open_regular(path, flags, mode)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new content;
    a directory or a link in its place is set aside first (`clear_way`), never written through."""
    tmp = path.with_name(path.name + ".tmp")
    clear_way(path)
    with open(open_checked(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as fh:
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


class Busy(Exception):
    """Another process holds a lock of the state dir."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by PID {holder or 'unknown'}")
        self.path = path
        self.holder = holder or "unknown"


class FolderBusy(Busy):
    """Another process holds the state folder's lock."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(folder, holder)
        self.folder = folder


def hold(path: Path) -> int:
    """Hold the lock file `path` for this process's life (an exclusive flock; the file names
    our PID); returns its descriptor, closed by `release`. Busy, naming the holder's PID, when
    another process holds it; OSError when it cannot be created."""
    fd = open_checked(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise Busy(path, holder) from None
    with contextlib.suppress(OSError):  # the PID is for the message of a second process only
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def claim_folder(folder: Path, *, lock: bool = True) -> int | None:
    """Create `folder`, prove that files can be written in it and, with `lock`, hold it for
    this process's life (`hold` on `folder/lock`); returns the lock's descriptor, closed by
    `release`. OSError when the folder cannot be created or written; FolderBusy when another
    process holds it. A full disk is no such fault: it is said (once a minute, as every failed
    state write) and the run goes on without the files."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".probe.{os.getpid()}"
    try:
        with open(open_checked(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as fh:
            fh.write(b"probe")
        probe.unlink()
        return hold(folder / LOCK_FILE) if lock else None
    except Busy as busy:
        raise FolderBusy(folder, busy.holder) from None
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        with contextlib.suppress(OSError):
            probe.unlink()
        state_write_failed(folder, exc)
        return None


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


def read_state(path: Path) -> bytes | None:
    """The bytes of state file `path`, or None when there is none. Anything there that is not a
    regular file (a directory, a FIFO, a socket, a device, a symbolic link) is set aside with
    one WARNING and read as absent, and nothing is opened that could block; OSError when a
    regular file cannot be read."""
    if not clear_way(path):
        return None
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except NotAFile as exc:  # swapped in since it was looked at
        set_aside(path, exc.strerror or "not a file")
        return None
    with open(fd, "rb") as fh:
        return fh.read()


def load_checked(path: Path, parse: Callable[[bytes], T]) -> T | None:
    """The content of state file `path` as `parse` reads it, or None when there is none. A file
    that cannot be read or that `parse` refuses (Malformed, or any ValueError, TypeError,
    KeyError), and anything that is not a regular file (`read_state`), is moved aside as
    NAME.bad-<time> with one WARNING, and None is returned: the caller carries on as if it were
    absent (docs/ingest.md#at-least-once: nothing lost, repeats allowed)."""
    try:
        data = read_state(path)
    except OSError as exc:
        set_aside(path, exc.strerror or exc.__class__.__name__)
        return None
    if data is None:
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
