"""procfs.py against psutil, the reference it stands in for on Linux: the same figures from
the same files, staged where psutil reads them too (psutil.PROCFS_PATH) and on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from psutil._common import _WrapNumbers  # psutil's own nowrap: the oracle for NoWrap

from sidecar.sources.telemetry import procfs
from sidecar.sources.telemetry.collectors.probe import HostProbe, _cpu_times, _psutil_net_io

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc only")

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GIB = 1 << 30


@pytest.fixture
def staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A /proc of the test's own, which psutil reads as well."""
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    (tmp_path / "net").mkdir()
    return tmp_path


def test_cpu_times_and_boot_time_are_psutils(staged: Path) -> None:
    (staged / "stat").write_text(
        "cpu  10132 52 4019 97311 1207 0 311 40 0 0\n"
        "cpu0 5066 26 2010 48655 604 0 155 20 0 0\n"
        "cpu1 5066 26 2009 48656 603 0 156 20 0 0\n"
        "intr 20331 0 9\nctxt 4242\nbtime 1764582000\nprocesses 1234\n")
    stat = procfs.CpuStat(str(staged)).read()
    for ticks, reference in [(stat.machine, psutil.cpu_times()),
                             *zip(stat.cores, psutil.cpu_times(percpu=True), strict=True)]:
        expected = _cpu_times(reference)
        assert ticks.busy / CLOCK_TICKS == pytest.approx(expected.busy, abs=1e-9)
        assert ticks.total / CLOCK_TICKS == pytest.approx(expected.total, abs=1e-9)
    assert len(stat.cores) == 2
    assert stat.boot_s == psutil.boot_time() == 1764582000.0


MEMINFO = """MemTotal:       {total} kB
MemFree:         {free} kB
MemAvailable:   {available} kB
Buffers:          123456 kB
Cached:          2345678 kB
SwapCached:            0 kB
Active:          3456789 kB
Inactive:        1234567 kB
Shmem:             65432 kB
Slab:             543210 kB
SReclaimable:     432100 kB
SwapTotal:       {swap_total} kB
SwapFree:        {swap_free} kB
"""


@pytest.mark.parametrize("available", [12_000_000, 70_000_000])  # above the total: containers
def test_memory_and_swap_are_psutils(staged: Path, available: int) -> None:
    (staged / "meminfo").write_text(MEMINFO.format(
        total=65_000_000, free=8_000_000, available=available, swap_total=4_000_000,
        swap_free=3_500_000))
    (staged / "vmstat").write_text("pswpin 10\npswpout 20\n")
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    assert procfs.MemInfo(str(staged)).read() == ((vm.total, vm.used, vm.available),
                                                  (sw.total, sw.used))


def test_memory_psutil_estimates_is_left_to_psutil(staged: Path) -> None:
    text = MEMINFO.format(total=65_000_000, free=8_000_000, available=0, swap_total=0,
                          swap_free=0)
    (staged / "meminfo").write_text(text)
    meminfo = procfs.MemInfo(str(staged))
    assert meminfo.read()[0] is None  # a kernel reporting 0: psutil estimates it
    (staged / "meminfo").write_text(text.replace("MemAvailable:        0 kB\n", ""))
    assert meminfo.read() == (None, (0, 0))  # before Linux 3.14


def test_disk_io_counts_whole_devices_as_psutil_does(staged: Path) -> None:
    """psutil asks /sys/block which names are whole devices; partitions are not counted."""
    try:
        devices = sorted(os.listdir("/sys/block"))[:3]
    except OSError:
        devices = []
    if not devices:
        pytest.skip("no /sys/block here to tell devices from partitions")
    layouts = [  # 2.6+ (14 fields), 4.18+ (18), 5.5+ (20)
        "{major} {minor} {name} 100 2 {read} 30 40 5 {written} 60 0 70 80",
        "{major} {minor} {name} 100 2 {read} 30 40 5 {written} 60 0 70 80 0 0 0 0",
        "{major} {minor} {name} 100 2 {read} 30 40 5 {written} 60 0 70 80 0 0 0 0 9 9",
    ]
    lines = [layouts[i % 3].format(major=8, minor=16 * i, name=name, read=1000 * (i + 1),
                                   written=7 * (i + 1)) for i, name in enumerate(devices)]
    lines.append(f"8 1 {devices[0]}-part1 40 900 50 7")  # a partition in 2.6's short form
    lines.append(f"8 2 {devices[0]}p2 100 2 500 30 40 5 6 60 0 70 80")
    (staged / "diskstats").write_text("\n".join(lines) + "\n")
    reference = psutil.disk_io_counters(nowrap=False)
    assert reference is not None
    assert procfs.DiskIo(str(staged)).read() == (reference.read_bytes, reference.write_bytes)
    (staged / "diskstats").write_text("8 0 sda 1 2 3\n")
    with pytest.raises(ValueError, match="not sure how to interpret"):  # as psutil raises
        procfs.DiskIo(str(staged)).read()


def test_network_interfaces_are_psutils(staged: Path) -> None:
    """Running, not loopback, and an interface gone before its flags were read left out."""
    real = Path("/proc/net/dev").read_text().splitlines()
    gone = "vanished0: 5 1 0 0 0 0 0 0 7 1 0 0 0 0 0 0"
    (staged / "net" / "dev").write_text("\n".join([*real, gone]) + "\n")
    assert procfs.NetIo(str(staged)).read() == _psutil_net_io()


def test_a_kept_open_net_dev_follows_interfaces_coming_and_going(staged: Path) -> None:
    """NetIo keeps /proc/net/dev open: each read is the file as it is now, whole, however
    much it grew (a hundred interfaces appeared ahead of the real ones) or shrank."""
    lines = Path("/proc/net/dev").read_text().splitlines()
    header, real = lines[:2], lines[2:]
    net_dev = staged / "net" / "dev"
    netio = procfs.NetIo(str(staged))
    many = [f"veth{i}: {i} 1 0 0 0 0 0 0 {i} 1 0 0 0 0 0 0" for i in range(100)]
    for lines in ([*header, *real], [*header, *many, *real], header, [*header, *real]):
        net_dev.write_text("\n".join(lines) + "\n")
        assert netio.read() == _psutil_net_io()
    assert len("\n".join(many)) > 4096  # more than a first read of a page takes


def test_a_kept_open_proc_file_is_made_anew_at_each_read() -> None:
    """Linux writes a /proc file's text again for a read from its start: a kept-open
    /proc/loadavg shows the newest pid moving on once a process was created."""
    loadavg = procfs.ProcFile("/proc/loadavg")
    newest = int(loadavg.read().split()[-1])
    with subprocess.Popen(["true"]) as created:
        created.wait()
    assert int(loadavg.read().split()[-1]) != newest
    loadavg.close()


def test_nowrap_is_psutils() -> None:
    """A counter that went down carries what it had reached; a device that went forgets."""
    readings = [
        {"a": (100, 50), "b": (10, 10)},
        {"a": (120, 60), "b": (20, 5)},  # b's second counter wrapped
        {"a": (5, 70), "b": (30, 8)},  # a's first wrapped, b's second goes on from its carry
        {"a": (7, 2)},  # b went: it forgets its carry
        {"a": (9, 3), "b": (1, 1)},  # b came back: as it is
        {"a": (1, 1), "b": (2, 0), "c": (4, 4)},
    ]
    ours, psutils = procfs.NoWrap(), _WrapNumbers()
    for reading in readings:
        assert ours.adjust(dict(reading)) == psutils.run(dict(reading), "counters")


def test_the_host_probe_reads_this_machine_as_psutil_does() -> None:
    probe = HostProbe()
    total, used, available = probe.memory()
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert used == pytest.approx(vm.used, abs=GIB // 4)  # the machine moves between the reads
    assert available == pytest.approx(vm.available, abs=GIB // 4)
    assert probe.swap()[0] == psutil.swap_memory().total
    machine, cores = probe.cpu_times()
    assert machine.total == pytest.approx(_cpu_times(psutil.cpu_times()).total, rel=1e-3)
    assert len(cores) == len(psutil.cpu_times(percpu=True))
    assert probe.net_io().keys() == _psutil_net_io().keys()
    disk, reference = probe.disk_io(), psutil.disk_io_counters()
    assert (disk is None) == (reference is None)
    if disk is not None and reference is not None:
        assert disk[0] == pytest.approx(reference.read_bytes, abs=64 << 20)


def test_disk_usage_and_load_average_are_psutils() -> None:
    probe = HostProbe()
    total, used, free = probe.disk_usage("/")
    reference = psutil.disk_usage("/")
    assert total == reference.total
    assert used == pytest.approx(reference.used, abs=64 << 20)  # the disk moves between reads
    assert free == pytest.approx(reference.free, abs=64 << 20)
    assert probe.load_average() == pytest.approx(psutil.getloadavg(), abs=0.5)


SAMPLE_THE_HOST = """
import os, sys
from sidecar.sources.telemetry.collectors.probe import HostProbe
probe = HostProbe()
probe.cpu_times(); probe.load_average(); probe.memory(); probe.swap(); probe.disk_io()
probe.net_io(); probe.disk_usage("/"); probe.process_tree(os.getpid())
print("psutil" in sys.modules)
"""


def test_a_host_with_proc_never_loads_psutil() -> None:
    """psutil answers only where /proc cannot: its import was a twentieth of the start-up and
    a megabyte of a daemon that reads /proc anyway."""
    done = subprocess.run([sys.executable, "-c", SAMPLE_THE_HOST], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
