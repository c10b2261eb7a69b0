"""What makes a followed file the same file across rename, rotation and truncation (issue: file
sources).

A file is known by device and inode, and by its content: a fingerprint of its first bytes
(offsets.fingerprint). A renamed file keeps its device and inode; a file truncated in place
(copytruncate, or by hand) keeps them too, but no longer begins with the bytes it began with.
A file that holds the same content as one followed in the same folder under a related name
(copytruncate's rotated copy, a move across filesystems) is the same content: the same first
bytes, and the same bytes just before where the shorter of the two ends (a followed file as far
as it was read, or while it is open as far as it holds).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.sources.files.offsets import FINGERPRINT_BYTES

if TYPE_CHECKING:
    from sidecar.sources.files.tail import FileId, Tail

END_CHECK_BYTES = 64  # a copy taken for a file's content must hold its last bytes read

_ROTATION_SUFFIX = re.compile(r"(?:[.\-_]\d+|\.(?:gz|bz2|xz|zst))+$")  # what logrotate appends


def file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


def last_bytes(fd: int, offset: int) -> bytes:
    """The END_CHECK_BYTES before `offset` of the file open as `fd` (fewer near its start)."""
    return _pread(fd, min(offset, END_CHECK_BYTES), offset - END_CHECK_BYTES)


def same_start(tail: Tail) -> bool:
    """Whether the file still begins with the bytes it began with (copytruncate, reuse); the
    tail's first bytes grow with a file still shorter than the fingerprint."""
    head = _pread(tail.fd, FINGERPRINT_BYTES, 0)
    if len(head) > len(tail.head) and head.startswith(tail.head):
        tail.head = head
    return head.startswith(tail.head) and bool(head or not tail.head)


def copy_holding(tail: Tail) -> Path | None:
    """A file in the same folder with the tail's content, holding all that was read of it
    (copytruncate's rotated copy)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(tail.path.parent):
            if entry.path == str(tail.path) or not entry.is_file():
                continue
            if entry.stat().st_size < tail.read_offset or not _related(str(tail.path),
                                                                       entry.path):
                continue
            with contextlib.suppress(OSError), open(entry.path, "rb") as fh:
                head = fh.read(FINGERPRINT_BYTES)
                fh.seek(tail.read_offset - len(tail.end))
                if _same_content(tail, entry.path, head) and \
                        fh.read(len(tail.end)) == tail.end:
                    return Path(entry.path)
    return None


def original_of(tails: Iterable[Tail], name: str, head: bytes, fd: int, size: int) -> Tail | None:
    """The one of `tails` (those followed in its folder) whose content the file at `name` (open
    as `fd`, `size` bytes long, beginning `head`) holds: the same start, and the same bytes just
    before where the shorter of the two ends. A tail open for reading holds what its file holds,
    read yet or not: it reads the rest from there. One found in the same look as its copy
    (copytruncate's, taken of a file first seen then) has read nothing yet, and only its file
    can say whether the copy holds its content. When that cannot be checked it is not a copy:
    better a repeat than a loss."""
    for tail in tails:
        if not _same_content(tail, name, head):
            continue
        held = max(tail.read_offset, tail.size) if tail.fd >= 0 else tail.read_offset
        upto = min(size, held)
        expected = tail.end if upto == tail.read_offset else \
            _pread(tail.fd, END_CHECK_BYTES, upto - END_CHECK_BYTES) if tail.fd >= 0 else b""
        if expected and _pread(fd, len(expected), upto - len(expected)) == expected:
            return tail
    return None


def _pread(fd: int, size: int, offset: int) -> bytes:
    try:
        return os.pread(fd, size, max(offset, 0)) if size > 0 else b""
    except OSError:
        return b""


def _related(one: str, other: str) -> bool:
    """Whether one file may be a rotated copy of the other: the same folder, and the same name
    but for rotation suffixes (app.log, app.log.1, app.log.2.gz, app.log-20261201)."""
    (folder, name), (other_folder, other_name) = os.path.split(one), os.path.split(other)
    return folder == other_folder and _unrotated(name) == _unrotated(other_name)


def _unrotated(name: str) -> str:
    return _ROTATION_SUFFIX.sub("", name) or name


def _same_content(tail: Tail, path: str, head: bytes) -> bool:
    """Whether a file at `path` beginning with `head` holds the tail's content: a related name,
    and first bytes of which the shorter is the start of the longer (a file shorter than the
    fingerprint may have grown since it was copied, or since it was read)."""
    own = str(tail.path)
    if not head or not tail.head or own == path or not _related(own, path):
        return False
    return head.startswith(tail.head) if len(head) >= len(tail.head) else \
        tail.head.startswith(head)
