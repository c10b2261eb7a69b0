"""The crash tail (CONTRACT 4, /logs): what the ingest has not acknowledged of the last 64 KiB of
each stream when the command exits, journaled and delivered at least once before the end event.

While the command runs, /logs stays best-effort; each stream only remembers its recent pieces of
text (`StreamTail`) and which of them the ingest acknowledged. At the exit the unacknowledged
ones, in the order they were put, become one /logs body (with the failure summary after them) in
a journal of the state dir (journal.py's framing and durable acknowledged count), delivered with
retries within the output's share of the drain. What is left there goes with the next start or
`sidecar replay`, before the lifecycle events left with it, and never twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from sidecar.delivery.client import Answer, IngestClient, Verdict, json_body
from sidecar.delivery.journal import SKIPPED, Journal, append_dead_letter, read_back
from sidecar.log import log, state_write_failed
from sidecar.statefile import TEXT, Kind, record

TAIL_BYTES = 64 << 10  # CONTRACT 4: of each stream, what the crash tail may hold
JOURNAL_NAME = "logs-tail.journal"
ROUTE = "logs/tail"  # /logs, delivered strictly
LIST = Kind("a list", lambda v: isinstance(v, list))


class Piece:
    """One piece of a stream's text as it was put to /logs."""

    __slots__ = ("acked", "order", "text")

    def __init__(self, order: int, text: str, acked: bool = False) -> None:
        self.order = order  # across streams: the order the pieces were put in
        self.text = text
        self.acked = acked


class StreamTail:
    """A stream's recent pieces: at least TAIL_BYTES characters (so at least as many bytes)."""

    def __init__(self, orders: Iterator[int]) -> None:
        self.orders = orders  # shared by the streams of one run
        self._pieces: deque[Piece] = deque()
        self._chars = 0

    def add(self, text: str) -> Piece:
        piece = Piece(next(self.orders), text)
        self._pieces.append(piece)
        self._chars += len(text)
        while len(self._pieces) > 1 and self._chars - len(self._pieces[0].text) >= TAIL_BYTES:
            self._chars -= len(self._pieces.popleft().text)
        return piece

    def unacked(self) -> list[Piece]:
        """The pieces of the stream's last TAIL_BYTES (UTF-8) not acknowledged, oldest first;
        the oldest may be cut to its end."""
        kept: list[Piece] = []
        room = TAIL_BYTES
        for piece in reversed(self._pieces):
            size = len(piece.text.encode("utf-8", "surrogatepass"))
            if not piece.acked:
                text = piece.text
                if size > room:
                    text = piece.text.encode("utf-8", "surrogatepass")[-room:].decode(
                        "utf-8", "ignore")
                kept.append(Piece(piece.order, text) if text is not piece.text else piece)
            room -= size
            if room <= 0:
                break
        kept.reverse()
        return kept


def tail_pieces(tails: Sequence[StreamTail]) -> list[Piece]:
    """Every stream's unacknowledged tail, merged in the order the pieces were put."""
    return sorted((p for tail in tails for p in tail.unacked()), key=lambda p: p.order)


def new_tails(count: int) -> list[StreamTail]:
    orders = itertools.count()
    return [StreamTail(orders) for _ in range(count)]


class CrashTail:
    """The journal of crash tails in the run's folder and their strict, ordered delivery."""

    def __init__(self, run_dir: Path, run_id: str, client: IngestClient) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.client = client
        self._journal: Journal | None = None
        # bodies not yet acknowledged, and whether in the journal
        self._pending: list[tuple[bytes, bool]] = []
        self._lock = asyncio.Lock()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def open(self) -> int:
        """Load what an earlier sidecar left undelivered; returns how many bodies."""
        self._journal = Journal(self.run_dir / JOURNAL_NAME)
        self._pending = await asyncio.to_thread(read_back, self._journal, self._is_tail,
                                                "/logs bodies", self.run_id)
        skipped = sum(body == SKIPPED for body, _ in self._pending)
        if len(self._pending) > skipped:
            log.info("delivering the crash tail an earlier start left undelivered, before its "
                     "lifecycle events")
        return len(self._pending)

    async def add(self, chunks: list[str]) -> None:
        """Journal one body of `chunks` (durably, before its first attempt) for delivery."""
        if not chunks:
            return
        body = json_body({"run_id": self.run_id, "chunks": chunks, "eof": False})
        assert self._journal is not None, "open() first"
        try:
            await asyncio.to_thread(self._journal.append, body)
            self._pending.append((body, True))
        except OSError as exc:  # a full disk: still delivered from memory during this drain
            state_write_failed(self._journal.path, exc)
            self._pending.append((body, False))

    async def deliver(self, deadline: float | None = None) -> bool:
        """Deliver the bodies in order until none is left (True) or `deadline` passes."""
        delay = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay), self._lock:
                while self._pending:
                    await self._deliver_first()
        return not self._pending

    def _is_tail(self, body: bytes) -> bool:
        """Whether a record read back from the journal is a crash tail of this run, as `add`
        writes it (the state dir's loader rules: checked before it is trusted)."""
        try:
            doc = record(json.loads(body), {"run_id": TEXT, "chunks": LIST})
        except ValueError:
            return False
        return doc["run_id"] == self.run_id and all(isinstance(c, str) for c in doc["chunks"])

    async def _deliver_first(self) -> None:
        body, journaled = self._pending[0]
        answer = (Answer(Verdict.ACCEPTED) if body == SKIPPED
                  else await self.client.deliver(ROUTE, body))
        if answer.verdict is Verdict.REJECTED:
            log.error("/logs: HTTP %s: the ingest refused the crash tail for good; kept in %s",
                      answer.status, append_dead_letter(self.run_dir, "logs", answer.status, body))
        self._pending.pop(0)
        journal = self._journal
        if journal is None or not journaled:
            return
        try:
            await asyncio.to_thread(journal.ack)
            if not journal.pending:
                await asyncio.to_thread(journal.clear)
        except OSError as exc:
            state_write_failed(journal.path, exc)
