"""Artifact registrations, delivered strictly (docs/ingest.md#strict): a lost one is a data
incident, a repeated one a second entry in the console.

Each registration is written to the journal before its first attempt, together with the
identity it was made for (the checkpoint's local path and fingerprint), then delivered in order,
retried until acknowledged; a 4xx is dead-lettered with the ingest's reason. The identities of
what was journaled are kept in `artifacts.json` and read back, with those of the journal's
undelivered records, at the next start: a restart, or `sidecar replay`, never registers a
checkpoint twice, and a checkpoint rewritten in place (a new fingerprint) is registered again.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from sidecar.aio import cancel, wait_set
from sidecar.delivery.client import IngestClient, json_body
from sidecar.delivery.journal import SKIPPED, Journal, append_dead_letter, read_back
from sidecar.log import log, state_write_failed
from sidecar.statefile import Malformed, load_checked, write_atomic
from sidecar.supervise import fault_point, supervise

JOURNAL = "artifact.journal"
REGISTERED = "artifacts.json"  # local path -> fingerprint of what was journaled for it


def _parse_registered(data: bytes) -> dict[str, str]:
    doc = json.loads(data)
    if not isinstance(doc, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise Malformed("not a mapping of paths to fingerprints")
    return doc


class Artifacts:
    """Strict, ordered, durable delivery of `/artifact` registrations for one run."""

    def __init__(self, run_dir: Path, run_id: str, client: IngestClient) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.client = client
        self.delivered = 0
        self.rejected = 0  # refused for good (dead-lettered)
        self.opened = asyncio.Event()
        self._registered: dict[str, str] = {}
        self._journal = Journal(run_dir / JOURNAL)
        self._queue: list[tuple[bytes, bool]] = []  # (record, in the journal)
        self._fresh: list[bytes] = []  # registered, not yet journaled
        self._journaling = 0  # taken from _fresh, being journaled
        self._fresh_ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Read back what an earlier start left, then deliver (in a supervised task)."""
        self._task = supervise("artifacts", self._run)

    async def opened_if_started(self) -> None:
        """Wait until what an earlier start left is read back, when delivering at all."""
        if self._task is not None:
            await self.opened.wait()

    def known(self, path: str, fingerprint: str) -> bool:
        """Whether the checkpoint at `path` with `fingerprint` was registered already."""
        return self._registered.get(path) == fingerprint

    def register(self, local: str, fingerprint: str, body: dict[str, Any]) -> None:
        """Queue one registration; it is journaled before its first attempt. Never blocks."""
        self._registered[local] = fingerprint
        doc = {"run_id": self.run_id, "identity": {"path": local, "fingerprint": fingerprint},
               "body": {"run_id": self.run_id, **body}}
        self._fresh.append(json_body(doc))
        self._idle.clear()
        self._fresh_ready.set()

    @property
    def pending(self) -> int:
        """Registrations not yet acknowledged (or refused for good)."""
        return len(self._fresh) + self._journaling + sum(
            1 for record, _ in self._queue if record != SKIPPED)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every registration is acknowledged; False when `timeout_s` ran out."""
        if self._task is None:  # nothing to register in this run, nothing left by another
            return True
        return await wait_set(self._idle, timeout_s)

    async def close(self) -> None:
        await cancel(self._task)
        try:
            await asyncio.to_thread(self._journal.save_ack)
        except OSError as exc:
            state_write_failed(self._journal.path.with_name(JOURNAL + ".acked"), exc)

    async def _run(self) -> None:
        if not self.opened.is_set():
            await asyncio.to_thread(self._open)
            self.opened.set()
        # Journaling goes on while the head is retried: a registration made during an outage
        # is on disk at once, not when the outage ends.
        await asyncio.gather(self._journal_loop(), self._send_loop())

    async def _journal_loop(self) -> None:
        while True:
            if not self._fresh:
                self._fresh_ready.clear()
                await self._fresh_ready.wait()
                continue
            await self._journal_fresh()
            self._wake.set()

    async def _send_loop(self) -> None:
        while True:
            fault_point()
            if not self._queue:
                if not self._fresh and not self._journaling:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            record, journaled = self._queue[0]
            if record != SKIPPED:
                await self._deliver(record)
            if journaled:
                try:
                    await asyncio.to_thread(self._journal.ack)
                except OSError as exc:
                    state_write_failed(self._journal.path.with_name(JOURNAL + ".acked"), exc)
            self._queue.pop(0)

    def _open(self) -> None:
        """Blocking: the registered identities and the journal's undelivered records."""
        self._registered.update(load_checked(self.run_dir / REGISTERED, _parse_registered) or {})
        self._queue = read_back(self._journal, self._belongs, "artifact registrations",
                                self.run_id)
        for record, _ in self._queue:
            if record != SKIPPED:
                identity = json.loads(record)["identity"]
                self._registered[identity["path"]] = identity["fingerprint"]
        if self._queue:
            log.info("replaying %d artifact registration(s) left undelivered by an earlier "
                     "start", len(self._queue))

    async def _journal_fresh(self) -> None:
        """Journal what was registered since and remember its identities durably, both before
        the first attempt: an acknowledged registration whose identity a crash lost would be
        registered again at the next start."""
        fresh, self._fresh = self._fresh, []
        self._journaling = len(fresh)
        journaled = []
        for record in fresh:
            try:
                await asyncio.to_thread(self._journal.append, record)
                journaled.append((record, True))
            except OSError as exc:  # a full disk: deliver from memory, the next start may repeat
                state_write_failed(self._journal.path, exc)
                journaled.append((record, False))
        snapshot = json.dumps(self._registered).encode()
        try:
            await asyncio.to_thread(write_atomic, self.run_dir / REGISTERED, snapshot)
        except OSError as exc:
            state_write_failed(self.run_dir / REGISTERED, exc)
        self._queue.extend(journaled)
        self._journaling = 0

    async def _deliver(self, record: bytes) -> None:
        body = json_body(json.loads(record)["body"])
        answer = await self.client.deliver("artifact", body)
        if not answer.ok:  # a 4xx (a 413 too: one registration cannot be split)
            self.rejected += 1
            try:
                kept = await asyncio.to_thread(append_dead_letter, self.run_dir, "artifact",
                                               answer.status, body)
                where = f"kept in {kept}"
            except OSError as exc:
                state_write_failed(self.run_dir / "dead-letter.jsonl", exc)
                where = "not kept"
            log.error("/artifact: HTTP %s: the ingest refused %s for good (%s); %s",
                      answer.status, body.decode(), answer.reason or "no reason given", where)
        else:
            self.delivered += 1

    def _belongs(self, record: bytes) -> bool:
        """Whether a record read back from the journal is a registration of this run, as
        `register` writes them (checked before it is trusted)."""
        try:
            doc = json.loads(record)
            identity, body = doc["identity"], doc["body"]
            return (doc["run_id"] == self.run_id and isinstance(body, dict)
                    and body.get("run_id") == self.run_id
                    and isinstance(identity.get("path"), str)
                    and isinstance(identity.get("fingerprint"), str))
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
