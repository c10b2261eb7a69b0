"""The run's lifecycle: journaled, in order, until acknowledged (docs/lifecycle.md#the-journal).

An event is written to the journal in the state dir before its first attempt, with `ts` the
moment it happened; a sender delivers the journal head by head. Events a previous sidecar left
unacknowledged go out first, so a restart replays them in their original order and times.

The lifecycle is a state machine, enforced where events are recorded: `starting` once, `running`
once, then one end event, and nothing after it (a `running` handed over after the command had
exited reached the ingest after `failed`, and so did the billing start). The journal holds the
run's whole history, acknowledged or not, so a sidecar started again for the same run (a
restarted container, a killed wrapper) goes on from what it holds, and one process at a time
writes it (two of them each kept their own acknowledged count, and the ingest saw `succeeded`
twice): the second is told which process holds it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

from sidecar.aio import cancel, wait_set
from sidecar.delivery.client import Answer, IngestClient
from sidecar.delivery.handoff import WRAPPER_SOCKET_VARIABLE
from sidecar.delivery.journal import SKIPPED, Journal, read_back
from sidecar.delivery.strict import Pending, StrictSender
from sidecar.exits import ConfigError
from sidecar.log import log, state_write_failed
from sidecar.records import iso_ts
from sidecar.statefile import TEXT, Busy, record
from sidecar.supervise import supervise

EVENTS = ("starting", "running", "succeeded", "failed")
END_EVENTS = ("succeeded", "failed")
_STAGE = {"starting": 0, "running": 1, "succeeded": 2, "failed": 2}  # each at most once, rising
JOURNAL_NAME = "lifecycle.journal"


def refusal(recorded: Sequence[str], event: str) -> str | None:
    """Why `event` may not follow the events `recorded`, or None when it may: each stage at most
    once and in order (`starting`, `running`, then one end event), nothing after the end. A
    repeat of an event already recorded is no refusal: there is nothing to record."""
    if event in recorded:
        return None
    end = next((e for e in recorded if e in END_EVENTS), None)
    if end is not None:
        return f"the run has ended (`{end}` is recorded); nothing is recorded after its end"
    later = [e for e in recorded if _STAGE[e] > _STAGE[event]]
    if later:
        return f"`{later[0]}` is recorded already, and `{event}` comes before it"
    return None


class Lifecycle:
    """Strict, ordered, durable delivery of lifecycle events for one run."""

    def __init__(self, run_dir: Path, run_id: str, client: IngestClient | None) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.client = client  # None: offline, events are recorded in memory only
        self.recorded: list[str] = []  # the run's events, in order, an earlier start's too
        self.rejected = 0  # events the ingest refused for good (dead-lettered)
        self.release = asyncio.Event()
        self._sender: StrictSender | None = None  # once `open` holds the journal, when reporting
        self._task: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()  # one event at a time: the journal's order is the checks'

    @property
    def ended(self) -> bool:
        """Whether the run's end event is recorded."""
        return any(event in END_EVENTS for event in self.recorded)

    async def open(self) -> None:
        """Hold the run's journal (ConfigError naming the process that holds it), load what an
        earlier sidecar recorded and left undelivered, and start delivering."""
        self.release.set()
        if self.client is None:
            return
        journal = Journal(self.run_dir / JOURNAL_NAME)
        try:
            queue = await asyncio.to_thread(self._load, journal)
        except Busy as busy:
            raise ConfigError(
                f"--state-dir: the lifecycle journal of run {self.run_id} in {self.run_dir} is "
                f"written by another sidecar (PID {busy.holder}), and one process at a time "
                f"writes a run's lifecycle: that one posts its events. Inside the command of a "
                f"`sidecar run`, `sidecar lifecycle` hands its event to the wrapper (through "
                f"{WRAPPER_SOCKET_VARIABLE}); otherwise wait until PID {busy.holder} has "
                "finished") from None
        self._follow_history(journal.records, queue)
        if queue:
            log.info("replaying %d lifecycle event(s) left undelivered by an earlier start",
                     len(queue))
        self._sender = StrictSender(self.client, "lifecycle", journal, self.run_dir,
                                    letter_route="lifecycle", accepted=self._accepted,
                                    refused=self._refused, gate=self.release)
        self._sender.put(queue)
        self._task = supervise("lifecycle", self._sender.run)

    def _load(self, journal: Journal) -> list[Pending]:
        """Hold `journal` (Busy when another process does) and read it back; blocking."""
        try:
            journal.hold()
        except OSError as exc:  # a full disk must not stop the run: nor can another write here
            state_write_failed(journal.lock_path, exc)
        return read_back(journal, self._is_event, "lifecycle events", self.run_id)

    def _follow_history(self, records: Sequence[bytes], queue: list[Pending]) -> None:
        """Take the events the journal holds as recorded, in order; one of `queue` (those not
        yet acknowledged) that breaks the order (an earlier version wrote `running` after
        `failed`) is made SKIPPED there, never posted."""
        unacked = len(records) - len(queue)
        broken = []
        for number, body in enumerate(records):
            if not self._is_event(body):
                continue
            event = json.loads(body)["event"]
            if refusal(self.recorded, event) is None and event not in self.recorded:
                self.recorded.append(event)
            elif number >= unacked and queue[number - unacked][0] != SKIPPED:
                queue[number - unacked] = (SKIPPED, True)
                broken.append(event)
        if broken:
            log.warning("%s: %d event(s) not yet delivered break the run's lifecycle (%s after "
                        "%s); they are skipped, never posted", self._journal_path, len(broken),
                        ", ".join(broken), ", ".join(self.recorded))

    def say_earlier_start(self) -> None:
        """For a start of the run's command: what the journal holds of an earlier one, if any,
        and so which events this start records."""
        held = ", ".join(self.recorded)
        if not held:
            return
        if self.ended:
            log.warning("%s already holds the end of run %s (%s): nothing is recorded after "
                        "it, so no lifecycle event of this start is posted; give a new run id "
                        "to report a new run", self._journal_path, self.run_id, held)
        else:
            log.info("%s already holds %s from an earlier start of run %s: going on from there, "
                     "none of them is recorded again", self._journal_path, held, self.run_id)

    @property
    def _journal_path(self) -> Path:
        return self.run_dir / JOURNAL_NAME

    async def record(self, event: str, ts: float | None = None) -> str | None:
        """Persist `event` (happened at `ts`, default now), then queue it for delivery; returns
        why it may not be recorded now (`refusal`), else None (a repeat is not recorded)."""
        if event not in EVENTS:
            raise ValueError(f"unknown lifecycle event {event!r}; one of {', '.join(EVENTS)}")
        async with self._writing:
            why = refusal(self.recorded, event)
            if why is not None or event in self.recorded:
                return why
            self.recorded.append(event)
            when = time.time() if ts is None else ts
            if self._sender is None:  # offline, or a node that does not report the lifecycle
                log.debug("lifecycle: %s (not posted)", event)
                return None
            log.info("lifecycle: %s recorded (journaled, to be posted)",
                     event)
            body = json.dumps({"run_id": self.run_id, "event": event,
                               "ts": iso_ts(when)}).encode()
            # a full disk must not stop the run: the event is then delivered from memory
            await self._sender.add(body)
        return None

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every recorded event is acknowledged; False when `timeout_s` ran out."""
        self.release.set()
        if self._sender is None:  # offline: nothing is posted, nothing waits
            return True
        return await wait_set(self._sender.idle, timeout_s)

    @property
    def pending(self) -> list[str]:
        """The events not yet acknowledged, oldest first."""
        queue = self._sender.queue if self._sender is not None else []
        return [json.loads(body)["event"] for body, _ in queue if body != SKIPPED]

    async def close(self) -> None:
        await cancel(self._task)
        if self._sender is not None:
            # an acknowledgement the disk refused earlier, so the next start does not post the
            # event again
            await self._sender.save_ack()
            self._sender.journal.close()

    def _is_event(self, body: bytes) -> bool:
        """Whether a record read back from the journal is an event of this run, as `record`
        writes them (the state dir's loader rules: checked before it is trusted)."""
        try:
            doc = record(json.loads(body), {"run_id": TEXT, "event": TEXT, "ts": TEXT})
        except ValueError:
            return False
        return doc["run_id"] == self.run_id and doc["event"] in EVENTS

    def _accepted(self, body: bytes) -> None:
        log.info("lifecycle: %s accepted by the ingest", json.loads(body)["event"])

    def _refused(self, body: bytes, answer: Answer, kept: Path | None) -> None:
        self.rejected += 1
        log.error("/lifecycle: HTTP %s: the ingest refused %s for good; %s", answer.status,
                  body.decode(), f"kept in {kept}" if kept else "not kept",
                  extra={"route": "lifecycle"})
