"""--stall-after: a trainer that has printed nothing and produced no new metric step for that long
is said to be stalled, once, and to have resumed, once (docs/commands.md#stalls). Never a failure:
nothing else changes. Hardware samples are no activity: a hung NCCL collective keeps a GPU busy.

    [sidecar] no output and no new metric step for 30m0s; GPUs 0-7: 100 % utilisation, 2 % SM
    activity
    [sidecar] output resumed after 41m12s
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from sidecar.log import format_duration, log


class StallWatch:
    """Told of every activity (cheap: one clock read), looked at by a periodic tick."""

    def __init__(self, after_s: float, announce: Callable[[str], None], gpus: Callable[[], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s  # 0: off
        self.announce = announce  # a line for /logs (without its line end)
        self.gpus = gpus  # what the sampler last saw of the GPUs, in words
        self.clock = clock
        self.stalled = False
        self._last = clock()

    def activity(self) -> None:
        """Output or a new metric step, now."""
        now = self.clock()
        if self.stalled:
            self.stalled = False
            line = f"[sidecar] output resumed after {format_duration(now - self._last)}"
            log.info("%s", line.removeprefix("[sidecar] "))
            self.announce(line)
        self._last = now

    def check(self) -> None:
        """From a periodic tick: say a stall once it has lasted --stall-after."""
        if self.stalled or not self.after_s:
            return
        quiet_s = self.clock() - self._last
        if quiet_s < self.after_s:
            return
        self.stalled = True
        line = (f"[sidecar] no output and no new metric step for {format_duration(quiet_s)}; "
                f"{self.gpus()}")
        log.warning("%s (--stall-after %g; the run is not failed for it)",
                    line.removeprefix("[sidecar] "), self.after_s)
        self.announce(line)

    def due_in_s(self) -> float | None:
        """Seconds until a stall could be said if nothing happens meanwhile (0 once due); None
        while there is nothing to look for (off, or a stall already said)."""
        if self.stalled or not self.after_s:
            return None
        return max(0.0, self._last + self.after_s - self.clock())

    @property
    def stalled_s(self) -> float:
        """How long the current stall has lasted; 0 when there is none."""
        return self.clock() - self._last if self.stalled else 0.0


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
    return f"{label} {_ranges(indices)}: {', '.join(parts)}"


def _per_gpu(gauges: Mapping[str, float], name: str) -> dict[int, float]:
    found = {}
    for key, value in gauges.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "gpu" and parts[2] == name and parts[1].isdigit():
            found[int(parts[1])] = value
    return found


def _mean(values: Mapping[int, float]) -> float:
    return sum(values.values()) / len(values)


def _ranges(indices: list[int]) -> str:
    """0-7, or 0,2,4-5."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
