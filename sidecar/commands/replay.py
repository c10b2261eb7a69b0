"""`sidecar replay`: deliver what an earlier run left in its state folder (issue: nothing lost).

A node restarted or a pod rescheduled onto the same volume leaves the crash tail and lifecycle
events in their journals and hardware/environment payloads in the spool (the crash tail goes
first: the end event it left closes the log), hardware/environment payloads in the spool, and
what its files (--jsonl, --tensorboard, --log, as the run recorded them in `sources.json`) hold
past their committed offsets: a drain that timed out leaves metric points there; and the
checkpoint uploads its ledger holds unfinished (then registered). This delivers
all of it with a progress line and exits 0 only when nothing is left; what it cannot deliver, it
names (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from sidecar.config import Config
from sidecar.delivery.crashtail import CrashTail
from sidecar.delivery.lifecycle import Lifecycle
from sidecar.exits import ConfigError
from sidecar.log import log
from sidecar.node import resolve_node
from sidecar.pipeline import Pipeline, recorded_sources
from sidecar.runtime import claim_run_dir, make_client
from sidecar.sources.files.kinds import FILE_KINDS
from sidecar.statefile import release

PROGRESS_EVERY_S = 0.5


async def replay(cfg: Config, timeout_s: float) -> int:
    """Deliver the run's journal and spool; 0 when everything was acknowledged, else 1."""
    client = make_client(cfg)
    if client is None:
        raise ConfigError("replay needs reporting on: set STARFORGE_ENABLED=1 (or "
                          "TUNEPLANE_JOB_ENABLED=1) with the run's endpoint, run id and token")
    if not cfg.run_dir.is_dir():
        print(f"replay: nothing to deliver, {cfg.run_dir} does not exist", file=sys.stderr)
        return 0
    held = claim_run_dir(cfg)
    await client.start()
    crash_tail = CrashTail(cfg.run_dir, cfg.platform.run_id, client)
    lifecycle = Lifecycle(cfg.run_dir, cfg.platform.run_id, client)
    recorded = recorded_sources(cfg.run_dir)
    if recorded and not any(cfg.files.values()):
        cfg = cfg._replace(files=recorded)
    pipeline = Pipeline(cfg, client, resolve_node(cfg.node_name, os.environ, cfg.nodes))
    batchers = pipeline.batchers
    try:
        await crash_tail.open()
        deadline = time.monotonic() + timeout_s
        if not await crash_tail.deliver(deadline):  # the lifecycle events it left come after
            log.error("replay: the command's last output (for /logs) is still undelivered "
                      "after %.0f s (last failure: %s); it and the lifecycle events stay in %s",
                      timeout_s, _last_failure(client), cfg.run_dir)
            return 1
        await lifecycle.open()
        pipeline.start()
        await pipeline.artifacts.opened_if_started()
        pipeline.uploads.hurry()  # what is left goes now: no start spread
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                await pipeline.uploads_opened_if_started()
        except TimeoutError:
            log.error("replay: the uploads ledger in %s could not be read back in %.0f s; the "
                      "checkpoint uploads it holds stay there", cfg.run_dir, timeout_s)
            return 1

        def left() -> int:
            return (len(lifecycle.pending) + sum(b.queued for b in batchers)
                    + pipeline.uploads.pending + pipeline.artifacts.pending)

        total = left()
        redraw = "\r" if sys.stderr.isatty() else ""  # a line redrawn is for a terminal only
        while left() and time.monotonic() < deadline:
            if redraw:
                print(f"{redraw}replay: {total - left()}/{total} payloads delivered", end="",
                      file=sys.stderr, flush=True)
            await asyncio.sleep(PROGRESS_EVERY_S)
        print(f"{redraw}replay: {total - left()}/{total} payloads delivered", file=sys.stderr)
        await pipeline.drain(deadline)  # the files, read to their end
        points = pipeline.metrics.delivered
        print(f"replay: {points} metric points read again from the run's files past their "
              "committed offsets and delivered", file=sys.stderr)
        unread = _unread(pipeline)
        if unread:
            log.error("replay: these files hold data past their committed offsets, but the run "
                      "did not record them as its sources: %s; give replay the run's %s options "
                      "to deliver it", "; ".join(unread), _source_options())
            return 1
        if left():
            log.error("replay: %d payloads still undelivered after %.0f s (last failure: %s); "
                      "they stay in %s", left(), timeout_s, _last_failure(client), cfg.run_dir)
            return 1
        return 0
    finally:
        await lifecycle.close()
        await pipeline.close()
        await client.close()
        release(held)


def _unread(pipeline: Pipeline) -> list[str]:
    """Files with a committed offset that are not among the followed sources, and hold more."""
    followed = {os.path.abspath(name) for spec in pipeline.follower.specs
                for name in spec.names()}
    unread = []
    for mark in pipeline.offsets.marks.values():
        try:
            st = os.stat(mark.path)
        except OSError:
            continue
        if ((st.st_dev, st.st_ino) == (mark.dev, mark.ino) and st.st_size > mark.offset
                and os.path.abspath(mark.path) not in followed):
            unread.append(f"{mark.path} ({st.st_size - mark.offset} bytes)")
    return unread


def _source_options() -> str:
    """The file-source options, those whose files hold metric points past their offsets (what
    a drain leaves) first: "--jsonl, --tensorboard or --log"."""
    flags = [kind.flag for kind in sorted(FILE_KINDS, key=lambda kind: not kind.metrics)]
    return ", ".join(flags[:-1]) + " or " + flags[-1]


def _last_failure(client: object) -> str:
    stats = getattr(client, "stats", {})
    reasons = [s.last_failure for s in stats.values() if s.last_failure]
    return reasons[-1] if reasons else "none: the ingest has not answered yet"


def main(args: argparse.Namespace) -> int:
    """`sidecar replay`."""
    from sidecar.config import configured

    cfg = configured(args, "replay")
    return asyncio.run(replay(cfg, args.timeout))
