"""`sidecar run`: the command's lifecycle, its output to /logs, and why it failed.

    child stdout/stderr --pump thread--> own stdout/stderr (unchanged, as tee; splice(2) when
                                    |     /logs does not want the block)
                                    \\--> LineAssembler --> LogShipper --> IngestClient /logs
                                    |    (beside it: Scanner, the failure signatures; the
                                    |     stall clock; each stream's tail of pieces)
    at the exit: the unacknowledged tail + the failure summary --> CrashTail (journal) --> /logs
    lifecycle events --> Lifecycle (journal in the state dir) --> IngestClient /lifecycle

The ingest's acknowledgement travels back: the lifecycle journal forgets an event only once the
ingest took it, so a crash or an outage leaves it to the next start; the same holds for the crash
tail, which goes before the end event. What `sidecar watch` shares with it is in daemon.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING

from sidecar.aio import cancel
from sidecar.config import Config
from sidecar.daemon import TICK_S, Report, claim_run_dir, make_client, serve_status, stall_watch
from sidecar.delivery import handoff
from sidecar.delivery.client import IngestClient
from sidecar.delivery.crashtail import CrashTail, StreamTail, new_tails, tail_pieces
from sidecar.delivery.lifecycle import Lifecycle
from sidecar.delivery.logs import LogShipper
from sidecar.diagnose import Failure, diagnose
from sidecar.log import log, mask, secrets
from sidecar.node import resolve_node
from sidecar.sources.console.child import FORWARDED_SIGNALS, READ_BYTES, Child, Pump, SpawnError
from sidecar.sources.console.lines import SCREEN_SLICE_CHARS, LineAssembler
from sidecar.sources.console.signatures import Scanner
from sidecar.sources.files.hparams import load_hparams
from sidecar.sources.telemetry.cgroup import oom_kill_counts, oom_kills_since, own_memory_cgroups
from sidecar.stall import StallWatch
from sidecar.statefile import release
from sidecar.supervise import fault_point, supervise

if TYPE_CHECKING:  # imported once the command runs: it is spawned before these
    from sidecar.observe.endpoint import StatusServer
    from sidecar.pipeline import Pipeline

OUTPUT_GRACE_S = 2.0  # after the child exits, how long its pipes may stay open (grandchildren)
LOGS_DRAIN_SHARE = 0.5  # of --drain-timeout the output may take, so a hung /logs cannot starve
#                         the end event that waits behind it
TAIL_DRAIN_SHARE = 0.5  # of the output's share kept for the crash tail when older text waits
EXIT_CANNOT_START = 127
BUDGET_BATCH_S = 0.1  # --log-rate: output is read for /logs once this long's worth is available
MAX_BACKLOG_CHARS = 64 << 10  # of output the terminal model has still to draw: more is dropped
#   (a flood of escape sequences it draws at a few microseconds a character)
GIL_SWITCH_S = 0.0005  # the pump threads get the GIL back quickly after each read and write,
#                        so the loop's work on one block never holds up the child's pipe


class _Budget:
    """A token bucket of output bytes a second, shared by the command's two streams (and so by
    their two pump threads)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate  # bytes a second; 0: no limit
        self._tokens = rate  # a second's worth at the start
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def grant(self) -> int:
        """Bytes that may be read for /logs now: none until a batch's worth has built up (a
        tenth of a second of the rate, at most one read), so that a flood is forwarded in a few
        large blocks, not in many small ones between splices."""
        if not self.rate:
            return READ_BYTES
        with self._lock:
            available = self._refill()
        batch = min(self.rate * BUDGET_BATCH_S, READ_BYTES)
        return int(min(available, READ_BYTES)) if available >= batch else 0

    def spend(self, size: int) -> None:
        if self.rate:
            with self._lock:
                self._tokens = self._refill() - size

    def _refill(self) -> float:
        now = time.monotonic()
        self._tokens = min(self._tokens + (now - self._at) * self.rate, self.rate)
        self._at = now
        return self._tokens


class _Stream:
    """One of the child's output streams on its way to /logs; the pump's Gate."""

    def __init__(self, name: str, assembler: LineAssembler, shipper: LogShipper | None,
                 budget: _Budget, scanner: Scanner, tail: StreamTail, stall: StallWatch) -> None:
        self.name = name  # stdout or stderr, or terminal (--tty)
        self.assembler = assembler
        self.shipper = shipper  # None when reporting is off
        self.budget = budget
        self.scanner = scanner  # failure signatures, looked for beside the log path
        self.tail = tail  # the recent text and what of it the ingest acknowledged (crash tail)
        self.stall = stall  # told of every block, read or skipped
        self.closed = asyncio.Event()
        self._skipped = 0
        self._resuming = False  # a call to draw the terminal's backlog is scheduled

    def allowance(self) -> tuple[int, str]:
        """In the pump thread: drop before spending CPU on it, the trainer's cores are not ours."""
        shipper = self.shipper
        if shipper is None:
            return 0, "reporting is off"
        if not shipper.has_room:
            return 0, "the log buffer is full while the ingest is slow"
        granted = self.budget.grant()
        if not granted:
            return 0, "the command writes faster than --log-rate forwards"
        if not self.assembler.drawing:
            return granted, ""
        room = MAX_BACKLOG_CHARS - self.assembler.backlog  # read, as it says, in this thread
        if room <= 0:
            return 0, "the sidecar fell behind the command's output"
        return min(granted, room), ""

    def taken(self, size: int) -> None:
        self.budget.spend(size)

    def feed(self, block: bytes) -> None:
        self.stall.activity()
        if self.shipper is None:
            return
        self.scanner.feed(self.name, block)
        self._mark_gap()
        self._put(self.assembler.feed(block, time.monotonic()))
        self._resume_soon()

    def _resume_soon(self) -> None:
        """The terminal draws a slice a call: the rest once the loop has run what waits."""
        if self.assembler.backlog and not self._resuming:
            self._resuming = True
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._resuming = False
        if self.shipper is not None:
            self._put(self.assembler.resume(time.monotonic()))
            self._resume_soon()

    async def drawn(self) -> None:
        """Until the terminal drew what it was given so far, a slice a turn of the loop (what a
        writer that outlived the command adds meanwhile is left to `finish`)."""
        left = self.assembler.backlog
        while left > 0 and self.assembler.backlog and self.shipper is not None:
            self._put(self.assembler.resume(time.monotonic()))
            left -= SCREEN_SLICE_CHARS
            await asyncio.sleep(0)

    def skip(self, size: int, why: str) -> None:
        self.stall.activity()
        self._skipped += size
        if self.shipper is not None:
            self.shipper.count_dropped(size, why)

    def tick(self) -> None:
        if self.shipper is not None:
            self._put(self.assembler.tick(time.monotonic()))

    def finish(self) -> None:
        self.scanner.finish(self.name)
        if self.shipper is not None:
            self._mark_gap()
            self._put(self.assembler.finish())

    def _mark_gap(self) -> None:
        if self._skipped and self.shipper is not None:
            self._put(self.assembler.gap(self._skipped))
        self._skipped = 0

    def _put(self, text: str) -> None:
        if text and self.shipper is not None:
            self.shipper.put(text, piece=self.tail.add(text))


async def run_wrapped(cfg: Config, argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """`sidecar run`: report the command's lifecycle and output; returns its exit status."""
    sys.setswitchinterval(GIL_SWITCH_S)
    node = resolve_node(cfg.node_name, environ, cfg.nodes)
    client = make_client(cfg)
    hparams = load_hparams(cfg.hparams) if client is not None and cfg.hparams else None
    held = claim_run_dir(cfg) if client is not None else None
    if client is None:
        log.info("reporting is off (ENABLED=0): the command's output is passed through, "
                 "nothing is posted")
    lifecycle = Lifecycle(cfg.run_dir, cfg.platform.run_id,
                          client if node.reports_lifecycle else None)
    crash_tail = CrashTail(cfg.run_dir, cfg.platform.run_id, client) if client else None
    earlier_tail = await crash_tail.open() if crash_tail is not None else 0
    await lifecycle.open()  # its sender waits for the client, started after the spawn
    tail_sender = _send_earlier_tail(crash_tail, lifecycle) if earlier_tail else None
    await lifecycle.record("starting")

    address = handoff.new_address()
    marker = await handoff.serve(address, _marker_acceptor(lifecycle, cfg.running_when))
    child_env = dict(environ)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env[handoff.ENV_VAR] = address

    prefix = cfg.log_prefix.format(node=node.name, rank=node.rank)
    budget = _Budget(cfg.log_rate * 1e6)
    shipper = LogShipper(client, cfg.platform.run_id) if client is not None else None  # it holds
    #                       the first output until the pipeline, imported after the spawn, is up
    scanner = Scanner()
    report = Report(scanner)
    stall = stall_watch(cfg, report, shipper, prefix)
    keep_sgr = cfg.log_ansi == "keep"
    names = ("terminal",) if cfg.tty else ("stdout", "stderr")  # --tty: both share one
    streams = [_Stream(name, LineAssembler(secrets, prefix, keep_sgr=keep_sgr,
                                           screen_slice_chars=SCREEN_SLICE_CHARS),
                       shipper, budget, scanner, tail, stall)
               for name, tail in zip(names, new_tails(len(names)), strict=True)]
    child = Child(argv, child_env, tty=cfg.tty)
    cgroups = own_memory_cgroups()  # before the spawn, so that a kill at once still shows; a
    oom_before = oom_kill_counts(cgroups)  # few small reads, nothing else waits on the loop yet
    running_at = time.time()  # stamped before the spawn, journaled right after it: the fsync
    try:  #                      need not delay the command
        fds = child.spawn()
    except SpawnError as exc:
        log.error("%s", exc)
        await cancel(tail_sender)  # what it did not deliver goes first in the drain
        await lifecycle.record("failed")
        if client is not None:
            await client.start()
        if crash_tail is not None:  # the one line that says why, before the end event
            failure = Failure(EXIT_CANNOT_START, 0.0, str(exc), "cannot_start", node=node.name,
                              rank=node.rank, multi_node=node.multi_node)
            await crash_tail.add([mask(prefix + failure.line() + "\n")])
        await _drain(cfg, lifecycle, None, crash_tail=crash_tail)
        await _close(client, lifecycle, None, marker, None)
        release(held)
        return EXIT_CANNOT_START
    spawned_at = time.monotonic()

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for signum in FORWARDED_SIGNALS:
        loop.add_signal_handler(signum, _on_signal, child, signum, interrupted)
    for fd, sink, stream in zip(fds, (1, 2)[:len(fds)], streams, strict=True):
        Pump(stream.name, fd, sink, stream, stream.feed, stream.skip, stream.closed.set,
             loop).start()
    if cfg.running_when == "spawn":
        await lifecycle.record("running", running_at)

    # The command runs: now what posts (imports, connections, threads) is set up.
    pipeline = None
    if client is not None:
        from sidecar.pipeline import Pipeline

        pipeline = Pipeline(cfg, client, node, hparams, shipper)
        await client.start()
        pipeline.start()
        pipeline.start_telemetry(child_env, environ, argv, lambda: child.pid or None,
                                 find_trainer_python=True)
        pipeline.on_activity = stall.activity
        report.gpus = pipeline
    status = await serve_status(cfg, node, "run", client, pipeline, lifecycle, report)
    ticker = supervise("ticker", lambda: _tick(streams, stall))

    exit_status = await child.wait()
    ended_at = child.exited_at or time.time()  # when it exited, not when the loop saw it
    duration_s = (child.exited_monotonic or time.monotonic()) - spawned_at
    if cfg.running_when == "marker" and "running" not in lifecycle.recorded:
        log.warning("the command exited (status %d) and never ran `sidecar lifecycle running`, "
                    "the marker --running-when marker waits for: `running` was never posted; "
                    "run it in the command just before training starts, or drop the option",
                    exit_status)
    await cancel(tail_sender)  # what it did not deliver goes first in the drain
    lifecycle.release.clear()  # the end event waits for the output before it (the platform
    await lifecycle.record("succeeded" if exit_status == 0 else "failed", ended_at)  # closes logs
    await _wait_all([s.closed for s in streams], OUTPUT_GRACE_S)
    ticker.cancel()
    for stream in streams:
        await stream.drawn()
        stream.finish()
    summary = ""
    if exit_status != 0:
        report.failure = diagnose(
            exit_status, duration_s, scanner, node,
            await asyncio.to_thread(oom_kills_since, oom_before, cgroups),
            tuple(pipeline.sampler.xids) if pipeline and pipeline.sampler else ())
        log.error("%s", mask(report.failure.line().removeprefix("[sidecar] ")))
        summary = mask(prefix + report.failure.line() + "\n")
    drain_start = time.monotonic()
    if client is not None:
        client.hurry()  # a backoff of the request in flight ends now
    if pipeline is not None and crash_tail is not None:
        await _journal_tail(pipeline.shipper, crash_tail, streams, summary,
                            drain_start + cfg.drain_timeout * LOGS_DRAIN_SHARE)
    await _drain(cfg, lifecycle, pipeline, interrupted, crash_tail, drain_start)
    for signum in FORWARDED_SIGNALS:
        loop.remove_signal_handler(signum)
    await _close(client, lifecycle, pipeline, marker, status)
    release(held)
    return exit_status


def _marker_acceptor(lifecycle: Lifecycle, running_when: str) -> handoff.Acceptor:
    async def accept(event: str, ts: float) -> str | None:
        if event != "running":
            return (f"only `running` is handed to the wrapper; it posts {event!r} itself when "
                    "the command exits")
        if "running" in lifecycle.recorded:
            return None
        if running_when != "marker":
            log.warning("the command marked running, but --running-when is %s", running_when)
        await lifecycle.record("running", ts)
        return None

    return accept


def _on_signal(child: Child, signum: int, interrupted: asyncio.Event) -> None:
    """Forward to the child's group while it runs; once it has exited, cut the drain short."""
    if child.running and not interrupted.is_set():
        log.info("forwarding %s to the command", signal.Signals(signum).name)
        child.signal(signum)
    else:
        log.warning("%s during shutdown: stopping the drain now", signal.Signals(signum).name)
        interrupted.set()


async def _tick(streams: Sequence[_Stream], stall: StallWatch) -> None:
    while True:
        fault_point()
        await asyncio.sleep(TICK_S)
        for stream in streams:
            stream.tick()
        stall.check()


async def _drain(cfg: Config, lifecycle: Lifecycle, pipeline: Pipeline | None,
                 interrupted: asyncio.Event | None = None, crash_tail: CrashTail | None = None,
                 started: float | None = None) -> None:
    """Deliver what is left within --drain-timeout from `started` (default now): the output
    first (what was queued before the crash tail, then the crash tail), then the end event."""
    started = time.monotonic() if started is None else started
    deadline = started + cfg.drain_timeout
    if pipeline is not None:
        pipeline.client.hurry()
    stop = interrupted or asyncio.Event()
    output_deadline = started + cfg.drain_timeout * LOGS_DRAIN_SHARE
    if pipeline is not None:
        backlog_deadline = output_deadline
        if crash_tail is not None and crash_tail.pending:
            backlog_deadline -= (output_deadline - time.monotonic()) * TAIL_DRAIN_SHARE
        await _until(_drained(pipeline, backlog_deadline), backlog_deadline, stop)
    if crash_tail is not None and not await _until(
            crash_tail.deliver(output_deadline), output_deadline, stop):
        log.warning("the crash tail (the command's last output) is not yet delivered to "
                    "/logs; kept in %s for the next start or `sidecar replay`", cfg.run_dir)
    delivered = await _until(lifecycle.drain(max(deadline - time.monotonic(), 0.0)), deadline,
                             stop)
    if not delivered and lifecycle.pending:
        log.warning("drain deadline reached: %d lifecycle event(s) (%s) not yet delivered, "
                    "kept in %s; the next start or `sidecar replay` delivers them",
                    len(lifecycle.pending), ", ".join(lifecycle.pending), cfg.run_dir)


async def _journal_tail(shipper: LogShipper, crash_tail: CrashTail, streams: Sequence[_Stream],
                        summary: str, deadline: float) -> None:
    """Once the request in flight was answered, take the streams' unacknowledged tail (and the
    failure summary after it) out of the best-effort queue into the crash tail's journal; the
    queue's older text is then sent on, best-effort, before it."""
    await shipper.settle(deadline - time.monotonic())
    pieces = tail_pieces([stream.tail for stream in streams])
    shipper.forget(pieces)
    await crash_tail.add([piece.text for piece in pieces] + ([summary] if summary else []))
    shipper.start()


def _send_earlier_tail(crash_tail: CrashTail | None,
                       lifecycle: Lifecycle) -> asyncio.Task[None] | None:
    """An earlier start's crash tail goes before the lifecycle events it left: they wait."""
    if crash_tail is None:
        return None
    lifecycle.release.clear()

    async def send() -> None:
        await crash_tail.deliver()
        lifecycle.release.set()

    return supervise("earlier-crash-tail", send)


async def _drained(pipeline: Pipeline, deadline: float) -> bool:
    await pipeline.drain(deadline)
    return True


async def _until(work: Awaitable[bool], deadline: float, stop: asyncio.Event) -> bool:
    """Run `work` until it finishes, `deadline` passes or `stop` is set; True if it finished."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, timeout=max(deadline - time.monotonic(), 0),
                                 return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, stopper):
        pending.cancel()
    await asyncio.gather(task, stopper, return_exceptions=True)
    return task in done and not task.cancelled() and bool(task.result())


async def _wait_all(events: Sequence[asyncio.Event], timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):  # not wait_for: see sidecar.aio
            await asyncio.gather(*(e.wait() for e in events))


async def _close(client: IngestClient | None, lifecycle: Lifecycle, pipeline: Pipeline | None,
                 marker: asyncio.Server, status: StatusServer | None) -> None:
    marker.close()
    if status is not None:
        await status.close()
    await lifecycle.close()
    if pipeline is not None:
        await pipeline.close()
    if client is not None:
        await client.close()
    sys.stdout.flush()
