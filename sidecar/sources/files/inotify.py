"""File-change events for the follower: Linux inotify read by the event loop itself.

No thread and no timer: the descriptor is registered with `loop.add_reader`, so an idle
sidecar spends nothing here. Filesystems whose changes inotify never sees (NFS, SMB, FUSE,
9p) are recognised from /proc/self/mountinfo, and the follower polls them instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from sidecar.log import log

# <sys/inotify.h>
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x002, 0x004, 0x008
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x040, 0x080, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_ONLYDIR = 0x400, 0x800, 0x01000000
_IN_IGNORED = 0x8000  # a watch ended: its folder was removed (or moved off the filesystem)
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len name bytes
_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE
         | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR)
_READ_BYTES = 64 << 10
_CONTENT_ONLY = _IN_MODIFY | _IN_CLOSE_WRITE  # a file's bytes changed, no name or folder did

# Filesystems where another machine writes and inotify stays silent.
REMOTE_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs",
    "beegfs", "fuse", "fuseblk", "virtiofs"})


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding `path` (or its nearest existing parent), e.g. ext4,
    nfs4, fuse.sshfs; "" when it cannot be told."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                mount_point = fields[4].replace("\\040", " ")
                kind = fields[fields.index("-") + 1]
                inside = str(path) == mount_point or str(path).startswith(
                    mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, fstype = mount_point, kind
    except (OSError, ValueError, IndexError):
        return ""
    return fstype


def is_remote(fstype: str) -> bool:
    return fstype.split(".")[0] in REMOTE_FILESYSTEMS


class Inotify:
    """An inotify descriptor watching folders; calls `on_event` from the loop on any change.
    `take_changes` says what changed since it was last called: whether anything but a file's
    content did (a file created, moved, deleted, its attributes; an overflowed queue), and the
    files whose content changed: when those are all files the follower reads already, it only
    reads on, without looking for files."""

    def __init__(self, on_event: Callable[[], None]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter already uses
        self._add_watch = libc.inotify_add_watch
        self._add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        # folder -> its watch (-1: it could not be watched) and the folder's device and inode
        self._watched: dict[str, tuple[int, int, int]] = {}
        self._folders: dict[int, str] = {}  # by watch descriptor, absolute
        self._on_event = on_event
        self._structural = False
        self._modified: set[str] = set()  # absolute paths
        self._paused = False
        asyncio.get_running_loop().add_reader(self._fd, self._readable)

    def watch(self, folders: Iterable[str]) -> None:
        """Add watches for `folders` not watched yet. A folder removed
        and made again is watched again: its watch ended with it (IN_IGNORED), or, while a file
        of the old one is still open (which keeps it, and its watch, alive), the name now
        leads to another inode."""
        for folder in folders:
            try:
                st = os.stat(folder)
            except OSError:
                continue  # gone again: the next look sees its parent
            known = self._watched.get(folder)
            if known is not None and known[1:] == (st.st_dev, st.st_ino):
                continue
            wd = self._add_watch(self._fd, os.fsencode(folder), _MASK)
            if wd < 0:
                errno = ctypes.get_errno()
                log.info("no file events for %s (%s); it is polled", folder, os.strerror(errno))
            else:
                self._folders[wd] = os.path.abspath(folder)
            self._watched[folder] = (wd, st.st_dev, st.st_ino)

    def take_changes(self) -> tuple[bool, set[str]]:
        """(whether anything but a file's content changed, the files whose content changed)
        since the last call."""
        changes = self._structural, self._modified
        self._structural, self._modified = False, set()
        return changes

    def pause(self) -> None:
        """Leave events unread (they queue in the kernel) until `resume`: a steady trickle of
        writes wakes the loop once per gathering, not once per write."""
        if self._fd >= 0 and not self._paused:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._paused = True

    def resume(self) -> None:
        """Read events again; those that queued meanwhile call `on_event` at once."""
        if self._fd >= 0 and self._paused:
            asyncio.get_running_loop().add_reader(self._fd, self._readable)
        self._paused = False

    def close(self) -> None:
        if self._fd >= 0:
            if not self._paused:
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _readable(self) -> None:
        try:
            while data := os.read(self._fd, _READ_BYTES):
                self._forget_ended(data)
                if not self._structural:
                    self._structural = self._note(data)
        except BlockingIOError:
            pass
        except OSError as exc:
            log.warning("reading file events failed (%s); polling instead", exc)
            self.close()
            return
        self._on_event()

    def _forget_ended(self, data: bytes) -> None:
        """Drop the watches the kernel ended (IN_IGNORED), so that their folders are watched
        again once they exist again."""
        ended, offset = set(), 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _, name_len = _EVENT.unpack_from(data, offset)
            if mask & _IN_IGNORED:
                ended.add(wd)
            offset += _EVENT.size + name_len
        if ended:
            self._watched = {f: w for f, w in self._watched.items() if w[0] not in ended}
            for wd in ended:
                self._folders.pop(wd, None)

    def _note(self, data: bytes) -> bool:
        """Note the files whose content the events in `data` changed; True when one of them
        is more than a change of content (or cannot be told)."""
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            folder = self._folders.get(wd)
            if mask & ~_CONTENT_ONLY or folder is None or not length:
                return True
            start = offset + _EVENT.size
            name = data[start:start + length].rstrip(b"\0")
            self._modified.add(os.path.join(folder, os.fsdecode(name)))
            offset = start + length
        return offset != len(data)  # a torn read: cannot tell
