"""The questions the host collector asks, answered from /proc (procfs.py), else by psutil."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, NamedTuple

from sidecar.sources.telemetry import procfs
from sidecar.sources.telemetry.collectors.processes import (
    CLOCK_TICKS,
    ParentTable,
    ProcessReading,
    proc_reading,
)

if TYPE_CHECKING:
    import psutil


class CpuTimes(NamedTuple):
    """Cumulative CPU seconds: busy (everything but idle and iowait) and total. A tuple: a
    sample makes one a core."""

    busy: float
    total: float


class HostProbe:
    """What the host collector reads, one question a method; tests override it to inject.

    Linux's /proc is read directly (procfs.py: psutil's figures at a fraction of its cost);
    psutil answers where /proc cannot, and stays the reference the tests compare with.
    """

    def __init__(self) -> None:
        self._parents = ParentTable()
        self._stat = procfs.CpuStat()
        self._meminfo = procfs.MemInfo()
        self._disk_io = procfs.DiskIo()
        self._net_io = procfs.NetIo()
        self._boot_s: float | None = None  # psutil.boot_time() from the last /proc/stat read
        self._swap: tuple[int, int] | None = None  # what memory() found of swap, for swap()

    def cpu_times(self) -> tuple[CpuTimes, list[CpuTimes]]:
        """The whole machine's and each core's."""
        try:
            stat = self._stat.read()
        except OSError:
            ps = procfs.psutil_module()
            return _cpu_times(ps.cpu_times()), [_cpu_times(c) for c in ps.cpu_times(True)]
        self._boot_s = stat.boot_s
        return _ticks_to_seconds(stat.machine), [_ticks_to_seconds(c) for c in stat.cores]

    def load_average(self) -> tuple[float, float, float]:
        return os.getloadavg()

    def memory(self) -> tuple[int, int, int]:
        """Total, used and available bytes."""
        try:
            found, self._swap = self._meminfo.read()
        except OSError:
            found, self._swap = None, None
        return _psutil_memory() if found is None else found

    def swap(self) -> tuple[int, int]:
        """Total and used bytes: from memory()'s read of /proc/meminfo, called just before."""
        found, self._swap = self._swap, None
        if found is None:
            try:
                found = self._meminfo.read()[1]
            except OSError:
                found = None
        return _psutil_swap() if found is None else found

    def disk_io(self) -> tuple[int, int] | None:
        """Bytes read and written by all disks since boot."""
        try:
            return self._disk_io.read()
        except OSError:
            return _psutil_disk_io()

    def net_io(self) -> dict[str, tuple[int, int]]:
        """Bytes received and sent per interface that is up and not loopback."""
        try:
            return self._net_io.read()
        except OSError:
            return _psutil_net_io()

    def disk_usage(self, path: str) -> tuple[int, int, int]:
        """Total, used and available bytes of the file system holding `path`."""
        fs = os.statvfs(path)  # psutil.disk_usage's arithmetic
        return (fs.f_blocks * fs.f_frsize, (fs.f_blocks - fs.f_bfree) * fs.f_frsize,
                fs.f_bavail * fs.f_frsize)

    def process_tree(self, pid: int) -> list[ProcessReading] | None:
        """The process `pid` and its descendants; None once it has gone."""
        below = self._parents.descendants(pid)
        if below is not None:  # Linux: each process from one read of its stat file
            boot_s = procfs.psutil_module().boot_time() if self._boot_s is None else self._boot_s
            lines = self._parents.stat_lines
            readings = [r for r in (proc_reading(p, boot_s, lines.get(p)) for p in [pid, *below])
                        if r is not None]
            return readings if readings and readings[0].pid == pid else None
        ps = procfs.psutil_module()
        try:  # no /proc to list: psutil's own walk
            root = ps.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except ps.Error:
            return None
        readings = []
        for proc in processes:
            with contextlib.suppress(ps.Error), proc.oneshot():
                cpu = proc.cpu_times()
                readings.append(ProcessReading(
                    pid=proc.pid, started_s=proc.create_time(), cpu_s=cpu.user + cpu.system,
                    rss_bytes=proc.memory_info().rss, threads=proc.num_threads(),
                    open_files=_num_fds(proc)))
        return readings


def _ticks_to_seconds(ticks: procfs.CpuTicks) -> CpuTimes:
    return CpuTimes(ticks.busy / CLOCK_TICKS, ticks.total / CLOCK_TICKS)


def _psutil_memory() -> tuple[int, int, int]:
    vm = procfs.psutil_module().virtual_memory()
    return vm.total, vm.used, vm.available


def _psutil_swap() -> tuple[int, int]:
    sw = procfs.psutil_module().swap_memory()
    return sw.total, sw.used


def _psutil_disk_io() -> tuple[int, int] | None:
    io = procfs.psutil_module().disk_io_counters()
    return None if io is None else (io.read_bytes, io.write_bytes)


def _psutil_net_io() -> dict[str, tuple[int, int]]:
    ps = procfs.psutil_module()
    stats = ps.net_if_stats()
    counters = ps.net_io_counters(pernic=True)
    return {name: (c.bytes_recv, c.bytes_sent) for name, c in counters.items()
            if name in stats and stats[name].isup and not _loopback(name, stats[name])}


def _cpu_times(times: Any) -> CpuTimes:
    total = sum(float(v) for v in times)
    idle = float(times.idle) + float(getattr(times, "iowait", 0.0))
    return CpuTimes(busy=total - idle, total=total)


def _loopback(name: str, stats: Any) -> bool:
    flags = getattr(stats, "flags", "")
    return name == "lo" or "loopback" in flags.split(",")


def _num_fds(proc: psutil.Process) -> int | None:
    try:
        return proc.num_fds()
    except (procfs.psutil_module().Error, AttributeError):
        return None
