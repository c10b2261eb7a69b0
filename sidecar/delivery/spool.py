"""A route's overflow on disk: payloads the ingest could not take yet, in order, bounded in size.

Segments of framed records (`<u32 length><u32 crc32><payload>`, as in journal.py) under
`<run_dir>/spool/<route>/`, plus a `cursor` file (segment number and offset of the first record
not yet acknowledged) replaced atomically. A torn tail left by a crash is detected by its frame
and dropped (counted); a fully acknowledged segment is deleted.

fsync policy: every append is flushed and fsynced before `append` returns, since a payload
lands here only when the ingest is already failing, at the rate of a few a second at most.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import zlib
from pathlib import Path

from sidecar.delivery.journal import append_frames, frame
from sidecar.log import log, state_write_failed
from sidecar.statefile import (
    Malformed,
    clear_way,
    load_checked,
    open_checked,
    read_state,
    set_aside,
    write_atomic,
)

_HEADER = struct.Struct("<II")
SEGMENT_BYTES = 4 << 20
SEGMENT_NAME = re.compile(r"[0-9]{8}\.seg")
MAX_SPOOL_BYTES = 256 << 20  # per route; beyond it new payloads are refused with an ERROR


class SpoolFull(Exception):
    """The spool reached its size cap or the disk is full."""


class Spool:
    """Ordered, durable overflow of one route."""

    def __init__(self, folder: Path, max_bytes: int = MAX_SPOOL_BYTES) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.torn_bytes = 0
        self._segments: list[int] = []
        self._cursor = (0, 0)  # (segment, offset) of the first unacknowledged record
        self._bytes = 0
        self._records = 0

    def open(self) -> None:
        """Load what an earlier run left; drops a torn tail."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._segments = sorted(self._segment_numbers())
        self._cursor = self._read_cursor()
        self._bytes = self._records = 0
        for number in [n for n in self._segments if n < self._cursor[0]]:
            self._path(number).unlink()  # acknowledged before a crash left it behind
            self._segments.remove(number)
        for number in self._segments:
            path = self._path(number)
            data = self._read(number)
            start = self._cursor[1] if number == self._cursor[0] else 0
            good, count = _scan(data, start)
            if good < len(data):
                self.torn_bytes += len(data) - good
                log.warning("%s: dropped a torn tail of %d bytes left by a crash", path,
                            len(data) - good)
                with open(open_checked(path, os.O_RDWR), "r+b") as fh:
                    fh.truncate(good)
            self._bytes += good - start
            self._records += count

    @property
    def records(self) -> int:
        """Payloads waiting on disk."""
        return self._records

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def append(self, payloads: list[bytes]) -> None:
        """Store `payloads` durably at the end; SpoolFull when the cap or the disk says no."""
        frames = b"".join(frame(p) for p in payloads)
        if self._bytes + len(frames) > self.max_bytes:
            raise SpoolFull(f"the spool of {self.folder.name} reached its cap of "
                            f"{self.max_bytes >> 20} MiB")
        if not self._segments or self._path(self._segments[-1]).stat().st_size >= SEGMENT_BYTES:
            self._segments.append(self._segments[-1] + 1 if self._segments else 0)
        try:
            append_frames(self._path(self._segments[-1]), frames)
        except OSError as exc:  # ENOSPC and its kin: refused like a full spool
            state_write_failed(self.folder, exc)
            raise SpoolFull(f"cannot write the spool in {self.folder}: {exc.strerror}") from exc
        self._bytes += len(frames)
        self._records += len(payloads)

    def peek(self, limit: int) -> list[bytes]:
        """Up to `limit` payloads from the front, without removing them."""
        out: list[bytes] = []
        segment, offset = self._cursor
        for number in (n for n in self._segments if n >= segment):
            data = self._read(number)
            pos = offset if number == segment else 0
            while pos + _HEADER.size <= len(data) and len(out) < limit:
                length, _ = _HEADER.unpack_from(data, pos)
                out.append(data[pos + _HEADER.size: pos + _HEADER.size + length])
                pos += _HEADER.size + length
            if len(out) >= limit:
                break
        return out

    def ack(self, count: int) -> None:
        """Forget the first `count` payloads (they were acknowledged)."""
        segment, offset = self._cursor
        while count > 0 and self._segments:
            data = self._read(segment)
            while count > 0 and offset + _HEADER.size <= len(data):
                length, _ = _HEADER.unpack_from(data, offset)
                offset += _HEADER.size + length
                self._bytes -= _HEADER.size + length
                self._records -= 1
                count -= 1
            if offset >= len(data) and segment != self._segments[-1]:
                self._path(segment).unlink()
                self._segments.remove(segment)
                segment, offset = self._segments[0], 0
        self._cursor = (segment, offset)
        try:
            write_atomic(self.folder / "cursor", f"{segment} {offset}".encode())
        except OSError as exc:  # kept in memory; a crash before the next write repeats them
            state_write_failed(self.folder / "cursor", exc)
        if self._records == 0:
            self._reset()

    def _reset(self) -> None:
        """Everything acknowledged: start again from an empty first segment."""
        for number in self._segments:
            with contextlib.suppress(OSError):
                self._path(number).unlink()
        self._segments, self._cursor, self._bytes = [], (0, 0), 0
        with contextlib.suppress(OSError):
            (self.folder / "cursor").unlink()

    def _path(self, number: int) -> Path:
        return self.folder / f"{number:08d}.seg"

    def _read(self, number: int) -> bytes:
        """Segment `number`'s bytes, read the state folder's checked way; one that is gone, or
        was something else than a file (set aside), is the OSError a vanished file gives."""
        path = self._path(number)
        data = read_state(path)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "a spool segment is gone", str(path))
        return data

    def _segment_numbers(self) -> list[int]:
        """The numbers of the segments here; anything else named *.seg (a stray backup.seg) is
        set aside by the state dir's loader rules, never trusted."""
        numbers = []
        for path in self.folder.glob("*.seg"):
            if not SEGMENT_NAME.fullmatch(path.name):
                set_aside(path, "not a segment this spool writes (NNNNNNNN.seg)")
            elif clear_way(path) and path.exists():  # a FIFO there would block its read
                numbers.append(int(path.stem))
        return numbers

    def _read_cursor(self) -> tuple[int, int]:
        """Where the unacknowledged records begin; the whole spool when the cursor is absent,
        malformed (set aside) or names a segment that is gone."""
        cursor = load_checked(self.folder / "cursor", _parse_cursor)
        if cursor is None or cursor[0] not in self._segments:
            return (self._segments[0], 0) if self._segments else (0, 0)
        return cursor


def _parse_cursor(data: bytes) -> tuple[int, int]:
    segment, offset = (int(x) for x in data.decode("ascii").split())
    if segment < 0 or offset < 0:
        raise Malformed(f"a negative position {segment} {offset}")
    return segment, offset


def _scan(data: bytes, pos: int) -> tuple[int, int]:
    """The end of the intact records from `pos` on, and how many there are."""
    count = 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if end > len(data) or zlib.crc32(data[pos + _HEADER.size:end]) != crc:
            break
        pos, count = end, count + 1
    return pos, count
