"""Sources -> batchers -> ingest for one run: what `run` and `watch` share.

    --log files ------\\                       /--> LogShipper (best-effort) ----------> /logs
    --jsonl files -----> Follower --> Pipeline ---> Batcher "metrics" (at-least-once) --> /metrics
    --tensorboard dirs /   (offsets  <-- acks  \\--> Batcher "hparams" ------------------> /hparams
    --hparams file ---------------------------------^
    emit(route, payload) (sampler, environment) --> Batcher per route ---------> /hardware, ...

A file's offset is committed (files/offsets.py) only when every payload made from the bytes before
it was acknowledged; the acknowledgement travels back as a `Ticket`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.aio import cancel, wait_set
from sidecar.config import Config
from sidecar.delivery.artifacts import JOURNAL as ARTIFACT_JOURNAL
from sidecar.delivery.artifacts import Artifacts
from sidecar.delivery.batcher import Batcher
from sidecar.delivery.client import ROUTES, IngestClient
from sidecar.delivery.keys import KeyBudget
from sidecar.delivery.logs import LogShipper
from sidecar.delivery.spool import MAX_SPOOL_BYTES, Spool
from sidecar.delivery.upload import LEDGER as UPLOAD_LEDGER
from sidecar.delivery.upload import Uploads
from sidecar.log import log, state_write_failed
from sidecar.masking import mask
from sidecar.node import Node
from sidecar.records import Ticket
from sidecar.sources.base import Parsed
from sidecar.sources.files.discover import tree_root
from sidecar.sources.files.follow import Follower, Sink
from sidecar.sources.files.hparams import HparamsFile
from sidecar.sources.files.kinds import FILE_KINDS, FileKind, Follow
from sidecar.sources.files.offsets import Offsets
from sidecar.sources.files.spec import SourceSpec
from sidecar.sources.telemetry.environment import post_environment
from sidecar.statefile import Malformed, load_checked, write_atomic
from sidecar.supervise import supervise

if TYPE_CHECKING:
    from sidecar.sources.files.checkpoints import CheckpointWatcher, Found
    from sidecar.sources.files.logfile import LogFileParser
    from sidecar.sources.telemetry.sampler import HardwareSampler

# keys whose NaN/inf values are counted and said by name; the values of further keys are counted
# together (a new key every step would grow without end)
MAX_NAMED_INVALID_KEYS = 100
DOCUMENT_ROUTES = tuple(name for name, policy in ROUTES.items() if policy.documents)
MAX_QUEUED_DOCUMENTS = 8  # in memory (lost to a SIGKILL); more waits in the disk spool
MAX_HPARAMS_PER_REQUEST = 1000
DRAIN_READ_STEP_S = 0.05
ENVIRONMENT_DRAIN_SHARE = 0.25  # of --drain-timeout a snapshot still being taken may have


SOURCES_FILE = "sources.json"  # in the run's folder: the file sources it follows, for replay


def recorded_sources(run_dir: Path) -> dict[str, tuple[str, ...]] | None:
    """The file sources a run recorded in its folder (`Pipeline.start`), or None. A kind the
    file does not name has none: the run that wrote it predates the kind."""
    def parse(data: bytes) -> dict[str, tuple[str, ...]]:
        doc = json.loads(data)
        if not isinstance(doc, dict) or not all(
                isinstance(doc.get(kind.name, []), list)
                and all(isinstance(p, str) for p in doc.get(kind.name, []))
                for kind in FILE_KINDS):
            raise Malformed("not lists of paths by source kind")
        return {kind.name: tuple(doc.get(kind.name, ())) for kind in FILE_KINDS}

    return load_checked(run_dir / SOURCES_FILE, parse)


def document_batcher(client: IngestClient, route: str, run_dir: Path) -> Batcher:
    """The batcher of a route whose payloads are documents, spooling to disk when it must."""
    cap = ROUTES[route].spool_max_bytes
    spool = Spool(run_dir / "spool" / route.replace("/", "_"),
                  max_bytes=MAX_SPOOL_BYTES if cap is None else cap)
    return Batcher(client, route, lambda docs: docs[0], run_dir, max_items=1,
                   max_queued=MAX_QUEUED_DOCUMENTS, spool=spool)


def routed_batcher(client: IngestClient, route: str, run_id: str, run_dir: Path,
                   on_room: Callable[[], None]) -> Batcher:
    """The batcher of a file kind's documents: one a request, each with the run's id, a few
    queued at most (a round's chunks are large); the file's offset waits for them."""
    return Batcher(client, route, lambda docs: {"run_id": run_id, **docs[0]}, run_dir,
                   max_items=1, max_queued=MAX_QUEUED_DOCUMENTS, on_room=on_room)


def source_specs(cfg: Config, node: Node,
                 made: Callable[[LogFileParser], None] | None = None) -> list[SourceSpec]:
    """The files `cfg` asks to follow, each kind with its parser (`made` is told of each log
    file's)."""
    follow = Follow(cfg, cfg.log_prefix.format(node=node.name, rank=node.rank), made)
    specs = []
    for kind in FILE_KINDS:
        patterns = cfg.files.get(kind.name, ())
        if patterns and kind.reporting_node and node.rank != 0:
            log.info("%s: not followed on node rank %d: on a multi-node run, node rank 0 "
                     "posts what these files hold", kind.flag, node.rank,
                     extra={"source": kind.name})
            continue
        if kind.tree:
            # a folder's parsers name keys from the path below it: one spec a folder
            specs += [_spec(kind, (pattern,), follow._replace(
                folder=tree_root(pattern, kind.name, kind.tree))) for pattern in patterns]
        elif patterns:
            specs.append(_spec(kind, patterns, follow))
    return specs


def _spec(kind: FileKind, patterns: tuple[str, ...], follow: Follow) -> SourceSpec:
    return SourceSpec(kind.name, patterns, kind.parsers(follow), parse_bytes=kind.parse_bytes,
                      option=kind.flag, tree=kind.tree, silence=kind.silence)


def _checkpoint_watcher(cfg: Config, node: Node, artifacts: Artifacts,
                        uploads: Uploads) -> CheckpointWatcher:
    """--checkpoints: found checkpoints to /artifact, uploaded first when unmapped and asked
    to; rank 0 alone registers on a multi-node run (a folder on a shared filesystem is seen
    by every node, and a trainer saves on its main process, so node-local folders of other
    nodes hold no checkpoint of the run's own)."""
    from sidecar.delivery.upload import Checkpoint
    from sidecar.options import parse_artifact_uri
    from sidecar.sources.files.checkpoints import (
        ArtifactPaths,
        CheckpointWatcher,
        container_signal,
        uploads_unmapped,
    )

    def register(found: Found) -> None:
        body: dict[str, Any] = {"kind": found.kind, "path": found.artifact_path,
                                "format": found.format, "size_bytes": found.size_bytes}
        if found.step is not None:
            body["step"] = found.step
        if not found.upload:
            artifacts.register(found.local, found.fingerprint, body)
            return
        name = os.path.relpath(found.local, found.root).replace(os.sep, "/")
        uploads.submit(Checkpoint(found.local, found.fingerprint, name, found.files, body))

    def known(path: str, fingerprint: str) -> bool:
        return artifacts.known(path, fingerprint) or uploads.known(path, fingerprint)

    not_registering = "" if node.rank == 0 else (
        f"this is node rank {node.rank}: on a multi-node run, node rank 0 registers checkpoints")
    container = container_signal(os.environ)
    paths = ArtifactPaths([parse_artifact_uri(m) for m in cfg.artifact_uri], container,
                          upload=uploads_unmapped(cfg.checkpoint_upload, container))
    return CheckpointWatcher(cfg.checkpoints, register, known, paths,
                             not_registering, mode=cfg.file_watch)


class Pipeline(Sink):
    """Everything that posts for one run, except the lifecycle."""

    def __init__(self, cfg: Config, client: IngestClient, node: Node,
                 hparams_file: Path | None = None,
                 log_shipper: LogShipper | None = None,
                 on_activity: Callable[[], None] | None = None) -> None:
        """`hparams_file`: --hparams, followed from start; `log_shipper`: `run` makes it first,
        for the command's output before this pipeline exists; `on_activity`: told of log text,
        and of a metric step beyond any before (the stall clock)."""
        self.cfg = cfg
        self.client = client
        self.node = node
        self.key_budget = KeyBudget()  # the platform's limit on a run's distinct metric keys
        self.invalid: dict[str, int] = {}  # NaN and infinite values, per key
        self.invalid_unnamed = 0  # those of keys past MAX_NAMED_INVALID_KEYS of them
        self.sampler: HardwareSampler | None = None
        self.on_activity = on_activity
        self._top_step = float("-inf")
        self._thinned = 0
        self._follow_task: asyncio.Task[None] | None = None
        self._environment_task: asyncio.Task[None] | None = None
        self._sampler_task: asyncio.Task[None] | None = None
        self._hparams_task: asyncio.Task[None] | None = None
        self._checkpoints_task: asyncio.Task[None] | None = None
        self._uploads_task: asyncio.Task[None] | None = None
        self.read = asyncio.Event()  # the drain read the files to their end (or gave up)
        run_id, run_dir = cfg.platform.run_id, cfg.run_dir
        # a sink with room again wakes the follower (made below, before anything is sent)
        self.shipper = log_shipper or LogShipper(
            client, run_id, prefix=cfg.log_prefix.format(node=node.name, rank=node.rank),
            on_room=self.room)
        self.metrics = Batcher(client, "metrics", lambda points: {
            "run_id": run_id, "points": points}, run_dir, on_room=self.room)
        self.hparams = Batcher(client, "hparams", lambda pairs: {
            "run_id": run_id, "params": dict(pairs)}, run_dir, max_items=MAX_HPARAMS_PER_REQUEST,
            on_room=self.room)
        self.documents = {route: document_batcher(client, route, run_dir)
                          for route in DOCUMENT_ROUTES}
        # the documents of file kinds with a route (files/kinds.py), by kind: not spooled, the
        # file holds them until acknowledged
        self.routed = {kind.name: routed_batcher(client, kind.route, run_id, run_dir, self.room)
                       for kind in FILE_KINDS if kind.route and cfg.files.get(kind.name)}
        self.hparams_file = None if hparams_file is None else HparamsFile(
            hparams_file, lambda params: self.hparams.push(list(params.items())))
        self.offsets = Offsets(run_dir / "offsets.json")
        self._prefix = cfg.log_prefix.format(node=node.name, rank=node.rank)
        # the parsers of the log files followed now: a line of ours ends their open lines first
        self._log_parsers: weakref.WeakSet[LogFileParser] = weakref.WeakSet()
        self.follower = Follower(source_specs(cfg, node, self._log_parsers.add), self,
                                 self.offsets, mode=cfg.file_watch)
        self.artifacts = Artifacts(run_dir, run_id, client)
        self.uploads = Uploads(run_dir, run_id, client, self.artifacts.register,
                               self.artifacts.known, cfg.upload_rate)
        self.checkpoints = _checkpoint_watcher(cfg, node, self.artifacts, self.uploads) \
            if cfg.checkpoints else None

    def room(self) -> None:
        """A sink has room again: the follower reads on (its files wait while none has)."""
        self.follower.room()

    @property
    def batchers(self) -> list[Batcher]:
        return [self.metrics, self.hparams, *self.documents.values(), *self.routed.values()]

    def start(self) -> None:
        """Start delivering, load the offsets, follow the files, send --hparams."""
        self._record_sources()
        self.shipper.start()
        for batcher in self.batchers:
            if batcher.spool is not None:
                batcher.spool.open()
            batcher.start()
        self.offsets.load()
        self.offsets.start()
        if self.hparams_file is not None:
            self._hparams_task = supervise("hparams", self.hparams_file.run)
        if self.follower.specs:
            self._follow_task = supervise("follow", self.follower.run)
        left_uploads = (self.cfg.run_dir / UPLOAD_LEDGER).exists()
        # an upload an earlier start left is registered through the artifacts once stored
        if (self.checkpoints is not None or left_uploads
                or (self.cfg.run_dir / ARTIFACT_JOURNAL).exists()):
            self.artifacts.start()
        if self.checkpoints is not None or left_uploads:
            self._uploads_task = supervise("uploads-open", self._start_uploads)
        if self.checkpoints is not None:
            self._checkpoints_task = supervise("checkpoints", self._watch_checkpoints)

    async def uploads_opened_if_started(self) -> None:
        """Wait until the uploads an earlier start left are read back, when there are any."""
        if self._uploads_task is not None:
            await self.uploads.opened.wait()

    async def _start_uploads(self) -> None:
        """The uploads, once the registrations of earlier starts are known (an upload whose
        registration was made is not made again)."""
        await self.artifacts.opened.wait()
        self.uploads.start()

    async def _watch_checkpoints(self) -> None:
        """--checkpoints, once the registrations and the uploads of earlier starts are known."""
        assert self.checkpoints is not None
        await self.artifacts.opened.wait()
        await self.uploads.opened.wait()
        await self.checkpoints.run()

    def _record_sources(self) -> None:
        """Say in the run's folder which files it follows, so that `sidecar replay` can read
        what they hold past their committed offsets without being told again."""
        cfg = self.cfg
        # a token in a pattern is masked (replay then finds no file there, and says so)
        doc = {kind.name: [mask(os.path.abspath(p)) for p in cfg.files.get(kind.name, ())]
               for kind in FILE_KINDS}
        try:
            write_atomic(cfg.run_dir / SOURCES_FILE, json.dumps(doc).encode())
        except OSError as exc:
            state_write_failed(cfg.run_dir / SOURCES_FILE, exc)

    def start_telemetry(self, child_env: Mapping[str, str], environ: Mapping[str, str],
                        command: Sequence[str], trainer_pid: Callable[[], int | None] | None,
                        find_trainer_python: bool) -> None:
        """The environment snapshot and the hardware sampler (docs/ingest.md#nodes-and-ranks)."""
        cfg = self.cfg
        self._environment_task = supervise("environment", lambda: post_environment(
            emit=self.emit, run_id=cfg.platform.run_id, node=self.node, python=cfg.python,
            child_env=child_env, environ=environ, command=command,
            find_trainer_python=find_trainer_python))
        if cfg.hardware_interval > 0:
            # imported here: with sampling off, its NVML and psutil code is never loaded
            from sidecar.sources.telemetry.gpus import choose_gpus
            from sidecar.sources.telemetry.sampler import HardwareSampler

            # the folders the files are written in
            disk_paths = [cfg.state_dir, *(tree_root(p, kind.name, kind.tree) if kind.tree
                                           else Path(p).parent
                                           for kind in FILE_KINDS
                                           for p in cfg.files.get(kind.name, ()))]
            gpus = choose_gpus(cfg.gpus, child_env, environ, watching=trainer_pid is None)
            self.sampler = HardwareSampler(
                run_id=cfg.platform.run_id, node=self.node.name, interval_s=cfg.hardware_interval,
                emit=self.emit, gpu_filter=gpus.filter, by_processes=gpus.by_processes,
                gpu_rule=gpus.rule, trainer_pid=trainer_pid, disk_paths=disk_paths)
            self._sampler_task = supervise("hardware", self.sampler.sample_forever)

    async def _stop_telemetry(self) -> None:
        """Stop sampling; a snapshot still being taken gets a share of the drain time."""
        await cancel(self._sampler_task)
        if self._environment_task is not None:
            await asyncio.wait({self._environment_task},
                               timeout=self.cfg.drain_timeout * ENVIRONMENT_DRAIN_SHARE)
        await cancel(self._environment_task)
        if self.sampler is not None:
            self.sampler.close()

    # -- Sink ---------------------------------------------------------------------------------

    def has_room(self) -> bool:
        return (self.shipper.has_room and self.metrics.has_room and self.hparams.has_room
                and all(batcher.has_room for batcher in self.routed.values()))

    def due(self) -> float | None:
        """The soonest a request of log text or points that is not full starts, while paced."""
        paced = [at for at in (self.shipper.pace.next_at(), self.metrics.pace.next_at())
                 if at is not None]
        return min(paced, default=None)

    def deliver(self, parsed: Parsed, ticket: Ticket, kind: str, source: str) -> None:
        active = bool(parsed.text) or self._new_step(parsed.points)
        if parsed.text:  # before a line of ours about it (resumed): the text is assembled,
            self.shipper.put(parsed.text, ticket)  # its file's open line is known past it
        if self.on_activity is not None and active:
            self.on_activity()
        if parsed.points:
            self.metrics.push(self.key_budget.admit(parsed.points), ticket)
        if parsed.hparams:
            self.hparams.push(list(parsed.hparams.items()), ticket)
        if parsed.documents:
            self.routed[kind].push(parsed.documents, ticket)
        for key, count in parsed.invalid.items():
            if key in self.invalid:
                self.invalid[key] += count
            elif len(self.invalid) < MAX_NAMED_INVALID_KEYS:  # each said once
                step = parsed.invalid_steps.get(key)
                log.warning("metric %r: a NaN or infinite value%s in %s is never sent; such "
                            "values are counted per key (said once per key)", key,
                            "" if step is None else f" at step {step}", source)
                self.invalid[key] = count
            else:
                if not self.invalid_unnamed:
                    log.warning("NaN or infinite values in more than %d metric keys: those of "
                                "further keys are counted together, not named",
                                MAX_NAMED_INVALID_KEYS)
                self.invalid_unnamed += count

    def announce(self, line: str) -> None:
        """A line of ours (`[sidecar] ...`) to /logs between the followed files' lines, never
        spliced into one of them: the open line of each (sent in part after a quiet second)
        is ended first, and its rest, when it comes, is prefixed again."""
        for parser in list(self._log_parsers):
            self.shipper.put(parser.end_line())
        self.shipper.put(mask(self._prefix + line + "\n"))

    def _new_step(self, points: list[dict[str, Any]]) -> bool:
        """Whether `points` go beyond every step seen before (--stall-after's progress)."""
        top = max((point["step"] for point in points), default=float("-inf"))
        if top <= self._top_step:
            return False
        self._top_step = top
        return True

    def emit(self, route: str, payload: dict[str, Any]) -> None:
        """Hand one payload to an at-least-once document route; never blocks. Past half its
        spool, every other hardware sample is dropped (thinned) to keep room for the rest."""
        batcher = self.documents[route]
        spool = batcher.spool
        if ROUTES[route].thinned and spool is not None and spool.size_bytes > spool.max_bytes // 2:
            self._thinned += 1
            if self._thinned % 2:
                if self._thinned % 1000 == 1:
                    log.warning("/%s: the ingest has been unreachable long enough to fill "
                                "half the %s spool; keeping every other sample (%d dropped "
                                "so far)", route, route, self._thinned // 2 + 1,
                                extra={"route": route})
                return
        batcher.offer([payload])

    # -- shutdown -------------------------------------------------------------------------------

    async def drain(self, deadline: float) -> None:
        """Read every file to its end and deliver what can be delivered by `deadline`; `read`
        is set once the files' text is all with the log shipper (`run`'s crash tail goes
        after it)."""
        self.key_budget.report_refused()  # what a minute held back
        # beside the files: a snapshot still being taken must not hold up their text
        telemetry = asyncio.create_task(self._stop_telemetry())
        if self.hparams_file is not None:
            await cancel(self._hparams_task)
            await self.hparams_file.check(final=True)
        await cancel(self._checkpoints_task)
        # beside the files: a checkpoint still being written at a stop may take all the drain's time
        checkpoints = asyncio.create_task(self._drain_checkpoints(deadline))
        if self._follow_task is not None:
            await cancel(self._follow_task)
            while time.monotonic() < deadline:
                if await self.follower.drain():
                    break
                await asyncio.sleep(DRAIN_READ_STEP_S)
        self.read.set()
        await telemetry
        remaining = max(deadline - time.monotonic(), 0.0)
        await asyncio.gather(self.shipper.flush(remaining), checkpoints,
                             *(b.flush(remaining) for b in self.batchers))
        await self.offsets.save()

    async def _drain_checkpoints(self, deadline: float) -> None:
        """Judge the checkpoints that are settling, then deliver the registrations, by
        `deadline`."""
        self.uploads.hurry()
        if self.checkpoints is not None and await wait_set(
                self.uploads.opened, max(deadline - time.monotonic(), 0.0)):
            await self.checkpoints.drain(deadline)
            self.checkpoints.say_unregistered()
        await self.uploads.drain(max(deadline - time.monotonic(), 0.0))
        await self.artifacts.drain(max(deadline - time.monotonic(), 0.0))

    async def stop_reading(self) -> None:
        """Stop every source at once, reading nothing more (the drain is not waited out: no
        answer of the run was accepted); what they made and was not acknowledged stays where
        close() says."""
        await cancel(self._sampler_task)
        await cancel(self._environment_task)
        if self.sampler is not None:
            self.sampler.close()
        await cancel(self._hparams_task)
        await cancel(self._follow_task)

    async def close(self) -> list[str]:
        """Stop; what is undelivered is spooled (documents) or left to the files, and said in
        one line; returned too, a phrase a route, for the run's last line."""
        self.key_budget.report_refused()
        await self.shipper.stop()
        await cancel(self._checkpoints_task)
        await cancel(self._uploads_task)
        await self.uploads.close()
        await self.artifacts.close()
        await asyncio.gather(*(b.stop() for b in self.batchers))
        for batcher in self.documents.values():
            await batcher.persist()
        await self.offsets.stop()
        self.follower.close()
        left = {b.route: b.queued for b in self.batchers if b.queued}
        if self.artifacts.pending:
            left["artifact"] = self.artifacts.pending
        if left:
            log.warning(
                "stopped with undelivered data: %s. Metric points are read again from their "
                "files' last acknowledged offsets at the next start; spooled payloads are in "
                "%s, for the next start or `sidecar replay`",
                ", ".join(f"{route} {n}" for route, n in left.items()), self.cfg.run_dir / "spool")
        said = [f"{route} {n}" for route, n in left.items()]
        if self.shipper.dropped_chars:
            log.warning("log output dropped in this run, not to be delivered: %d characters in "
                        "all (/logs is best-effort while the command runs)",
                        self.shipper.dropped_chars)
            said.append(f"{self.shipper.dropped_chars} characters of output dropped for /logs")
        return said
