"""The `/logs` batcher: text pieces in, chunked POSTs out, best-effort (CONTRACT 4).

`put` never blocks and never raises: when the ingest is slow or down, text waits in a buffer of
bounded size and the oldest is dropped (and counted) once it is full. One request is in flight
at a time so the console sees the text in order. Requests are paced as the item routes'
(batcher.Pace): text after a quiet spell goes at once, a steady trickle in about one request a
second, a batch worth its request (LINGER_BELOW_CHARS) without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from sidecar.aio import cancel, wait_set
from sidecar.delivery.batcher import PACE_S, Pace
from sidecar.delivery.client import IngestClient, Verdict, json_body
from sidecar.delivery.crashtail import Piece
from sidecar.log import log
from sidecar.records import LOG_BLOCK, Ticket
from sidecar.supervise import fault_point, supervise

MAX_BUFFER_CHARS = 8 << 20  # text held while the ingest is slow; beyond it the oldest is dropped
MAX_REQUEST_BYTES = 1 << 20  # nginx's default client_max_body_size (ingress-nginx's
#   proxy-body-size too): a larger body is answered 413
MAX_REQUEST_CHARS = LOG_BLOCK  # text in one request; denser text (non-ASCII, many escapes),
#   whose body would pass MAX_REQUEST_BYTES, lowers it
DENSE_TEXT_MARGIN = 16  # that lower limit is a sixteenth under the proportional one: the text
#   after may be denser still
MIN_FILL_SHARE = 8  # a request is topped up with the head of a text when 1/8 of it is left
MIN_SPLIT_CHARS = 1 << 10  # a batch refused as too large is halved down to this, then dropped
LINGER_S = 0.05  # how long a small batch waits for more text
LINGER_BELOW_CHARS = MAX_REQUEST_CHARS // 4  # a batch this big is worth its request at once:
#   waiting would only delay it (the end of a file read from its start), not spare a request
FLUSH_STALL_S = 1.0  # a flush gives up once no request was answered for this long


class LogShipper:
    """Buffers log text and ships it to `/logs` in order, dropping the oldest when full."""

    def __init__(self, client: IngestClient, run_id: str,
                 max_buffer_chars: int = MAX_BUFFER_CHARS,
                 max_request_chars: int = MAX_REQUEST_CHARS, linger_s: float = LINGER_S,
                 linger_below_chars: int = LINGER_BELOW_CHARS,
                 on_room: Callable[[], None] | None = None, pace_s: float = PACE_S) -> None:
        self.client = client
        self.run_id = run_id
        self.max_buffer_chars = max_buffer_chars
        self.max_request_chars = max_request_chars
        self.linger_s = linger_s
        self.linger_below_chars = linger_below_chars
        self.pace = Pace(pace_s)
        self.on_room = on_room  # called when room comes back (wakes a reader)
        self.dropped_chars = 0
        self.sent_chars = 0
        self._chunks: deque[tuple[str, Ticket | None, Piece | None]] = deque()
        self._buffered = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._lingering = False  # a small batch waits: only a big one or a flush wakes it
        self._hurry = False  # a flush waits: what is queued goes without lingering
        self._task: asyncio.Task[None] | None = None
        # taken, not yet answered
        self._inflight: list[tuple[str, Ticket | None, Piece | None]] | None = None
        self._answered = asyncio.Event()
        self._warned_at = float("-inf")
        self._halved_at = float("-inf")
        self._active_at = 0.0  # when a request was last sent or answered, or work came to an idle

    def start(self) -> None:
        """Start shipping, and what was put before."""
        if self._chunks:
            self._active_at = time.monotonic()
        else:
            self._idle.set()
        self._task = supervise("logs-shipper", self._run)

    @property
    def queued(self) -> int:
        """Chunks of text waiting to be sent."""
        return len(self._chunks)

    @property
    def has_room(self) -> bool:
        """Whether a whole request's worth of text is still welcome, so that what a source
        puts after asking is never dropped; when not, a source waits (a file) or drops before
        decoding (a pipe)."""
        return self._buffered + self.max_request_chars <= self.max_buffer_chars

    def count_dropped(self, size: int, why: str) -> None:
        """Count output a source dropped on this batcher's behalf."""
        self._drop(size, why)

    def put(self, text: str, ticket: Ticket | None = None, piece: Piece | None = None) -> None:
        """Queue `text` for `/logs`; never blocks. `ticket` is released once it was sent or
        given up on (best-effort: either way the source may move on); `piece` (of a stream's
        crash tail) is marked acknowledged once the ingest took it."""
        if not text:
            return
        self._chunks.append((text, ticket.hold() if ticket else None, piece))
        self._buffered += len(text)
        if self._idle.is_set():
            self._active_at = time.monotonic()
        self._idle.clear()
        while self._buffered > self.max_buffer_chars and len(self._chunks) > 1:
            oldest, done, _ = self._chunks.popleft()
            self._buffered -= len(oldest)
            self._drop(len(oldest), "the log buffer is full while the ingest is slow")
            if done is not None:
                done.release()
        if not self._lingering or self._buffered >= self.linger_below_chars:
            self._wake.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued was sent or dropped; False if `timeout_s` ran out or
        the request in flight has had no answer for FLUSH_STALL_S, counted from when it was
        sent, not from when the flush began: an ingest that hung during the run costs the
        exit at most what is left of that second (logs are best-effort, and the end event
        waits behind them). What is queued goes without lingering."""
        self._hurry = True
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while not self._idle.is_set():
            now = time.monotonic()
            stall_left = self._active_at + FLUSH_STALL_S - now
            left = min(deadline - now, stall_left)
            if left <= 0:
                return False
            await wait_set(self._idle, left)
        return True

    async def settle(self, timeout_s: float) -> None:
        """Stop sending once the request in flight was answered (or has had no answer for
        FLUSH_STALL_S since it was sent, or `timeout_s` ran out: then it is cancelled and its
        text queued again, unacknowledged). What the ingest acknowledged is then known."""
        deadline = time.monotonic() + timeout_s
        while self._inflight is not None:
            now = time.monotonic()
            left = min(deadline - now, self._active_at + FLUSH_STALL_S - now)
            if left <= 0 or not await wait_set(self._answered, left):
                break
        await cancel(self._task)
        self._task = None
        if self._inflight is not None:
            self._chunks.extendleft(reversed(self._inflight))
            self._buffered += sum(len(text) for text, _, _ in self._inflight)
            self._inflight = None

    def forget(self, pieces: Sequence[Piece]) -> None:
        """Take the queued text of `pieces` out: it goes by the crash tail's journal instead."""
        gone = {piece.order for piece in pieces}
        kept: deque[tuple[str, Ticket | None, Piece | None]] = deque()
        for entry in self._chunks:
            text, ticket, piece = entry
            if piece is None or piece.order not in gone:
                kept.append(entry)
                continue
            self._buffered -= len(text)
            if ticket is not None:
                ticket.release()
        self._chunks = kept

    async def stop(self) -> None:
        """Stop shipping; what is still buffered is counted as dropped."""
        await cancel(self._task)
        if self._buffered:
            self._drop(self._buffered, "shutdown reached its drain deadline")
            self._chunks.clear()
            self._buffered = 0

    async def _run(self) -> None:
        while True:
            fault_point()
            if self._inflight is None:  # else a failure interrupted it: send it again
                if not self._chunks:
                    self._idle.set()
                    self._hurry = False
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._linger()
                self._inflight = self._take()
                if self.on_room is not None and self.has_room:
                    self.on_room()
            batch = [text for text, _, _ in self._inflight]
            body = json_body({"run_id": self.run_id, "chunks": batch, "eof": False})
            size = sum(map(len, batch))
            if len(body) > MAX_REQUEST_BYTES and self._requeue(size, (
                    size * MAX_REQUEST_BYTES // len(body) * (DENSE_TEXT_MARGIN - 1)
                    // DENSE_TEXT_MARGIN)):
                continue  # never sent: an ingest behind nginx would refuse it
            self._active_at = time.monotonic()
            self.pace.sent(size >= self.linger_below_chars)
            self._answered.clear()
            answer = await self.client.deliver("logs", body)
            self._active_at = time.monotonic()
            self._answered.set()
            if answer.verdict is Verdict.TOO_LARGE and self._halve(size):
                continue
            entries, self._inflight = self._inflight, None
            if answer.ok:
                self.sent_chars += size
            else:
                self._drop(size, f"the ingest did not take it ({answer.detail or answer.status})")
            for _, ticket, piece in entries:
                if ticket is not None:
                    ticket.release()
                if piece is not None and answer.ok:
                    piece.acked = True

    async def _linger(self) -> None:
        """Give a small batch linger_s to gain company after a quiet spell, else until the
        pace allows the next request, and no longer than it takes to grow worth its request
        or than a flush allows."""
        deadline = time.monotonic() + self.pace.linger_s(self.linger_s)
        self._lingering = True
        try:
            while self._buffered < self.linger_below_chars and not self._hurry:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.clear()
                await wait_set(self._wake, left)
        finally:
            self._lingering = False

    def _halve(self, size: int) -> bool:
        """After a 413: the batch in flight goes again as two requests' worth, and requests
        carry at most half its characters from now on (the ingest's limit stays what it was).
        False when it is one text under 2 * MIN_SPLIT_CHARS: that is dropped, as any refused
        batch."""
        if not self._requeue(size, size // 2):
            return False
        if time.monotonic() - self._halved_at >= 60.0:
            self._halved_at = time.monotonic()
            log.warning("/logs: the ingest refused %d characters as too large (HTTP 413); "
                        "they are sent again in halves, and requests carry at most %d "
                        "characters from now on", size, self.max_request_chars)
        return True

    def _requeue(self, size: int, limit: int) -> bool:
        """Put the batch in flight (`size` characters) back at the front of the queue, to go
        in requests of at most `limit` characters from now on; a batch of one text has that
        text cut at a line end before `limit`. False (nothing done) when it is one text under
        2 * MIN_SPLIT_CHARS."""
        entries = self._inflight
        assert entries is not None
        if len(entries) == 1:
            if size < 2 * MIN_SPLIT_CHARS:
                return False
            entries = list(_cut(entries[0], limit))
        self.max_request_chars = max(min(self.max_request_chars, limit), 1)
        self._inflight = None
        self._chunks.extendleft(reversed(entries))
        self._buffered += size
        return True

    def _take(self) -> list[tuple[str, Ticket | None, Piece | None]]:
        """The next request's worth: whole texts while they fit, then the head of the next one
        up to its last line end in reach, so that a request is full: a read block just over
        the limit left a request of its own for the few lines past it. Only a text that opens
        the request is cut where the limit falls when it has no line end in reach."""
        batch: list[tuple[str, Ticket | None, Piece | None]] = []
        size = 0
        limit = self.max_request_chars
        while self._chunks:
            text = self._chunks[0][0]
            room = limit - size
            if len(text) <= room:
                batch.append(self._chunks.popleft())
                size += len(text)
                continue
            if batch and (room < limit // MIN_FILL_SHARE or text.rfind("\n", 0, room) < 0):
                break  # not worth a cut: the text starts the next request
            first, rest = _cut(self._chunks.popleft(), room)
            self._chunks.appendleft(rest)
            batch.append(first)
            size += len(first[0])
            break
        self._buffered -= size
        return batch

    def _drop(self, chars: int, why: str) -> None:
        if chars <= 0:  # nothing lost: no count, and no "dropped 0 characters"
            return
        self.dropped_chars += chars
        self.client.route_stats("logs").dropped += chars
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            log.warning("/logs: dropped %d characters of output: %s (%d dropped in all; "
                        "training is not affected)", chars, why, self.dropped_chars)


def _cut(entry: tuple[str, Ticket | None, Piece | None], at: int
         ) -> tuple[tuple[str, Ticket | None, Piece | None],
                    tuple[str, Ticket | None, Piece | None]]:
    """One queued text as two, cut after the last line end before `at` (else at `at`). Both
    hold its ticket; the first carries a stand-in of its piece, so that the crash tail still
    takes both out of the queue (`forget`) while only the second, the last of the text, marks
    the piece acknowledged."""
    text, ticket, piece = entry
    cut = text.rfind("\n", 0, at) + 1 or at
    head = text[:cut]
    first = (head, ticket.hold() if ticket is not None else None,
             Piece(piece.order, head) if piece is not None else None)
    return first, (text[cut:], ticket, piece)
