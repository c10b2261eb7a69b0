"""Files in the state dir: written so that a crash leaves the old or the new content, never half."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


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
    written; FolderBusy when another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".probe.{os.getpid()}"
    with open(probe, "wb") as fh:
        fh.write(b"probe")
    probe.unlink()
    if not lock:
        return None
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise FolderBusy(folder, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int | None) -> None:
    """Let go of a folder `claim_folder` locked."""
    if fd is not None:
        os.close(fd)
