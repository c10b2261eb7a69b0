"""The asyncio idioms the sidecar's long-lived tasks need: a wait with a timeout, a cancel that
waits, a window of requests in flight.

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


class Window:
    """At most `most` at once, starting with one: `widen` lets one more in, `narrow` puts it
    back to one (additive increase, a cut at the first sign of a struggling server)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.size = 1
        self.inside = 0
        self._changed = asyncio.Condition()

    def widen(self) -> None:
        self.size = min(self.size + 1, self.most)

    def narrow(self) -> None:
        self.size = 1

    async def __aenter__(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.inside < self.size)
            self.inside += 1

    async def __aexit__(self, *exc: object) -> None:
        async with self._changed:
            self.inside -= 1
            self._changed.notify_all()
