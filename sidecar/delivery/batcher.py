"""At-least-once delivery of item routes: batched, in order, retried until acknowledged.

Items (metric points, hardware points, hparams pairs, node snapshots) are queued with a `Ticket`
that travels back when the ingest acknowledged them: a file source commits its offset only
then. A full queue makes `put` wait (a file is its own buffer, so its reader simply pauses);
`offer` never waits and says whether the items were taken.

Pacing: an item after a quiet spell goes out at once (after LINGER_S for company); while items
keep coming, a route sends at most one request every PACE_S (`Pace`), so a steady trickle costs
the ingest about a request a second per route instead of one per point, and a full batch still
goes at once (a flood is not held back).

Answers (docs/ingest.md#answers): 413 splits the batch and retries the halves; a 4xx bisects the
batch so that one poison item goes to the dead-letter file and the good ones get through.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sidecar.aio import cancel, wait_set
from sidecar.delivery.client import IngestClient, Verdict, json_body
from sidecar.delivery.deadletter import dead_letter
from sidecar.delivery.spool import Spool, SpoolFull
from sidecar.log import Throttle, log
from sidecar.records import MAX_POINTS_PER_REQUEST, Ticket
from sidecar.supervise import fault_point, supervise

MAX_QUEUED_ITEMS = 16_384  # beyond it, put() waits and offer() refuses (about 8 requests)
LINGER_S = 0.05  # a small batch waits this long for company
# while output keeps coming, a route's requests start at most this often: about one a second, and
# what waits for the next one (with the file reader's coalescing, follow.COALESCE_S) still arrives
# within a second
PACE_S = 0.85


class Pace:
    """When a route's next request that is not full may start: at once after a quiet spell
    (no request for `interval_s`) or after a full request (a flood's last small batch is not
    held back), else `interval_s` after the previous one. The linger of a small batch so grows
    with the load: a lone point goes at once, a steady trickle of them in one request each
    `interval_s`."""

    __slots__ = ("interval_s", "sent_at")

    def __init__(self, interval_s: float = PACE_S) -> None:
        self.interval_s = interval_s
        self.sent_at = float("-inf")  # when the last request that was not full started

    def linger_s(self, least_s: float) -> float:
        """How long a small batch waits from now: `least_s` at least (for company)."""
        return max(least_s, self.sent_at + self.interval_s - time.monotonic())

    def next_at(self) -> float | None:
        """When (time.monotonic) a request that is not full may start next, while that is still
        ahead; None when one may start now."""
        at = self.sent_at + self.interval_s
        return at if at > time.monotonic() else None

    def sent(self, full: bool) -> None:
        """A request starts; `full`: as large as the route's requests get."""
        self.sent_at = float("-inf") if full else time.monotonic()

    async def linger(self, least_s: float, wake: asyncio.Event,
                     enough: Callable[[], bool]) -> None:
        """Let a small batch wait for company: `least_s` after a quiet spell, else until the
        next request may start; over as soon as `enough()` (the batch is worth its request, or
        a flush hurries it), checked again each time `wake` is set."""
        deadline = time.monotonic() + self.linger_s(least_s)
        while not enough():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wake.clear()
            await wait_set(wake, left)


class _Item:
    __slots__ = ("ticket", "value")

    def __init__(self, value: Any, ticket: Ticket | None) -> None:
        self.value = value
        self.ticket = ticket


class Batcher:
    """One route's at-least-once queue; `wrap` turns a list of items into the request body."""

    def __init__(self, client: IngestClient, route: str,
                 wrap: Callable[[list[Any]], dict[str, Any]], run_dir: Path,
                 max_items: int = MAX_POINTS_PER_REQUEST, max_queued: int = MAX_QUEUED_ITEMS,
                 linger_s: float = LINGER_S, spool: Spool | None = None,
                 on_room: Callable[[], None] | None = None, pace_s: float = PACE_S) -> None:
        self.client = client
        self.route = route
        self.wrap = wrap
        self.run_dir = run_dir
        self.max_items = max_items
        self.max_queued = max_queued
        self.linger_s = linger_s
        self.pace = Pace(pace_s)
        self.spool = spool  # overflow on disk, for routes whose source cannot wait
        self.on_room = on_room  # called when room comes back (wakes a reader)
        self.delivered = 0
        self.dead_lettered = 0
        self.refused = 0
        self._throttle = Throttle()
        self._queue: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._idle = asyncio.Event()
        self._lingering = False  # a small batch waits: only a full one or a flush wakes it
        self._hurry = False  # a flush waits: what is queued goes without lingering
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._room.set()
        self._idle.set()
        self._task = supervise(f"deliver-{self.route}", self._run)

    @property
    def queued(self) -> int:
        """Items waiting, in memory and on disk."""
        return len(self._queue) + (self.spool.records if self.spool is not None else 0)

    @property
    def has_room(self) -> bool:
        return len(self._queue) < self.max_queued

    def offer(self, items: Sequence[Any], ticket: Ticket | None = None) -> bool:
        """Queue `items` without waiting: in memory, else on disk behind what is there, else
        refuse them (False, with an ERROR at most once a minute). A ticket does not travel to
        disk: only routes without file offsets (documents) spool."""
        if self.spool is not None and (self.spool.records or not self.has_room):
            return self._to_disk(items)
        if not self.has_room:
            return False
        self.push(items, ticket)
        return True

    def _to_disk(self, items: Sequence[Any]) -> bool:
        assert self.spool is not None
        try:
            self.spool.append([json_body(item) for item in items])
        except SpoolFull as exc:
            self.refused += len(items)
            if self._throttle.admit("full") is not None and exc.__cause__ is None:
                log.error("/%s: %s; refusing new payloads (%d refused so far) until the ingest "
                          "takes what is waiting", self.route, exc, self.refused,
                          extra={"route": self.route})
            return False
        self._idle.clear()
        self._wake.set()
        return True

    async def put(self, items: Sequence[Any], ticket: Ticket | None = None) -> None:
        """Queue `items`, waiting while the queue is full."""
        while not self.has_room:
            self._room.clear()
            await self._room.wait()
        self.push(items, ticket)

    def push(self, items: Sequence[Any], ticket: Ticket | None = None) -> None:
        """Queue `items` even past the cap (a caller that checked has_room before reading)."""
        if not items:
            return
        for value in items:
            self._queue.append(_Item(value, ticket.hold() if ticket else None))
        self._idle.clear()
        if not self._lingering or len(self._queue) >= self.max_items:
            self._wake.set()

    async def persist(self) -> int:
        """Move what waits in memory to the disk spool (shutdown); returns how many moved.
        They land behind what is already on disk: the routes that spool (hardware and
        environment snapshots) carry their own times, so their order does not matter."""
        if self.spool is None or not self._queue:
            return 0
        payloads = [json_body(item.value) for item in self._queue]
        try:
            await asyncio.to_thread(self.spool.append, payloads)
        except SpoolFull as exc:
            if exc.__cause__ is None:  # a full disk was said already
                log.error("/%s: %s; %d payloads are lost", self.route, exc, len(payloads),
                          extra={"route": self.route})
            return 0
        self._queue.clear()
        return len(payloads)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued was acknowledged (or dead-lettered); what is queued
        goes without lingering."""
        self._hurry = True
        self._wake.set()
        return await wait_set(self._idle, timeout_s)

    async def stop(self) -> None:
        await cancel(self._task)

    async def _run(self) -> None:
        while True:
            fault_point()
            if not self._queue and self.spool is not None and self.spool.records:
                await self._send_spooled()
                continue
            if not self._queue:
                self._idle.set()
                self._hurry = False
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._linger()
            batch = [self._queue[i] for i in range(min(self.max_items, len(self._queue)))]
            self.pace.sent(len(batch) >= self.max_items)
            await self._send(batch)
            for _ in batch:
                self._queue.popleft()
            if self.has_room:
                self._room.set()
                if self.on_room is not None:
                    self.on_room()
            for item in batch:
                if item.ticket is not None:
                    item.ticket.release()

    async def _linger(self) -> None:
        """A small batch waits for the pace; a full batch, or a flush, ends the wait."""
        self._lingering = True
        try:
            await self.pace.linger(self.linger_s, self._wake,
                                   lambda: len(self._queue) >= self.max_items or self._hurry)
        finally:
            self._lingering = False

    async def _send_spooled(self) -> None:
        assert self.spool is not None
        payloads = await asyncio.to_thread(self.spool.peek, self.max_items)
        items = [_Item(value, None) for value in map(_spooled, payloads) if value is not None]
        if len(items) < len(payloads):
            self.dead_lettered += len(payloads) - len(items)
            log.warning("/%s: %d spooled payload(s) in %s are not JSON objects; skipped, never "
                        "posted", self.route, len(payloads) - len(items), self.spool.folder,
                        extra={"route": self.route})
        if items:
            await self._send(items)
        await asyncio.to_thread(self.spool.ack, len(payloads))

    async def _send(self, batch: list[_Item]) -> None:
        """Deliver `batch` until acknowledged; split it on 413 and on a permanent refusal."""
        body = json_body(self.wrap([item.value for item in batch]))
        answer = await self.client.deliver(self.route, body)
        if answer.ok:
            self.delivered += len(batch)
            return
        if answer.verdict in (Verdict.TOO_LARGE, Verdict.REJECTED) and len(batch) > 1:
            half = len(batch) // 2
            await self._send(batch[:half])
            await self._send(batch[half:])
            return
        self.dead_lettered += len(batch)
        path = dead_letter(self.run_dir, self.route, answer.status, body)
        kept = f"it is kept in {path}" if path else "it could not be kept and is lost"
        log.error("/%s: HTTP %s: the ingest refused this payload for good (%s); %s; later "
                  "payloads go on", self.route, answer.status, answer.detail or "no reason given",
                  kept, extra={"route": self.route})


def _spooled(payload: bytes) -> Any:
    """A payload read back from the spool, or None when it is not the JSON object it was
    written as (the state dir's loader rules: checked before it is trusted)."""
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
