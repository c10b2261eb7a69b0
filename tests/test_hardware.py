"""The /hardware sampler: NVML through the real bindings and a stand-in library, psutil and
InfiniBand counters through seams, the schedule, and (once wired) two nodes end to end."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import json
import logging
import math
import os
import struct
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from sidecar.log import log
from sidecar.sources.telemetry.collectors.host import HostCollector
from sidecar.sources.telemetry.collectors.infiniband import InfinibandCollector
from sidecar.sources.telemetry.collectors.probe import CpuTimes, HostProbe
from sidecar.sources.telemetry.collectors.processes import ParentTable, ProcessReading
from sidecar.sources.telemetry.gpus import choose_gpus, gpu_filter_from_env
from sidecar.sources.telemetry.nvml.fields import field_value
from sidecar.sources.telemetry.readings import Rates, counter_rate
from sidecar.sources.telemetry.sampler import HardwareSampler
from tests.conftest import RUN_ID, Sidecar, clean_environ, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest, wait_until
from tests.nvml_stub.build import BuildError, build, gcc

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
UUID = "GPU-00000000-0000-0000-0000-0000000000{:02d}"

# ---- the stand-in NVML ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libnvidia-ml.so.1, compiled once per session."""
    if gcc() is None:
        pytest.skip("gcc is not installed: the stand-in libnvidia-ml.so.1 cannot be built")
    try:
        return build(tmp_path_factory.mktemp("nvml-stub"))
    except BuildError as exc:
        pytest.fail(str(exc))


def drive(stub_dir: Path | None, tmp_path: Path, script: dict[str, Any],
          **config: Any) -> tuple[dict[str, Any], str]:
    """Run the sampler in its own process with the stand-in first on the loader path (or no
    NVML at all when stub_dir is None); returns its JSON result and its stderr."""
    script_path = tmp_path / "nvml-script.txt"
    script_path.write_text("".join(f"{k} {v}\n" for k, v in script.items()))
    config_path = tmp_path / "drive.json"
    config_path.write_text(json.dumps(config))
    empty = tmp_path / "no-nvml"
    empty.mkdir(exist_ok=True)
    env = dict(os.environ, NVML_STUB_SCRIPT=str(script_path),
               LD_LIBRARY_PATH=str(stub_dir or empty))
    done = subprocess.run([sys.executable, "-m", "tests.nvml_stub.drive", str(config_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def values(payload: dict[str, Any]) -> dict[str, float]:
    return {p["key"]: p["value"] for p in payload["points"]}


def gpu_keys(payload: dict[str, Any]) -> set[str]:
    return {k for k in values(payload) if k.startswith("gpu/")}


TWO_GPUS = {
    "count": 2, "driver": "550.54.15", "cuda": 12040,
    "0.util_gpu": 87, "0.util_mem": 40, "0.mem_used": 30 * GIB, "0.mem_reserved": GIB // 2,
    "0.temp": 61, "0.power_mw": 312500, "0.power_limit_mw": 700000,
    "0.energy_mj": 5_000_000, "0.energy_step_mj": 1000, "0.clock_sm": 1980, "0.clock_mem": 2619,
    "0.pcie_tx_kb": 100, "0.pcie_rx_kb": 200,
    "0.nvlink_links": 4, "0.nvlink_step_kib": 100, "0.nvlink_step_us": 1_000_000,
    "0.clock_events": 0x44, "0.ecc_corr": 3, "0.ecc_uncorr": 1, "0.remap_corr": 2,
    "0.remap_pending": 1, "0.procs": "0:1048576,1:4096", "0.gpm": 1, "0.mig": 2, "0.xid": 79,
    "1.util_gpu": 12, "1.power_mw": 71000,
}


def test_gpu_values_and_units(stub_dir: Path, tmp_path: Path) -> None:
    result, stderr = drive(stub_dir, tmp_path, TWO_GPUS, samples=4, trainer=True)
    payloads = result["payloads"]
    assert all(p["run_id"] == "run-1" and p["node"] == "node-a" for p in payloads)
    assert all(datetime.fromisoformat(p["ts"]).utcoffset() is not None
               for payload in payloads for p in payload["points"])
    last = values(payloads[-1])
    expected = {
        "gpu/0/utilization_percent": 87, "gpu/0/memory_utilization_percent": 40,
        "gpu/0/memory_used_bytes": 30 * GIB, "gpu/0/memory_total_bytes": 80 * GIB,
        "gpu/0/memory_reserved_bytes": GIB // 2, "gpu/0/temperature_celsius": 61,
        "gpu/0/power_watts": 312.5, "gpu/0/power_limit_watts": 700.0,
        "gpu/0/energy_joules": 5003.0,  # 5,000,000 mJ and 1,000 mJ more per read: 4th read
        "gpu/0/sm_clock_hertz": 1.98e9, "gpu/0/memory_clock_hertz": 2.619e9,
        "gpu/0/pcie_tx_bytes_per_second": 100 * 1024, "gpu/0/pcie_rx_bytes_per_second": 204800,
        # 4 links, each +100 KiB (tx) and +200 KiB (rx) per read, NVML stamps 1 s apart
        "gpu/0/nvlink_tx_bytes_per_second": 4 * 100 * 1024,
        "gpu/0/nvlink_rx_bytes_per_second": 4 * 200 * 1024,
        "gpu/0/clock_event/sw_power_cap_flag": 1, "gpu/0/clock_event/hw_thermal_slowdown_flag": 1,
        "gpu/0/clock_event/gpu_idle_flag": 0, "gpu/0/clock_event/hw_slowdown_flag": 0,
        "gpu/0/ecc_corrected_count": 3, "gpu/0/ecc_uncorrected_count": 1,
        "gpu/0/remapped_rows_correctable_count": 2, "gpu/0/row_remap_pending_flag": 1,
        "gpu/0/row_remap_failure_flag": 0,
        "gpu/0/trainer_memory_used_bytes": 1048576,  # this process; pid 1 is not the trainer's
        "gpu/0/mig/0/memory_used_bytes": 1 << 20, "gpu/0/mig/1/memory_used_bytes": 2 << 20,
        "gpu/0/mig/1/memory_total_bytes": 40 * GIB,
        "gpu/0/sm_active_percent": 3.0, "gpu/0/sm_occupancy_percent": 4.5,  # metric id * 1.5
        "gpu/0/tensor_active_percent": 7.5, "gpu/0/dram_bandwidth_percent": 15.0,
        "gpu/1/utilization_percent": 12, "gpu/1/power_watts": 71.0,
    }
    assert {k: last.get(k) for k in expected} == expected
    first = values(payloads[0])
    assert "gpu/0/nvlink_tx_bytes_per_second" not in first  # the first sample gives no rate
    assert "gpu/0/sm_active_percent" not in first  # nor an interval average
    assert "gpu/1/nvlink_tx_bytes_per_second" not in last  # no NVLink: absent, not zero
    assert "gpu/1/mig/0/memory_used_bytes" not in last
    xids = [p for payload in payloads for p in payload["points"] if p["key"].endswith("/xid_code")]
    assert [(p["key"], p["value"]) for p in xids] == [("gpu/0/xid_code", 79)]
    assert "GPU 0 (GPU-00000000-0000-0000-0000-000000000000) reported XID 79" in stderr
    assert {"cpu/load_average_1m", "memory/used_bytes"} <= set(last)  # the host is there too


# Every key a sample with TWO_GPUS has, as the sampler posted them before its reads were
# rewritten for speed (issue 17): the same keys, and the same values above.
GPU_KEYS_PER_GPU = {
    "clock_event/applications_clocks_setting_flag", "clock_event/display_clock_setting_flag",
    "clock_event/gpu_idle_flag", "clock_event/hw_power_brake_slowdown_flag",
    "clock_event/hw_slowdown_flag", "clock_event/hw_thermal_slowdown_flag",
    "clock_event/sw_power_cap_flag", "clock_event/sw_thermal_slowdown_flag",
    "clock_event/sync_boost_flag", "ecc_corrected_count", "ecc_uncorrected_count",
    "energy_joules", "memory_clock_hertz", "memory_reserved_bytes", "memory_total_bytes",
    "memory_used_bytes", "memory_utilization_percent", "pcie_rx_bytes_per_second",
    "pcie_tx_bytes_per_second", "power_limit_watts", "power_watts",
    "remapped_rows_correctable_count", "remapped_rows_uncorrectable_count",
    "row_remap_failure_flag", "row_remap_pending_flag", "sm_clock_hertz",
    "temperature_celsius", "trainer_memory_used_bytes", "utilization_percent",
}
GPU_0_ONLY = {  # NVLink, MIG and GPM are scripted on GPU 0 alone
    "dram_bandwidth_percent", "mig/0/memory_total_bytes", "mig/0/memory_used_bytes",
    "mig/1/memory_total_bytes", "mig/1/memory_used_bytes", "nvlink_rx_bytes_per_second",
    "nvlink_tx_bytes_per_second", "sm_active_percent", "sm_occupancy_percent",
    "tensor_active_percent",
}
HOST_KEYS = {
    "cpu/busiest_core_utilization_percent", "cpu/load_average_15m", "cpu/load_average_1m",
    "cpu/load_average_5m", "cpu/utilization_percent", "disk/read_bytes_per_second",
    "disk/write_bytes_per_second", "memory/available_bytes", "memory/total_bytes",
    "memory/used_bytes", "swap/total_bytes", "swap/used_bytes", "trainer/cpu_percent",
    "trainer/open_files_count", "trainer/processes_count", "trainer/rss_bytes",
    "trainer/threads_count",
}


def test_a_sample_has_every_key_it_had(stub_dir: Path, tmp_path: Path) -> None:
    result, _ = drive(stub_dir, tmp_path, TWO_GPUS, samples=3, trainer=True)
    keys = set(values(result["payloads"][-1]))
    expected_gpus = ({f"gpu/0/{k}" for k in GPU_KEYS_PER_GPU | GPU_0_ONLY}
                     | {f"gpu/1/{k}" for k in GPU_KEYS_PER_GPU})
    assert gpu_keys(result["payloads"][-1]) == expected_gpus
    assert keys >= HOST_KEYS
    others = keys - expected_gpus - HOST_KEYS
    assert others and all(k.split("/")[0] in {"net", "fs"} for k in others), others
    assert all(k.endswith(("_bytes", "_bytes_per_second")) for k in others)


def test_one_thread_reads_a_whole_sample(stub_dir: Path, tmp_path: Path) -> None:
    """The host, disk usage and every GPU in one hand-off to one thread, not one thread each."""
    script = {"count": 4, **{f"{i}.util_gpu": 10 + i for i in range(4)}}
    result, _ = drive(stub_dir, tmp_path, script, samples=3)
    assert all(len({k.split("/")[1] for k in gpu_keys(p)}) == 4 for p in result["payloads"])
    assert [t for t in result["threads"] if t.startswith("sample")] == ["sample"]


def test_a_hung_gpu_leaves_out_itself_alone(stub_dir: Path, tmp_path: Path) -> None:
    """The reads after a hung one in the same sample go on on another thread."""
    script = {"count": 3, "0.hang.nvmlDeviceGetPowerUsage": 1500,
              **{f"{i}.util_gpu": 10 + i for i in range(3)}}
    result, stderr = drive(stub_dir, tmp_path, script, samples=6, interval_s=0.1,
                           nvml_timeout_s=0.3)
    first = values(result["payloads"][0])
    assert "gpu/0/utilization_percent" not in first
    assert (first["gpu/1/utilization_percent"], first["gpu/2/utilization_percent"]) == (11, 12)
    assert any(k.startswith("fs/") for k in first) and "memory/used_bytes" in first
    assert stderr.count("GPU 0 (GPU-00000000-0000-0000-0000-000000000000) did not answer") == 1
    assert all(values(p)["gpu/2/utilization_percent"] == 12 for p in result["payloads"])


def test_what_never_changes_is_asked_once(stub_dir: Path, tmp_path: Path) -> None:
    """NVLink's link count, MIG's instances and GPM's support at the first sample alone; the
    process list in one call a sample, its array grown once when NVML says it is short."""
    procs = ",".join(f"{pid}:{1 << 20}" for pid in range(1, 8))  # 7, more than first room
    script = {**TWO_GPUS, "0.procs": f"0:{3 << 20},{procs}"}
    functions = ["nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount",
                 "nvmlGpmQueryDeviceSupport", "nvmlDeviceGetFieldValues",
                 "nvmlDeviceGetComputeRunningProcesses_v3"]
    result, _ = drive(stub_dir, tmp_path, script, samples=5, trainer=True,
                      calls=[[0, name] for name in functions])
    assert result["calls"] == {
        "0:nvmlDeviceGetMigMode": 1, "0:nvmlDeviceGetMaxMigDeviceCount": 1,
        "0:nvmlGpmQueryDeviceSupport": 1,
        "0:nvmlDeviceGetFieldValues": 1 + 5,  # the link count, then the counters each sample
        "0:nvmlDeviceGetComputeRunningProcesses_v3": 5 + 1,  # the first sample's retry
    }
    assert all(values(p)["gpu/0/trainer_memory_used_bytes"] == 3 << 20
               for p in result["payloads"])


def test_only_the_jobs_gpus(stub_dir: Path, tmp_path: Path) -> None:
    script = {"count": 4, **{f"{i}.util_gpu": 10 + i for i in range(4)}}
    child_env = {"CUDA_VISIBLE_DEVICES": f"1,{UUID.format(3)}"}
    calls = [[i, "nvmlDeviceGetUtilizationRates"] for i in range(4)]
    result, _ = drive(stub_dir, tmp_path, script, samples=2, child_env=child_env, calls=calls)
    for payload in result["payloads"]:
        assert {k.split("/")[1] for k in gpu_keys(payload)} == {"1", "3"}
        assert values(payload)["gpu/3/utilization_percent"] == 13
    assert result["calls"] == {"0:nvmlDeviceGetUtilizationRates": 0,
                               "1:nvmlDeviceGetUtilizationRates": 2,
                               "2:nvmlDeviceGetUtilizationRates": 0,
                               "3:nvmlDeviceGetUtilizationRates": 2}
    assert result["stats"]["gpu_status"] == "2 of 4 GPUs"


def test_unsupported_query_is_turned_off_for_that_gpu_alone(stub_dir: Path,
                                                            tmp_path: Path) -> None:
    script = {"count": 2, "0.fail.nvmlDeviceGetPowerUsage": 3,  # NVML_ERROR_NOT_SUPPORTED
              "0.power_limit_mw": 400000, "1.power_mw": 90000}
    calls = [[0, "nvmlDeviceGetPowerUsage"], [0, "nvmlDeviceGetEnforcedPowerLimit"]]
    result, _ = drive(stub_dir, tmp_path, script, samples=4, calls=calls)
    for payload in result["payloads"]:
        got = values(payload)
        assert "gpu/0/power_watts" not in got
        assert got["gpu/0/power_limit_watts"] == 400.0
        assert got["gpu/1/power_watts"] == 90.0
    assert result["calls"] == {"0:nvmlDeviceGetPowerUsage": 1,  # asked once, never again
                               "0:nvmlDeviceGetEnforcedPowerLimit": 4}
    assert "power" in result["stats"]["disabled"]["gpu/0"]
    assert "power" not in result["stats"]["disabled"].get("gpu/1", {})


def test_lost_gpu_is_dropped_and_the_others_go_on(stub_dir: Path, tmp_path: Path) -> None:
    script = {"count": 2, "1.lost_after": 2, "0.util_gpu": 50, "1.util_gpu": 60}
    calls = [[1, "nvmlDeviceGetUtilizationRates"], [1, "nvmlDeviceGetTemperature"]]
    result, stderr = drive(stub_dir, tmp_path, script, samples=5, calls=calls)
    seen = [values(p).get("gpu/1/utilization_percent") for p in result["payloads"]]
    assert seen == [60, 60, None, None, None]
    assert all(values(p)["gpu/0/utilization_percent"] == 50 for p in result["payloads"])
    # the third read met GPU_IS_LOST at its first call and went no further; none since
    assert result["calls"] == {"1:nvmlDeviceGetUtilizationRates": 3,
                               "1:nvmlDeviceGetTemperature": 2}
    assert stderr.count("no longer sampled") == 1
    assert result["stats"]["gpus"] == 1


def test_an_older_driver_gets_the_older_calls(stub_dir: Path, tmp_path: Path) -> None:
    script = {"count": 1, "0.clock_events": 0x4, "0.mem_used": 3 * GIB, "0.mem_reserved": GIB,
              "0.fail.nvmlDeviceGetCurrentClocksEventReasons": 13,  # FUNCTION_NOT_FOUND
              "0.fail.nvmlDeviceGetMemoryInfo_v2": 13}
    calls = [[0, "nvmlDeviceGetCurrentClocksEventReasons"], [0, "nvmlDeviceGetMemoryInfo_v2"]]
    result, _ = drive(stub_dir, tmp_path, script, samples=3, calls=calls)
    last = values(result["payloads"][-1])
    assert last["gpu/0/clock_event/sw_power_cap_flag"] == 1  # through ThrottleReasons
    assert last["gpu/0/memory_used_bytes"] == 4 * GIB  # v1: the reserved share counts as used
    assert "gpu/0/memory_reserved_bytes" not in last
    assert result["calls"] == {"0:nvmlDeviceGetCurrentClocksEventReasons": 1,  # not retried
                               "0:nvmlDeviceGetMemoryInfo_v2": 1}
    assert not {"clock_events", "memory"} & set(result["stats"]["disabled"]["gpu/0"])


def test_hung_call_never_freezes_the_loop(stub_dir: Path, tmp_path: Path) -> None:
    script = {"count": 2, "1.hang.nvmlDeviceGetPowerUsage": 1500, "0.util_gpu": 50,
              "1.power_mw": 80000}
    result, stderr = drive(stub_dir, tmp_path, script, samples=18, interval_s=0.1,
                           nvml_timeout_s=0.3)
    payloads = result["payloads"]
    assert "gpu/0/utilization_percent" in values(payloads[0])
    assert not gpu_keys(payloads[0]) & {"gpu/1/power_watts", "gpu/1/utilization_percent"}
    hung = [i for i, p in enumerate(payloads) if "gpu/1/power_watts" not in values(p)]
    assert hung[0] == 0 and len(hung) < len(payloads), "GPU 1 never came back"
    assert values(payloads[-1])["gpu/1/power_watts"] == 80.0
    assert all("gpu/0/utilization_percent" in values(p) for p in payloads)
    assert result["stats"]["skipped_reads"] > 0  # the stuck worker was not given more work
    assert result["max_tick_gap_s"] < 0.2, "the event loop stalled while NVML hung"
    assert "GPU 1 (GPU-00000000-0000-0000-0000-000000000001) did not answer within 0.3 s" in stderr
    assert "answers again" in stderr


def test_driver_not_loaded_samples_the_rest(stub_dir: Path, tmp_path: Path) -> None:
    result, stderr = drive(stub_dir, tmp_path, {"init_error": 9}, samples=2)
    assert stderr.count("no GPU telemetry on this node: the NVIDIA driver is not loaded") == 1
    for payload in result["payloads"]:
        assert not gpu_keys(payload)
        assert "memory/used_bytes" in values(payload)


def test_no_nvml_library_samples_the_rest(tmp_path: Path) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed here: 'no library' cannot be staged")
    result, stderr = drive(None, tmp_path, {}, samples=2)
    assert stderr.count("no GPU telemetry on this node: the NVIDIA driver library "
                        "libnvidia-ml.so.1 is not installed") == 1
    assert "memory/used_bytes" in values(result["payloads"][-1])
    assert not gpu_keys(result["payloads"][-1])


def test_environment_snapshot_has_the_driver_and_gpus_from_nvml(stub_dir: Path,
                                                                tmp_path: Path) -> None:
    script = {"count": 2, "driver": "535.161.08", "cuda": 12020, "1.name": "NVIDIA H100 80GB HBM3",
              "1.mem_total": 80 * GIB}
    result, _ = drive(stub_dir, tmp_path, script, samples=1, environment=True)
    snapshot = result["environment"]
    assert snapshot["nvidia"] == {"driver_version": "535.161.08", "cuda_driver_version": "12.2"}
    assert snapshot["gpus"][1] == {
        "index": 1, "name": "NVIDIA H100 80GB HBM3", "uuid": UUID.format(1),
        "memory_total_bytes": 80 * GIB, "compute_capability": "9.0"}


def test_a_field_value_reads_as_its_type_says() -> None:
    """nvmlValue_t's 8 bytes, read once as unsigned, then as nvmlValueType_t says."""
    def raw(fmt: str, value: float) -> int:
        return int(struct.unpack("=Q", struct.pack(fmt, value).ljust(8, b"\xff"))[0])

    cases = [(0, "=d", 2.5), (1, "=I", 4_000_000_000), (2, "=Q", 2**50 + 5),
             (3, "=Q", 12), (4, "=q", -3), (5, "=i", -2), (6, "=H", 65_000)]
    assert [field_value(kind, raw(fmt, value)) for kind, fmt, value in cases] == [
        value for _, _, value in cases]


@pytest.mark.parametrize(("env", "selected", "rejected"), [
    ({}, None, None),
    ({"CUDA_VISIBLE_DEVICES": "0,2"}, [(0, "GPU-a"), (2, "GPU-c")], [(1, "GPU-b")]),
    ({"CUDA_VISIBLE_DEVICES": "GPU-bb"}, [(5, "GPU-bbbb-1")], [(0, "GPU-aaaa")]),
    ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, [(1, "GPU-x")], [(2, "GPU-y")]),  # CUDA stops at -1
    ({"CUDA_VISIBLE_DEVICES": ""}, [], [(0, "GPU-a")]),
    ({"CUDA_VISIBLE_DEVICES": "all", "NVIDIA_VISIBLE_DEVICES": "none"}, None, None),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, None, None),
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, [], [(0, "GPU-a")]),
    ({"NVIDIA_VISIBLE_DEVICES": ""}, [], [(0, "GPU-a")]),
    ({"NVIDIA_VISIBLE_DEVICES": "2,3"}, None, None),  # the runtime renumbered: every GPU seen
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-cc,GPU-dd"}, [(7, "GPU-cc")], [(0, "GPU-aa")]),
])
def test_gpu_filter_from_env(env: dict[str, str], selected: list[tuple[int, str]] | None,
                             rejected: list[tuple[int, str]] | None) -> None:
    gpu_filter = gpu_filter_from_env(env)
    if selected is None:
        assert gpu_filter is None
        return
    assert gpu_filter is not None
    assert all(gpu_filter.selects(i, u) for i, u in selected)
    assert not any(gpu_filter.selects(i, u) for i, u in rejected or [])


def test_mig_uuid_selects_its_instance_only() -> None:
    gpu_filter = gpu_filter_from_env({"CUDA_VISIBLE_DEVICES": "MIG-abc"})
    assert gpu_filter is not None and gpu_filter.names_mig
    assert not gpu_filter.selects(0, "GPU-x")
    assert gpu_filter.selects_mig("MIG-abcdef") and not gpu_filter.selects_mig("MIG-zzz")


# ---- counters and rates ---------------------------------------------------------------------


def test_counter_rates_never_negative_or_spiking() -> None:
    rates = Rates()
    readings = [(1000, 0.0), (3000, 1.0), (500, 2.0), (1500, 3.0), (1500, 3.0), (2000, 4.0)]
    got = [rates.rate("k", value, at) for value, at in readings]
    assert got == [None, 2000.0, None, 1000.0, None, 500.0]
    assert counter_rate((5.0, 1.0), (6.0, 1.0)) is None  # no time passed: no rate


def write_ib_port(root: Path, words_tx: int, words_rx: int, **errors: int) -> None:
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    (port / "hw_counters").mkdir(exist_ok=True)
    counters = {"port_xmit_data": words_tx, "port_rcv_data": words_rx,
                "port_xmit_packets": words_tx // 100, "port_rcv_packets": words_rx // 100,
                "symbol_error": errors.get("symbol_error", 0),
                "link_downed": errors.get("link_downed", 0)}
    for name, value in counters.items():
        (port / "counters" / name).write_text(f"{value}\n")
    (port / "hw_counters" / "out_of_sequence").write_text(f"{errors.get('oos', 0)}\n")


def ib_rates(collector: InfinibandCollector, rates: Rates, at: float) -> dict[str, float | None]:
    out = collector.read(at)
    got: dict[str, float | None] = {k: rates.rate(k, v, t) for k, (v, t) in out.counters.items()}
    got.update(out.gauges)
    return got


def test_infiniband_words_become_bytes_and_a_reset_gives_no_rate(tmp_path: Path) -> None:
    collector, rates = InfinibandCollector(tmp_path), Rates()
    write_ib_port(tmp_path, 1_000_000, 2_000_000)
    first = ib_rates(collector, rates, 10.0)
    assert first["ib/mlx5_0/1/tx_bytes"] is None  # the first reading gives no rate
    write_ib_port(tmp_path, 1_250_000, 2_500_000, symbol_error=2, oos=7)
    second = ib_rates(collector, rates, 12.0)
    assert second["ib/mlx5_0/1/tx_bytes"] == 250_000 * 4 / 2.0  # 4-byte words, over 2 s
    assert second["ib/mlx5_0/1/rx_bytes"] == 500_000 * 4 / 2.0
    assert second["ib/mlx5_0/1/tx_packets"] == 2500 / 2.0
    assert second["ib/mlx5_0/1/symbol_error_count"] == 2
    assert second["ib/mlx5_0/1/out_of_sequence_count"] == 7
    write_ib_port(tmp_path, 100, 200)  # the counters were reset (perfquery -x -r, a reboot)
    assert ib_rates(collector, rates, 14.0)["ib/mlx5_0/1/tx_bytes"] is None
    write_ib_port(tmp_path, 1100, 1200)
    assert ib_rates(collector, rates, 15.0)["ib/mlx5_0/1/tx_bytes"] == 4000.0


@pytest.fixture
def sidecar_logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The sidecar's own messages at INFO and above, whatever set up its logger before."""
    monkeypatch.setattr(log, "propagate", True)
    caplog.set_level(logging.INFO, logger="sidecar")
    return caplog


def test_saturated_infiniband_counter_is_left_out(tmp_path: Path, sidecar_logs: Any) -> None:
    collector = InfinibandCollector(tmp_path)
    write_ib_port(tmp_path, 2**32 - 1, 5)
    for at in (1.0, 2.0):
        out = collector.read(at)
        assert "ib/mlx5_0/1/tx_bytes" not in out.counters
        assert "ib/mlx5_0/1/rx_bytes" in out.counters
    assert sum("saturates" in r.getMessage() for r in sidecar_logs.records) == 1


class ScriptedProbe(HostProbe):
    """Host counters a test scripts sample by sample; everything else is fixed."""

    def __init__(self, net: list[tuple[int, int]], disk: list[tuple[int, int]],
                 cpu: list[tuple[float, float]] | None = None) -> None:
        self.net, self.disk = list(net), list(disk)
        self.cpu = list(cpu or [(0.0, 0.0)] * len(net))
        self.tree: list[list[ProcessReading]] = []
        self.block_disk_usage: threading.Event | None = None

    def cpu_times(self) -> tuple[CpuTimes, list[CpuTimes]]:
        busy, total = self.cpu.pop(0) if len(self.cpu) > 1 else self.cpu[0]
        return CpuTimes(busy, total), [CpuTimes(busy, total), CpuTimes(busy / 2, total)]

    def load_average(self) -> tuple[float, float, float]:
        return (1.5, math.nan, 0.5)

    def memory(self) -> tuple[int, int, int]:
        return (64 * GIB, 20 * GIB, 40 * GIB)

    def swap(self) -> tuple[int, int]:
        return (0, 0)

    def disk_io(self) -> tuple[int, int] | None:
        return self.disk.pop(0) if len(self.disk) > 1 else self.disk[0]

    def net_io(self) -> dict[str, tuple[int, int]]:
        return {"eth0": self.net.pop(0) if len(self.net) > 1 else self.net[0]}

    def disk_usage(self, path: str) -> tuple[int, int, int]:
        if self.block_disk_usage is not None:
            self.block_disk_usage.wait()
        return (100 * GIB, 30 * GIB, 70 * GIB)

    def process_tree(self, pid: int) -> list[ProcessReading] | None:
        return self.tree.pop(0) if self.tree else None


def test_host_counter_resets_give_no_rate() -> None:
    probe = ScriptedProbe(net=[(1000, 10), (5000, 20), (100, 5), (1100, 1005)],
                          disk=[(0, 0), (4096, 8192), (0, 0), (1024, 0)],
                          cpu=[(10.0, 100.0), (60.0, 200.0), (50.0, 150.0), (80.0, 250.0)])
    host, rates = HostCollector(probe, None), Rates()
    seen = []
    for at in (0.0, 1.0, 2.0, 3.0):
        out, _pids = host.read(at, 1e9 + at)
        row: dict[str, float | None] = {k: rates.rate(k, v, t) for k, (v, t) in
                                         out.counters.items()}
        row["cpu"] = out.gauges.get("cpu/utilization_percent")
        seen.append(row)
    assert [r["net/eth0/rx_bytes"] for r in seen] == [None, 4000.0, None, 1000.0]
    assert [r["net/eth0/tx_bytes"] for r in seen] == [None, 10.0, None, 1000.0]
    assert [r["disk/read_bytes"] for r in seen] == [None, 4096.0, None, 1024.0]
    assert [r["cpu"] for r in seen] == [None, 50.0, None, 30.0]  # CPU times went backwards


def test_trainer_tree_cpu_counts_new_processes_and_never_goes_negative() -> None:
    probe = ScriptedProbe(net=[(0, 0)], disk=[(0, 0)])
    wall = 1_000_000.0
    parent = ProcessReading(10, wall - 100, 50.0, 1000, 4, 7)
    probe.tree = [
        [parent, ProcessReading(11, wall - 50, 30.0, 500, 2, 3)],
        # child 11 exited (its 30 s gone), 12 started since: 0.5 s of its own; parent +1 s
        [ProcessReading(10, wall - 100, 51.0, 1000, 4, 7),
         ProcessReading(12, wall + 0.5, 0.5, 200, 1, None)],
    ]
    host = HostCollector(probe, lambda: 10)
    first, pids = host.read(0.0, wall)
    assert pids == frozenset({10, 11})
    assert "trainer/cpu_percent" not in first.gauges
    assert first.gauges["trainer/rss_bytes"] == 1500
    assert first.gauges["trainer/open_files_count"] == 10
    second, _ = host.read(2.0, wall + 2)
    assert second.gauges["trainer/cpu_percent"] == pytest.approx(100 * 1.5 / 2)
    assert second.gauges["trainer/threads_count"] == 5
    assert "trainer/open_files_count" not in second.gauges  # one process's count unknown
    third, pids = host.read(4.0, wall + 4)  # the trainer is gone
    assert pids is None and not any(k.startswith("trainer/") for k in third.gauges)


def kept_stat_files() -> set[int]:
    """The pids whose /proc/PID/stat this process has open."""
    pids = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            parts = os.readlink(f"/proc/self/fd/{fd}").split("/")
            if len(parts) == 4 and parts[1] == "proc" and parts[3] == "stat":
                pids.add(int(parts[2]))
    return pids


def test_the_trainer_tree_is_found_as_psutil_finds_it_and_follows_exits_and_orphans() -> None:
    """ParentTable keeps parents between samples: new processes, exited ones and an orphan
    re-parented away from the tree are each seen at the next look."""
    table = ParentTable()
    # sh -> (sleep, sh -> sleep): the inner sh prints its pid and that of its sleep
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & echo $$ $!; wait' & wait"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert tree.stdout is not None
        inner, orphan = map(int, tree.stdout.readline().split())
        def descendants() -> list[int]:
            return sorted(p.pid for p in psutil.Process(tree.pid).children(recursive=True))

        assert sorted(table.descendants(tree.pid) or []) == descendants()
        assert {inner, orphan} <= set(table.descendants(tree.pid) or [])
        os.kill(inner, 9)  # its sleep is re-parented (to init or a subreaper): no longer ours
        wait_until(lambda: inner not in descendants() and orphan not in descendants(), 10,
                   "the inner shell exited and its child was re-parented")
        assert sorted(table.descendants(tree.pid) or []) == descendants()
        assert orphan not in (table.descendants(tree.pid) or [])
        # the files kept open of the tree's stats: neither the exited nor the orphan's
        assert kept_stat_files() & {inner, orphan, tree.pid} == {tree.pid}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, 9)
        tree.kill()
        tree.wait()


def test_the_trainer_tree_lists_proc_again_only_once_a_process_was_created(
        tmp_path: Path) -> None:
    """While the newest pid of /proc/loadavg stays, no process can have joined the tree: only
    the tree's own are read again (an exit, a re-parented orphan); once it moves, /proc is."""
    def stage(pid: int, parent: int) -> None:
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a b) S {parent} 1 1 0\n")

    def newest(pid: int) -> None:
        (tmp_path / "loadavg").write_text(f"0.50 0.40 0.30 1/90 {pid}\n")

    for pid, parent in ((1, 0), (10, 1), (11, 10), (12, 11), (20, 1)):
        stage(pid, parent)
    newest(20)
    table = ParentTable(tmp_path)
    assert table.descendants(10) == [11, 12]
    stage(13, 10)  # /proc shows it, but the newest pid says no process was created: a stage
    stage(12, 1)  # 11's child re-parented away
    assert table.descendants(10) == [11]
    newest(13)
    assert table.descendants(10) == [11, 13]
    (tmp_path / "loadavg").write_text("garbled\n")  # no newest pid: /proc is listed every time
    stage(14, 13)
    assert table.descendants(10) == [11, 13, 14]


def test_the_trainer_tree_reads_each_process_as_psutil_does(tmp_path: Path) -> None:
    """HostProbe reads a process from its stat file and its fd folder's size alone; the
    figures are psutil's, for a trainer with threads and many files open."""
    code = ("import sys, threading, time\n"
            f"files = [open({str(tmp_path)!r} + f'/f{{i}}', 'w') for i in range(40)]\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "print('ready', flush=True)\ntime.sleep(30)\n")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          text=True) as trainer:
        try:
            assert trainer.stdout is not None and trainer.stdout.readline() == "ready\n"
            [reading] = HostProbe().process_tree(trainer.pid) or []
            it = psutil.Process(trainer.pid)
            with it.oneshot():
                cpu = it.cpu_times()
                assert (reading.pid, reading.threads) == (trainer.pid, it.num_threads())
                assert reading.threads == 2
                assert reading.started_s == pytest.approx(it.create_time(), abs=0.02)
                assert reading.rss_bytes == pytest.approx(it.memory_info().rss, rel=0.05)
                assert reading.cpu_s == pytest.approx(cpu.user + cpu.system, abs=0.05)
                assert reading.open_files == it.num_fds() >= 43  # stdin, stdout, stderr, 40
        finally:
            trainer.kill()
    assert HostProbe().process_tree(2**22 + 1) is None  # beyond pid_max: no such process


# ---- the sampler in this process (no GPUs) --------------------------------------------------


def sampler(probe: HostProbe, emitted: list[dict[str, Any]], tmp_path: Path,
            interval_s: float = 0.1, **kwargs: Any) -> HardwareSampler:
    def emit(route: str, payload: dict[str, Any]) -> None:
        assert route == "hardware"
        emitted.append(payload)

    return HardwareSampler(run_id=RUN_ID, node="node-a", interval_s=interval_s, emit=emit,
                           gpu_filter=None, trainer_pid=None, disk_paths=[tmp_path],
                           sysfs_root=tmp_path / "sys", probe=probe,
                           **{"gpus": False, **kwargs})


async def test_sampler_posts_rates_and_nothing_negative_or_unknown(tmp_path: Path) -> None:
    probe = ScriptedProbe(net=[(1000, 10), (5000, 20), (100, 5), (1100, 1005)],
                          disk=[(0, 0), (4096, 8192), (0, 0), (1024, 0)])
    write_ib_port(tmp_path / "sys", 1000, 1000)
    emitted: list[dict[str, Any]] = []
    hw = sampler(probe, emitted, tmp_path)
    for step in range(4):
        write_ib_port(tmp_path / "sys", 1000 + 100 * step, 1000)
        await hw.sample_once()
    assert len(emitted) == 4 and hw.stats.samples == 4
    keys = [values(p) for p in emitted]
    assert "net/eth0/rx_bytes_per_second" not in keys[0]
    assert keys[1]["net/eth0/rx_bytes_per_second"] > 0
    assert "net/eth0/rx_bytes_per_second" not in keys[2]  # the reset interval
    assert keys[3]["ib/mlx5_0/1/tx_bytes_per_second"] > 0
    assert all(v >= 0 for row in keys for v in row.values())
    assert "cpu/load_average_5m" not in keys[0]  # NaN is never sent
    assert keys[0]["cpu/load_average_1m"] == 1.5
    assert keys[0]["fs/" + _fs_name(tmp_path) + "/used_bytes"] == 30 * GIB


def _fs_name(path: Path) -> str:
    current = path
    while not os.path.ismount(current):
        current = current.parent
    return str(current).strip("/").replace("/", "_") or "root"


async def test_schedule_is_drift_free_and_a_late_sample_skips_ticks(tmp_path: Path) -> None:
    class SlowOnce(ScriptedProbe):
        calls = 0

        def memory(self) -> tuple[int, int, int]:
            SlowOnce.calls += 1
            if SlowOnce.calls == 3:
                threading.Event().wait(0.25)  # this sample overruns two ticks
            return super().memory()

    emitted: list[dict[str, Any]] = []
    hw = sampler(SlowOnce(net=[(0, 0)], disk=[(0, 0)]), emitted, tmp_path, interval_s=0.1)
    task = asyncio.create_task(hw.run())
    deadline = asyncio.get_running_loop().time() + 10
    while len(emitted) < 7:
        assert asyncio.get_running_loop().time() < deadline, f"{len(emitted)} of 7 samples in 10 s"
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    starts = [datetime.fromisoformat(p["points"][0]["ts"]).timestamp() for p in emitted]
    offsets = [(s - starts[0]) / 0.1 for s in starts]
    assert all(abs(o - round(o)) < 0.35 for o in offsets), offsets  # on the 0.1 s grid
    ticks = [round(o) for o in offsets]
    assert ticks[:3] == [0, 1, 2] and ticks[3] >= 5  # ticks 3 and 4 skipped, not bunched


async def test_a_hung_disk_holds_up_only_disk_usage(tmp_path: Path) -> None:
    probe = ScriptedProbe(net=[(0, 0)], disk=[(0, 0)])
    probe.block_disk_usage = threading.Event()
    emitted: list[dict[str, Any]] = []
    hw = sampler(probe, emitted, tmp_path, host_timeout_s=0.2)
    try:
        await hw.sample_once()
        await hw.sample_once()
        assert all("memory/used_bytes" in values(p) for p in emitted)
        assert not any(k.startswith("fs/") for p in emitted for k in values(p))
        assert hw.stats.skipped_reads == 1  # the second sample did not queue behind the first
        probe.block_disk_usage.set()
        for _ in range(100):  # the stuck read returns on its thread; then reads resume
            await hw.sample_once()
            if any(k.startswith("fs/") for k in values(emitted[-1])):
                break
        assert any(k.startswith("fs/") for k in values(emitted[-1]))
    finally:
        probe.block_disk_usage.set()
        hw.close()


async def test_a_big_sample_is_split_into_requests(tmp_path: Path) -> None:
    class ManyInterfaces(ScriptedProbe):
        def net_io(self) -> dict[str, tuple[int, int]]:
            return {f"veth{i}": (i, i) for i in range(1500)}

    emitted: list[dict[str, Any]] = []
    hw = sampler(ManyInterfaces(net=[(0, 0)], disk=[(0, 0)]), emitted, tmp_path)
    await hw.sample_once()
    await hw.sample_once()
    first_request, *rest = emitted[1:]
    assert len(first_request["points"]) == 2048
    assert len(first_request["points"]) + sum(len(p["points"]) for p in rest) > 3000


# ---- two nodes end to end -------------------------------------------------------------------


def test_two_nodes_against_one_ingest(ingest: RunningIngest, tmp_path: Path,
                                      fast_sampling: None) -> None:
    child = python_child("import time; time.sleep(1.5)")
    sidecars = [
        Sidecar(["run", "--hardware-interval", "0.2", "--nodes", "2", "--", *child],
                platform_env(ingest, tmp_path / f"state{rank}", NODE_RANK=str(rank),
                             SIDECAR_NODE_NAME=f"node-{rank}"), tmp_path / f"sc{rank}")
        for rank in (0, 1)]
    for sc in sidecars:
        finished = sc.wait()
        assert finished.status == 0, finished.stderr
    environment = ingest.records("environment")
    assert len(environment) == 1 and environment[0]["node"] == "node-0"
    entries = [n for r in ingest.records("environment/nodes") for n in r["nodes"]]
    assert sorted((n["node"], n["rank"]) for n in entries) == [("node-0", 0), ("node-1", 1)]
    assert {r["node"] for r in ingest.records("hardware")} == {"node-0", "node-1"}
    assert [r["event"] for r in ingest.records("lifecycle")] == [
        "starting", "running", "succeeded"]


# -- the job's GPUs: which rule, said once ------------------------------------------------------

NOT_A_PID = 4_000_000_000  # above any pid_max: a process of another pod, not visible here


def test_a_pod_sidecar_samples_only_the_gpus_its_pods_processes_run_on(
        stub_dir: Path, tmp_path: Path) -> None:
    """NVIDIA_VISIBLE_DEVICES=all shows the sidecar every GPU of the node: it samples the one
    the trainer (another process of the pod) runs on, not the sidecar's own, not another
    pod's, not an idle one."""
    with subprocess.Popen(["sleep", "60"]) as trainer:
        try:
            script = {"count": 4, **{f"{i}.util_gpu": 10 + i for i in range(4)},
                      "0.procs": "0:4096",  # the sidecar's own process, never the job's
                      "1.procs": f"{NOT_A_PID}:1048576,{trainer.pid}:1048576",
                      "2.procs": f"{NOT_A_PID}:1048576"}
            result, stderr = drive(stub_dir, tmp_path, script, samples=2, pod_sidecar=True,
                                   child_env={"NVIDIA_VISIBLE_DEVICES": "all"})
        finally:
            trainer.kill()
    for payload in result["payloads"]:
        assert {k.split("/")[1] for k in gpu_keys(payload)} == {"1"}
    assert result["stats"]["gpu_status"] == "1 of 4 GPUs"
    assert stderr.count("GPUs sampled: those on which this pod's processes run") == 1
    assert "sampling GPU(s) 1 " in stderr


def test_gpus_option_names_the_jobs_gpus_before_the_environment(stub_dir: Path,
                                                                tmp_path: Path) -> None:
    script = {"count": 4, **{f"{i}.util_gpu": 10 + i for i in range(4)}}
    result, stderr = drive(stub_dir, tmp_path, script, samples=2, gpus=f"0,{UUID.format(2)}",
                           child_env={"CUDA_VISIBLE_DEVICES": "1"})
    for payload in result["payloads"]:
        assert {k.split("/")[1] for k in gpu_keys(payload)} == {"0", "2"}
    assert stderr.count(f"GPUs sampled: those --gpus names (0,{UUID.format(2)}): 2, 0 ") == 1


def fake_proc(tmp_path: Path, pid1: bytes) -> Path:
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "cmdline").write_bytes(pid1)
    return tmp_path / "proc"


@pytest.mark.parametrize(("option", "child_env", "environ", "watching", "pid1", "rule"), [
    ("3", {"CUDA_VISIBLE_DEVICES": "0"}, {"POD_NAME": "p"}, True, b"/pause\0", "--gpus"),
    ("", {"CUDA_VISIBLE_DEVICES": "0"}, {"POD_NAME": "p"}, True, b"/pause\0",
     "CUDA_VISIBLE_DEVICES='0' names"),
    ("", {"NVIDIA_VISIBLE_DEVICES": "all"}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, True,
     b"/pause\0", "this pod's processes run"),
    ("", {"NVIDIA_VISIBLE_DEVICES": "all"}, {"POD_NAME": "p"}, True, b"sidecar\0watch\0",
     "shareProcessNamespace: true"),
    ("", {}, {"POD_NAME": "p"}, False, b"/pause\0", "every GPU this node shows (nothing"),
    ("", {}, {}, True, b"/pause\0", "every GPU this node shows (nothing"),
])
def test_the_rule_for_the_jobs_gpus(tmp_path: Path, option: str, child_env: dict[str, str],
                                    environ: dict[str, str], watching: bool, pid1: bytes,
                                    rule: str) -> None:
    """--gpus, else the variables naming the job's GPUs, else (a pod's sidecar seeing the pod's
    processes) the GPUs they run on, else every GPU, saying which."""
    choice = choose_gpus(option, child_env, environ, watching=watching,
                         proc=fake_proc(tmp_path, pid1))
    assert rule in choice.rule
    assert choice.by_processes == (rule == "this pod's processes run")
    if option:
        assert choice.filter is not None and choice.filter.selects(3, UUID.format(3))
        assert not choice.filter.selects(0, UUID.format(0))


def test_a_gpus_value_that_names_no_gpu_is_a_configuration_error(tmp_path: Path) -> None:
    env = {**clean_environ(), "STARFORGE_ENABLED": "0"}
    done = sidecar(["run", "--gpus", "0,first", "--", sys.executable, "-c", "pass"], env,
                   tmp_path / "run")
    assert done.status == 2
    assert b"--gpus='0,first': 'first' is neither a GPU index nor a UUID" in done.stderr


def test_an_xid_of_a_gpu_the_pod_may_yet_use_is_held_until_the_gpu_is_its_own() -> None:
    """A pod's sidecar samples the GPUs its pod's processes run on: an XID of a GPU that fails
    as the trainer first touches it came before NVML listed the trainer there, and was
    dropped for good when drained. It is held (XID_HELD_S) and posted once the GPU is the
    pod's; another pod's GPU's XID is not."""
    from sidecar.sources.telemetry.nvml.xid import XidEvent
    from sidecar.sources.telemetry.sampler import XID_HELD_S, ours

    early, other = XidEvent(2, 79, 1000.0), XidEvent(3, 48, 1000.0)
    posted, held = ours([early, other], sampled={1}, maybe={2}, now=1001.0)
    assert posted == [] and held == [early]
    posted, held = ours(held, sampled={1, 2}, maybe=set(), now=1002.0)
    assert posted == [early] and held == []
    _, held = ours([early], sampled={1}, maybe={2}, now=1000.0 + XID_HELD_S + 1)
    assert held == []  # not held for ever: the GPU never became the pod's


def test_an_xid_watch_that_ends_on_a_failed_wait_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the driver's events gone (a GPU lost, a reset), XIDs are no longer watched and the
    failure summary can no longer name one: said at WARNING, where it was a DEBUG line."""
    import sidecar.sources.telemetry.nvml.xid as xid
    from sidecar.sources.telemetry.nvml.bindings import NvmlError

    def failing(name: str, *args: Any) -> Any:
        raise NvmlError(15, f"{name}: GPU is lost")  # NVML_ERROR_GPU_IS_LOST

    monkeypatch.setattr(xid, "call", failing)
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        xid.XidWatcher([])._wait_loop(object())
    finally:
        log.removeHandler(handler)
    [record] = said
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("XID events are no longer watched: waiting for them "
                                          "failed (nvmlEventSetWait_v2: GPU is lost)")


async def test_a_fault_opening_the_gpus_is_not_taken_for_no_gpu(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """An unexpected exception while the GPUs were opened left the sampler started: the
    supervisor's restart found it so and sampled no GPU for the rest of the run, in silence."""
    import sidecar.sources.telemetry.sampler as sampling

    looks: list[int] = []

    def discover(gpu_filter: Any) -> tuple[list[Any], int]:
        looks.append(1)
        if len(looks) == 1:
            raise RuntimeError("a fault of ours")
        return [], 0

    monkeypatch.setattr(sampling, "discover", discover)
    probe = ScriptedProbe(net=[(0, 0)] * 4, disk=[(0, 0)] * 4)
    sampled = sampler(probe, [], tmp_path, gpus=True)
    try:
        with pytest.raises(RuntimeError):
            await sampled.start()
        await sampled.start()  # the supervisor's restart
    finally:
        sampled.close()
    assert len(looks) == 2
    assert sampled.stats.gpu_status == "no NVIDIA GPU found"
