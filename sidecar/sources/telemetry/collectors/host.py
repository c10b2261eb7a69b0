"""The host's CPU, load, memory, swap, disk I/O and network, and the trainer's process tree."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from sidecar.sources.telemetry.collectors import Part, Sample
from sidecar.sources.telemetry.collectors.infiniband import InfinibandCollector
from sidecar.sources.telemetry.collectors.probe import CpuTimes, HostProbe
from sidecar.sources.telemetry.readings import MIN_RATE_INTERVAL_S, Readings

_LOAD_KEYS = ("cpu/load_average_1m", "cpu/load_average_5m", "cpu/load_average_15m")
_MEMORY_KEYS = ("memory/total_bytes", "memory/used_bytes", "memory/available_bytes")
_SWAP_KEYS = ("swap/total_bytes", "swap/used_bytes")


class HostCollector:
    """CPU, load, memory, swap, disk and network rates, and the trainer's process tree."""

    def __init__(self, probe: HostProbe, trainer_pid: Callable[[], int | None] | None) -> None:
        self.probe = probe
        self.trainer_pid = trainer_pid
        self._cpu: tuple[CpuTimes, list[CpuTimes]] | None = None
        self._tree: dict[tuple[int, float], float] = {}  # (pid, started) -> cpu seconds
        self._tree_at: tuple[float, float] | None = None  # (monotonic, wall) of that reading

    def read(self, now_s: float, wall_s: float) -> tuple[Readings, frozenset[int] | None]:
        """This moment's readings, and the trainer's pids (None when there is no trainer)."""
        out = Readings()
        gauges, counters = out.gauges, out.counters
        self._read_cpu(gauges)
        gauges.update(zip(_LOAD_KEYS, self.probe.load_average(), strict=True))
        gauges.update(zip(_MEMORY_KEYS, self.probe.memory(), strict=True))
        gauges.update(zip(_SWAP_KEYS, self.probe.swap(), strict=True))
        disk = self.probe.disk_io()
        if disk is not None:
            counters["disk/read_bytes"] = (disk[0], now_s)
            counters["disk/write_bytes"] = (disk[1], now_s)
        for name, (rx, tx) in self.probe.net_io().items():
            counters[f"net/{name}/rx_bytes"] = (rx, now_s)
            counters[f"net/{name}/tx_bytes"] = (tx, now_s)
        return out, self._read_trainer(gauges, now_s, wall_s)

    def _read_cpu(self, gauges: dict[str, float]) -> None:
        current = self.probe.cpu_times()
        previous, self._cpu = self._cpu, current
        if previous is None:
            return
        total = _busy_percent(previous[0], current[0])
        if total is not None:
            gauges["cpu/utilization_percent"] = total
        if len(previous[1]) == len(current[1]):  # a core came or went: skip this interval
            cores = [_busy_percent(p, c) for p, c in zip(previous[1], current[1], strict=True)]
            known = [c for c in cores if c is not None]
            if known:
                gauges["cpu/busiest_core_utilization_percent"] = max(known)

    def _read_trainer(self, gauges: dict[str, float], now_s: float,
                      wall_s: float) -> frozenset[int] | None:
        pid = self.trainer_pid() if self.trainer_pid is not None else None
        tree = self.probe.process_tree(pid) if pid is not None else None
        if not tree:
            self._tree, self._tree_at = {}, None
            return None
        gauges["trainer/processes_count"] = len(tree)
        gauges["trainer/rss_bytes"] = sum(p.rss_bytes for p in tree)
        gauges["trainer/threads_count"] = sum(p.threads for p in tree)
        fds = [p.open_files for p in tree]
        if all(n is not None for n in fds):
            gauges["trainer/open_files_count"] = sum(n for n in fds if n is not None)
        cpu = {(p.pid, p.started_s): p.cpu_s for p in tree}
        previous, previous_at = self._tree, self._tree_at
        self._tree, self._tree_at = cpu, (now_s, wall_s)
        if previous_at is not None and now_s - previous_at[0] >= MIN_RATE_INTERVAL_S:
            used = _tree_cpu_delta(previous, cpu, previous_at[1])
            gauges["trainer/cpu_percent"] = 100.0 * used / (now_s - previous_at[0])
        return frozenset(p.pid for p in tree)


def _busy_percent(previous: CpuTimes, current: CpuTimes) -> float | None:
    busy = current.busy - previous.busy
    total = current.total - previous.total
    if total <= 0 or busy < 0:
        return None
    return min(100.0, 100.0 * busy / total)


def _tree_cpu_delta(previous: Mapping[tuple[int, float], float],
                    current: Mapping[tuple[int, float], float], previous_wall_s: float) -> float:
    """CPU seconds the tree used since the last reading, process by process.

    A process seen both times counts its increase; one started since counts all of its time;
    one that exited is not seen now and counts nothing, so the total never goes negative.
    """
    used = 0.0
    for key, cpu_s in current.items():
        if key in previous:
            used += max(cpu_s - previous[key], 0.0)
        elif key[1] >= previous_wall_s:
            used += cpu_s
    return used


def host_part(host: HostCollector, infiniband: InfinibandCollector, timeout_s: float) -> Part:
    """The sample's `host` read: the host's counters and InfiniBand's, read at one moment; it
    finds the trainer's pids, whose GPU memory the GPUs' reads count."""

    def read(sample: Sample) -> Readings:
        now_s = time.monotonic()
        out, sample.trainer_pids = host.read(now_s, time.time())
        out.merge(infiniband.read(now_s))
        return out

    return Part("host", "host", read, timeout_s)
