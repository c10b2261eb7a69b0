"""Two asyncio idioms every long-lived task of the sidecar needs."""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event`; False when `timeout_s` ran out first."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` and wait until it has finished."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
