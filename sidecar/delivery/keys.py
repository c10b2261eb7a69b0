"""The run's metric keys: the platform takes MAX_METRIC_KEYS distinct ones, and a point of a
key past them is refused here, before it costs a request.

A refusal is said in an ERROR that names a few of the keys, at most once a minute: a trainer
that makes a new key every step (`grad/layer_{step}`) would otherwise say one for every
gathering of its file, for as long as it runs. What a minute held back is said when it ends,
or at the drain. The refused keys are remembered up to MAX_REMEMBERED_REFUSED_KEYS, so that
each is counted once; past them a refused key is counted but not kept, and memory stays
bounded however many keys come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sidecar.log import log

MAX_METRIC_KEYS = 4096  # a run's distinct keys; past it a new key is refused locally
MAX_REMEMBERED_REFUSED_KEYS = 4096  # refused keys kept, each counted once
SHOWN_REFUSED_KEYS = 5  # named in the ERROR that refuses keys; the rest are counted
REFUSALS_SAID_EVERY_S = 60.0


class KeyBudget:
    """Admits the points of the run's first MAX_METRIC_KEYS keys, refuses the others."""

    def __init__(self, every_s: float = REFUSALS_SAID_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`every_s`: the least time between two ERRORs about refused keys."""
        self.every_s = every_s
        self.keys: set[str] = set()
        self.refused: set[str] = set()  # the first MAX_REMEMBERED_REFUSED_KEYS refused keys
        self.refused_count = 0  # refused keys: distinct while remembered, then each refusal
        self._clock = clock
        self._unreported: list[str] = []  # to be named in the next ERROR
        self._unreported_count = 0
        self._reported_at = float("-inf")
        self._timer: asyncio.TimerHandle | None = None

    def admit(self, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The points whose key fits the budget (all of them, most of the time)."""
        fresh = {point["key"] for point in points} - self.keys
        if len(self.keys) + len(fresh) <= MAX_METRIC_KEYS:
            self.keys |= fresh
            return points
        for key in dict.fromkeys(p["key"] for p in points if p["key"] not in self.keys):
            if len(self.keys) < MAX_METRIC_KEYS:
                self.keys.add(key)
            elif key not in self.refused:
                if len(self.refused) < MAX_REMEMBERED_REFUSED_KEYS:
                    self.refused.add(key)
                self.refused_count += 1
                self._unreported_count += 1
                if len(self._unreported) < SHOWN_REFUSED_KEYS:
                    self._unreported.append(key)
        self._report_when_due()
        return [p for p in points if p["key"] in self.keys]

    def report_refused(self) -> None:
        """The ERROR for the keys refused since the last one, if any (also at the drain)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._unreported_count:
            return
        count, named = self._unreported_count, self._unreported
        more = f" and {count - len(named)} more" if count > len(named) else ""
        in_all = (f"more than {MAX_REMEMBERED_REFUSED_KEYS}"
                  if self.refused_count > MAX_REMEMBERED_REFUSED_KEYS else str(self.refused_count))
        log.error("%d metric key%s refused (%s%s): the run already has %d distinct metric keys, "
                  "the platform's limit; their points are not sent (%s refused in all; said at "
                  "most once a minute)", count, "" if count == 1 else "s",
                  ", ".join(map(repr, named)), more, MAX_METRIC_KEYS, in_all)
        self._reported_at = self._clock()
        self._unreported, self._unreported_count = [], 0

    def _report_when_due(self) -> None:
        if not self._unreported_count:
            return
        wait_s = self._reported_at + self.every_s - self._clock()
        if wait_s <= 0:
            self.report_refused()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait_s, self.report_refused)
