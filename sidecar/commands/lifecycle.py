"""`sidecar lifecycle EVENT`: one lifecycle event posted strictly, from a shell or from inside a
command `sidecar run` wraps (docs/lifecycle.md).

Inside such a command the event is handed to the wrapper over its socket (its address in the
command's environment), so that the run's lifecycle has one writer; elsewhere it is journaled in
the run's state folder, then posted until acknowledged or `--timeout` passes (then kept for the
next start or `sidecar replay`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping

from sidecar.config import Config
from sidecar.delivery import handoff
from sidecar.delivery.lifecycle import Lifecycle
from sidecar.exits import EXIT_OK, EXIT_REFUSED
from sidecar.log import log
from sidecar.runtime import claim_run_dir, make_client


def to_wrapper(event: str, environ: Mapping[str, str]) -> int | None:
    """Inside a command `sidecar run` wraps: `event` handed to the wrapper, and the exit status;
    elsewhere None, and the event is posted by `post`."""
    address = environ.get(handoff.WRAPPER_SOCKET_VARIABLE)
    if not address:
        return None
    refusal = asyncio.run(handoff.hand_over(address, event))
    if refusal:
        log.error("lifecycle %s: %s", event, refusal)
        return EXIT_REFUSED
    return EXIT_OK


async def post(cfg: Config, event: str, timeout_s: float) -> int:
    """`event` journaled in the run's state folder and posted within `timeout_s`."""
    if not cfg.platform.enabled:
        log.info("lifecycle %s: reporting is off (ENABLED=0), nothing posted", event)
        return EXIT_OK
    client = make_client(cfg)
    assert client is not None
    claim_run_dir(cfg, lock=False)  # a `watch` may hold the folder; the journal is held below
    await client.start()
    lifecycle = Lifecycle(cfg.run_dir, cfg.platform.run_id, client)
    try:
        await lifecycle.open()  # ConfigError naming the sidecar that holds the run's journal
        if event in lifecycle.recorded:
            log.info("lifecycle %s: already recorded for run %s, not recorded again", event,
                     cfg.platform.run_id)
        refusal = await lifecycle.record(event, time.time())
        if refusal is not None:
            log.error("lifecycle %s: refused: %s (%s holds %s)", event, refusal, cfg.run_dir,
                      ", ".join(lifecycle.recorded))
            return EXIT_REFUSED
        if await lifecycle.drain(timeout_s):
            return EXIT_REFUSED if lifecycle.rejected else EXIT_OK
        log.error("lifecycle %s: not acknowledged within %.0f s (%s); kept in %s for the next "
                  "start or `sidecar replay`", event, timeout_s,
                  client.route_stats("lifecycle").trouble, cfg.run_dir)
        return EXIT_REFUSED
    finally:
        await lifecycle.close()
        await client.close()


def main(args: argparse.Namespace) -> int:
    """`sidecar lifecycle EVENT`: handed to the wrapper inside a `sidecar run`, else posted."""
    import os

    from sidecar.config import configured
    from sidecar.log import setup

    setup()
    handed = to_wrapper(args.event, os.environ)
    if handed is not None:
        return handed
    cfg = configured(args, "lifecycle")
    return asyncio.run(post(cfg, args.event, args.timeout))
