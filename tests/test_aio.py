"""sidecar.aio: a cancellation is never lost, whatever finishes in the same loop step."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.aio import cancel, wait_set


async def test_a_cancelled_wait_stays_cancelled_when_the_event_is_set_in_the_same_step() -> None:
    """asyncio.wait_for (Python 3.11) returned True here and the task ran on: the hardware
    sampler, cancelled at shutdown, slept another 10 s and held the drain up."""
    event = asyncio.Event()
    task = asyncio.create_task(wait_set(event, 10.0))
    await asyncio.sleep(0)  # the task now waits
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_ends_a_loop_that_waits_on_an_event_set_as_it_is_cancelled() -> None:
    event = asyncio.Event()
    rounds = 0

    async def loop_forever() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            event.clear()
            await wait_set(event, 10.0)

    task = asyncio.create_task(loop_forever())
    await asyncio.sleep(0)
    event.set()
    task.cancel()  # in the same step as the set, as a shutdown does
    await asyncio.wait_for(cancel(task), 1.0)
    assert task.cancelled() and rounds == 1


async def test_wait_set_times_out_and_sees_an_event_already_set() -> None:
    event = asyncio.Event()
    assert not await wait_set(event, 0.01)
    event.set()
    assert await wait_set(event, 0.0)
