"""One supervisor for every long-lived task: a task that raises is restarted, never lost.

Each route's sender, the follower, the sampler, the log shipper, the offsets saver, the ticker:
each runs as `supervise(name, work)`. When `work()` raises, the exception is logged once at
ERROR with the task's name and where it was raised (further failures of the same task within a
minute are counted, not repeated), the restart is counted (`restarts()`, shown by /status and
/metrics) and `work()` is called again after a backoff. A task keeps its state in its object, so
a restart resumes where it failed: what was in flight is sent again (docs/ingest.md#at-least-once:
nothing lost, repeats allowed). A cancellation is never a failure: it ends the task.

Tests make every task fail once: `_SIDECAR_TEST_FAULTS=SECONDS` in the environment arms each
supervised task to raise `InjectedFault` at its first `fault_point()` after a random moment
within SECONDS of its start. It is no option: nothing a user sets or sees.
"""

from __future__ import annotations

import asyncio
import os
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from sidecar.log import Throttle, log
from sidecar.process import held

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 10.0
HEALTHY_S = 60.0  # a task that ran this long before failing restarts after the first backoff
FAULTS_ENV = "_SIDECAR_TEST_FAULTS"

Work = Callable[[], Coroutine[Any, Any, None]]


class InjectedFault(Exception):
    """Raised by `fault_point()` in tests (FAULTS_ENV), as a bug would raise."""


class Supervisor:
    """Runs tasks, restarts the ones that raise, counts the restarts by task name."""

    def __init__(self, fault_window_s: float | None = None) -> None:
        self.fault_window_s = fault_window_s
        self.restarts: dict[str, int] = {}
        self._throttle = Throttle()
        self._armed: dict[str, float] = {}  # task name -> loop time to raise
        self._fired: set[str] = set()

    def forget(self) -> None:
        """No restart counted, no fault armed or fired, no failure said yet."""
        self.restarts.clear()
        self._throttle.forget()
        self._armed.clear()
        self._fired.clear()

    def spawn(self, name: str, work: Work) -> asyncio.Task[None]:
        """Run `work()` as task `name` under supervision."""
        return asyncio.create_task(self._keep(name, work), name=name)

    def fault_point(self) -> None:
        """Where an armed test fault is raised: a task's loop calls it at the top of each round,
        where its state is consistent, as it would be when a bug raises there."""
        if not self._armed:  # always, but in a test that armed faults
            return
        task = asyncio.current_task()
        if task is None:
            return
        name = task.get_name()
        at = self._armed.get(name)
        if at is not None and asyncio.get_running_loop().time() >= at:
            del self._armed[name]
            self._fired.add(name)
            raise InjectedFault(f"a fault injected into {name} by the test")

    async def _keep(self, name: str, work: Work) -> None:
        loop = asyncio.get_running_loop()
        backoff_s = FIRST_BACKOFF_S
        while True:
            self._arm(name)
            began = loop.time()
            try:
                await work()
                return
            except Exception as exc:  # any bug: logged, counted, restarted (module docstring)
                if loop.time() - began >= HEALTHY_S:
                    backoff_s = FIRST_BACKOFF_S
                self.failed(name, exc, f"restarting it in {backoff_s:.1f} s")
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)

    def _arm(self, name: str) -> None:
        if self.fault_window_s and name not in self._fired and name not in self._armed:
            import random  # here: only tests inject faults, and random is 1 % of a start-up

            self._armed[name] = (asyncio.get_running_loop().time()
                                 + random.uniform(0, self.fault_window_s))

    def failed(self, name: str, exc: Exception, then: str = "it goes on") -> None:
        """Count a failure of `name` and say it (once a minute); for a task the supervisor
        runs, and for work it does not (a status request, a pump thread)."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        log.debug("task %s failed", name, exc_info=exc)
        held = self._throttle.admit(name)
        if held is None:
            return
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        more = f"; {held} more failures of it since the last message" if held else ""
        log.error("task %s failed (%s: %s%s); %s (%d restarts so far%s)", name,
                  exc.__class__.__name__, exc, where, then, self.restarts[name], more)


def _fault_window() -> float | None:
    try:
        return float(os.environ[FAULTS_ENV])
    except (KeyError, ValueError):
        return None


SUPERVISOR = Supervisor(_fault_window())


def supervise(name: str, work: Work) -> asyncio.Task[None]:
    """Run `work()` as the long-lived task `name` under the process's supervisor."""
    return SUPERVISOR.spawn(name, work)


def fault_point() -> None:
    """See `Supervisor.fault_point`; free when no test armed a fault."""
    SUPERVISOR.fault_point()


# the tasks spawn_once started and not yet done: the event loop holds only a weak reference
_RUNNING: set[asyncio.Task[None]] = set()


def spawn_once(name: str, work: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
    """`work()` as a task run once (a look is not repeated, a signal not forwarded twice): what
    it raises is said and counted as a supervised task's failure would be."""

    async def run() -> None:
        try:
            await work()
        except Exception as exc:  # a bug: said and counted, never the sidecar's end
            SUPERVISOR.failed(name, exc)

    task = asyncio.create_task(run(), name=name)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task


def restarts() -> dict[str, int]:
    """Restarts so far, by task name (for /status and /metrics)."""
    return dict(SUPERVISOR.restarts)


def _fresh() -> None:
    """No restart counted, no fault armed, no task held: as a new process starts."""
    SUPERVISOR.forget()
    _RUNNING.clear()


held(_fresh)
