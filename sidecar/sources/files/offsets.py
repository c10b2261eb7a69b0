"""Per-file offsets in the state dir, advanced once acknowledged (docs/ingest.md#at-least-once).

One JSON document, `offsets.json`, replaced atomically:

    {"version": 2, "files": {"<dev>:<ino>": {"path": str, "dev": int, "ino": int,
        "fingerprint": str, "head_bytes": int, "offset": int, "state": {...}}}}

A file is known by device, inode and a fingerprint: the hex BLAKE2b-64 checksum of its first
`head_bytes` bytes (up to FINGERPRINT_BYTES; fewer while the file is shorter, and the fingerprint
grows with it), so a new file on a reused inode starts from its beginning. `offset` is where
reading resumes; `state` is the file parser's own (a JSONL line number, CRI pieces of a line
still waiting for its end). Version 1 stored the first bytes themselves as hex in `fingerprint`
and had no `head_bytes`; it is converted on load. The document is read back through the state
dir's checked loader (MARK_FIELDS is its schema): a malformed one is set aside with one WARNING
and every file is then read from its start (the ingest may see repeats, nothing is lost), never
a crash loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from sidecar.aio import cancel
from sidecar.log import state_write_failed
from sidecar.masking import mask
from sidecar.statefile import (
    COUNT,
    HEX,
    INTEGER,
    OBJECT,
    TEXT,
    load_checked,
    record,
    write_atomic,
)
from sidecar.supervise import fault_point, supervise

SAVE_RETRY_S = 1.0
SAVE_SPACING_S = 0.1  # the least time between two writes of the offsets
FINGERPRINT_BYTES = 256  # a file is known by a checksum of this many first bytes (Vector's)
VERSION = 2


def fingerprint(head: bytes) -> str:
    """The checksum a file's first bytes are known by."""
    return hashlib.blake2b(head, digest_size=8).hexdigest()


class Mark:
    """Where reading one file may resume; its attributes (`vars`) are its offsets.json entry."""

    def __init__(self, path: str, dev: int, ino: int, fingerprint: str, offset: int,
                 state: dict[str, Any] | None = None, head_bytes: int = 0) -> None:
        self.path = path
        self.dev = dev
        self.ino = ino
        self.fingerprint = fingerprint  # fingerprint() of the file's first `head_bytes` bytes
        self.offset = offset
        self.state = {} if state is None else state  # the parser's own (line numbers...)
        self.head_bytes = head_bytes

    def matches(self, head: bytes) -> bool:
        """Whether a file beginning with `head` is the file this mark was taken of."""
        return len(head) >= self.head_bytes and fingerprint(
            head[:self.head_bytes]) == self.fingerprint

    @classmethod
    def of_version_1(cls, fields: dict[str, Any]) -> Mark:
        head = bytes.fromhex(fields.pop("fingerprint"))
        return cls(fingerprint=fingerprint(head), head_bytes=len(head), **fields)


# The schema of offsets.json's marks (module docstring), for the state dir's checked loader.
MARK_FIELDS = {"path": TEXT, "dev": INTEGER, "ino": INTEGER, "fingerprint": HEX, "offset": COUNT,
               "state": OBJECT}
MARK_FIELDS_SINCE_2 = {"head_bytes": COUNT}


def parse_offsets(data: bytes) -> dict[str, Mark]:
    """offsets.json's marks by "dev:ino"; Malformed (or ValueError) when it is not one."""
    doc = record(json.loads(data), {"files": OBJECT}, {"version": INTEGER})
    version_1 = doc.get("version") == 1
    marks = [Mark.of_version_1(fields) if version_1 else Mark(**fields)
             for fields in (record(value, MARK_FIELDS, {} if version_1 else MARK_FIELDS_SINCE_2)
                            for value in doc["files"].values())]
    return {f"{mark.dev}:{mark.ino}": mark for mark in marks}


class Offsets:
    """The offsets document and a background saver."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.marks: dict[str, Mark] = {}  # by "dev:ino"
        self._dirty = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # the last write, which a cancel cannot stop
        self._writing: asyncio.Future[None] | None = None

    def load(self) -> None:
        """The offsets an earlier start left; none when the document is absent or malformed
        (set aside by the loader: every file is then read from its start)."""
        self.marks = load_checked(self.path, parse_offsets) or {}

    def find(self, dev: int, ino: int) -> Mark | None:
        return self.marks.get(f"{dev}:{ino}")

    def set(self, mark: Mark) -> None:
        self.marks[f"{mark.dev}:{mark.ino}"] = mark
        self._dirty = True
        self._changed.set()

    def forget(self, dev: int, ino: int) -> None:
        if self.marks.pop(f"{dev}:{ino}", None) is not None:
            self._dirty = True
            self._changed.set()

    def start(self) -> None:
        self._task = supervise("offsets", self._saver)

    async def stop(self) -> None:
        """Stop the saver and write what is left."""
        await cancel(self._task)
        await self.save()

    async def save(self) -> bool:
        """Write the offsets if they changed; False when the state dir refused (a full disk:
        they stay in memory, and a crash meanwhile repeats what was delivered since)."""
        # One write at a time, in order: the saver cancelled at stop left its write running in
        # its thread, and the final save's write, of newer offsets, overtook it and was then
        # replaced by it (a restart read again what had been delivered), or the two shared
        # the temporary file.
        while self._writing is not None and not self._writing.done():
            try:
                await asyncio.shield(self._writing)
            except OSError:  # that write's offsets are still to be written: this one does
                self._dirty = True
        if not self._dirty:
            return True
        self._dirty = False
        # a path is there to be read by a person (marks are known by device and inode): a
        # token in it is masked like anywhere else we write (docs/ingest.md#logs)
        doc = {"version": VERSION, "files": {k: {**vars(m), "path": mask(m.path)}
                                             for k, m in self.marks.items()}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        self._writing = asyncio.ensure_future(asyncio.to_thread(write_atomic, self.path, data))
        try:
            await asyncio.shield(self._writing)
        except OSError as exc:
            self._dirty = True
            state_write_failed(self.path, exc)
            return False
        return True

    async def _saver(self) -> None:
        # Written as soon as progress is acknowledged, then not again for SAVE_SPACING_S
        # (changes meanwhile are coalesced into the next write): a file read at full speed is
        # acknowledged every few milliseconds, and each write costs two fsyncs. A crash repeats
        # what was in flight and at most that much acknowledged since.
        while True:
            fault_point()
            await self._changed.wait()
            self._changed.clear()
            if not await self.save():
                await asyncio.sleep(SAVE_RETRY_S)
                self._changed.set()
            else:
                await asyncio.sleep(SAVE_SPACING_S)
