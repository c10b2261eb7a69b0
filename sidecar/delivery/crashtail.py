"""The crash tail (docs/ingest.md#the-crash-tail): what is unacknowledged of the last 64 KiB of
each stream when the command exits, journaled and delivered at least once before the end event.

While the command runs, /logs stays best-effort; each stream keeps a ledger of its recent pieces
of text (`StreamTail`): the shipper marks there, character by character, what is settled (the
ingest acknowledged it, or the shipper gave it up while the command ran: dropped, said, and marked
in the log where it was, so never sent later out of its place), and the crash tail reads it. At
the exit, once the request in flight was answered (or had no answer in time, and only then may its
text go twice; a failed answer there is not given up), the unacknowledged text of each
stream's last 64 KiB, in the order it was put (the failure summary last), becomes one /logs body
in a journal of the state dir (journal.py's framing and durable acknowledged count), delivered with
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
from typing import NamedTuple

from sidecar.delivery.client import Answer, IngestClient, json_body
from sidecar.delivery.journal import SKIPPED, Journal, read_back
from sidecar.delivery.strict import StrictSender
from sidecar.log import log
from sidecar.statefile import TEXT, Kind, record

TAIL_BYTES = 64 << 10  # of each stream, the crash tail's most (docs/ingest.md#the-crash-tail)
JOURNAL_NAME = "logs-tail.journal"
ROUTE = "logs/tail"  # /logs, delivered strictly
LIST = Kind("a list", lambda v: isinstance(v, list))


class Piece:
    """One piece of a stream's text as it was put to /logs, and which of its characters the
    ingest acknowledged: the ledger entry that the shipper writes and the crash tail reads."""

    __slots__ = ("_acked", "order", "text")

    def __init__(self, order: int, text: str) -> None:
        self.order = order  # across streams: the order the pieces were put in
        self.text = text
        self._acked: list[tuple[int, int]] = []  # [start, end) the ingest took, in order

    def ack(self, start: int, end: int) -> None:
        """The ingest acknowledged `text[start:end]`."""
        acked = self._acked
        if acked and acked[-1][1] == start:  # the usual case: the next part, in order
            acked[-1] = (acked[-1][0], end)
            return
        acked.append((start, end))
        acked.sort()

    @property
    def acked(self) -> bool:
        """Whether all of it was acknowledged."""
        return self.unacked() == []

    def unacked(self, start: int = 0) -> list[tuple[int, int]]:
        """The [start, end) ranges from `start` on that the ingest did not acknowledge."""
        gaps = []
        at = start
        for lo, hi in self._acked:
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < len(self.text):
            gaps.append((at, len(self.text)))
        return gaps


class Span:
    """Where a text queued for /logs lies in its piece: the shipper marks it acknowledged there
    once the ingest took it, and the crash tail takes out of the queue what it carries."""

    __slots__ = ("piece", "start")

    def __init__(self, piece: Piece, start: int = 0) -> None:
        self.piece = piece
        self.start = start  # of the text, in the piece's text

    def ack(self, size: int) -> None:
        self.piece.ack(self.start, self.start + size)

    def after(self, size: int) -> Span:
        """The span of what follows the first `size` characters of this one."""
        return Span(self.piece, self.start + size)


class TakenTail(NamedTuple):
    """The crash tail taken from the ledgers: what it carries, and from where in each piece
    (the queued text of a piece from that offset on goes by the crash tail instead)."""

    texts: list[str]
    carried_from: dict[int, int]  # piece order -> offset in its text


class StreamTail:
    """A stream's ledger: its recent pieces, at least TAIL_BYTES characters (so at least as
    many bytes), each with what of it the ingest acknowledged."""

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

    def window(self) -> list[tuple[Piece, int]]:
        """The pieces of the stream's last TAIL_BYTES (UTF-8), oldest first, each with the
        offset its part in the window starts at (0 but for the oldest, which may be cut)."""
        kept: list[tuple[Piece, int]] = []
        room = TAIL_BYTES
        for piece in reversed(self._pieces):
            encoded = piece.text.encode("utf-8", "surrogatepass")
            start = 0
            if len(encoded) > room:  # a character cut by the window's edge is left out whole
                start = len(piece.text) - len(encoded[-room:].decode("utf-8", "ignore"))
                # and so is a line: the window starts at one, and older text may be sent
                # after it (drain.py's _tail_first) or a line of ours put before it
                line_end = piece.text.find("\n", start - 1) if start else -1
                if line_end >= 0:
                    start = line_end + 1
            kept.append((piece, start))
            room -= len(encoded)
            if room <= 0:
                break
        kept.reverse()
        return kept


def take_tail(tails: Sequence[StreamTail]) -> TakenTail:
    """What the ingest did not acknowledge of every stream's window, merged in the order the
    pieces were put: acknowledged text is never in it, and no text outside it is left out of
    the queue (the oldest piece's part before the window stays queued)."""
    window = sorted((entry for tail in tails for entry in tail.window()),
                    key=lambda entry: entry[0].order)
    texts = [piece.text[lo:hi] for piece, start in window for lo, hi in piece.unacked(start)]
    return TakenTail(texts, {piece.order: start for piece, start in window})


def new_tails(count: int) -> list[StreamTail]:
    orders = itertools.count()
    return [StreamTail(orders) for _ in range(count)]


class CrashTail:
    """The journal of crash tails in the run's folder and their strict, ordered delivery."""

    def __init__(self, run_dir: Path, run_id: str, client: IngestClient) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.client = client
        # dead-lettered as /logs; the journal holds only what is not yet delivered
        self._lead = ""  # see `lead`
        self._sender = StrictSender(client, ROUTE, Journal(run_dir / JOURNAL_NAME), run_dir,
                                    letter_route="logs", refused=_refused, clear_when_done=True,
                                    body_of=self._body_of, accepted=self._accepted)
        self._lock = asyncio.Lock()

    @property
    def pending(self) -> int:
        return len(self._sender.queue)

    async def open(self) -> int:
        """Load what an earlier sidecar left undelivered; returns how many bodies."""
        left = await asyncio.to_thread(read_back, self._sender.journal, self._is_tail,
                                       "/logs bodies", self.run_id)
        self._sender.put(left)
        if any(body != SKIPPED for body, _ in left):
            log.info("delivering the command's last output that an earlier start left "
                     "undelivered to /logs, before its lifecycle events")
        return len(left)

    async def add(self, chunks: list[str]) -> None:
        """Journal one body of `chunks` (durably, before its first attempt) for delivery."""
        if not chunks:
            return
        # a full disk: still delivered from memory during this drain
        await self._sender.add(json_body({"run_id": self.run_id, "chunks": chunks,
                                          "eof": False}))

    def lead(self, line: str) -> None:
        """`line` goes first in the next body delivered, from memory (not journaled): the gap
        marker of the best-effort text given up before the crash tail."""
        self._lead = line

    def _body_of(self, record: bytes) -> bytes:
        if not self._lead:
            return record
        doc = json.loads(record)
        doc["chunks"].insert(0, self._lead)
        return json_body(doc)

    def _accepted(self, body: bytes) -> None:
        self._lead = ""

    async def deliver(self, deadline: float | None = None) -> bool:
        """Deliver the bodies in order until none is left (True) or `deadline` passes."""
        delay = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay), self._lock:
                await self._sender.send_all()
        return not self._sender.queue

    def _is_tail(self, body: bytes) -> bool:
        """Whether a record read back from the journal is a crash tail of this run, as `add`
        writes it (the state dir's loader rules: checked before it is trusted)."""
        try:
            doc = record(json.loads(body), {"run_id": TEXT, "chunks": LIST})
        except ValueError:
            return False
        return doc["run_id"] == self.run_id and all(isinstance(c, str) for c in doc["chunks"])


def _refused(body: bytes, answer: Answer, kept: Path | None) -> None:
    log.error("/logs: HTTP %s: the ingest refused the command's last output for good; %s",
              answer.status, f"kept in {kept}" if kept else "not kept", extra={"route": "logs"})
