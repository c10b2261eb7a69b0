"""`sidecar watch`: follow the files and the node for a run whose trainer the sidecar did not
start, until SIGTERM or SIGINT, then drain.

In one picture: the files named by each file-source kind's option (sources/files/kinds.py), the
hardware sampler and the environment snapshot --> Pipeline (pipeline.py) --> IngestClient, all
built by the runtime `run` starts too (runtime.py); what `watch` adds is the processes a
launcher gave a rank, whose stacks a stall reads, and a stall clock that sleeps until a stall
could be due. SIGTERM or SIGINT --> every file read to its end, delivered within --drain-timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from sidecar.aio import cancel
from sidecar.config import Config, configured
from sidecar.exits import ConfigError
from sidecar.log import format_duration, log
from sidecar.runtime import TICK_S, Runtime
from sidecar.sources.files.kinds import FILE_KINDS
from sidecar.stall import StallWatch
from sidecar.supervise import fault_point, supervise

STALL_LOOK_S = 60.0  # the longest sleep between looks for a stall


async def run_watch(cfg: Config, environ: Mapping[str, str]) -> int:
    """`sidecar watch`: follow the sources until SIGTERM/SIGINT, then drain; returns 0."""
    from sidecar.stacks import ranked_processes

    # watch has no command: the processes here that a launcher gave a rank
    runtime = Runtime(cfg, environ, "watch", processes=ranked_processes)
    started = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    client = runtime.client
    if client is None:
        await runtime.start(child_env=environ, environ=environ)
        await stop.wait()
        await runtime.close("stopped")
        return 0
    await runtime.start(child_env=environ, environ=environ)
    pipeline = runtime.pipeline
    assert pipeline is not None
    stall_ticker = supervise("stall-watch", lambda: _watch_stall(runtime.stall))
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
    await runtime.close(f"stopped after {format_duration(time.monotonic() - started)}")
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


def main(args: argparse.Namespace) -> int:
    """`sidecar watch`: refused when it has nothing to watch."""
    cfg = configured(args, "watch")
    if not (any(cfg.files.values()) or cfg.hparams or cfg.hardware_interval or cfg.checkpoints
            or cfg.time_window):
        files = ", ".join(kind.flag for kind in FILE_KINDS)
        raise ConfigError(f"nothing to watch: give at least one of {files}, --hparams or "
                          "--checkpoints, or leave --hardware-interval or --time-window above 0")
    return asyncio.run(run_watch(cfg, os.environ))
