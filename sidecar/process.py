"""What the process holds beyond what a run builds: the secrets masked, whether our stderr ends
inside a line, the tasks started once, the NVML bindings, a driver's memory call. Each module
holding such a state registers how to make it fresh (`held`); `fresh()` makes every one as a new
process has it, which is what a test calls between tests, so that one test's token or library
never decides another's outcome."""

from __future__ import annotations

from collections.abc import Callable

_RESETS: list[Callable[[], object]] = []


def held(reset: Callable[[], object]) -> None:
    """Register `reset`, which puts one module's process-wide state back as it starts."""
    _RESETS.append(reset)


def fresh() -> None:
    """Every registered state as a new process has it (the modules not imported yet are)."""
    for reset in _RESETS:
        reset()
