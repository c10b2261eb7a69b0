"""The `/logs` batcher: text pieces in, chunked POSTs out, best-effort (docs/ingest.md#best-effort).

`put` never blocks and never raises: when the ingest is slow or down, text waits in a buffer of
bounded size and a failed request is retried for as long as the buffer has room; once it is
full the oldest text is dropped, counted, and marked where it was by a line of ours that names
every character dropped there. One request is in flight at a time so the console sees the text
in order. Requests are paced as the item routes' (batcher.Pace): text after a quiet spell goes
at once, a steady trickle in about one request a second, a batch worth its request
(LINGER_BELOW_CHARS) without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping

from sidecar.aio import cancel, wait_set
from sidecar.delivery.batcher import PACE_S, Pace
from sidecar.delivery.client import IngestClient, Verdict, json_body
from sidecar.delivery.crashtail import Piece, Span
from sidecar.log import log
from sidecar.records import LOG_BLOCK, Ticket
from sidecar.supervise import fault_point, supervise

MAX_BUFFER_CHARS = 8 << 20  # text held while the ingest is slow; beyond it the oldest is dropped
# a text queued for /logs: its ticket, where it lies in its piece of the crash tail's ledger, and
# why it is given up once it reaches the head of the queue ("" to send it)
Queued = tuple[str, Ticket | None, Span | None, str]
# nginx's default client_max_body_size (ingress-nginx's proxy-body-size too): a larger body is
# answered 413
MAX_REQUEST_BYTES = 1 << 20
# text in one request; denser text (non-ASCII, many escapes), whose body would pass
# MAX_REQUEST_BYTES, lowers it
MAX_REQUEST_CHARS = LOG_BLOCK
# that lower limit is a sixteenth under the proportional one: the text after may be denser still
DENSE_TEXT_MARGIN = 16
MIN_FILL_SHARE = 8  # a request is topped up with the head of a text when 1/8 of it is left
MIN_SPLIT_CHARS = 1 << 10  # a batch refused as too large is halved down to this, then dropped
LINGER_S = 0.05  # how long a small batch waits for more text
# a batch this big is worth its request at once: waiting would only delay it (the end of a file read
# from its start), not spare a request
LINGER_BELOW_CHARS = MAX_REQUEST_CHARS // 4
FLUSH_STALL_S = 1.0  # a flush gives up once no request was answered for this long


class LogShipper:
    """Buffers log text and ships it to `/logs` in order, dropping the oldest when full."""

    def __init__(self, client: IngestClient, run_id: str,
                 max_buffer_chars: int = MAX_BUFFER_CHARS,
                 max_request_chars: int = MAX_REQUEST_CHARS, linger_s: float = LINGER_S,
                 linger_below_chars: int = LINGER_BELOW_CHARS,
                 on_room: Callable[[], None] | None = None, prefix: str = "",
                 pace_s: float = PACE_S) -> None:
        self.client = client
        self.run_id = run_id
        self.max_buffer_chars = max_buffer_chars
        self.max_request_chars = max_request_chars
        self.linger_s = linger_s
        self.linger_below_chars = linger_below_chars
        self.pace = Pace(pace_s)
        self.on_room = on_room  # called when room comes back (wakes a reader)
        self.prefix = prefix  # of the log's lines (--log-prefix), for a gap's line of ours
        self.dropped_chars = 0
        self.sent_chars = 0
        # characters given up since the last text sent: said by a line of ours where they were,
        # before the next text that goes (the gap marker)
        self._gap = 0
        self._gap_why = ""
        self._line_open = False  # the log's last character sent was not a line end
        self.stop_reason = "shutdown reached its drain deadline"  # of what `stop` drops
        self._chunks: deque[Queued] = deque()
        self._buffered = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._lingering = False  # a small batch waits: only a big one or a flush wakes it
        self._hurry = False  # a flush waits: what is queued goes without lingering
        self._task: asyncio.Task[None] | None = None
        # taken, not yet answered
        self._inflight: list[Queued] | None = None
        # the queue behind the request in flight overflowed: it is given up once its attempt
        # fails, instead of being retried (it is the oldest text)
        self._overtaken = False
        self._answered = asyncio.Event()
        self._settling = False  # no new request: the one in flight is waited for (the exit)
        self.flush_stall_s = FLUSH_STALL_S  # `run` at the exit: its output's share bounds it
        self._warned_at = float("-inf")
        self._halved_at = float("-inf")
        self._active_at = 0.0  # when a request was last sent or answered, or work came to an idle
        # how long the last request took to its answer (retries included), or has been in
        # flight when `settle` gave up waiting: the pace the queue goes at
        self.latency_s = 0.0

    def start(self) -> None:
        """Start shipping, and what was put before."""
        self._settling = False
        if self._chunks:
            self._active_at = time.monotonic()
        else:
            self._idle.set()
        self._task = supervise("logs-shipper", self._run)

    def resume(self) -> None:
        """Ship again after `settle`: output a writer the command left behind goes on after
        the crash tail."""
        if self._task is None:
            self.start()

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
        """Count output a source dropped on this batcher's behalf (one piece of `size`)."""
        self._drop(size, why, 1)

    def put(self, text: str, ticket: Ticket | None = None, piece: Piece | None = None,
            over_chars: int = 0, over_why: str = "") -> None:
        """Queue `text` for `/logs`; never blocks. `ticket` is released once it was sent or
        given up on (best-effort: either way the source may move on); `piece` (of a stream's
        crash tail) is marked acknowledged in its ledger once the ingest took it. The last
        `over_chars` of it (from a line end) are given up, `over_why`, once they reach the head
        of the queue, not before: until then the crash tail may still carry them."""
        if not text:
            return
        entry = (text, ticket.hold() if ticket else None,
                 Span(piece) if piece is not None else None, "")
        if over_chars > 0:
            sent, over = _cut(entry, max(len(text) - over_chars, 0))
            self._queue(sent)
            self._queue((*over[:3], over_why))
        else:
            self._queue(entry)
        while self._buffered > self.max_buffer_chars and len(self._chunks) > 1:
            self._overtaken = self._inflight is not None
            self._drop_head("the log buffer is full while the ingest is slow")
        if not self._lingering or self._buffered >= self.linger_below_chars:
            self._wake.set()

    def _queue(self, entry: Queued) -> None:
        if not entry[0]:
            if entry[1] is not None:
                entry[1].release()
            return
        self._chunks.append(entry)
        self._buffered += len(entry[0])
        if self._idle.is_set():
            self._active_at = time.monotonic()
        self._idle.clear()

    def _drop_head(self, why: str) -> None:
        """Give up the oldest queued text, `why`."""
        oldest, done, span, _ = self._chunks.popleft()
        self._buffered -= len(oldest)
        self._give_up(len(oldest), why)
        if done is not None:
            done.release()
        if span is not None:
            span.ack(len(oldest))  # given up: the crash tail does not carry it later

    @property
    def queued_chars(self) -> int:
        """Characters of text waiting to be sent."""
        return self._buffered

    def sent_by(self, deadline: float, then: int = 0) -> bool:
        """Whether what is queued, and `then` requests after it, would be answered by
        `deadline` at the pace the last request went (`latency_s`)."""
        requests = -(-self._buffered // self.max_request_chars) + then
        return time.monotonic() + requests * self.latency_s <= deadline

    async def yield_to_tail(self, timeout_s: float) -> str:
        """The crash tail goes next, and nothing of this queue may follow it: settle (the
        request in flight answered, or `timeout_s` passed), give up what is still queued, and
        return the gap marker owed for all that was given up since the last text sent, for the
        crash tail to carry first ("" when none is owed)."""
        await self._give_up_queued(timeout_s)
        line, self._gap = self._gap_line(), 0
        return line

    async def give_up_rest(self, timeout_s: float) -> int:
        """As `yield_to_tail`, but return how many characters were given up since the last
        text sent, for a line of the caller's to say: no marker is owed for them here."""
        await self._give_up_queued(timeout_s)
        gap, self._gap = self._gap, 0
        return gap

    async def _give_up_queued(self, timeout_s: float) -> None:
        await self.settle(timeout_s)
        while self._chunks:
            self._drop_head(self.stop_reason)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued was sent or dropped; False if `timeout_s` ran out or
        the request in flight has had no answer for `flush_stall_s`, counted from when it was
        sent, not from when the flush began: an ingest that hung during the run costs the
        exit at most what is left of that second (logs are best-effort, and the end event
        waits behind them). What is queued goes without lingering."""
        self._hurry = True
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while not self._idle.is_set():
            now = time.monotonic()
            stall_left = self._active_at + self.flush_stall_s - now
            left = min(deadline - now, stall_left)
            if left <= 0:
                return False
            await wait_set(self._idle, left)
        return True

    async def settle(self, timeout_s: float) -> None:
        """Send no new request, and stop once the one in flight was answered: a slow ingest is
        waited for, since the text it is storing must not go again. Only when `timeout_s` ran
        out with no answer is the request cancelled and its text queued again,
        unacknowledged. What the ingest acknowledged is then known."""
        self._settling = True
        if self._inflight is not None:
            await wait_set(self._answered, max(timeout_s, 0.0))
        await cancel(self._task)
        self._task = None
        if self._inflight is not None:
            self.latency_s = max(self.latency_s, time.monotonic() - self._active_at)
            self._chunks.extendleft(reversed(self._inflight))
            self._buffered += sum(len(entry[0]) for entry in self._inflight)
            self._inflight = None

    def forget(self, carried_from: Mapping[int, int]) -> None:
        """Take out of the queue the text the crash tail carries: of each piece (by its order)
        what lies from the given offset on; what lies before it stays queued."""
        kept: deque[Queued] = deque()
        for entry in self._chunks:
            text, ticket, span, why = entry
            start = None if span is None else carried_from.get(span.piece.order)
            if span is None or start is None or span.start + len(text) <= start:
                kept.append(entry)
                continue
            head = text[:max(start - span.start, 0)]
            self._buffered -= len(text) - len(head)
            if head:
                kept.append((head, ticket, span, why))
            elif ticket is not None:
                ticket.release()
        self._chunks = kept

    async def stop(self) -> None:
        """Stop shipping; what is still buffered is counted as dropped."""
        await cancel(self._task)
        if self._buffered:
            self._drop(self._buffered, self.stop_reason, len(self._chunks))
            self._chunks.clear()
            self._buffered = 0

    async def _run(self) -> None:
        while True:
            fault_point()
            if self._inflight is None:  # else a failure interrupted it: send it again
                if not self._chunks or self._settling:
                    if not self._chunks:
                        self._idle.set()
                        self._hurry = False
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._linger()
                self._inflight = self._take()
                self._overtaken = False
                if self.on_room is not None and self.has_room:
                    self.on_room()
                if not self._inflight:  # all of it given up at the head
                    self._inflight = None
                    continue
            batch = [entry[0] for entry in self._inflight]
            size = sum(map(len, batch))
            marker = self._gap_line()
            marked = self._gap
            body = json_body({"run_id": self.run_id, "chunks": [marker, *batch] if marker
                              else batch, "eof": False})
            if len(body) > MAX_REQUEST_BYTES and self._requeue(size, (
                    size * MAX_REQUEST_BYTES // len(body) * (DENSE_TEXT_MARGIN - 1)
                    // DENSE_TEXT_MARGIN)):
                continue  # never sent: an ingest behind nginx would refuse it
            self._active_at = time.monotonic()
            self.pace.sent(size >= self.linger_below_chars)
            self._answered.clear()
            answer = await self.client.deliver("logs", body, lambda: self._overtaken)
            self.latency_s = time.monotonic() - self._active_at
            self._active_at = time.monotonic()
            self._answered.set()
            if answer.verdict is Verdict.TOO_LARGE and self._halve(size):
                continue
            if not answer.ok and self._settling:  # the exit: not given up, the crash tail
                self._chunks.extendleft(reversed(self._inflight))  # carries what it holds
                self._buffered += size
                self._inflight = None
                continue
            entries, self._inflight = self._inflight, None
            if answer.ok:
                self.sent_chars += size
                # what was given up while it was in flight is newer: the next request marks it
                self._gap -= marked
                self._line_open = not batch[-1].endswith("\n")
            else:
                why = ("the log buffer is full while the ingest is slow" if self._overtaken
                       else "the ingest did not take it")
                if self._give_up(size, f"{why} ({answer.detail or f'HTTP {answer.status}'})",
                                 len(entries)):
                    self.client.gave_up("logs")  # said: its end will be too
            for text, ticket, span, _ in entries:
                if ticket is not None:
                    ticket.release()
                if span is not None:  # taken, or given up: the crash tail carries neither
                    span.ack(len(text))

    async def _linger(self) -> None:
        """Give a small batch linger_s to gain company after a quiet spell, else until the
        pace allows the next request, and no longer than it takes to grow worth its request
        or than a flush allows."""
        self._lingering = True
        try:
            await self.pace.linger(self.linger_s, self._wake,
                                   lambda: self._buffered >= self.linger_below_chars
                                   or self._hurry)
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
                        "characters from now on", size, self.max_request_chars,
                        extra={"route": "logs"})
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

    def _take(self) -> list[Queued]:
        """The next request's worth: whole texts while they fit, then the head of the next one
        up to its last line end in reach, so that a request is full: a read block just over
        the limit left a request of its own for the few lines past it. Only a text that opens
        the request is cut where the limit falls when it has no line end in reach. A text to
        give up ends the batch; at its head it is given up (it is the oldest then)."""
        batch: list[Queued] = []
        size = 0
        limit = self.max_request_chars
        while self._chunks:
            text, _, _, why = self._chunks[0]
            if why:
                if batch:
                    break
                self._drop_head(why)
                continue
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

    def _give_up(self, chars: int, why: str, items: int = 1) -> bool:
        """Text taken for /logs is dropped: counted and said (True when said now), and marked
        where it was by a line of ours before the next text that goes."""
        if chars <= 0:
            return False
        self._gap += chars
        self._gap_why = why
        return self._drop(chars, why, items, marked=True)

    def take_gap_line(self) -> str:
        """The gap marker owed to the log, for text that goes another way (the crash tail) when
        nothing is left queued here to carry it; it is then no longer owed here."""
        if self._chunks or self._inflight is not None:
            return ""
        line, self._gap = self._gap_line(), 0
        return line

    def _gap_line(self) -> str:
        """The gap marker, when text was given up since the last text sent: on a line of its
        own, prefixed like the output's."""
        if not self._gap:
            return ""
        return (("\n" if self._line_open else "") + f"{self.prefix}[sidecar] {self._gap} "
                f"characters of output were dropped here: {self._gap_why}\n")

    def _drop(self, chars: int, why: str, items: int, marked: bool = False) -> bool:
        """Count `items` texts of `chars` characters dropped, and say so at most once a minute;
        True when said now."""
        if chars <= 0:  # nothing lost: no count, and no "dropped 0 characters"
            return False
        self.dropped_chars += chars
        stats = self.client.route_stats("logs")
        stats.dropped += items
        stats.dropped_chars += chars
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            where = ("; a `[sidecar]` line marks the gap in the log once /logs takes output "
                     "again" if marked else "")
            log.warning("/logs: dropped %d characters of output: %s%s (%d dropped in all; "
                        "the command's output still passes through to ours unchanged, its "
                        "writes never wait on /logs)", chars, why, where, self.dropped_chars,
                        extra={"route": "logs"})
            return True
        return False


def _cut(entry: Queued, at: int) -> tuple[Queued, Queued]:
    """One queued text as two, cut after the last line end before `at` (else at `at`). Both
    hold its ticket; each knows where it lies in the piece, so that each marks its own part
    acknowledged."""
    text, ticket, span, why = entry
    cut = text.rfind("\n", 0, at) + 1 or at
    first = (text[:cut], ticket.hold() if ticket is not None else None, span, why)
    return first, (text[cut:], ticket, span.after(cut) if span is not None else None, why)
