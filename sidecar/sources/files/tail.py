"""One followed file (issue: file sources): what it is (device, inode, first bytes), where it
is, how far it was read, parsed and acknowledged, and whether it still holds its name."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.sources.base import Parser
from sidecar.sources.files.offsets import Mark, fingerprint

if TYPE_CHECKING:
    from sidecar.sources.files.spec import SourceSpec

FileId = tuple[int, int]  # device, inode: what a followed file is known by across renames


class Tail:
    """One file being followed."""

    def __init__(self, spec: SourceSpec, path: Path, dev: int, ino: int, head: bytes,
                 parser: Parser, read_offset: int, committed: int, state: dict[str, Any],
                 fd: int = -1, size: int = 0, end: bytes = b"") -> None:
        self.spec = spec
        self.path = path
        self.dev = dev
        self.ino = ino
        # the file's first bytes (up to FINGERPRINT_BYTES; grows with a short file)
        self.head = head
        self.parser = parser
        self.read_offset = read_offset
        self.committed = committed
        self.state = state  # the parser's, at `committed`
        self.fd = fd  # -1 while closed: idle, or no descriptor to spare
        self.size = size  # as last seen
        self.end = end  # the last END_CHECK_BYTES read
        self.buffer = b""
        self.pending: deque[list[Any]] = deque()  # [end offset, done, state]
        self.copies: list[Mark] = []  # copies whose offsets to save once committed past
        self.last_data = time.monotonic()
        self.last_read: float | None = None
        self.retired = False
        self.closed = False
        self.opened = time.monotonic()
        self.from_start = read_offset == 0  # not resumed past what an earlier start read
        self.points = 0  # given by its parser
        self.silence_said = False  # a file that gave no point was said (follow.NO_POINT_S)

    @property
    def id(self) -> FileId:
        return self.dev, self.ino

    @property
    def consumed(self) -> int:
        return self.read_offset - len(self.buffer)

    def mark(self, offset: int, state: dict[str, Any]) -> Mark:
        return Mark(str(self.path), self.dev, self.ino, fingerprint(self.head), offset, state,
                    len(self.head))
