"""Blocking calls off the event loop: on daemon threads, each awaited with a timeout.

NVML calls, /proc and sysfs reads and disk usage can hang for good (a GPU fallen off the bus, a
dead NFS mount). The event loop, and so log forwarding, never waits on one: it waits on a future
with a deadline, and a thread stuck in a call is left behind rather than joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

BACKGROUND_NICE = 19  # the lowest priority: CPU the trainer does not use


class WorkerBusy(Exception):
    """The worker is still running an earlier read that has not returned."""


class Worker:
    """A daemon thread running blocking reads one at a time.

    Not a ThreadPoolExecutor: its threads are joined when the interpreter exits, so one NVML call
    hung for good would keep the sidecar from ever exiting. A daemon thread is simply left behind.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    async def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """fn() on the worker; TimeoutError after `timeout_s`, WorkerBusy while one is stuck."""
        future = self.submit(fn)
        async with asyncio.timeout(timeout_s):  # not wait_for: see sidecar.aio
            return await future

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """fn() on the worker, its outcome the future's; WorkerBusy while one is stuck."""
        if self._busy:
            raise WorkerBusy(self.name)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._busy = True
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        """End the thread once its current job (if any) returns."""
        if self._thread is not None:
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the awaiting side, never lost here
                result, error = None, exc
            self._busy = False
            with contextlib.suppress(RuntimeError):  # the loop closed while we were stuck
                future.get_loop().call_soon_threadsafe(_resolve, future, result, error)


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller timed out and went on
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def in_background(fn: Callable[[], T], name: str) -> T:
    """fn() on a daemon thread of its own at the lowest CPU priority (nice 19), so that it takes
    only the CPU the trainer leaves: for long bulk work such as an upload. Awaiting it can be
    cancelled; the thread itself ends when fn returns (fn must watch for its own stop)."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def serve() -> None:
        with contextlib.suppress(OSError):  # Linux: the nice value is the thread's own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the awaiting side, never lost here
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            future.get_loop().call_soon_threadsafe(_resolve, future, result, error)

    threading.Thread(target=serve, name=name, daemon=True).start()
    return await future


async def off_loop(fn: Callable[[], T], timeout_s: float, name: str) -> T:
    """fn() on a one-off daemon thread, with a timeout (TimeoutError) that never blocks the loop."""
    worker = Worker(name)
    try:
        return await worker.call(fn, timeout_s)
    finally:
        worker.stop()
