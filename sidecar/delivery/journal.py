"""A durable, ordered journal of payloads in the state dir, forgotten only once acknowledged.

Each record is framed as `<u32 length><u32 crc32><payload>` so that a tail torn by a crash is
detected, dropped and counted while everything before it replays. Acknowledgement is in order:
`<name>.acked` holds how many records from the start have been acknowledged, replaced
atomically. Appends and acks are fsynced: a record handed to the journal survives a crash. A
journal whose records must come from one process at a time (two writers each kept their own
acknowledged count, and the ingest saw events twice) is held by it: `hold`, on `<name>.lock`.
Both files are read through the state dir's checked loader: a directory or a FIFO in their
place is set aside, never opened in a way that blocks.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

from sidecar.log import log
from sidecar.statefile import (
    Malformed,
    hold,
    load_checked,
    open_checked,
    read_state,
    release,
    set_aside,
    write_atomic,
)

_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 64 << 20


class Journal:
    """An append-only file of framed records plus a durable count of acknowledged ones."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.torn_bytes = 0
        self._records: list[bytes] = []
        self._acked = 0
        self._ack_saved = True
        self._lock: int | None = None

    @property
    def ack_path(self) -> Path:
        return self.path.with_name(self.path.name + ".acked")

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def hold(self) -> None:
        """Be the journal's one writer until `close`: statefile.Busy, naming the holder's PID,
        while another process is; OSError when the lock cannot be created. Before `open`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = hold(self.lock_path)

    def close(self) -> None:
        """Let another process hold the journal."""
        release(self._lock)
        self._lock = None

    def open(self) -> list[bytes]:
        """Load the journal; returns the records not yet acknowledged, oldest first."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = read_state(self.path) or b""
        except OSError as exc:  # unreadable: kept for a person to look at, started afresh
            set_aside(self.path, exc.strerror or exc.__class__.__name__)
            data = b""
        self._records, good = _unframe(data)
        if good < len(data):
            self.torn_bytes = len(data) - good
            log.warning("%s: dropped a torn tail of %d bytes left by a crash; the %d records "
                        "before it are kept", self.path, self.torn_bytes, len(self._records))
            with open(open_checked(self.path, os.O_RDWR), "r+b") as fh:
                fh.truncate(good)
                os.fsync(fh.fileno())
        stored = self._read_acked()
        self._acked = min(stored, len(self._records))
        if stored != self._acked:  # a stale count would swallow the records appended next
            write_atomic(self.ack_path, str(self._acked).encode())
        return self._records[self._acked:]

    def append(self, payload: bytes) -> None:
        """Add one record durably (blocking: call from a thread on the event loop's behalf);
        OSError (a full disk) leaves the journal as it was."""
        append_frames(self.path, frame(payload))
        self._records.append(payload)

    def ack(self, count: int = 1) -> None:
        """Mark the next `count` records acknowledged, durably."""
        if count < 0:
            raise ValueError(f"cannot acknowledge {count} records")
        self._acked = min(self._acked + count, len(self._records))
        self._ack_saved = False
        write_atomic(self.ack_path, str(self._acked).encode())
        self._ack_saved = True

    def clear(self) -> None:
        """Forget every record once all are acknowledged: the journal first, so that a crash
        in between leaves an acknowledged count that `open` finds too high and corrects."""
        self.path.unlink(missing_ok=True)
        self.ack_path.unlink(missing_ok=True)
        self._records, self._acked, self._ack_saved = [], 0, True

    def save_ack(self) -> None:
        """Write the acknowledged count again if its last write failed (a full disk)."""
        if not self._ack_saved:
            write_atomic(self.ack_path, str(self._acked).encode())
            self._ack_saved = True

    @property
    def pending(self) -> int:
        """How many records are not yet acknowledged."""
        return len(self._records) - self._acked

    @property
    def records(self) -> tuple[bytes, ...]:
        """Every record the journal holds, acknowledged or not, oldest first."""
        return tuple(self._records)

    def _read_acked(self) -> int:
        """The acknowledged count; 0 (replay it all) when absent or malformed (set aside)."""
        return load_checked(self.ack_path, _parse_count) or 0


SKIPPED = b""  # in a queue read back: a record that is not the journal's own, acked unposted


def read_back(journal: Journal, belongs: Callable[[bytes], bool], what: str,
              run_id: str) -> list[tuple[bytes, bool]]:
    """Open `journal` and queue what it left undelivered, each record as (body, replayed):
    one that is not `what` of run `run_id` becomes SKIPPED, said once in a WARNING, never
    posted. Blocking: call it in a thread."""
    queue = [(body if belongs(body) else SKIPPED, True) for body in journal.open()]
    skipped = sum(body == SKIPPED for body, _ in queue)
    if skipped:
        log.warning("%s: %d record(s) are not %s of run %s; they are skipped, never posted",
                    journal.path, skipped, what, run_id)
    return queue


def _parse_count(data: bytes) -> int:
    count = int(data.decode("ascii").strip() or 0)
    if count < 0:
        raise Malformed(f"a negative count {count}")
    return count


def frame(payload: bytes) -> bytes:
    """`payload` framed with its length and CRC32, so that a torn copy is recognised."""
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def append_frames(path: Path, frames: bytes) -> None:
    """Append and fsync; on failure (ENOSPC...) cut the file back so no partial frame stays.
    Something else than a regular file at `path` is set aside first (`open_checked`), never
    followed or waited on."""
    with open(open_checked(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as fh:
        size = fh.tell()
        try:
            fh.write(frames)
            fh.flush()
            os.fsync(fh.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                fh.truncate(size)
            raise


def _unframe(data: bytes) -> tuple[list[bytes], int]:
    """The complete, intact records at the start of `data` and how many bytes they span."""
    records: list[bytes] = []
    pos = 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            break
        payload = data[pos + _HEADER.size:end]
        if zlib.crc32(payload) != crc:
            break
        records.append(payload)
        pos = end
    return records, pos
