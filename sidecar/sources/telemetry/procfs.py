"""The host's counters read straight from Linux's /proc, as psutil reads them, for less.

psutil answered the sampler's host questions with 1.4 ms of CPU a sample: two reads of
/proc/stat, two of /proc/meminfo plus all of /proc/vmstat for swap, an access() per disk line of
/proc/diskstats, four ioctls and a socket per network interface, a namedtuple for everything.
The readers here keep each file open (`ProcFile`: one pread a sample instead of open, read, read,
close, which cost as much again as the read itself) and keep only what the sampler posts, with
psutil's arithmetic: the same fields summed, the same disks counted (whole devices, not
partitions), the same interfaces (running, not loopback), and psutil's "nowrap" correction of
counters that went down (`NoWrap`). Each raises OSError where its file cannot be read (not
Linux, no /proc), so the caller can ask psutil instead; values psutil estimates from several
sources (MemAvailable missing on an old kernel) are left to psutil too (None).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from typing import Any, NamedTuple

PROC = "/proc"
SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own size
_SIOCGIFFLAGS = 0x8913  # linux/sockios.h: an interface's flags, as psutil's net_if_flags reads
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
IFF_LOOPBACK = 0x8  # linux/if.h
IFF_RUNNING = 0x40  # psutil's `isup` is "running" in the flags
_IFREQ = struct.Struct("16sh")  # struct ifreq: the name, then ifr_flags
_IFREQ_ADDR = struct.Struct("16s4x4s16x")  # struct ifreq: the name, a sockaddr_in's address
_CPU_FIELDS = 10  # user nice system idle iowait irq softirq steal guest guest_nice: psutil's
_IDLE, _IOWAIT = 3, 4  # among those fields: the two psutil's idle time is made of here


def psutil_module() -> Any:
    """psutil, imported only where /proc and sysfs cannot answer: a Linux node never loads it
    (its import was a twentieth of the start-up, and a megabyte)."""
    import psutil

    return psutil


def read_file(path: str) -> bytes:
    """A whole /proc or /sys file in as few reads as it takes, without a Python file object."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class ProcFile:
    """A /proc or /sys file kept open and read whole from its start at each `read()`.

    The kernel makes such a file's text anew on a read at offset 0 (seq_file, sysfs), so one
    pread gives what a fresh open would, without the path walk, open and close. The buffer
    grows until a read comes back short of it: then the read holds the whole file. A read that
    fails (the file went: a sysfs device removed, an exited process) closes the file; the next
    read opens the path again, and raises OSError while it is not there.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._size = _FIRST_READ_BYTES

    def read(self) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while len(data := os.pread(self._fd, self._size, 0)) == self._size:
                self._size *= 2
        except OSError:
            self.close()
            raise
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


_FIRST_READ_BYTES = 4096  # a page: what most of these files fit in


class CpuTicks(NamedTuple):
    """Cumulative clock ticks of one CPU line of /proc/stat: busy (all but idle and iowait),
    and total (the fields psutil sums)."""

    busy: int
    total: int


class Stat(NamedTuple):
    """What the sampler takes from /proc/stat: the machine's and each core's ticks, and the
    boot time (`btime`, what psutil.boot_time() reads)."""

    machine: CpuTicks
    cores: list[CpuTicks]
    boot_s: float | None


class CpuStat:
    """The whole machine's and each core's ticks, and the boot time, from one read of
    /proc/stat."""

    def __init__(self, proc: str = PROC) -> None:
        self._file = ProcFile(f"{proc}/stat")

    def read(self) -> Stat:
        data = self._file.read()
        machine: CpuTicks | None = None
        cores = []
        for line in data.split(b"\n"):
            if not line.startswith(b"cpu"):
                break  # the cpu lines come first (fs/proc/stat.c)
            fields = line.split(None, _CPU_FIELDS + 1)
            values = list(map(int, fields[1:_CPU_FIELDS + 1]))
            total = sum(values)
            ticks = CpuTicks(total - values[_IDLE] - values[_IOWAIT], total)
            if fields[0] == b"cpu":
                machine = ticks
            else:
                cores.append(ticks)
        if machine is None:
            raise OSError(errno.ENODATA, f"no cpu line in {self._file.path}")
        at = data.find(b"\nbtime ")
        boot_s = float(data[at + 7:data.index(b"\n", at + 7)]) if at >= 0 else None
        return Stat(machine, cores, boot_s)


class MemInfo:
    """Memory as psutil.virtual_memory() gives it (total, used, available bytes) and swap as
    psutil.swap_memory() does (total, used), from one read of /proc/meminfo. Memory is None
    where psutil would estimate the available memory itself (no MemAvailable, or a kernel
    reporting 0); swap is None without its lines."""

    def __init__(self, proc: str = PROC) -> None:
        self._file = ProcFile(f"{proc}/meminfo")

    def read(self) -> tuple[tuple[int, int, int] | None, tuple[int, int] | None]:
        found = _meminfo_lines(b"\n" + self._file.read())
        return _memory(found), _swap(found)


_MEMINFO_NAMES = (b"MemTotal", b"MemFree", b"MemAvailable", b"SwapTotal", b"SwapFree")


def _meminfo_lines(data: bytes) -> dict[bytes, int]:
    """The /proc/meminfo lines the sampler uses, in bytes; a name absent is left out."""
    found = {}
    for name in _MEMINFO_NAMES:
        at = data.find(b"\n" + name + b":")
        if at >= 0:
            start = at + len(name) + 2
            end = data.find(b"\n", start)
            found[name] = int(data[start:end if end >= 0 else None].split()[0]) * 1024  # kB
    return found


def memory_total(proc: str = PROC) -> int:
    """MemTotal of /proc/meminfo in bytes, psutil's virtual_memory().total; OSError where the
    file cannot be read or lacks the line."""
    total = _meminfo_lines(b"\n" + read_file(f"{proc}/meminfo")).get(b"MemTotal")
    if total is None:
        raise OSError(errno.ENODATA, f"no MemTotal in {proc}/meminfo")
    return total


def _memory(mem: dict[bytes, int]) -> tuple[int, int, int] | None:
    total, available = mem.get(b"MemTotal"), mem.get(b"MemAvailable")
    if total is None or not available or b"MemFree" not in mem:
        return None
    if available > total:  # inside some containers: psutil then takes the free memory
        available = mem[b"MemFree"]
    return total, total - available, available


def _swap(mem: dict[bytes, int]) -> tuple[int, int] | None:
    if b"SwapTotal" not in mem or b"SwapFree" not in mem:
        return None
    return mem[b"SwapTotal"], mem[b"SwapTotal"] - mem[b"SwapFree"]


class NoWrap:
    """psutil's "nowrap" for pairs of counters read per device: a value that went down is taken
    to have wrapped, and what it had reached is added to it from then on, so a device's count
    never decreases; a device that disappears forgets what it carried (psutil's _WrapNumbers,
    which does this field by field, as here)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}
        self._carry: dict[str, tuple[int, int]] = {}

    def adjust(self, current: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        adjusted, carried = {}, {}
        for key, (first, second) in current.items():
            last = self._last.get(key)
            if last is None:  # new (or back after it was gone): as it is
                adjusted[key] = (first, second)
                continue
            carry_first, carry_second = self._carry.get(key, (0, 0))
            if first < last[0]:
                carry_first += last[0]
            if second < last[1]:
                carry_second += last[1]
            if carry_first or carry_second:
                carried[key] = (carry_first, carry_second)
            adjusted[key] = (first + carry_first, second + carry_second)
        self._last, self._carry = current, carried
        return adjusted


class DiskIo:
    """Bytes read and written by all disks since boot, as psutil.disk_io_counters() sums them:
    whole devices (those /sys/block lists, so no partition counts twice), each corrected by
    NoWrap before the sum. Whether a name is a whole device is asked once per name."""

    def __init__(self, proc: str = PROC, sys_block: str = "/sys/block") -> None:
        self._file = ProcFile(f"{proc}/diskstats")
        self._sys_block = sys_block
        self._whole: dict[str, bool] = {}
        self._nowrap = NoWrap()

    def read(self) -> tuple[int, int] | None:
        disks = {}
        for line in self._file.read().decode().splitlines():
            name, read_sectors, written_sectors = _diskstats_line(line.split())
            if self._is_whole(name):
                disks[name] = (read_sectors * SECTOR_BYTES, written_sectors * SECTOR_BYTES)
        if not disks:
            return None
        totals = self._nowrap.adjust(disks).values()
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    def _is_whole(self, name: str) -> bool:
        whole = self._whole.get(name)
        if whole is None:
            path = f"{self._sys_block}/{name.replace('/', '!')}"
            whole = self._whole[name] = os.access(path, os.F_OK)
        return whole


def _diskstats_line(fields: list[str]) -> tuple[str, int, int]:
    """Name, sectors read and sectors written of a /proc/diskstats line, in its three layouts
    (Documentation/admin-guide/iostats.rst) as psutil tells them apart by their length."""
    if len(fields) == 15:  # Linux 2.4
        return fields[3], int(fields[5]), int(fields[9])
    if len(fields) == 14 or len(fields) >= 18:  # a device on 2.6+ (4.18 and 5.5 added fields)
        return fields[2], int(fields[5]), int(fields[9])
    if len(fields) == 7:  # a partition on 2.6
        return fields[2], int(fields[4]), int(fields[6])
    raise ValueError(f"not sure how to interpret /proc/diskstats line {' '.join(fields)!r}")


class NetIo:
    """Bytes received and sent per interface that is running and not loopback, as psutil's
    net_io_counters(pernic=True) and net_if_stats() give them: /proc/net/dev, each interface's
    flags from one ioctl (on a socket kept for them), and NoWrap over every interface, as psutil
    applies it."""

    def __init__(self, proc: str = PROC) -> None:
        self._file = ProcFile(f"{proc}/net/dev")
        self._nowrap = NoWrap()
        self._socket: int | None = None  # its descriptor: closed with the reader

    def read(self) -> dict[str, tuple[int, int]]:
        counters = {}
        for line in self._file.read().decode().splitlines()[2:]:
            name, _, rest = line.rpartition(":")
            fields = rest.split()
            counters[name.strip()] = (int(fields[0]), int(fields[8]))  # bytes received, sent
        adjusted = self._nowrap.adjust(counters)
        if self._socket is None:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM).detach()
        sock = self._socket
        return {name: (rx, tx) for name, (rx, tx) in adjusted.items() if _counted(sock, name)}

    def __del__(self) -> None:
        if self._socket is not None:
            os.close(self._socket)


def _counted(sock: int, name: str) -> bool:
    """Whether psutil's filter (up, not loopback) keeps the interface; a vanished one is not."""
    if name == "lo":
        return False
    try:
        flags = interface_flags(sock, name)
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            return False
        raise
    return bool(flags & IFF_RUNNING) and not flags & IFF_LOOPBACK


def interface_flags(sock: int, name: str) -> int:
    """An interface's flags (SIOCGIFFLAGS on `sock`, an AF_INET datagram socket's descriptor),
    as psutil's net_if_flags reads them; OSError where it has none (ENODEV: it went)."""
    return int(_IFREQ.unpack(fcntl.ioctl(sock, _SIOCGIFFLAGS, _IFREQ.pack(name.encode(), 0)))[1])


def interface_ipv4(sock: int, name: str) -> str | None:
    """An interface's IPv4 address (SIOCGIFADDR: the first, as psutil's net_if_addrs lists it
    first); None where it has none."""
    try:
        answer = fcntl.ioctl(sock, _SIOCGIFADDR, _IFREQ_ADDR.pack(name.encode(), b""))
    except OSError:
        return None
    return socket.inet_ntoa(_IFREQ_ADDR.unpack(answer)[1])
