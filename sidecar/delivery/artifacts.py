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
from sidecar.delivery.client import Answer, IngestClient, Verdict, json_body
from sidecar.delivery.journal import SKIPPED, Journal, read_back
from sidecar.delivery.strict import Pending, StrictSender
from sidecar.log import log, state_write_failed
from sidecar.statefile import Malformed, load_checked, write_atomic
from sidecar.supervise import supervise

JOURNAL = "artifact.journal"
REGISTERED = "artifacts.json"  # local path -> fingerprint of what was journaled for it


def _posted(record: bytes) -> bytes:
    """The /artifact body of a journaled registration."""
    return json_body(json.loads(record)["body"])


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
        self._fresh: list[bytes] = []  # registered, not yet journaled
        self._journaling = 0  # taken from _fresh, being journaled
        self._fresh_ready = asyncio.Event()
        # a 413 is refused for good too: one registration cannot be split
        self._sender = StrictSender(
            client, "artifact", Journal(run_dir / JOURNAL), run_dir, letter_route="artifact",
            accepted=self._accepted, refused=self._refused, body_of=_posted,
            dead_letters=frozenset({Verdict.REJECTED, Verdict.TOO_LARGE}),
            more_coming=lambda: bool(self._fresh or self._journaling))
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
        self._sender.expect()
        self._fresh_ready.set()

    @property
    def pending(self) -> int:
        """Registrations not yet acknowledged (or refused for good)."""
        return len(self._fresh) + self._journaling + sum(
            1 for record, _ in self._sender.queue if record != SKIPPED)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every registration is acknowledged; False when `timeout_s` ran out."""
        if self._task is None:  # nothing to register in this run, nothing left by another
            return True
        return await wait_set(self._sender.idle, timeout_s)

    async def close(self) -> None:
        await cancel(self._task)
        await self._sender.save_ack()

    async def _run(self) -> None:
        if not self.opened.is_set():
            self._sender.put(await asyncio.to_thread(self._open))
            self.opened.set()
        # Journaling goes on while the head is retried: a registration made during an outage
        # is on disk at once, not when the outage ends.
        await asyncio.gather(self._journal_loop(), self._sender.run())

    async def _journal_loop(self) -> None:
        while True:
            if not self._fresh:
                self._fresh_ready.clear()
                await self._fresh_ready.wait()
                continue
            await self._journal_fresh()

    def _open(self) -> list[Pending]:
        """Blocking: read the registered identities back; returns the journal's undelivered
        records."""
        self._registered.update(load_checked(self.run_dir / REGISTERED, _parse_registered) or {})
        queue = read_back(self._sender.journal, self._belongs, "artifact registrations",
                          self.run_id)
        for record, _ in queue:
            if record != SKIPPED:
                identity = json.loads(record)["identity"]
                self._registered[identity["path"]] = identity["fingerprint"]
        if queue:
            log.info("replaying %d artifact registration(s) left undelivered by an earlier "
                     "start", len(queue))
        return queue

    async def _journal_fresh(self) -> None:
        """Journal what was registered since and remember its identities durably, both before
        the first attempt: an acknowledged registration whose identity a crash lost would be
        registered again at the next start."""
        fresh, self._fresh = self._fresh, []
        self._journaling = len(fresh)
        # a full disk: delivered from memory, the next start may repeat it
        journaled = [await self._sender.journaled(record) for record in fresh]
        snapshot = json.dumps(self._registered).encode()
        try:
            await asyncio.to_thread(write_atomic, self.run_dir / REGISTERED, snapshot)
        except OSError as exc:
            state_write_failed(self.run_dir / REGISTERED, exc)
        self._sender.put(journaled)
        self._journaling = 0

    def _accepted(self, body: bytes) -> None:
        self.delivered += 1

    def _refused(self, body: bytes, answer: Answer, kept: Path | None) -> None:
        self.rejected += 1
        log.error("/artifact: HTTP %s: the ingest refused %s for good (%s); %s", answer.status,
                  body.decode(), answer.reason or "no reason given",
                  f"kept in {kept}" if kept else "not kept", extra={"route": "artifact"})

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
