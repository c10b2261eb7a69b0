"""The descriptors the followed files may hold (issue: file sources).

A share of RLIMIT_NOFILE (`descriptor_budget`), the rest left to the ingest client, the spool and
the child's pipes. A file read to its end gives its descriptor back after a quiet while, or at
once when another file needs one, the longest idle first; the follower reopens it when it
changes, after checking that it is still the same file (identity.py).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from typing import TYPE_CHECKING

from sidecar.log import log

if TYPE_CHECKING:
    from sidecar.sources.files.tail import Tail

IDLE_CLOSE_S = 10.0  # a file read to its end and quiet this long gives its descriptor back
DESCRIPTOR_SHARE = 4  # files may hold 1/4 of RLIMIT_NOFILE: sockets, spool and pipes need theirs
MAX_OPEN_FILES = 1024
MIN_OPEN_FILES = 4


def descriptor_budget() -> int:
    """How many files may be open at once, from the soft RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    return max(MIN_OPEN_FILES, min(MAX_OPEN_FILES, soft // DESCRIPTOR_SHARE))


class Descriptors:
    """The descriptors of the followed files, at most `budget` open at once."""

    def __init__(self, released: Callable[[], None]) -> None:
        self.budget = descriptor_budget()  # files open at once, at most
        self.open_count = 0
        self._idle: dict[Tail, None] = {}  # open, read to the end: LRU
        # called each time a tail's descriptor is given back: the files open for reading changed
        self._released = released

    def open(self, name: str) -> int | None:
        """A descriptor for `name` within the budget (an idle file gives its own back), or None
        (the file waits for the next look)."""
        while self.open_count >= self.budget and self._idle:
            self.release(next(iter(self._idle)))
        if self.open_count >= self.budget:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot open %s: %s", name, exc.strerror)
            return None
        self.open_count += 1
        return fd

    def close(self, fd: int) -> None:
        self.open_count -= 1
        with contextlib.suppress(OSError):
            os.close(fd)

    def release(self, tail: Tail) -> None:
        """Close the tail's descriptor; it is reopened when the file changes."""
        self._idle.pop(tail, None)
        if tail.fd >= 0:
            self.close(tail.fd)
            tail.fd = -1
            self._released()

    def caught_up(self, tail: Tail) -> None:
        """`tail` is open and read to its end: its descriptor may be given back."""
        self._idle[tail] = None

    def busy(self, tail: Tail) -> None:
        """`tail` has more to read, or its descriptor is spoken for: not one to give back."""
        self._idle.pop(tail, None)

    def any_idle(self) -> bool:
        return bool(self._idle)

    def release_idle(self, now: float) -> None:
        """Give back the descriptors of files read to their end and quiet since IDLE_CLOSE_S
        before `now` (time.monotonic)."""
        for tail in list(self._idle):
            if now - tail.last_data > IDLE_CLOSE_S:
                self.release(tail)
