"""The command's output on its way to /logs: a `Stream` for each of its pipes (or its one pipe,
or its terminal), fed by the pump threads (child.py) with every block, which it gives to the
failure scanner (signatures.py), the stall clock, the line assembler (lines.py) and then to the
log sink and the crash tail's ledger, within --log-rate (`Budget`). While the crash tail goes
first at the exit, what a writer the command left behind adds waits behind it (`BehindTail`).

The sink and the ledger are delivery's (delivery/logs.py's LogShipper, delivery/crashtail.py's
StreamTail); this module names only what it calls of them (`LogSink`, `Ledger`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sidecar.masking import mask
from sidecar.sources.console.child import READ_BYTES
from sidecar.sources.console.lines import SCREEN_SLICE_CHARS, LineAssembler
from sidecar.sources.console.signatures import Scanner
from sidecar.stall import StallWatch

if TYPE_CHECKING:
    from sidecar.stacks import RankClock

# characters of output the terminal model may have still to draw: more is dropped (a flood of
# escape sequences it draws at a few microseconds a character)
MAX_BACKLOG_CHARS = 64 << 10
# characters a writer the command left behind may write while the crash tail, taken before
# them, is delivered; more is dropped and counted
MAX_BEHIND_TAIL_CHARS = 1 << 20


class LogSink(Protocol):
    """Where a stream's text goes to /logs (delivery/logs.py's LogShipper)."""

    def put(self, text: str, ticket: Any = None, piece: Any = None, over_chars: int = 0,
            over_why: str = "") -> None: ...

    def count_dropped(self, size: int, why: str) -> None: ...


class Ledger(Protocol):
    """A stream's recent text for the crash tail (delivery/crashtail.py's StreamTail)."""

    def add(self, text: str) -> Any: ...


class BehindTail:
    """What the streams put once the crash tail was taken (a writer the command left behind)
    waits here until the crash tail is delivered or given up: it was written after it, and
    /logs keeps the order it was written in."""

    def __init__(self) -> None:
        self.texts: list[tuple[Stream, str]] = []
        self.chars = 0  # read in the pump threads

    def release(self, streams: Sequence[Stream]) -> None:
        """The crash tail went (or was given up): what waits goes on, and so what comes."""
        for stream in streams:
            stream.behind = None
        for stream, text in self.texts:
            stream.ship(text)
        self.texts.clear()
        self.chars = 0


class Budget:
    """--log-rate: a token bucket of output characters a second forwarded to /logs, shared by
    the command's streams."""

    def __init__(self, rate: float) -> None:
        self.rate = rate  # characters a second; 0: no limit
        self._tokens = rate  # a second's worth at the start
        self._at = time.monotonic()

    def take(self, size: int) -> int:
        """How many of `size` characters may go to /logs now (spent)."""
        if not self.rate:
            return size
        now = time.monotonic()
        self._tokens = min(self._tokens + (now - self._at) * self.rate, self.rate)
        self._at = now
        taken = int(min(max(self._tokens, 0.0), size))
        self._tokens -= taken
        return taken


class Stream:
    """One of the child's output streams on its way to /logs; the pump's Gate."""

    def __init__(self, name: str, assembler: LineAssembler, shipper: LogSink | None,
                 budget: Budget, scanner: Scanner, tail: Ledger, stall: StallWatch) -> None:
        self.name = name  # stdout or stderr, or both: ONE_PIPE, TTY (--tty)
        self.assembler = assembler
        self.shipper = shipper  # None when reporting is off
        self.budget = budget
        self.scanner = scanner  # failure signatures, looked for beside the log path
        self.tail = tail  # the recent text and what of it the ingest acknowledged (crash tail)
        self.stall = stall  # told of every block, read or skipped
        self.ranks: RankClock | None = None  # told of every block read: who printed last
        self.closed = asyncio.Event()  # the pipe's end: no process holds it any more
        self.ended = False  # finished for /logs: what comes after is not forwarded
        self.others: Sequence[Stream] = ()  # the command's other stream (none on one)
        self.behind: BehindTail | None = None  # set while the crash tail goes first
        self._skipped = 0
        self._resuming = False  # a call to draw the terminal's backlog is scheduled

    def allowance(self) -> tuple[int, str]:
        """In the pump thread: every block is read while reporting is on, whatever /logs will
        take of it, so that the failure scanner and the crash tail see every byte; only after
        the output's time it goes by splice(2)."""
        if self.shipper is None:
            return 0, "reporting is off"
        if self.ended:
            return 0, "the command exited and its output's time is up"
        room = MAX_BACKLOG_CHARS - self.assembler.backlog  # read, as it says, in this thread
        if not self.assembler.drawing or room <= 0:
            return READ_BYTES, ""
        return min(READ_BYTES, room), ""

    def taken(self, size: int) -> None:
        """The rate is spent on what goes to /logs, in `_put`."""

    def feed(self, block: bytes) -> None:
        """The block to the failure scanner first, then to the crash tail's ledger and /logs
        (best-effort: what /logs gives up, the ledger still holds)."""
        if self.ended:
            return
        self.stall.activity()
        if self.ranks is not None:
            self.ranks.feed(block)
        if self.shipper is None:
            return
        self.scanner.feed(self.name, block)
        if self.assembler.drawing and self.assembler.backlog >= MAX_BACKLOG_CHARS:
            self.skip(len(block), "the sidecar fell behind the command's output")
            return
        now = time.monotonic()
        for other in self.others:  # what they hold was written first
            other.commit(now)
        self._mark_gap()
        self._put(self.assembler.feed(block, now), metered=True)
        self._resume_soon()

    def commit(self, now: float) -> None:
        """Another stream wrote: the whole lines this one holds go first."""
        if self.shipper is not None:
            self._put(self.assembler.commit(now), metered=True)

    def _resume_soon(self) -> None:
        """The terminal draws a slice a call: the rest once the loop has run what waits."""
        if self.assembler.backlog and not self._resuming:
            self._resuming = True
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._resuming = False
        if self.shipper is not None:
            self._put(self.assembler.resume(time.monotonic()), metered=True)
            self._resume_soon()

    async def drawn(self) -> None:
        """Until the terminal drew what it was given so far, a slice a turn of the loop (what a
        writer that outlived the command adds meanwhile is left to `finish`)."""
        left = self.assembler.backlog
        while left > 0 and self.assembler.backlog and self.shipper is not None:
            self._put(self.assembler.resume(time.monotonic()))
            left -= SCREEN_SLICE_CHARS
            await asyncio.sleep(0)

    def skip(self, size: int, why: str) -> None:
        if self.ended:
            return
        self.stall.activity()
        self._skipped += size
        if self.shipper is not None:
            self.shipper.count_dropped(size, why)

    def tick(self) -> None:
        if self.shipper is not None and not self.ended:
            self._put(self.assembler.tick(time.monotonic()), metered=True)

    def finish(self) -> None:
        self.ended = True
        self.scanner.finish(self.name)
        if self.shipper is not None:
            self._mark_gap()
            self._put(self.assembler.finish())

    def _mark_gap(self) -> None:
        if self._skipped and self.shipper is not None:
            self._put(self.assembler.gap(self._skipped))
        self._skipped = 0

    def end_line(self) -> None:
        """A line of ours follows: the stream's open line (a partial sent) is ended first."""
        self._put(self.assembler.end_line())

    def announce(self, line: str) -> None:
        """A line of ours (`[sidecar] ...`, masked) in the stream, as its own line, prefixed."""
        self._put(self.assembler.own_line(line))

    def _put(self, text: str, metered: bool = False) -> None:
        """Text to the crash tail's ledger and to /logs, or, while the crash tail goes, behind
        it; of the command's output (`metered`), what is beyond --log-rate is given up in /logs
        only."""
        if not text or self.shipper is None:
            return
        behind = self.behind
        if behind is not None:
            if behind.chars >= MAX_BEHIND_TAIL_CHARS:
                self.shipper.count_dropped(len(text), "the log buffer is full while the "
                                           "command's last output is delivered")
                return
            behind.texts.append((self, text))
            behind.chars += len(text)
            return
        self.ship(text, metered)

    def ship(self, text: str, metered: bool = False) -> None:
        assert self.shipper is not None
        over = len(text) - self.budget.take(len(text)) if metered else 0
        self.shipper.put(text, piece=self.tail.add(text), over_chars=over,
                         over_why="the command writes faster than --log-rate forwards")


def announce_in(streams: Sequence[Stream], line: str) -> None:
    """A line of ours to /logs between the output's lines, never spliced into one of them: the
    streams' open lines are ended first (their rest, when it comes, is prefixed again)."""
    for stream in streams:
        stream.end_line()
    streams[-1].announce(mask(line))
