"""The parts `sidecar run` (wrapper.py) and `sidecar watch` (watch.py) both start, built once, in
one place (docs/design.md#one-runtime).

A `Runtime` is made with what its parts call: the processes whose stacks a stall or a signal
reads, the way a line of ours reaches /logs, whether a stall line still holds. Making it settles
what must be known before anything is journaled: the node, the ingest client (None when
reporting is off) and the claim on the run's state folder; the stall clock is made then too,
since the command's output is read through it. `start` builds the rest once there is something
to report on: the pipeline, the stack taker and the status endpoint. `close` stops them in the
reverse order and releases the claim. What only `run` has (the child, its lifecycle, the crash
tail) and what only `watch` has (the processes it finds) stay in their command's module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sidecar.config import Config
from sidecar.delivery.client import IngestClient
from sidecar.exits import ConfigError
from sidecar.log import BRIEF, brief, log
from sidecar.node import Node, resolve_node
from sidecar.stall import StallWatch, gpu_summary
from sidecar.statefile import FolderBusy, claim_folder, release
from sidecar.supervise import restarts, spawn_once, supervise

if TYPE_CHECKING:  # imported once there is something to report on: `run` spawns before these
    from sidecar.delivery.lifecycle import Lifecycle
    from sidecar.delivery.logs import LogShipper
    from sidecar.diagnose import Failure
    from sidecar.observe.endpoint import StatusServer
    from sidecar.pipeline import Pipeline
    from sidecar.sources.console.signatures import Scanner
    from sidecar.stacks import Process, StackTaker
    from sidecar.timeshare import TimeSampler

TICK_S = 0.25  # how often quiet partial lines, progress bars and the stall clock are looked at


def end_line(outcome: str, client: IngestClient, left: Sequence[str]) -> str:
    """The last line: `outcome`, what the ingest took by route, and what was `left`
    undelivered (each said in a WARNING before)."""
    took = {route: stats.accepted for route, stats in sorted(client.stats.items())
            if stats.accepted}
    line = (f"{outcome}; the ingest took {sum(took.values())} payload(s)"
            + (f" ({', '.join(f'{route} {n}' for route, n in took.items())})" if took else ""))
    if left:
        return line + "; not delivered (said above): " + "; ".join(left)
    return line + "; nothing is left to deliver"


def make_client(cfg: Config) -> IngestClient | None:
    """The ingest client for `cfg`, or None when reporting is off (ENABLED=0); ConfigError when
    --ca-file cannot be loaded, so that nothing starts with it."""
    if not cfg.platform.enabled:
        return None
    try:
        return IngestClient(endpoint=cfg.platform.endpoint,
                            token_headers=cfg.platform.token_headers, read_token=cfg.read_token,
                            ca_file=cfg.ca_file)
    except ValueError as exc:
        raise ConfigError(f"--ca-file {cfg.ca_file}: {exc}; give the PEM bundle of the "
                          "authority that signed the ingest's certificate, or drop the "
                          "option") from None


def claim_run_dir(cfg: Config, *, lock: bool = True) -> int | None:
    """The run's state folder created, proven writable and, with `lock`, held by this process
    alone (docs/commands.md#the-state-folder); else ConfigError naming --state-dir. Returns the lock
    for `release`."""
    try:
        return claim_folder(cfg.run_dir, lock=lock)
    except FolderBusy as busy:
        raise ConfigError(f"--state-dir: {cfg.run_dir} is in use by another sidecar (PID "
                          f"{busy.holder}); a run's folder is held by one sidecar at a time: "
                          "stop that one, or give this one its own --state-dir") from None
    except OSError as exc:
        where = ("--state-dir (SIDECAR_STATE_DIR)" if not cfg.state_dir_is_default else
                 "the default --state-dir (from XDG_STATE_HOME or HOME)")
        raise ConfigError(f"{where}: {cfg.run_dir} cannot be created or written "
                          f"({exc.strerror or exc.__class__.__name__}); the spool and the "
                          "lifecycle journal live there: pass --state-dir a writable folder, "
                          "in a pod an emptyDir volume") from None


class Report:
    """What the status endpoint shows of the run beyond the routes: the failure signatures seen
    in the command's output, the failure summary, the stall."""

    __slots__ = ("failure", "scanner", "stall")

    def __init__(self, scanner: Scanner | None, stall: StallWatch | None) -> None:
        self.scanner = scanner
        self.failure: Failure | None = None
        self.stall = stall


class Runtime:
    """The client, the claim on the state folder, the stall clock, the pipeline, the stack taker
    and the status endpoint of one run, in the order they are built."""

    def __init__(self, cfg: Config, environ: Mapping[str, str], mode: str, *,
                 processes: Callable[[], Iterable[Process]],
                 announce: Callable[[str], None] | None = None,
                 scanner: Scanner | None = None,
                 still_stalled: Callable[[], bool] = lambda: True,
                 stall_lines: Callable[[], Sequence[str]] = tuple) -> None:
        """`processes`: whose stacks to read (blocking); `announce`: a line of ours to /logs
        between the output's lines (by default through the pipeline, as `watch` has no output
        of its own); `still_stalled`: whether a stall's stacks are still worth saying once
        taken (`run`: while the command runs); `stall_lines`: said after them (`run`: which
        ranks printed last)."""
        self.cfg, self.mode = cfg, mode
        self.node: Node = resolve_node(cfg.node_name, environ, cfg.nodes)
        self.client = make_client(cfg)
        self.held = claim_run_dir(cfg) if self.client is not None else None
        self.pipeline: Pipeline | None = None
        self.stacks: StackTaker | None = None
        self.status: StatusServer | None = None
        self.time: TimeSampler | None = None  # --time-window's sampling
        self._time_task: asyncio.Task[None] | None = None
        self._processes = processes
        self._announce = announce or self._through_pipeline
        self._still_stalled = still_stalled
        self._stall_lines = stall_lines
        self.stall = StallWatch(cfg.stall_after, self._announce, self._gpus,
                                on_stall=self._stacks_at_stall)
        self.report = Report(scanner, self.stall)
        self.lifecycle: Lifecycle | None = None
        self._say_start()

    def _say_start(self) -> None:
        """The one line before the command's output: what is reported, and where to."""
        node = self.node
        where = f"node {node.name}" + (f", rank {node.rank}" if node.multi_node else "")
        more = " (-v: all of the sidecar's messages)" if brief() else ""
        if self.client is None:
            log.info("reporting is off (ENABLED=0): %s%s",
                     "the command's output is passed through, nothing is posted"
                     if self.mode == "run" else "nothing is followed; waiting for SIGTERM",
                     more, extra=BRIEF)
            return
        log.info("reporting run %s to %s from %s%s", self.cfg.platform.run_id,
                 self.cfg.platform.endpoint, where, more, extra=BRIEF)

    async def start(self, *, lifecycle: Lifecycle | None = None,
                    shipper: LogShipper | None = None, child_env: Mapping[str, str],
                    environ: Mapping[str, str], argv: Sequence[str] = (),
                    trainer_pid: Callable[[], int | None] | None = None) -> None:
        """What posts (imports, connections, threads), the stack taker and the status endpoint;
        `run` calls it once the command runs. `shipper`: `run` made it first, for the command's
        output before the pipeline exists."""
        cfg, client = self.cfg, self.client
        self.lifecycle = lifecycle
        if client is not None:
            from sidecar.pipeline import Pipeline

            # known at once: the shipper `run` made wakes its follower through it
            pipeline = self.pipeline = Pipeline(cfg, client, self.node, cfg.hparams, shipper,
                                                on_activity=self.stall.activity)
            await client.start()
            pipeline.start()
            pipeline.start_telemetry(child_env, environ, argv, trainer_pid,
                                     find_trainer_python=self.mode == "run")
        from sidecar.stacks import StackTaker

        self.stacks = StackTaker(self._processes, cfg.run_dir if client is not None else None)
        if cfg.time_window > 0:
            self._sample_time()
        self.status = await serve_status(cfg, self.node, self.mode, client, self.pipeline,
                                         lifecycle, self.report, self.stacks, self.time,
                                         self._processes)

    def _sample_time(self) -> None:
        """--time-window: each window's shares to /hardware, its verdicts to /logs."""
        from sidecar.timeshare import TimeSampler
        from sidecar.verdicts import Verdicts

        assert self.stacks is not None
        node = self.node
        verdicts = Verdicts(self._announce, node.name, node.multi_node, self._gpus)
        run_id = self.cfg.platform.run_id

        def emit(points: list[dict[str, Any]]) -> None:
            if self.pipeline is not None:
                self.pipeline.emit("hardware", {"run_id": run_id, "node": node.name,
                                                "points": points})

        # py-spy's output in a folder of the temporary directory, not the state folder: a full
        # state disk is said once, as its own cause, and the sampling goes on
        self.time = TimeSampler(self.cfg.time_window, self._processes, emit, verdicts,
                                verdicts.lines, self.stacks.tool, verdicts.starving)
        self._time_task = supervise("time-shares", self.time.run)

    async def close(self, outcome: str, kept: Sequence[str] = ()) -> None:
        """The status endpoint, the pipeline, the client, in that order; then the claim. One
        line ends it: the run's `outcome`, what the ingest took, and what was not delivered
        (`kept`: what the caller holds beyond the pipeline's)."""
        if self.status is not None:
            await self.status.close()
        if self.time is not None:
            from sidecar.aio import cancel

            await cancel(self._time_task)
            self.time.close()
        left = await self.pipeline.close() if self.pipeline is not None else []
        if self.client is not None:
            await self.client.close()
            lifecycle = self.lifecycle
            pending = lifecycle.pending if lifecycle is not None else []
            if pending:
                left.insert(0, f"lifecycle {', '.join(pending)}")
            log.info("%s", end_line(outcome, self.client, [*left, *kept]), extra=BRIEF)
        release(self.held)

    def _through_pipeline(self, line: str) -> None:
        if self.pipeline is not None:
            self.pipeline.announce(line)

    def _gpus(self) -> str:
        """What the sampler last saw of the GPUs, for a stall's line."""
        sampler = self.pipeline.sampler if self.pipeline is not None else None
        return gpu_summary(sampler.gpu_gauges) if sampler is not None else "no GPU"

    def _stacks_at_stall(self) -> None:
        """The stall was said: the stacks follow it, off the loop, as one block."""
        taker = self.stacks
        if taker is None:
            return
        async def look() -> None:  # without py-spy, one line in our log says so
            from sidecar.stacks import say

            stacks = await taker.take("stall")
            # said while the stall lasts: after its resume line it would say a past moment
            if stacks is not None and self.stall.stalled and self._still_stalled():
                block = taker.block(stacks, "at the stall", list(self._stall_lines()))
                say(block)
                for line in block:
                    self._announce(line)

        spawn_once("stacks-at-stall", look)


async def serve_status(cfg: Config, node: Node, mode: str, client: IngestClient | None,
                       pipeline: Pipeline | None, lifecycle: Lifecycle | None,
                       report: Report, stacks: StackTaker | None = None,
                       shares: TimeSampler | None = None,
                       processes: Callable[[], Iterable[Process]] = tuple
                       ) -> StatusServer | None:
    """The local status endpoint (--status-addr), reading the live objects at request time."""
    if cfg.status_addr == "off":
        return None  # nor is the endpoint's module imported
    from sidecar.observe.endpoint import (
        CheckpointSnapshot,
        FileSnapshot,
        MatchSnapshot,
        RouteSnapshot,
        SourceSnapshot,
        StatusSnapshot,
        UploadSnapshot,
        start_status_server,
    )

    started_at = time.time()

    def snapshot() -> StatusSnapshot:
        queued = {b.route: b.queued for b in pipeline.batchers} if pipeline is not None else {}
        if pipeline is not None:
            queued["logs"] = pipeline.shipper.queued
        sources = tuple(
            SourceSnapshot(kind, kind, s.bytes_read, s.records, s.points, s.invalid, s.skipped)
            for kind, s in (pipeline.follower.stats.items() if pipeline is not None else ()))
        follower = pipeline.follower if pipeline is not None else None
        files = tuple(FileSnapshot(f.path, f.kind, f.offset, f.size, f.lag_bytes, f.committed,
                                   f.last_read) for f in (follower.files() if follower else ()))
        matches = tuple(MatchSnapshot(m.source, m.files, m.note)
                        for m in (follower.matches() if follower else ()))
        sampler = pipeline.sampler if pipeline is not None else None
        watcher = pipeline.checkpoints if pipeline is not None else None
        checkpoints = tuple(CheckpointSnapshot(*folder)
                            for folder in (watcher.states() if watcher is not None else ()))
        uploads = pipeline.uploads if pipeline is not None else None
        upload_totals = {} if uploads is None else {
            "bytes": uploads.bytes_uploaded, "files": uploads.files_uploaded,
            "refused": uploads.refused}
        return StatusSnapshot(
            run_id=cfg.platform.run_id, node=node.name, mode=mode, offline=client is None,
            started_at=started_at,
            routes=tuple(RouteSnapshot.of(route, stats, queue_depth=queued.get(route, 0))
                         for route, stats in (client.stats.items() if client else ())),
            sources=sources, files=files, matches=matches,
            sampler_duration_s=sampler.stats.last_sample_s if sampler is not None else None,
            lifecycle_recorded=tuple(lifecycle.recorded) if lifecycle is not None else (),
            lifecycle_pending=tuple(lifecycle.pending) if lifecycle is not None else (),
            task_restarts=restarts(),
            signatures=report.scanner.counts if report.scanner is not None else {},
            failure=report.failure.to_json() if report.failure is not None else None,
            stalled_s=report.stall.stalled_s if report.stall is not None else 0.0,
            checkpoints=checkpoints,
            uploads=tuple(UploadSnapshot(**u) for u in (uploads.progress() if uploads else ())),
            upload_totals=upload_totals,
            time_shares=shares.to_json() if shares is not None else None)

    run_dir = cfg.run_dir if client is not None else None

    async def look(fresh: bool) -> dict[str, Any] | str:
        """/stacks: a look now; /stacks/last: the one taken at the stall or the signal."""
        if stacks is None or not stacks.available:
            return ("the stacks cannot be taken: py-spy is not installed here "
                    "(docs/stalls.md#where-it-cannot-look)")
        taken = await stacks.take("on-demand") if fresh else stacks.last
        if taken is None:
            return "no stacks were taken yet: no stall was said"
        return taken.to_json()

    async def profile(seconds: int) -> dict[str, Any] | str:
        """/profile: every rank sampled for `seconds`, its workers too."""
        from sidecar.timeshare import profile as sample

        return await sample(stacks.tool if stacks is not None else None, processes, seconds)

    return await start_status_server(cfg.status_addr, run_dir, snapshot, stacks=look,
                                     profile=profile)
