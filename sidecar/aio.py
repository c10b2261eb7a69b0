"""Two asyncio idioms every long-lived task of the sidecar needs.

Timeouts are `asyncio.timeout` blocks, never `asyncio.wait_for`: on Python 3.11, wait_for
returns normally when the awaited thing finishes in the same loop step as the task is cancelled,
and the cancellation is lost. A task cancelled at shutdown then ran on (the hardware sampler into
its 10 s sleep), holding the drain up until its deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event`; False when `timeout_s` ran out first."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` and wait until it has finished."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
