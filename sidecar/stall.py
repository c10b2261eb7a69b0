"""--stall-after: a trainer that has printed nothing and produced no new metric step for that long
is said to be stalled, once, and to have resumed, once (docs/stalls.md). Never a failure:
nothing else changes. Hardware samples are no activity: a hung NCCL collective keeps a GPU busy.

Without --stall-after the threshold is the run's own cadence (docs/stalls.md#the-default):
CADENCE_FACTOR times the longest quiet gap between two activities so far, at least
CADENCE_FLOOR_S; before the second activity, BEFORE_CADENCE_S. A run that steps every 2 s is said
stalled after 2 minutes, well before NCCL's 10-minute watchdog; one that prints once an hour
after 3 hours.

    [sidecar] no output and no new metric step for 30m0s; GPUs 0-7: 100 % utilisation, 2 % SM
    activity
    [sidecar] output resumed after 41m12s
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from sidecar.log import format_duration, log

CADENCE_FACTOR = 3.0
CADENCE_FLOOR_S = 120.0
BEFORE_CADENCE_S = 1800.0  # nothing known of the cadence yet: what --stall-after was by default


class StallWatch:
    """Told of every activity (cheap: one clock read), looked at by a periodic tick."""

    def __init__(self, after_s: float | None, announce: Callable[[str], None],
                 gpus: Callable[[], str], clock: Callable[[], float] = time.monotonic,
                 on_stall: Callable[[], None] = lambda: None) -> None:
        self.after_s = after_s  # 0: off; None: the run's cadence
        self.announce = announce  # a line for /logs (without its line end)
        self.gpus = gpus  # what the sampler last saw of the GPUs, in words
        self.clock = clock
        self.on_stall = on_stall  # after the stall's line: the stacks are taken
        self.stalled = False
        self._last = clock()
        self._active = False  # an activity was seen: the gap before it is no cadence
        self.longest_gap_s: float | None = None
        self._stopped_at: float | None = None  # the run was stopped (a signal we forwarded)

    @property
    def threshold_s(self) -> float:
        """The quiet time a stall is said after: --stall-after, else the cadence's."""
        if self.after_s is not None:
            return self.after_s
        if self.longest_gap_s is None:
            return BEFORE_CADENCE_S
        return max(CADENCE_FLOOR_S, CADENCE_FACTOR * self.longest_gap_s)

    def _rule(self) -> str:
        if self.after_s is not None:
            return f"--stall-after {self.after_s:g}"
        if self.longest_gap_s is None:
            return (f"the default before the run has a cadence, "
                    f"{format_duration(BEFORE_CADENCE_S)}")
        return (f"the run's cadence: {CADENCE_FACTOR:g} x its longest quiet gap so far, "
                f"{format_duration(self.longest_gap_s)}, at least "
                f"{format_duration(CADENCE_FLOOR_S)}")

    def stop(self) -> None:
        """The run is being stopped (a signal forwarded to it): what it writes on the way out
        is no resumed training, and a stall ended here, not later."""
        if self._stopped_at is None:
            self._stopped_at = self.clock()

    def activity(self) -> None:
        """Output or a new metric step, now."""
        if self._stopped_at is not None:
            return
        now = self.clock()
        if self._active:
            gap_s = now - self._last
            if self.longest_gap_s is None or gap_s > self.longest_gap_s:
                self.longest_gap_s = gap_s
        self._active = True
        if self.stalled:
            self.stalled = False
            line = f"[sidecar] output resumed after {format_duration(now - self._last)}"
            log.info("%s", line.removeprefix("[sidecar] "))
            self.announce(line)
        self._last = now

    def check(self) -> None:
        """From a periodic tick: say a stall once it has lasted --stall-after."""
        if self.stalled or self.after_s == 0 or self._stopped_at is not None:
            return
        quiet_s = self.clock() - self._last
        if quiet_s < self.threshold_s:
            return
        self.stalled = True
        line = (f"[sidecar] no output and no new metric step for {format_duration(quiet_s)}; "
                f"{self.gpus()}")
        log.warning("%s (%s; the run is not failed for it)",
                    line.removeprefix("[sidecar] "), self._rule())
        self.announce(line)
        self.on_stall()

    def due_in_s(self) -> float | None:
        """Seconds until a stall could be said if nothing happens meanwhile (0 once due); None
        while there is nothing to look for (off, or a stall already said)."""
        if self.stalled or self.after_s == 0:
            return None
        return max(0.0, self._last + self.threshold_s - self.clock())

    @property
    def stalled_s(self) -> float:
        """How long the current stall has lasted; 0 when there is none."""
        end = self.clock() if self._stopped_at is None else self._stopped_at
        return end - self._last if self.stalled else 0.0

    @property
    def quiet_s(self) -> float:
        """How long since the last activity."""
        return self.clock() - self._last


def gpu_summary(gauges: Mapping[str, float]) -> str:
    """`GPUs 0-7: 100 % utilisation, 2 % SM activity` from the sampler's last GPU gauges (means
    over the GPUs), or `no GPU`."""
    utilisation = _per_gpu(gauges, "utilization_percent")
    if not utilisation:
        return "no GPU"
    parts = [f"{_mean(utilisation):.0f} % utilisation"]
    sm_active = _per_gpu(gauges, "sm_active_percent")
    if sm_active:
        parts.append(f"{_mean(sm_active):.0f} % SM activity")
    indices = sorted(utilisation)
    label = "GPU" if len(indices) == 1 else "GPUs"
    return f"{label} {ranges(indices)}: {', '.join(parts)}"


def _per_gpu(gauges: Mapping[str, float], name: str) -> dict[int, float]:
    found = {}
    for key, value in gauges.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "gpu" and parts[2] == name and parts[1].isdigit():
            found[int(parts[1])] = value
    return found


def _mean(values: Mapping[int, float]) -> float:
    return sum(values.values()) / len(values)


def ranges(indices: list[int]) -> str:
    """0-7, or 0,2,4-5."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
