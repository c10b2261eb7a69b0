"""What a collector's read produces (`Readings`), and counters made into per-second rates."""

from __future__ import annotations

MIN_RATE_INTERVAL_S = 0.001  # two readings closer than this give no rate (noise, not data)


class Readings:
    """What one read produced, the shape every collector fills.

    Gauges are posted as they are. Counters are cumulative values with the time they were read
    (seconds); the sampler turns consecutive ones into `<key>_per_second`. A key in `restarted`
    had its counter start over (a different set of links added up), so no rate spans it.
    """

    __slots__ = ("counters", "gauges", "restarted")

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.counters: dict[str, tuple[float, float]] = {}
        self.restarted: set[str] = set()

    def merge(self, other: Readings) -> None:
        self.gauges.update(other.gauges)
        self.counters.update(other.counters)
        self.restarted |= other.restarted


def counter_rate(previous: tuple[float, float], current: tuple[float, float]) -> float | None:
    """Per-second rate between two (value, time) readings; None across a reset or wrap."""
    delta = current[0] - previous[0]
    elapsed = current[1] - previous[1]
    if delta < 0 or elapsed < MIN_RATE_INTERVAL_S:
        return None
    return delta / elapsed


class Rates:
    """Per-second rates from consecutive readings of cumulative counters, by key."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}

    def rate(self, key: str, value: float, at_s: float) -> float | None:
        """The rate since the key's previous reading; None for its first."""
        previous = self._last.get(key)
        self._last[key] = (value, at_s)
        return None if previous is None else counter_rate(previous, (value, at_s))

    def forget(self, key: str) -> None:
        self._last.pop(key, None)
