"""The run's metric key budget: points of keys past the platform's limit are refused here, said
in one ERROR a minute at most, and the refused keys kept in bounded memory."""

from __future__ import annotations

import asyncio
import time

import pytest

from sidecar.delivery.keys import MAX_METRIC_KEYS, MAX_REMEMBERED_REFUSED_KEYS, KeyBudget


def _points(*keys: str, step: int = 0) -> list[dict[str, object]]:
    return [{"key": key, "step": step, "value": 1.0} for key in keys]


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_new_key_every_step_past_the_limit_says_one_error_a_minute_in_bounded_memory(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    budget = KeyBudget(clock=clock)
    assert budget.admit(_points(*(f"k{i}" for i in range(MAX_METRIC_KEYS)))) != []
    steps = 3 * MAX_REMEMBERED_REFUSED_KEYS  # a week of a new key a step, in small
    for step in range(steps):
        points = _points("loss", "k0", f"grad/layer_{step}", step=step)
        kept = budget.admit(points)
        assert [p["key"] for p in kept] == ["k0"]  # "loss" came past the limit too
        clock.now += 0.5  # a gathering every half second
    budget.report_refused()
    minutes = steps * 0.5 / 60
    errors = _errors(caplog)
    assert minutes <= len(errors) <= minutes + 2, len(errors)
    assert len(budget.refused) == MAX_REMEMBERED_REFUSED_KEYS
    assert errors[0].startswith("2 metric keys refused ('loss', 'grad/layer_0'): the run "
                                f"already has {MAX_METRIC_KEYS} distinct metric keys")
    assert errors[0].endswith("(2 refused in all; said at most once a minute)")
    assert errors[1].startswith("120 metric keys refused ('grad/layer_1', 'grad/layer_2', "
                                "'grad/layer_3', 'grad/layer_4', 'grad/layer_5' and 115 more)")
    assert errors[-1].endswith(f"(more than {MAX_REMEMBERED_REFUSED_KEYS} refused in all; said "
                               "at most once a minute)")


async def test_refusals_held_back_are_said_when_the_minute_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    budget = KeyBudget(every_s=0.3)
    budget.admit(_points(*(f"k{i}" for i in range(MAX_METRIC_KEYS + 1))))
    assert len(_errors(caplog)) == 1  # the first is said at once
    budget.admit(_points("late-1", "late-2"))
    assert len(_errors(caplog)) == 1  # held back: said within the minute already
    deadline = time.monotonic() + 10
    while len(_errors(caplog)) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert _errors(caplog)[1].startswith("2 metric keys refused ('late-1', 'late-2')")
    assert _errors(caplog)[1].endswith("(3 refused in all; said at most once a minute)")
    budget.admit(_points("late-1"))  # refused already: not said again
    budget.report_refused()
    assert len(_errors(caplog)) == 2
