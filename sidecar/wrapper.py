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
tail, which goes before the end event. The parts `sidecar watch` starts too (the client, the
state folder's claim, the stall clock, the pipeline, the stack taker, the status endpoint) are the
runtime's (runtime.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from sidecar.aio import cancel
from sidecar.config import Config, configured
from sidecar.delivery import handoff
from sidecar.delivery.crashtail import CrashTail, new_tails
from sidecar.delivery.lifecycle import Lifecycle
from sidecar.delivery.logs import LogShipper
from sidecar.diagnose import Failure, diagnose
from sidecar.drain import drain, journal_tail, logs_by, reserve_s, until
from sidecar.exits import EXIT_CANNOT_START, ConfigError
from sidecar.log import format_duration, log, one_destination
from sidecar.masking import mask, secrets
from sidecar.runtime import TICK_S, Runtime
from sidecar.sources.console.child import (
    FORWARDED_SIGNALS,
    Child,
    Pump,
    ReadOrder,
    SpawnError,
)
from sidecar.sources.console.lines import SCREEN_SLICE_CHARS, LineAssembler
from sidecar.sources.console.signatures import ONE_PIPE, TTY, TWO_PIPES, Scanner
from sidecar.sources.console.stream import BehindTail, Budget, Stream, announce_in
from sidecar.sources.telemetry.cgroup import oom_kill_counts, oom_kills_since, own_memory_cgroups
from sidecar.stacks import (
    SIGNAL_BUDGET_S,
    Process,
    RankClock,
    StackTaker,
    processes_of,
    say,
    take_with_budget,
)
from sidecar.stall import StallWatch
from sidecar.supervise import fault_point, spawn_once, supervise

if TYPE_CHECKING:  # imported once the command runs: it is spawned before these
    from sidecar.pipeline import Pipeline

# The drain is one budget, --drain-timeout from the command's exit, spent in order
# (docs/lifecycle.md#the-drain): what one part leaves is there for the next.
# After the exit, the time the command's output has to reach its end in the pipes: a process
# still holding them open past it is a writer the command left behind, forwarded beside the
# drain, and the crash tail and the end event do not wait for it.
OUTPUT_SETTLE_S = 1.0
# a writer left behind is forwarded until this long before the deadline: its last lines and the
# line that names it are sent in what is left
FINAL_FLUSH_S = 1.0
# the pump threads get the GIL back quickly after each read and write, so the loop's work on one
# block never holds up the child's pipe
GIL_SWITCH_S = 0.0005
# a SIGTERM to a run quiet this long (or stalled) waits for the stacks, at most SIGNAL_BUDGET_S,
# before it is forwarded (docs/stalls.md#when-the-platform-stops-the-run)
QUIET_FOR_STACKS_S = 60.0


async def run_wrapped(cfg: Config, argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """`sidecar run`: report the command's lifecycle and output; returns its exit status."""
    sys.setswitchinterval(GIL_SWITCH_S)
    run = _Run(cfg, argv, environ)
    await run.open_journals()
    await run.offer_marker()
    run.make_streams()
    try:
        fds = run.spawn()
    except SpawnError as exc:
        return await run.cannot_start(exc)
    await run.pump(fds)
    await run.start_reporting()
    exit_status = await run.wait()
    await run.record_end(exit_status)
    await run.finish_output(exit_status)
    await run.drain()
    await run.close(run.outcome(exit_status))
    return exit_status


class _Run:
    """One `sidecar run`, phase by phase, in the order run_wrapped calls them: the command is
    spawned as early as can be, and what posts is set up once it runs."""

    def __init__(self, cfg: Config, argv: Sequence[str], environ: Mapping[str, str]) -> None:
        """What is settled before anything is journaled: the node, the client (None when
        reporting is off) and the claim on the run's state folder."""
        self.cfg, self.argv, self.environ = cfg, argv, environ
        self.scanner = Scanner()
        self.streams: list[Stream] = []
        self.ranks = RankClock()
        self.pid = 0  # the command's, once spawned
        # Its stall clock's lines go through the streams' line assemblers.
        self.runtime = Runtime(cfg, environ, "run", processes=self._command_processes,
                               announce=lambda line: announce_in(self.streams, line),
                               scanner=self.scanner, still_stalled=lambda: self.child.running,
                               stall_lines=lambda: [self.ranks.line()])
        self.node, self.client = self.runtime.node, self.runtime.client
        self.stall, self.report = self.runtime.stall, self.runtime.report
        self.lifecycle = Lifecycle(cfg.run_dir, cfg.platform.run_id,
                                   self.client if self.node.reports_lifecycle else None)
        self.crash_tail = (CrashTail(cfg.run_dir, cfg.platform.run_id, self.client)
                           if self.client else None)
        self.tail_sender: asyncio.Task[None] | None = None
        self.pipeline: Pipeline | None = None
        self.stacks: StackTaker | None = None
        self.interrupted = asyncio.Event()
        self.behind: BehindTail | None = None
        # a failed exit with older output still queued for /logs: the crash tail goes first
        self.tail_first = False

    async def open_journals(self) -> None:
        """The crash tail's and the lifecycle's journals: what an earlier start left goes
        first, then `starting`."""
        earlier_tail = await self.crash_tail.open() if self.crash_tail is not None else 0
        # Its sender waits for the client, started after the spawn.
        await self.lifecycle.open()
        # A restarted container, a killed wrapper: go on from there.
        self.lifecycle.say_earlier_start()
        if earlier_tail:
            self.tail_sender = _send_earlier_tail(self.crash_tail, self.lifecycle)
        await self.lifecycle.record("starting")

    async def offer_marker(self) -> None:
        """The hand-off `sidecar lifecycle running` reaches from inside the command, and the
        command's environment that names it."""
        address = handoff.new_address()
        # From then on no hand-off is taken.
        self.exited = asyncio.Event()
        self.marker = await handoff.listen(
            address, _marker_acceptor(self.lifecycle, self.cfg.running_when, self.exited))
        self.child_env = dict(self.environ)
        self.child_env.setdefault("PYTHONUNBUFFERED", "1")
        self.child_env[handoff.WRAPPER_SOCKET_VARIABLE] = address

    def make_streams(self) -> None:
        """One stream of output a pipe of the command's (one, where both share a pipe or --tty's
        terminal), each with its line assembler, its share of --log-rate and its tail for the
        crash tail."""
        cfg = self.cfg
        self.prefix = cfg.log_prefix.format(node=self.node.name, rank=self.node.rank)
        budget = Budget(cfg.log_rate * 1e6)
        # It holds the first output until the pipeline, imported after the spawn, is up.
        self.shipper = (LogShipper(self.client, cfg.platform.run_id, prefix=self.prefix,
                                   on_room=self._room)
                        if self.client is not None else None)
        keep_sgr = cfg.log_ansi == "keep"
        self.one_pipe = not cfg.tty and one_destination(1, 2)
        names = (TTY,) if cfg.tty else (ONE_PIPE,) if self.one_pipe else TWO_PIPES
        _say_pipes(self.one_pipe, cfg.tty)
        self.tails = new_tails(len(names))  # each stream's ledger, for the crash tail
        self.streams.extend(
            Stream(name, LineAssembler(secrets, self.prefix, keep_sgr=keep_sgr,
                                       screen_slice_chars=SCREEN_SLICE_CHARS),
                   self.shipper, budget, self.scanner, tail, self.stall)
            for name, tail in zip(names, self.tails, strict=True))
        for stream in self.streams:
            stream.others = [other for other in self.streams if other is not stream]
            stream.ranks = self.ranks
        self.stacks_at_signal = ""  # where the ranks were when the platform stopped the run
        self.forwarded = 0  # the first signal forwarded to the command, while it ran
        self.signal_stacks: asyncio.Task[None] | None = None

    def spawn(self) -> tuple[int, ...]:
        """Start the command; its output's descriptors. SpawnError when it cannot start."""
        self.child = Child(self.argv, self.child_env, tty=self.cfg.tty, one_pipe=self.one_pipe)
        # Before the spawn, so that a kill at once still shows; a few small reads, nothing else
        # waits on the loop yet.
        self.cgroups = own_memory_cgroups()
        self.oom_before = oom_kill_counts(self.cgroups)
        # Stamped before the spawn, journaled right after it: the fsync need not delay the
        # command.
        self.running_at = time.time()
        fds = self.child.spawn()
        self.spawned_at = time.monotonic()
        self.pid = self.child.pid or 0
        return fds

    def _room(self) -> None:
        """/logs has room again: the pipeline's follower reads on, once there is one."""
        if self.runtime.pipeline is not None:
            self.runtime.pipeline.room()

    def _command_processes(self) -> list[Process]:
        """The command's processes now, whose stacks a stall or a SIGTERM reads (blocking)."""
        return processes_of(self.pid) if self.pid else []

    async def cannot_start(self, exc: SpawnError) -> int:
        """The command could not start: `failed`, with the one line that says why."""
        log.error("%s", exc)
        # What it did not deliver goes first in the drain.
        await cancel(self.tail_sender)
        await self.lifecycle.record("failed")
        if self.client is not None:
            await self.client.start()
        # The one line that says why, before the end event.
        if self.crash_tail is not None:
            node = self.node
            failure = Failure(EXIT_CANNOT_START, 0.0, str(exc), "cannot_start", node=node.name,
                              rank=node.rank, multi_node=node.multi_node)
            await self.crash_tail.add([mask(self.prefix + failure.line() + "\n")])
        await drain(self.cfg, self.lifecycle, None, crash_tail=self.crash_tail,
                    deadline=time.monotonic() + self.cfg.drain_timeout)
        await self.close("the command could not start")
        return EXIT_CANNOT_START

    async def pump(self, fds: Sequence[int]) -> None:
        """Forward our signals to the command, and its output to ours and to the streams."""
        self.loop = asyncio.get_running_loop()
        for signum in FORWARDED_SIGNALS:
            self.loop.add_signal_handler(signum, self._on_signal, signum)
        order = ReadOrder()
        for fd, sink, stream in zip(fds, (1, 2)[:len(fds)], self.streams, strict=True):
            Pump(stream.name, fd, sink, stream, stream.feed, stream.skip, stream.closed.set,
                 self.loop, order).start()
        if self.cfg.running_when == "spawn":
            await self.lifecycle.record("running", self.running_at)

    async def start_reporting(self) -> None:
        """The command runs: now what posts (imports, connections, threads) is set up."""
        await self.runtime.start(lifecycle=self.lifecycle, shipper=self.shipper,
                                 child_env=self.child_env, environ=self.environ, argv=self.argv,
                                 trainer_pid=lambda: self.child.pid or None)
        self.pipeline, self.stacks = self.runtime.pipeline, self.runtime.stacks
        self.ticker = supervise("ticker", lambda: _tick(self.streams, self.stall))

    def _forward(self, signum: int) -> None:
        """The signal to the command (or, once it exited, the drain cut short); the first one
        forwarded is what stopped the run, whatever the command prints on its way out."""
        if _on_signal(self.child, signum, self.interrupted) and not self.forwarded:
            self.forwarded = signum
            self.stall.stop()

    def _on_signal(self, signum: int) -> None:
        """A SIGTERM to a quiet or stalled run: the stacks first (within SIGNAL_BUDGET_S), then
        the signal; any other, or a second one, is forwarded at once."""
        taker = self.stacks
        if (signum != signal.SIGTERM or taker is None or not taker.available
                or not self.child.running or self.interrupted.is_set()
                or self.signal_stacks is not None
                or not (self.stall.stalled or self.stall.quiet_s >= QUIET_FOR_STACKS_S)):
            self._forward(signum)
            return

        async def look_then_forward() -> None:
            try:
                stacks = await take_with_budget(taker, "sigterm", SIGNAL_BUDGET_S)
            finally:
                self._forward(signum)
            if stacks is None:
                return
            where_said = "at SIGTERM"
            if self.stall.stalled:
                where_said += f", stalled for {format_duration(self.stall.stalled_s)}"
            block = taker.block(stacks, where_said, [self.ranks.line()])
            say(block)
            for line in block:
                announce_in(self.streams, line)
            if block and stacks.processes:
                self.stacks_at_signal = "; ".join(stacks.summary())

        log.info("SIGTERM to a quiet run: taking the command's stacks first (at most %g s)",
                 SIGNAL_BUDGET_S)
        self.signal_stacks = spawn_once("stacks-at-sigterm", look_then_forward)

    async def wait(self) -> int:
        """The command's exit status, once it exited and what it wrote before passed through
        (or OUTPUT_SETTLE_S passed): what the sidecar says of its end comes after its output."""
        exit_status = await self.child.wait()
        # When it exited, not when the loop saw it.
        self.ended_at = self.child.exited_at or time.time()
        self.exited.set()
        # The drain's budget counts from here.
        self.exited_at = self.child.exited_monotonic or time.monotonic()
        self.deadline = self.exited_at + self.cfg.drain_timeout
        if self.client is not None:
            # A backoff of the request in flight ends now.
            self.client.hurry()
        # What an earlier start's crash tail did not deliver goes first in the drain.
        await cancel(self.tail_sender)
        await until(_all_closed(self.streams),
                    min(self.exited_at + OUTPUT_SETTLE_S, self.deadline), self.interrupted)
        if self.cfg.running_when == "marker" and "running" not in self.lifecycle.recorded:
            log.warning("the command exited (status %d) and never ran `sidecar lifecycle "
                        "running`, the marker --running-when marker waits for: `running` was "
                        "never posted; run it in the command just before training starts, or "
                        "drop the option", exit_status)
        return exit_status

    async def record_end(self, exit_status: int) -> None:
        """The end event, journaled; it is sent after the output before it."""
        # The end event waits for the output before it: the platform closes the logs at it.
        self.lifecycle.release.clear()
        await self.lifecycle.record("succeeded" if exit_status == 0 else "failed",
                                    self.ended_at)

    async def finish_output(self, exit_status: int) -> None:
        """The command's output to its end (a writer it left behind goes on beside the drain),
        the failure summary last, and what /logs did not acknowledge of it into the crash
        tail's journal."""
        streams, exited_at = self.streams, self.exited_at
        for stream in streams:
            await stream.drawn()
            if stream.closed.is_set():
                stream.finish()
            else:
                # a line it left open is taken as complete: the summary may quote it
                self.scanner.finish(stream.name)
        pipeline = self.pipeline
        if exit_status != 0:
            duration_s = max(exited_at - self.spawned_at, 0.0)
            self.report.failure = diagnose(
                exit_status, duration_s, self.scanner, self.node,
                await asyncio.to_thread(oom_kills_since, self.oom_before, self.cgroups),
                tuple(pipeline.sampler.xids) if pipeline and pipeline.sampler else (),
                stall=self._stall_note(), forwarded=self.forwarded)
            log.error("%s", mask(self.report.failure.line().removeprefix("[sidecar] ")))
            # The crash tail's last line.
            announce_in(streams, self.report.failure.line())
        if pipeline is not None and self.crash_tail is not None:
            held = not all(stream.closed.is_set() for stream in streams)
            self.behind = BehindTail() if held else None
            self.tail_first = await journal_tail(
                pipeline.shipper, self.crash_tail, streams, self.tails, self.behind,
                logs_by(self.cfg, self.deadline),
                failed_by=self.deadline - reserve_s(self.cfg) if exit_status != 0 else None)

    def _stall_note(self) -> str:
        """What the failure summary says of a stall: how long, and where the ranks were."""
        note = ""
        if self.stall.stalled:
            note = f"stalled for {format_duration(self.stall.stalled_s)} before it"
        if self.stacks_at_signal:
            note += ("; " if note else "") + f"at SIGTERM: {self.stacks_at_signal}"
        return note

    async def drain(self) -> None:
        """Deliver what is left by the deadline, beside the output of a writer the command
        left behind; our signals are ours again after."""
        failure = self.report.failure
        closing = (mask(self.prefix + failure.line() + "\n")
                   if self.tail_first and failure is not None else "")
        await asyncio.gather(
            drain(self.cfg, self.lifecycle, self.pipeline, self.interrupted, self.crash_tail,
                  deadline=self.deadline, after_tail=self._after_tail, closing=closing),
            self._forward_held())
        for signum in FORWARDED_SIGNALS:
            self.loop.remove_signal_handler(signum)

    def _after_tail(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shipper.resume()
        if self.behind is not None:
            self.behind.release(self.streams)
            self.behind = None

    async def _forward_held(self) -> None:
        """What a process the command left behind writes to its output goes on, as under `tee`,
        until it closes the output or the drain's deadline is near; then one line names the
        processes that still hold it, and what is left of the output is sent by the deadline.
        Never killed, nor its pipe closed: once the sidecar has exited, its next write fails."""
        streams = self.streams
        await until(_all_closed(streams), self.deadline - FINAL_FLUSH_S, self.interrupted)
        self.ticker.cancel()
        holding = not all(stream.closed.is_set() for stream in streams)
        for stream in streams:
            if not stream.ended:
                await stream.drawn()
                stream.finish()
        if holding:
            holders = await asyncio.to_thread(lambda: _named(self.child.output_holders()))
            _announce_holders(streams, holders, time.monotonic() - self.exited_at)
        if self.pipeline is not None:
            await until(self.pipeline.shipper.flush(self.deadline - time.monotonic()),
                        self.deadline, self.interrupted)

    async def close(self, outcome: str) -> None:
        """Close what the run opened and release the claim on its state folder; `outcome`
        begins the last line."""
        self.marker.close()
        kept = (["the command's last output (kept for the next start)"]
                if self.crash_tail is not None and self.crash_tail.pending else [])
        await self.lifecycle.close()
        await self.runtime.close(outcome, kept)
        sys.stdout.flush()

    def outcome(self, exit_status: int) -> str:
        """How the command ended, for the last line."""
        took = format_duration(max(self.exited_at - self.spawned_at, 0.0))
        if exit_status == 0:
            return f"the command succeeded after {took}"
        return f"the command failed: exit status {exit_status} after {took}"


def _marker_acceptor(lifecycle: Lifecycle, running_when: str,
                     exited: asyncio.Event) -> handoff.Acceptor:
    async def accept(event: str, ts: float) -> str | None:
        if event != "running":
            return (f"only `running` is handed to the wrapper; it posts {event!r} itself when "
                    "the command exits")
        if "running" in lifecycle.recorded:
            return None
        refusal = ("the command has exited, and nothing is recorded after the run's end"
                   if exited.is_set() else await lifecycle.record("running", ts))
        if refusal is not None:
            log.warning("`sidecar lifecycle running` refused: %s", refusal)
            return f"refused: {refusal}"
        if running_when != "marker":
            log.warning("the command marked running, but --running-when is %s", running_when)
        return None

    return accept


def _say_pipes(one_pipe: bool, tty: bool) -> None:
    """Which way the command's output is read, and what that means for its order."""
    if tty:
        log.debug("the command's stdout and stderr on one pseudo-terminal (--tty), in the order "
                  "they were written")
    elif one_pipe:
        log.debug("the command's stdout and stderr on one pipe, in the order they were written: "
                  "the sidecar's own stdout and stderr are one destination")
    else:
        log.debug("the command's stdout and stderr on two pipes, as the sidecar's own go to two "
                  "destinations: lines written close together on the two may reach /logs in "
                  "another order (docs/running.md#the-commands-output)")


def _on_signal(child: Child, signum: int, interrupted: asyncio.Event) -> bool:
    """Forward to the child's group while it runs (True); once it has exited, cut the drain
    short."""
    if child.running and not interrupted.is_set():
        log.info("forwarding %s to the command", signal.Signals(signum).name)
        child.signal(signum)
        return True
    log.warning("%s during shutdown: stopping the drain now", signal.Signals(signum).name)
    interrupted.set()
    return False


async def _tick(streams: Sequence[Stream], stall: StallWatch) -> None:
    while True:
        fault_point()
        await asyncio.sleep(TICK_S)
        for stream in streams:
            stream.tick()
        stall.check()


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


async def _all_closed(streams: Sequence[Stream]) -> bool:
    await asyncio.gather(*(stream.closed.wait() for stream in streams))
    return True


def _named(pids: Sequence[int]) -> list[str]:
    """Each process as `PID name`, the name as /proc gives it (blocking: small reads)."""
    named = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
                named.append(f"{pid} {comm.read().strip()}")
        except OSError:  # gone meanwhile
            named.append(str(pid))
    return named


def _announce_holders(streams: Sequence[Stream], holders: Sequence[str], waited_s: float) -> None:
    """The output is still held open at the drain's end (a background process the command
    left): say by whom, in the log and in our own, and that what comes later is not
    forwarded."""
    if holders:
        who = (f"{len(holders)} process{'es' if len(holders) > 1 else ''} "
               f"(PID{'s' if len(holders) > 1 else ''} {', '.join(holders)})")
    else:
        who = "processes that /proc does not show"
    line = (f"[sidecar] the command's output is still held open by {who} "
            f"{format_duration(waited_s)} after the command exited, at the end of the drain "
            "(--drain-timeout); it was forwarded until now, what they write from now on is not")
    log.warning("%s", line.removeprefix("[sidecar] "))
    if streams[-1].shipper is not None:
        announce_in(streams, line)


def main(args: argparse.Namespace) -> int:
    """`sidecar run -- COMMAND`."""
    command: list[str] = args.command
    if not command:
        raise ConfigError("no command to run: put it after --, as in "
                          "`sidecar run -- ./train.sh`")
    cfg = configured(args, "run")
    return asyncio.run(run_wrapped(cfg, command, os.environ))
