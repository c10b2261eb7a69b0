"""The strict, journaled sender that the lifecycle, the artifacts and the crash tail share: each
record is in the journal before its first attempt, delivered head by head in order, retried
until the ingest acknowledges it (the route's policy, in the client), dead-lettered when it is
refused for good, then acknowledged in the journal
(docs/ingest.md#answers-and-what-the-sidecar-does-about-them). A full disk never stops it: a
record the journal refused is delivered from memory, an acknowledgement the disk refused is
written again with the next one or by `save_ack`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from sidecar.delivery.client import Answer, IngestClient, Verdict
from sidecar.delivery.deadletter import dead_letter
from sidecar.delivery.journal import SKIPPED, Journal
from sidecar.log import state_write_failed
from sidecar.supervise import fault_point

Pending = tuple[bytes, bool]  # (record, in the journal)
REFUSED_FOR_GOOD = frozenset({Verdict.REJECTED})


def _same(record: bytes) -> bytes:
    return record


def _nothing(body: bytes) -> None:
    return None


class StrictSender:
    """One strict route's queue of journaled records and its delivery; where the routes
    differ is a parameter:

    - `letter_route`: the route a dead letter names;
    - `refused(body, answer, kept)` and `accepted(body)`: the owner's words and counts for a
      body refused for good (`kept`: its dead-letter file, None when that could not be
      written) and for one acknowledged;
    - `body_of(record)`: the request body of a journaled record (the record itself);
    - `dead_letters`: the final refusals that are dead-lettered (another, a 413, is dropped
      without a dead letter);
    - `clear_when_done`: forget the journal once all of it is acknowledged (else it keeps the
      route's whole history);
    - `gate`: set when the next record may go (a record waits for it before its attempt);
    - `more_coming()`: whether records are on their way to the queue (`run` is not idle then).
    """

    def __init__(self, client: IngestClient, route: str, journal: Journal, run_dir: Path, *,
                 letter_route: str, refused: Callable[[bytes, Answer, Path | None], None],
                 accepted: Callable[[bytes], None] = _nothing,
                 body_of: Callable[[bytes], bytes] = _same,
                 dead_letters: frozenset[Verdict] = REFUSED_FOR_GOOD,
                 clear_when_done: bool = False, gate: asyncio.Event | None = None,
                 more_coming: Callable[[], bool] = lambda: False) -> None:
        self.client = client
        self.route = route
        self.journal = journal
        self.run_dir = run_dir
        self.letter_route = letter_route
        self.queue: list[Pending] = []  # not yet acknowledged, oldest first
        self.idle = asyncio.Event()  # set by `run` while nothing is queued or coming
        self._refused = refused
        self._accepted = accepted
        self._body_of = body_of
        self._dead_letters = dead_letters
        self._clear_when_done = clear_when_done
        self._gate = gate
        self._more_coming = more_coming
        self._wake = asyncio.Event()

    async def journaled(self, record: bytes) -> Pending:
        """Append `record` to the journal durably; on a full disk it is said, and the record
        goes from memory (the next start may then repeat or miss it). Not yet queued."""
        try:
            await asyncio.to_thread(self.journal.append, record)
        except OSError as exc:
            state_write_failed(self.journal.path, exc)
            return record, False
        return record, True

    async def add(self, record: bytes) -> None:
        """Journal `record`, then queue it."""
        self.put([await self.journaled(record)])

    def put(self, entries: Iterable[Pending]) -> None:
        """Queue entries (journaled, or read back from the journal) behind what is queued."""
        before = len(self.queue)
        self.queue.extend(entries)
        if len(self.queue) > before:
            self.idle.clear()
            self._wake.set()

    def expect(self) -> None:
        """Records are on their way to the queue (`more_coming`): not idle until they are
        delivered too."""
        self.idle.clear()

    async def run(self) -> None:
        """Deliver the queue head by head for as long as the task runs (a supervised task's
        work, or part of it): each round begins where a restarted task may resume."""
        while True:
            fault_point()
            if not self.queue:
                if not self._more_coming():
                    self.idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._gate is not None:
                await self._gate.wait()
            await self.send_head()

    async def send_all(self) -> None:
        """Deliver the queue head by head until it is empty."""
        while self.queue:
            await self.send_head()

    async def send_head(self) -> None:
        """Deliver the oldest record until the ingest answers for good, then acknowledge it
        in the journal. A record read back that is not the owner's (SKIPPED) is acknowledged
        unposted. Taken out of the queue before its acknowledgement is written, so that a
        cancellation while it is written does not send it again."""
        record, journaled = self.queue[0]
        if record != SKIPPED:
            await self._deliver(record)
        self.queue.pop(0)
        if journaled:
            await self._acknowledge()

    async def save_ack(self) -> None:
        """Write the acknowledged count again if the disk refused it last (at the close)."""
        try:
            await asyncio.to_thread(self.journal.save_ack)
        except OSError as exc:
            state_write_failed(self.journal.ack_path, exc)

    async def _deliver(self, record: bytes) -> None:
        body = self._body_of(record)
        answer = await self.client.deliver(self.route, body)
        if answer.ok:
            self._accepted(body)
        elif answer.verdict in self._dead_letters:
            kept = await asyncio.to_thread(dead_letter, self.run_dir, self.letter_route,
                                           answer.status, body)
            self._refused(body, answer, kept)

    async def _acknowledge(self) -> None:
        try:
            await asyncio.to_thread(self.journal.ack)
        except OSError as exc:
            # the next acknowledgement written, or save_ack, records this one too
            state_write_failed(self.journal.ack_path, exc)
            return
        if self._clear_when_done and not self.journal.pending:
            try:
                await asyncio.to_thread(self.journal.clear)
            except OSError as exc:
                state_write_failed(self.journal.path, exc)
