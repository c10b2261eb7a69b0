"""The drain (docs/lifecycle.md#the-drain): at the command's exit, `--drain-timeout` is one
budget, spent in order, each part with what the parts before it left: the output queued before
the crash tail, the crash tail (at a failed exit with a slow /logs, first), the end event; the
files, metrics, hparams, artifacts and documents beside them, until the deadline too."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from sidecar.aio import wait_set
from sidecar.config import Config
from sidecar.delivery.crashtail import CrashTail, StreamTail, take_tail
from sidecar.delivery.lifecycle import Lifecycle
from sidecar.delivery.logs import LogShipper
from sidecar.log import format_duration, log
from sidecar.sources.console.stream import BehindTail, Stream
from sidecar.sources.files.kinds import FILE_KINDS

if TYPE_CHECKING:  # imported once the command runs: it is spawned before these
    from sidecar.pipeline import Pipeline

# kept at the end of the budget for the end event, and before that for the crash tail, so that
# older output on a slow /logs cannot take their time (at most a quarter of the budget each)
RESERVE_S = 2.0
# how long the drain waits for the run's first answer when none came yet: a token refused on
# every attempt is known then, and not waited out
FIRST_ANSWER_WAIT_S = 1.0


async def drain(cfg: Config, lifecycle: Lifecycle, pipeline: Pipeline | None,
                interrupted: asyncio.Event | None = None, crash_tail: CrashTail | None = None,
                *, deadline: float, after_tail: Callable[[], None] = lambda: None,
                closing: str = "") -> None:
    """Deliver what is left by `deadline`, in order, each part with what the parts before it
    left of the budget (docs/lifecycle.md#the-drain): the output (what was queued before the
    crash tail, then the crash tail; at a failed exit, `closing` given, the crash tail first,
    see `_tail_first`), then the end event; the files, metrics, hparams, artifacts and
    documents beside them, until the deadline too. `after_tail` is called once the crash tail
    went, or was given up."""
    client = (pipeline.client if pipeline is not None
              else crash_tail.client if crash_tail is not None else lifecycle.client)
    if client is not None and not client.answered.is_set():  # a command that exits at once:
        await wait_set(client.answered, FIRST_ANSWER_WAIT_S)  # is the token taken at all?
    refused = client.never_accepted if client is not None else None
    if refused is not None:  # the drain would wait out its deadline: say what is kept instead
        _warn_kept(cfg, lifecycle, crash_tail, pipeline, refused)
        after_tail()
        if pipeline is not None:
            await pipeline.stop_reading()
        return
    if client is not None and client.failing:
        # the deadline counts from the command's exit: part of it may be gone already
        log.warning("waiting up to %s more (--drain-timeout %s from the exit) for the ingest "
                    "to take what is left (failing now: %s)",
                    format_duration(max(deadline - time.monotonic(), 0.0)),
                    format_duration(cfg.drain_timeout), ", ".join(client.failing),
                    extra={"option": "--drain-timeout"})
    stop = interrupted or asyncio.Event()
    sources = None
    tail_by = deadline - reserve_s(cfg)
    if pipeline is not None:
        pipeline.client.hurry()
        sources = asyncio.ensure_future(pipeline.drain(deadline))
    if pipeline is not None and crash_tail is not None and closing:
        await _tail_first(cfg, pipeline, crash_tail, closing, tail_by, stop)
    else:
        if pipeline is not None:
            older_by = logs_by(cfg, deadline)
            await until(_logs_sent(pipeline, older_by), older_by, stop)
        if pipeline is not None and crash_tail is not None and crash_tail.pending:
            # nothing older may follow the crash tail: what is left is given up, and marked
            crash_tail.lead(await pipeline.shipper.yield_to_tail(
                max(tail_by - time.monotonic(), 0.0) / 2))
        if crash_tail is not None:
            await _deliver_tail(cfg, crash_tail, tail_by, stop)
    after_tail()
    delivered = await until(lifecycle.drain(max(deadline - time.monotonic(), 0.0)), deadline,
                            stop)
    if not delivered and lifecycle.pending:
        log.warning("drain deadline reached: %d lifecycle event(s) (%s) not yet delivered, "
                    "kept in %s; the next start or `sidecar replay` delivers them",
                    len(lifecycle.pending), ", ".join(lifecycle.pending), cfg.run_dir)
    if sources is not None:
        await until(_done(sources), deadline, stop)


async def _deliver_tail(cfg: Config, crash_tail: CrashTail, tail_by: float,
                        stop: asyncio.Event) -> bool:
    """The crash tail's bodies by `tail_by`; when not, they stay journaled, and one line says
    so."""
    if await until(crash_tail.deliver(tail_by), tail_by, stop):
        return True
    # journaled before the end event goes: the next start or replay sends it
    log.warning("the command's last output is not yet delivered to /logs; kept in %s for "
                "the next start or `sidecar replay`", cfg.run_dir)
    return False


async def _tail_first(cfg: Config, pipeline: Pipeline, crash_tail: CrashTail, closing: str,
                      tail_by: float, stop: asyncio.Event) -> None:
    """A failed exit while older output still waits for a slow /logs: the platform reads the
    log's end when a run fails, so the crash tail goes first, marked by a line of ours; the
    older output follows as the budget allows, so that one more of its requests and the
    closing lines fit before `tail_by` at the pace the crash tail went; then a line says
    where it ends and what of it was dropped, and `closing` (the failure summary) ends the log
    again before the end event. The closing lines are journaled as the crash tail is."""
    shipper = pipeline.shipper
    prefix = shipper.prefix
    crash_tail.lead(f"{prefix}[sidecar] the command's last output goes first: the "
                    f"{shipper.queued_chars} characters written before it that /logs has not "
                    "taken yet follow it, as the drain allows\n")
    started = time.monotonic()
    if not await _deliver_tail(cfg, crash_tail, tail_by, stop):
        return
    step = max(time.monotonic() - started, reserve_s(cfg))
    older_by = tail_by - 2 * step
    sent = shipper.sent_chars
    shipper.resume()
    await until(_logs_sent(pipeline, older_by), older_by, stop)
    dropped = await shipper.give_up_rest(max(tail_by - time.monotonic(), 0.0) / 2)
    gone = f"; {dropped} dropped: {shipper.stop_reason}" if dropped else ""
    await crash_tail.add([
        f"{prefix}[sidecar] end of the output written before the command's last output "
        f"above: {shipper.sent_chars - sent} characters sent after it{gone}\n", closing])
    await _deliver_tail(cfg, crash_tail, tail_by, stop)


def reserve_s(cfg: Config) -> float:
    """What the end of the budget keeps for the end event, and before it for the crash tail."""
    return min(RESERVE_S, cfg.drain_timeout / 4)


def logs_by(cfg: Config, deadline: float) -> float:
    """Until when the output queued before the crash tail may be sent, ahead of it."""
    return deadline - 2 * reserve_s(cfg)


async def _logs_sent(pipeline: Pipeline, deadline: float) -> bool:
    """Whether the output before the crash tail (the followed files' too) was sent by
    `deadline`."""
    await pipeline.read.wait()
    return await pipeline.shipper.flush(deadline - time.monotonic())


def _warn_kept(cfg: Config, lifecycle: Lifecycle, crash_tail: CrashTail | None,
               pipeline: Pipeline | None, refused: str) -> None:
    """No answer of the run was accepted, each one was `refused`: no wait would change that,
    so the drain is not waited out; one line says what is kept, and for what."""
    kept = []
    if lifecycle.pending:
        kept.append(f"the lifecycle event{'s' if len(lifecycle.pending) > 1 else ''} "
                    f"{', '.join(lifecycle.pending)}")
    if crash_tail is not None and crash_tail.pending:
        kept.append("the command's last output")
    if pipeline is not None:
        pipeline.shipper.stop_reason = f"no answer of the ingest was accepted ({refused})"
        if any(pipeline.cfg.files.get(kind.name) for kind in FILE_KINDS if kind.metrics):
            kept.append("the metric points past the files' acknowledged offsets")
    what = (f"; kept in {cfg.run_dir} for the next start or `sidecar replay` (once the token "
            "is accepted): " + "; ".join(kept)) if kept else ""
    log.warning("no payload of this run was accepted: every answer was %s, so the exit does "
                "not wait for the drain%s", refused, what)


async def journal_tail(shipper: LogShipper, crash_tail: CrashTail, streams: Sequence[Stream],
                       tails: Sequence[StreamTail], behind: BehindTail | None,
                       deadline: float, failed_by: float | None) -> bool:
    """Once the request in flight was answered (or `deadline` passed with no answer), take
    what the ingest did not acknowledge of the streams' last 64 KiB (the failure summary last)
    out of the best-effort queue into the crash tail's journal; the queue's older text is then
    sent on, best-effort, before it: a slow answer is waited for until `deadline`, so that no
    request of it is still in flight (and stored later, or cut) meanwhile; what the streams
    put from then on waits in `behind` (None: no stream is still open). At a failed exit
    whose crash tail is due by `failed_by`, when the older text still queued would keep it
    past that at the pace /logs goes, the crash tail goes first instead: the queue waits
    (True)."""
    await shipper.settle(deadline - time.monotonic())
    tail = take_tail(tails)
    # a writer left behind goes on: what it writes from now on is not in this tail
    for stream in streams:
        stream.behind = behind
    shipper.forget(tail.carried_from)
    gap = shipper.take_gap_line() if tail.texts else ""  # what was dropped before it
    await crash_tail.add([gap, *tail.texts] if gap else tail.texts)
    shipper.flush_stall_s = math.inf
    if (failed_by is not None and crash_tail.pending and shipper.queued
            and not shipper.sent_by(failed_by, then=1)):
        return True
    shipper.start()
    return False


async def _done(work: Awaitable[None]) -> bool:
    await work
    return True


async def until(work: Awaitable[bool], deadline: float, stop: asyncio.Event) -> bool:
    """Run `work` until it finishes, `deadline` passes or `stop` is set; True if it finished."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, timeout=max(deadline - time.monotonic(), 0),
                                 return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, stopper):
        pending.cancel()
    await asyncio.gather(task, stopper, return_exceptions=True)
    return task in done and not task.cancelled() and bool(task.result())
