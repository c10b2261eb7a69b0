"""Wires sources to batchers to the ingest client for `sidecar watch`, and what `sidecar run`
(wrapper.py) shares with it: the client, the run's state folder, the stall clock, the status
endpoint.

`sidecar watch` in one picture: the files named by each file-source kind's option
(sources/files/kinds.py), the hardware sampler and the environment snapshot --> Pipeline
(pipeline.py) --> IngestClient;
SIGTERM or SIGINT --> every file read to its end, delivered within --drain-timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sidecar.aio import cancel
from sidecar.config import Config
from sidecar.delivery.client import IngestClient
from sidecar.exits import ConfigError
from sidecar.log import log
from sidecar.node import Node, resolve_node
from sidecar.sources.files.kinds import FILE_KINDS
from sidecar.stall import StallWatch, gpu_summary
from sidecar.statefile import FolderBusy, claim_folder, release
from sidecar.supervise import fault_point, restarts, supervise

if TYPE_CHECKING:  # types only: watch never loads the wrapper's modules, nor the endpoint's
    from sidecar.delivery.lifecycle import Lifecycle
    from sidecar.diagnose import Failure
    from sidecar.observe.endpoint import StatusServer
    from sidecar.pipeline import Pipeline
    from sidecar.sources.console.signatures import Scanner
    from sidecar.stacks import StackTaker

TICK_S = 0.25  # how often quiet partial lines and progress bars are looked at
STALL_LOOK_S = 60.0  # watch: the longest sleep between looks for a stall


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
    """What the status endpoint shows of the command beyond the routes: signatures, failure."""

    __slots__ = ("failure", "gpus", "scanner", "stall")

    def __init__(self, scanner: Scanner | None = None, failure: Failure | None = None,
                 stall: StallWatch | None = None, gpus: Pipeline | None = None) -> None:
        self.scanner = scanner
        self.failure = failure
        self.stall = stall
        self.gpus = gpus  # whose sampler says what the GPUs do, for a stall line

    def gpu_summary(self) -> str:
        sampler = self.gpus.sampler if self.gpus is not None else None
        return gpu_summary(sampler.gpu_gauges) if sampler is not None else "no GPU"


async def run_watch(cfg: Config, environ: Mapping[str, str]) -> int:
    """`sidecar watch`: follow the sources until SIGTERM/SIGINT, then drain; returns 0."""
    node = resolve_node(cfg.node_name, environ, cfg.nodes)
    client = make_client(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if client is None:
        log.info("reporting is off (ENABLED=0): nothing is followed; waiting for SIGTERM")
        status = await serve_status(cfg, node, "watch", None, None, None, Report())
        await stop.wait()
        if status is not None:
            await status.close()
        return 0
    from sidecar.pipeline import Pipeline

    held = claim_run_dir(cfg)
    await client.start()
    pipeline = Pipeline(cfg, client, node, cfg.hparams)
    pipeline.start()
    pipeline.start_telemetry(environ, environ, (), None, find_trainer_python=False)
    report = Report(gpus=pipeline)
    stall = stall_watch(cfg, report, pipeline.announce)  # between the followed files' lines
    pipeline.on_activity = stall.activity
    stall_ticker = supervise("stall-watch", lambda: _watch_stall(stall))
    from sidecar.stacks import StackTaker, ranked_processes, spawn_once

    # watch has no command: the processes here that a launcher gave a rank
    stacks = StackTaker(ranked_processes, cfg.run_dir)

    def stacks_at_stall() -> None:
        async def look() -> None:
            taken = await stacks.take("stall")
            if taken is not None and stall.stalled:  # not after its resume line
                for line in stacks.block(taken, "at the stall"):
                    pipeline.announce(line)

        spawn_once("stacks-at-stall", look)  # without py-spy, one line in our log says so

    stall.on_stall = stacks_at_stall
    status = await serve_status(cfg, node, "watch", client, pipeline, None, report, stacks)
    files = ", ".join(f"{len(cfg.files.get(kind.name, ()))} {kind.name}" for kind in FILE_KINDS)
    log.info("watching %s source(s), %d checkpoint folder(s)", files, len(cfg.checkpoints))
    await stop.wait()
    await cancel(stall_ticker)
    refused = client.never_accepted
    if refused is not None:  # no wait would change that: say what is kept instead
        log.warning("stopping: no payload of this run was accepted, every answer was %s, so "
                    "the drain is not waited out; the files' data past their acknowledged "
                    "offsets and the spooled payloads are kept in %s for the next start or "
                    "`sidecar replay` (once the token is accepted)", refused, cfg.run_dir)
        pipeline.shipper.stop_reason = f"no answer of the ingest was accepted ({refused})"
        await pipeline.stop_reading()
    else:
        log.info("stopping: reading every file to its end, delivering for at most %.0f s",
                 cfg.drain_timeout)
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal ends the drain
            loop.add_signal_handler(signum, _cancel_current_task, asyncio.current_task())
        client.hurry()
        with contextlib.suppress(asyncio.CancelledError):
            await pipeline.drain(time.monotonic() + cfg.drain_timeout)
    await pipeline.close()
    await client.close()
    if status is not None:
        await status.close()
    release(held)
    return 0


def _cancel_current_task(task: asyncio.Task[Any] | None) -> None:
    log.warning("second signal during shutdown: stopping the drain now")
    if task is not None:
        task.cancel()


async def _watch_stall(stall: StallWatch) -> None:
    """`watch` has no stream to tick: it sleeps until a stall could be due (at most
    STALL_LOOK_S, since activity is only noted, never signalled), not four times a second: that
    ticker was the whole of an idle sidecar's CPU."""
    while True:
        fault_point()
        due_in = stall.due_in_s()
        await asyncio.sleep(STALL_LOOK_S if due_in is None else min(max(due_in, TICK_S),
                                                                    STALL_LOOK_S))
        stall.check()


def stall_watch(cfg: Config, report: Report, announce: Callable[[str], None]) -> StallWatch:
    """--stall-after for a run: its lines to /logs through `announce` (between the output's lines,
    never inside one), the GPUs as the sampler last saw them, its state on the status
    endpoint."""
    report.stall = StallWatch(cfg.stall_after, announce, report.gpu_summary)
    return report.stall


async def serve_status(cfg: Config, node: Node, mode: str, client: IngestClient | None,
                        pipeline: Pipeline | None, lifecycle: Lifecycle | None,
                        report: Report, stacks: StackTaker | None = None) -> StatusServer | None:
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
            upload_totals=upload_totals)

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

    return await start_status_server(cfg.status_addr, run_dir, snapshot, stacks=look)
