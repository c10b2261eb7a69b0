"""The /hardware sampler: GPUs (nvml.py), the host (procfs.py, else psutil), InfiniBand from
sysfs.

Every `interval_s`, on a fixed schedule that does not drift, one sample becomes one `/hardware`
payload (docs/ingest.md#routes-and-bodies) with this node's name. Keys are slash-separated
with the unit last (docs/ingest.md#nodes-and-ranks): `gpu/0/power_watts`,
`net/eth0/rx_bytes_per_second`, `ib/mlx5_0/1/tx_bytes_per_second`.

A sample's reads (the host, each GPU, disk usage) run one after another on one worker thread,
each with its own timeout: a GPU fallen off the bus, or a dead NFS mount under the state dir,
is left to that thread, and the reads after it go on on another. While a thread is still stuck
in a read, that read is skipped, and it resumes once the thread comes back. The event loop, and
so log forwarding, never waits on a read.

Counters become rates from consecutive readings (`Rates`): the first reading gives no rate, and
a counter that went backwards (reset, wrap, a new process) gives none for that interval rather
than a negative or a spike. A value that could not be read is left out, never sent as zero.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from sidecar.log import log
from sidecar.records import iso_ts
from sidecar.sources.telemetry import nvml, procfs
from sidecar.sources.telemetry.nvml import (
    NVML_TIMEOUT_S,
    GpuDevice,
    GpuFilter,
    Readings,
    XidEvent,
    XidWatcher,
    gpu_filter_from_env,
    gpu_filter_from_option,
)
from sidecar.supervise import fault_point
from sidecar.threads import Worker

if TYPE_CHECKING:
    import psutil

__all__ = ["GpuChoice", "GpuFilter", "HardwareSampler", "HostProbe", "InfinibandCollector",
           "Rates", "SamplerStats", "choose_gpus", "gpu_filter_from_env"]

Emit = Callable[[str, dict[str, Any]], None]

GPU_STAGGER_S = 0.05  # a GPU's read taking longer than this overlaps the next GPU's
HOST_TIMEOUT_S = 5.0  # the same for the psutil/sysfs read and for disk usage
MAX_POINTS_PER_REQUEST = 2048  # as /metrics (docs/ingest.md#limits): a big node's sample is split
MIN_RATE_INTERVAL_S = 0.001  # two readings closer than this give no rate (noise, not data)
IB_WORD_BYTES = 4  # port_xmit_data / port_rcv_data count 4-byte words (IB spec, PortCounters)
MAX_XIDS_KEPT = 64  # the run's XID events kept for the failure summary
SATURATED = (2**32 - 1, 2**64 - 1)  # IB counters stop at their maximum instead of wrapping


# ---- counters -----------------------------------------------------------------------------


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


# ---- the host -----------------------------------------------------------------------------


class CpuTimes(NamedTuple):
    """Cumulative CPU seconds: busy (everything but idle and iowait) and total. A tuple: a
    sample makes one a core."""

    busy: float
    total: float


class ProcessReading(NamedTuple):
    """One process of the trainer's tree."""

    pid: int
    started_s: float  # wall-clock creation time: tells a new process from a reused pid
    cpu_s: float
    rss_bytes: int
    threads: int
    open_files: int | None


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
            readings = [r for r in (_proc_reading(p, boot_s, lines.get(p)) for p in [pid, *below])
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
    return CpuTimes(ticks.busy / _CLOCK_TICKS, ticks.total / _CLOCK_TICKS)


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


class ParentTable:
    """Every process's parent, kept from sample to sample, to find a process's descendants
    without reading the stat file of every process on the machine each time (psutil's
    children(recursive=True) does: 4 ms of a 10 ms sample on a machine of 170 processes).
    A pid's parent is read when the pid first appears, and the parents of the tree's own
    processes every time (an orphan is re-parented). /proc is listed again only when a process
    was created since the last look (the newest pid of /proc/loadavg moved on): otherwise no
    process can have joined the tree, and the tree's own are all there is to read. Set
    operations on a listing find what appeared and what went: Python touches only those.

    The tree's stat files are kept open (`procfs.ProcFile`) and their lines handed on in
    `stat_lines`, so that a process's reading needs no second read. An exited process's file
    fails its next read and is dropped: a new process given the same pid is opened anew."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._loadavg = procfs.ProcFile(f"{proc}/loadavg")
        self._parents: dict[str, tuple[int, int]] = {}  # /proc entry -> (pid, its parent)
        self._other: set[str] = set()  # /proc's entries that are not processes
        self._tree: set[str] = set()  # the root and its descendants at the last look
        self._files: dict[str, procfs.ProcFile] = {}  # their stat files
        self._looked: tuple[int, int] | None = None  # (newest pid, root) at the last look
        self.stat_lines: dict[int, bytes] = {}  # the stat line of each of them, this look

    def descendants(self, root: int) -> list[int] | None:
        """`root`'s descendants, parents before children; None where /proc cannot be listed."""
        newest = self._newest_pid()
        listed = newest is None or (newest, root) != self._looked
        if listed:
            try:
                self._learn(set(os.listdir(self._proc)))
            except OSError:
                return None
        self._looked = None if newest is None else (newest, root)
        parents = self._parents
        lines: dict[int, bytes] = {}
        for name in self._tree | {str(root)}:
            line = self._tree_stat(name)
            parent = None if line is None else _parent_of(line)
            if line is None or parent is None:  # it has just exited
                parents.pop(name, None)
            else:
                parents[name] = (int(name), parent)
                lines[int(name)] = line
        # with no process created, the tree can only have lost some: its own are all to look at
        candidates = parents.values() if listed else sorted(parents[str(p)] for p in lines)
        children: dict[int, list[int]] = collections.defaultdict(list)
        for pid, parent in candidates:
            children[parent].append(pid)
        found: list[int] = []
        stack = [root]
        while stack:
            below = children.get(stack.pop(), ())
            found.extend(below)
            stack.extend(below)
        self._tree = {str(pid) for pid in [root, *found]}
        for name in self._files.keys() - self._tree:
            self._files.pop(name).close()
        self.stat_lines = lines
        return found

    def _learn(self, listed: set[str]) -> None:
        """Forget the processes gone from the listing; read the parents of those new in it."""
        parents = self._parents
        for gone in parents.keys() - listed:
            del parents[gone]
        for name in listed - parents.keys() - self._other:
            if not name.isdigit():
                self._other.add(name)
                continue
            try:
                parent = _parent_of(_read_stat(f"{self._proc}/{name}/stat"))
            except OSError:  # it has just exited
                continue
            if parent is not None:
                parents[name] = (int(name), parent)

    def _tree_stat(self, name: str) -> bytes | None:
        """The stat line of the tree's process `name`, from its kept file; None once gone."""
        file = self._files.get(name)
        if file is None:
            file = self._files[name] = procfs.ProcFile(f"{self._proc}/{name}/stat")
        try:
            return file.read()
        except OSError:
            del self._files[name]
            return None

    def _newest_pid(self) -> int | None:
        """The pid most recently handed out (the last field of /proc/loadavg), None unreadable."""
        try:
            return int(self._loadavg.read().split()[-1])
        except (OSError, ValueError, IndexError):
            return None


def _parent_of(stat_line: bytes) -> int | None:
    """The parent pid in a /proc/PID/stat line (after the command name, which may hold spaces
    and parentheses: the last `)` ends it); None where the line is not one."""
    try:
        return int(stat_line[stat_line.rindex(b")") + 2:].split(b" ", 2)[1])
    except (ValueError, IndexError):
        return None


def _read_stat(path: str) -> bytes:
    """A /proc/PID/stat line in one read (it is under a page), without a Python file object."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _proc_reading(pid: int, boot_s: float, stat_line: bytes | None) -> ProcessReading | None:
    """One process from /proc/PID/stat (times, threads, start, RSS) and its fd folder, as
    psutil reads them but from one file: psutil's oneshot took 0.34 ms a process. `boot_s` is
    the boot time psutil adds (btime of /proc/stat), read once for the whole tree, not once a
    process; `stat_line` the stat line where it was just read. None once the process is gone."""
    try:
        if stat_line is None:
            stat_line = _read_stat(f"/proc/{pid}/stat")
        # after "pid (comm) ": state ppid ... utime(14) stime(15) ... num_threads(20)
        # itrealvalue starttime(22) vsize rss(24), counted from 1 with pid as field 1
        fields = stat_line[stat_line.rindex(b")") + 2:].split()
        utime, stime = int(fields[11]), int(fields[12])
        threads, started, rss_pages = int(fields[17]), int(fields[19]), int(fields[21])
    except (OSError, ValueError, IndexError):
        return None
    return ProcessReading(pid=pid, started_s=boot_s + started / _CLOCK_TICKS,
                          cpu_s=(utime + stime) / _CLOCK_TICKS, rss_bytes=rss_pages * _PAGE_BYTES,
                          threads=threads, open_files=_open_files(pid))


def _open_files(pid: int) -> int | None:
    """How many files the process has open, as psutil's num_fds() counts its fd folder's
    entries: the folder's size says it since Linux 6.2, in one stat instead of a listing of
    every descriptor (0 before: then listed). None where the folder cannot be read."""
    folder = f"/proc/{pid}/fd"
    try:
        return os.stat(folder).st_size or len(os.listdir(folder))
    except OSError:
        return None


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


class DiskUsageCollector:
    """Usage of the file systems holding the state dir and the declared folders."""

    def __init__(self, probe: HostProbe, paths: Sequence[Path]) -> None:
        self.probe = probe
        self.paths = tuple(paths)
        self._mounts: dict[Path, tuple[int, str]] = {}  # path -> (its device, mount point)

    def read(self) -> Readings:
        out = Readings()
        for mount in sorted({self._mount_of(p) for p in self.paths}):
            try:
                total, used, available = self.probe.disk_usage(mount)
            except OSError as exc:
                log.debug("disk usage of %s unavailable: %s", mount, exc)
                continue
            name = mount.strip("/").replace("/", "_") or "root"
            out.gauges.update({f"fs/{name}/total_bytes": total, f"fs/{name}/used_bytes": used,
                               f"fs/{name}/available_bytes": available})
        return out

    def _mount_of(self, path: Path) -> str:
        """The mount point of `path`, walked up to once and again only when the path moved to
        another device (something was mounted or unmounted on the way): one stat a sample."""
        try:
            device = os.stat(path).st_dev
        except OSError:  # not there (yet): its nearest existing parent's
            return _mount_point(path)
        known = self._mounts.get(path)
        if known is None or known[0] != device:
            known = self._mounts[path] = (device, _mount_point(path))
        return known[1]


def _mount_point(path: Path) -> str:
    """The mount point of `path`, or of its nearest existing parent."""
    current = os.path.abspath(path)
    while not os.path.ismount(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


# ---- InfiniBand and RoCE ------------------------------------------------------------------

# counters/ files that are data or packet counters: (sysfs name, key, multiplier).
IB_TRAFFIC = (
    ("port_xmit_data", "tx_bytes", IB_WORD_BYTES),
    ("port_rcv_data", "rx_bytes", IB_WORD_BYTES),
    ("port_xmit_packets", "tx_packets", 1),
    ("port_rcv_packets", "rx_packets", 1),
)
# Error counters posted as totals (`<name>_count`), from counters/ and RoCE's hw_counters/.
IB_ERRORS = (
    ("counters", "symbol_error"), ("counters", "link_error_recovery"),
    ("counters", "link_downed"), ("counters", "port_rcv_errors"),
    ("counters", "port_rcv_remote_physical_errors"), ("counters", "port_rcv_switch_relay_errors"),
    ("counters", "port_xmit_discards"), ("counters", "port_xmit_constraint_errors"),
    ("counters", "port_rcv_constraint_errors"), ("counters", "local_link_integrity_errors"),
    ("counters", "excessive_buffer_overrun_errors"), ("counters", "VL15_dropped"),
    ("hw_counters", "out_of_sequence"), ("hw_counters", "packet_seq_err"),
    ("hw_counters", "local_ack_timeout_err"), ("hw_counters", "rnr_nak_retry_err"),
)


class InfinibandCollector:
    """Per device and port traffic and error counters from <sysfs>/class/infiniband.

    A port has twenty counter files: each is kept open (`procfs.ProcFile`), read again from
    its start each sample; a port that went (its files fail) has them opened anew by path."""

    def __init__(self, sysfs_root: Path) -> None:
        self.root = sysfs_root / "class" / "infiniband"
        self._saturated: set[str] = set()
        self._files: dict[str, procfs.ProcFile] = {}

    def read(self, now_s: float) -> Readings:
        out = Readings()
        for device, port, folder in self._ports():
            prefix = f"ib/{device}/{port}"
            for filename, key, scale in IB_TRAFFIC:
                value = self._read_int(f"{folder}/counters/{filename}")
                if value is None or self._saturated_now(f"{prefix}/{filename}", value):
                    continue
                out.counters[f"{prefix}/{key}"] = (value * scale, now_s)
            for kind, filename in IB_ERRORS:
                value = self._read_int(f"{folder}/{kind}/{filename}")
                if value is not None:
                    out.gauges[f"{prefix}/{filename.lower()}_count"] = value
        return out

    def _read_int(self, path: str) -> int | None:
        file = self._files.get(path)
        if file is None:
            file = self._files[path] = procfs.ProcFile(path)
        try:
            return int(file.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _ports(self) -> list[tuple[str, str, str]]:
        """(device, port, folder) of every port, in name order; none without InfiniBand."""
        try:
            devices = sorted(os.listdir(self.root))
        except OSError:
            return []
        ports = []
        for device in devices:
            folder = f"{self.root}/{device}/ports"
            try:
                ports += [(device, port, f"{folder}/{port}") for port in sorted(os.listdir(folder))]
            except OSError:
                continue
        return ports

    def _saturated_now(self, what: str, value: int) -> bool:
        if value not in SATURATED:
            return False
        if what not in self._saturated:
            self._saturated.add(what)
            log.info("%s is stuck at its maximum (a 32-bit counter saturates): "
                     "its rate is left out", what)
        return True


# ---- the sampler --------------------------------------------------------------------------


# ---- which of the node's GPUs are the job's ----------------------------------------------------


class GpuChoice(NamedTuple):
    """Which of the node's GPUs are the job's, and the rule that says so (said once at INFO)."""

    filter: GpuFilter | None  # the GPUs that may be the job's; None: every GPU the node shows
    by_processes: bool  # of those, only the ones on which this pod's processes run
    rule: str


def choose_gpus(option: str, child_env: Mapping[str, str], environ: Mapping[str, str], *,
                watching: bool, proc: Path = Path("/proc")) -> GpuChoice:
    """The job's GPUs by the first rule that applies: `--gpus`; the job's CUDA_VISIBLE_DEVICES
    or NVIDIA_VISIBLE_DEVICES naming them; for a pod sidecar (`watch` in Kubernetes) that shares
    the pod's process namespace, those on which the pod's processes run; else every GPU the
    node shows. (The kubelet's pod-resources socket, which names a pod's devices, is not read.)
    """
    if option:
        return GpuChoice(gpu_filter_from_option(option), False, f"those --gpus names ({option})")
    named = gpu_filter_from_env(child_env)
    if named is not None:
        return GpuChoice(named, False, f"those {named.describe()} names")
    in_a_pod = "KUBERNETES_SERVICE_HOST" in environ or "POD_NAME" in environ
    if watching and in_a_pod:
        if shares_process_namespace(proc):
            return GpuChoice(None, True, "those on which this pod's processes run (NVML's "
                             "process list; --gpus names them otherwise)")
        return GpuChoice(None, False, "every GPU this node shows, other pods' too: this pod's "
                         "processes are not visible to the sidecar (`shareProcessNamespace: "
                         "true` in the pod's spec shows them); --gpus names the job's")
    return GpuChoice(None, False, "every GPU this node shows (nothing names the job's: --gpus, "
                     "CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES would)")


def shares_process_namespace(proc: Path = Path("/proc")) -> bool:
    """Whether this container sees its pod's processes: PID 1 is the pod's pause process, as
    with `shareProcessNamespace: true`, not this container's own entrypoint."""
    try:
        argv0 = (proc / "1" / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0) == b"pause"


def pod_pids(proc: Path = Path("/proc")) -> frozenset[int]:
    """The processes this one sees but itself: in a pod sharing its process namespace, the
    pod's (the trainer's among them)."""
    ours = os.getpid()
    try:
        return frozenset(int(name) for name in os.listdir(proc)
                         if name.isdigit() and int(name) != ours)
    except OSError:
        return frozenset()


class SamplerStats:
    """What the status endpoint shows of the sampler."""

    __slots__ = ("disabled", "gpu_status", "gpus", "last_sample_s", "samples", "skipped_reads")

    def __init__(self) -> None:
        self.samples = 0
        self.last_sample_s: float | None = None  # how long the last sample took
        self.gpus = 0  # GPUs being sampled
        self.gpu_status = "not started"  # how many GPUs, or why there is no GPU telemetry
        self.skipped_reads = 0  # reads skipped because the worker's previous read still hangs
        self.disabled: dict[str, dict[str, str]] = {}  # "gpu/0": {query: why}


class _Part(NamedTuple):
    """One read of a sample: its name (`host`, `disk-usage`, `gpu/0`), how a message names
    it, the read itself, and how long it may take before it counts as hung."""

    name: str
    what: str
    read: Callable[[_Sweep], Readings]
    timeout_s: float


class _Sweep:
    """One sample's reads, run one after another on one worker thread.

    One hand-off to a thread and back per sample: a thread for each read cost more CPU in
    wake-ups and GIL hand-offs than eight GPUs' reads themselves. `current` tells the loop which
    read runs and since when, so that it tells a read that hangs from a sample that is merely
    long; it then leaves the hung read to that thread and hands the reads after it to another.

    The thread also makes each read's gauges into the payload's points (`gauge_points`), while
    they are in its CPU's cache: the loop's thread, finding them in the other core's, took up
    to twice as long over the same points.
    """

    def __init__(self, parts: Sequence[_Part], ts: str) -> None:
        self.parts = parts
        self.ts = ts  # the sample's time, as its points carry it
        self.results: dict[str, Readings] = {}
        self.gauge_points: dict[str, list[dict[str, Any]]] = {}
        self.errors: dict[str, Exception] = {}
        self.trainer_pids: frozenset[int] | None = None  # the host read's, for the GPUs' reads
        self.current = (0, time.monotonic())  # the read running, and when it began
        self.runner: object | None = None  # the one thread that may go on reading

    def run(self, start: int, runner: object) -> None:
        """The reads from `start` on, while `runner` is still the one that may go on."""
        for index in range(start, len(self.parts)):
            if self.runner is not runner:  # given up on: the loop went on without this thread
                return
            part = self.parts[index]
            self.current = (index, time.monotonic())
            try:
                readings = part.read(self)
            except Exception as exc:  # one failing read never stops the others
                self.errors[part.name] = exc
                continue
            self.gauge_points[part.name] = _gauge_points(readings.gauges, self.ts)
            self.results[part.name] = readings


def _gauge_points(gauges: dict[str, float], ts: str) -> list[dict[str, Any]]:
    """The payload's points of a read's gauges, but those not finite (never sent)."""
    finite = math.isfinite
    if finite(sum(gauges.values())):  # a NaN or infinity would make the sum one
        return [{"key": k, "value": v, "ts": ts} for k, v in gauges.items()]
    return [{"key": k, "value": v, "ts": ts} for k, v in gauges.items() if finite(v)]


class HardwareSampler:
    """Samples this node every `interval_s` and emits each sample to `/hardware`."""

    def __init__(self, *, run_id: str, node: str, interval_s: float, emit: Emit,
                 gpu_filter: GpuFilter | None,
                 trainer_pid: Callable[[], int | None] | None,
                 disk_paths: Sequence[Path], sysfs_root: Path = Path("/sys"),
                 nvml_timeout_s: float = NVML_TIMEOUT_S,
                 host_timeout_s: float = HOST_TIMEOUT_S, probe: HostProbe | None = None,
                 gpus: bool = True, by_processes: bool = False, gpu_rule: str = "") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: the sampler needs a positive period")
        self.run_id = run_id
        self.node = node
        self.interval_s = interval_s
        self.emit = emit
        self.gpu_filter = gpu_filter
        self.nvml_timeout_s = nvml_timeout_s
        self.host_timeout_s = host_timeout_s
        self.use_gpus = gpus
        self.by_processes = by_processes  # of the GPUs the filter allows, those the pod uses
        self.gpu_rule = gpu_rule or (f"those {gpu_filter.describe()} names" if gpu_filter
                                     else "every GPU this node shows")
        self._candidates: list[GpuDevice] = []  # by_processes: the GPUs not seen used yet
        self._count = 0  # the GPUs the node shows
        self._process_lists: dict[str, nvml.ProcessList] = {}
        probe = probe or HostProbe()
        self._host = HostCollector(probe, trainer_pid)
        self._disks = DiskUsageCollector(probe, disk_paths)
        self._ib = InfinibandCollector(sysfs_root)
        self._rates = Rates()
        self._devices: list[GpuDevice] = []
        self._host_part = _Part("host", "host", self._read_host, host_timeout_s)
        self._disk_part = _Part("disk-usage", "disk usage", lambda _: self._disks.read(),
                                host_timeout_s)
        self._gpu_parts: dict[str, _Part] = {}
        self._worker: Worker | None = None  # the thread sweeps run on
        self._stuck: dict[str, Worker] = {}  # part -> the thread left behind in it
        self._stalled: set[str] = set()  # parts said to hang, until they answer again
        self._xid: XidWatcher | None = None
        self.xids: collections.deque[XidEvent] = collections.deque(maxlen=MAX_XIDS_KEPT)
        self._gpu_readings: list[Readings] = []  # the last sample's, for gpu_gauges
        self._stats = SamplerStats()
        self._started = False

    @property
    def gpu_gauges(self) -> dict[str, float]:
        """The last sample's GPU gauges, for a stall line."""
        return {k: v for readings in self._gpu_readings for k, v in readings.gauges.items()}

    @property
    def stats(self) -> SamplerStats:
        self._stats.gpus = len(self._devices)
        self._stats.disabled = {d.key: dict(d.disabled) for d in self._devices if d.disabled}
        return self._stats

    async def run(self) -> None:
        """Sample on a fixed schedule until cancelled; a late sample skips the ticks it missed."""
        try:
            await self.sample_forever()
        finally:
            self.close()

    async def sample_forever(self) -> None:
        """Sample on a fixed schedule until cancelled, leaving the workers to `close()`: a
        supervisor may call it again after a failure."""
        loop = asyncio.get_running_loop()
        await self.start()
        start = loop.time()
        tick = 0
        while True:
            fault_point()
            await self.sample_once()
            tick = max(tick + 1, math.floor((loop.time() - start) / self.interval_s) + 1)
            await asyncio.sleep(start + tick * self.interval_s - loop.time())

    async def start(self) -> None:
        """Open the job's GPUs (once); without NVML, say why at INFO and sample the rest."""
        if self._started:
            return
        self._started = True
        if not self.use_gpus:
            self._stats.gpu_status = "GPU sampling off"
            return
        worker = self._sweeper()
        try:
            devices, count = await worker.call(lambda: nvml.discover(self.gpu_filter),
                                               self.nvml_timeout_s)
        except nvml.NvmlError as exc:
            self._no_gpus(exc.reason())
            return
        except TimeoutError:
            self._leave(worker)
            self._no_gpus(f"NVML did not answer within {self.nvml_timeout_s:g} s")
            return
        if not devices:
            self._no_gpus("no NVIDIA GPU found" if count == 0 or self.gpu_filter is None else
                          f"{self.gpu_filter.describe()} selects none of this node's "
                          f"{count} GPUs")
            return
        self._count = count
        if self.by_processes:
            self._candidates = devices
            self._stats.gpu_status = f"0 of {count} GPUs (none used by this pod yet)"
            log.info("GPUs sampled: %s; none runs one of them yet", self.gpu_rule)
        else:
            self._select(devices)
            log.info("GPUs sampled: %s: %d, %s", self.gpu_rule, len(devices),
                     ", ".join(f"{d.index} {d.name}" for d in devices))
        self._xid = XidWatcher(devices)
        self._xid.start()

    def _select(self, devices: list[GpuDevice]) -> None:
        """Sample `devices` from now on, beside those sampled already."""
        self._devices += devices
        self._gpu_parts.update({d.key: _gpu_part(d, self.nvml_timeout_s) for d in devices})
        self._stats.gpu_status = f"{len(self._devices)} of {self._count} GPUs"

    async def _select_used_by_the_pod(self) -> None:
        """Add the GPUs on which a process of this pod now runs; a GPU once the job's stays."""
        if not self._candidates:
            return
        worker = self._sweeper()
        try:
            used = await worker.call(self._used_by_the_pod, self.nvml_timeout_s)
        except TimeoutError:
            self._leave(worker)
            return
        if used:
            self._candidates = [d for d in self._candidates if d not in used]
            self._select(used)
            log.info("sampling GPU(s) %s: this pod's processes run on them",
                     ", ".join(f"{d.index} {d.name}" for d in used))

    def _used_by_the_pod(self) -> list[GpuDevice]:
        """The candidate GPUs whose compute processes include one of this pod's (a thread)."""
        pids = pod_pids()
        used = []
        for device in self._candidates:
            processes = self._process_lists.get(device.key)
            if processes is None:
                processes = self._process_lists[device.key] = nvml.ProcessList(device.handle)
            try:
                running = processes.read()
            except nvml.NvmlError as exc:
                log.debug("%s: its processes cannot be listed: %s", device.describe(), exc)
                continue
            if any(pid in pids for pid, _ in running):
                used.append(device)
        return used

    def _no_gpus(self, reason: str) -> None:
        self._stats.gpu_status = reason
        log.info("no GPU telemetry on this node: %s; CPU, memory, disk and network are sampled",
                 reason)

    def close(self) -> None:
        """Stop the XID watcher and the workers; a worker stuck in a call is left behind."""
        if self._xid is not None:
            self._xid.stop()
        for worker in [self._worker, *self._stuck.values()]:
            if worker is not None:
                worker.stop()

    async def sample_once(self) -> None:
        """Read everything once and emit the sample."""
        await self.start()
        began = time.perf_counter()
        if self.by_processes:
            await self._select_used_by_the_pod()
        gpu_parts = [self._gpu_parts[d.key] for d in self._devices]
        in_order = [self._host_part, self._disk_part, *gpu_parts]  # the order points go out in
        sweep = _Sweep(self._ready([self._host_part, *gpu_parts, self._disk_part]),
                       iso_ts(time.time()))
        await self._run(sweep)
        answered = [part.name for part in in_order if self._collect(part, sweep)]
        self._gpu_readings = [sweep.results[p.name] for p in gpu_parts if p.name in sweep.results]
        self._forget_lost()
        self._emit(self._points(sweep, answered))
        self._stats.samples += 1
        self._stats.last_sample_s = time.perf_counter() - began

    def _ready(self, parts: list[_Part]) -> list[_Part]:
        """The parts to read now: not those whose thread is still stuck in their last read."""
        ready = []
        for part in parts:
            stuck = self._stuck.get(part.name)
            if stuck is not None and stuck.busy:
                self._stats.skipped_reads += 1
                continue
            self._stuck.pop(part.name, None)
            ready.append(part)
        return ready

    async def _run(self, sweep: _Sweep) -> None:
        """The sweep's reads on the sampler's thread. A read that outlives its timeout is left
        to that thread, said once, and the reads after it go on on a new one."""
        start = 0
        while start < len(sweep.parts):
            worker = self._sweeper()
            runner = sweep.runner = object()
            sweep.current = (start, time.monotonic())
            done = worker.submit(functools.partial(sweep.run, start, runner))
            try:
                hung = await _hung_read(sweep, done)
            except asyncio.CancelledError:  # the thread stops after the read it is in
                sweep.runner = None
                self._stuck[sweep.parts[sweep.current[0]].name] = worker
                self._leave(worker)
                raise
            if hung is None:
                return
            part = sweep.parts[hung]
            self._stuck[part.name] = worker
            self._leave(worker)
            self._stalled.add(part.name)
            log.warning("%s did not answer within %g s: left out of the samples until it does",
                        part.what, part.timeout_s)
            start = hung + 1

    def _collect(self, part: _Part, sweep: _Sweep) -> bool:
        """Whether the part was read; says so when it answers again, or why it failed."""
        read = part.name in sweep.results
        if read and part.name in self._stalled:
            self._stalled.discard(part.name)
            log.info("%s answers again", part.what)
        error = sweep.errors.get(part.name)
        if error is not None:
            log.warning("reading %s failed: %s", part.what, error)
        return read

    def _read_host(self, sweep: _Sweep) -> Readings:
        now_s = time.monotonic()
        out, sweep.trainer_pids = self._host.read(now_s, time.time())
        out.merge(self._ib.read(now_s))
        return out

    def _sweeper(self) -> Worker:
        if self._worker is None:
            self._worker = Worker("sample")
        return self._worker

    def _leave(self, worker: Worker) -> None:
        """Leave `worker` to its stuck read: it ends once that returns; reads go to a new one."""
        worker.stop()
        if self._worker is worker:
            self._worker = None

    def _forget_lost(self) -> None:
        for device in [d for d in self._devices if d.lost]:
            log.warning("%s is lost (%s): no longer sampled", device.describe(), device.lost)
            self._devices.remove(device)
            del self._gpu_parts[device.key]

    def _points(self, sweep: _Sweep, parts: list[str]) -> list[dict[str, Any]]:
        """The parts' gauges, then their counters' rates, in the parts' order."""
        points = []
        for name in parts:
            points += sweep.gauge_points[name]
        rates, ts = self._rates, sweep.ts
        for name in parts:
            readings = sweep.results[name]
            for key in readings.restarted:
                rates.forget(key)
            for key, (value, at_s) in readings.counters.items():
                rate = rates.rate(key, value, at_s)
                if rate is not None and math.isfinite(rate):
                    points.append({"key": f"{key}_per_second", "value": rate, "ts": ts})
        if self._xid is not None:
            sampled = {d.index for d in self._devices}  # another pod's GPU's XIDs are not ours
            xids = [e for e in self._xid.drain() if e.index in sampled]
            self.xids.extend(xids)
            points += [{"key": f"gpu/{e.index}/xid_code", "value": e.xid, "ts": iso_ts(e.at_s)}
                       for e in xids]
        return points

    def _emit(self, points: list[dict[str, Any]]) -> None:
        for start in range(0, len(points), MAX_POINTS_PER_REQUEST):
            self.emit("hardware", {"run_id": self.run_id, "node": self.node,
                                   "points": points[start:start + MAX_POINTS_PER_REQUEST]})


def _gpu_part(device: GpuDevice, timeout_s: float) -> _Part:
    return _Part(device.key, device.describe(), lambda sweep: device.read(sweep.trainer_pids),
                 timeout_s)


class _ReadHung(Exception):
    """A sweep's read `index` outlived its timeout: how the watchdog ends the wait for it."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


async def _hung_read(sweep: _Sweep, done: asyncio.Future[None]) -> int | None:
    """Wait for the sweep to end: None once it has, or the index of the read that outlived
    its timeout. One timer watches, due when the read in progress would time out, or sooner
    when a read after it could (it cannot see one begin): the loop never wakes while a sample
    is merely quick, and a quick sample costs that one timer (asyncio.wait's own futures and
    callbacks, one more wake-up of the loop, cost 25 us a sample)."""
    loop = asyncio.get_running_loop()
    shortest_s = min(part.timeout_s for part in sweep.parts)
    timer: asyncio.TimerHandle

    def watch() -> None:
        nonlocal timer
        if done.done():
            return
        index, began = sweep.current
        left = began + sweep.parts[index].timeout_s - time.monotonic()
        if left <= 0 and sweep.current == (index, began):
            done.set_exception(_ReadHung(index))
        else:
            timer = loop.call_later(min(max(left, 0.0), shortest_s), watch)

    timer = loop.call_later(shortest_s, watch)  # no read can time out sooner
    try:
        await done
    except _ReadHung as hung:
        return hung.index
    finally:
        timer.cancel()
    return None
