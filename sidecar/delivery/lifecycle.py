"""The run's lifecycle, delivered strictly (CONTRACT 4): persisted, in order, until acknowledged.

An event is written to the journal in the state dir before its first attempt, with `ts` the
moment it happened; a sender delivers the journal head by head. Events a previous sidecar left
unacknowledged go out first, so a restart replays them in their original order and times.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from sidecar.aio import cancel, wait_set
from sidecar.delivery.client import Answer, IngestClient, Verdict
from sidecar.delivery.journal import SKIPPED, Journal, append_dead_letter, read_back
from sidecar.log import log, state_write_failed
from sidecar.records import iso_ts
from sidecar.statefile import TEXT, record
from sidecar.supervise import fault_point, supervise

EVENTS = ("starting", "running", "succeeded", "failed")
TERMINAL = ("succeeded", "failed")


class Lifecycle:
    """Strict, ordered, durable delivery of lifecycle events for one run."""

    def __init__(self, run_dir: Path, run_id: str, client: IngestClient | None) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.client = client  # None: offline, events are recorded in memory only
        self.recorded: list[str] = []
        self.rejected = 0  # events the ingest refused for good (dead-lettered)
        self.release = asyncio.Event()
        self._journal: Journal | None = None
        self._queue: list[tuple[bytes, bool]] = []  # (body, in the journal)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Load what an earlier sidecar left undelivered and start delivering."""
        self.release.set()
        self._idle.set()
        if self.client is None:
            return
        self._journal = Journal(self.run_dir / "lifecycle.journal")
        self._queue = await asyncio.to_thread(read_back, self._journal, self._is_event,
                                              "lifecycle events", self.run_id)
        if self._queue:
            log.info("replaying %d lifecycle event(s) left undelivered by an earlier start",
                     len(self._queue))
            self._idle.clear()
        self._task = supervise("lifecycle", self._run)

    async def record(self, event: str, ts: float | None = None) -> None:
        """Persist `event` (happened at `ts`, default now), then queue it for delivery."""
        if event not in EVENTS:
            raise ValueError(f"unknown lifecycle event {event!r}; one of {', '.join(EVENTS)}")
        self.recorded.append(event)
        when = time.time() if ts is None else ts
        if self._journal is None:  # offline, or a node that does not report the lifecycle
            log.debug("lifecycle: %s (not posted)", event)
            return
        log.info("lifecycle: %s", event)
        body = json.dumps({"run_id": self.run_id, "event": event, "ts": iso_ts(when)}).encode()
        try:
            await asyncio.to_thread(self._journal.append, body)
            self._queue.append((body, True))
        except OSError as exc:  # a full disk must not stop the run: deliver from memory
            state_write_failed(self.run_dir / "lifecycle.journal", exc)
            self._queue.append((body, False))
        self._idle.clear()
        self._wake.set()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every recorded event is acknowledged; False when `timeout_s` ran out."""
        self.release.set()
        return await wait_set(self._idle, timeout_s)

    @property
    def pending(self) -> list[str]:
        """The events not yet acknowledged, oldest first."""
        return [json.loads(body)["event"] for body, _ in self._queue if body != SKIPPED]

    async def close(self) -> None:
        await cancel(self._task)
        if self._journal is not None:
            try:  # an acknowledgement the disk refused earlier, so the next start does not
                await asyncio.to_thread(self._journal.save_ack)  # post the event again
            except OSError as exc:
                state_write_failed(self.run_dir / "lifecycle.journal.acked", exc)

    async def _run(self) -> None:
        assert self.client is not None and self._journal is not None
        while True:
            fault_point()
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            await self.release.wait()
            body, journaled = self._queue[0]
            answer = (Answer(Verdict.ACCEPTED) if body == SKIPPED
                      else await self.client.deliver("lifecycle", body))
            if answer.verdict is Verdict.REJECTED:
                self.rejected += 1
                self._dead_letter(body, answer.status)
            if journaled:
                try:
                    await asyncio.to_thread(self._journal.ack)
                except OSError as exc:  # the next acknowledgement written records this one too
                    state_write_failed(self.run_dir / "lifecycle.journal.acked", exc)
            self._queue.pop(0)

    def _is_event(self, body: bytes) -> bool:
        """Whether a record read back from the journal is an event of this run, as `record`
        writes them (the state dir's loader rules: checked before it is trusted)."""
        try:
            doc = record(json.loads(body), {"run_id": TEXT, "event": TEXT, "ts": TEXT})
        except ValueError:
            return False
        return doc["run_id"] == self.run_id and doc["event"] in EVENTS

    def _dead_letter(self, body: bytes, status: int | None) -> None:
        try:
            where = f"kept in {append_dead_letter(self.run_dir, 'lifecycle', status, body)}"
        except OSError as exc:
            state_write_failed(self.run_dir / "dead-letter.jsonl", exc)
            where = "not kept"
        log.error("/lifecycle: HTTP %s: the ingest refused %s for good; %s", status,
                  body.decode(), where)
