"""Run the HardwareSampler against whatever libnvidia-ml.so.1 the loader finds; print JSON.

    LD_LIBRARY_PATH=STUB_DIR NVML_STUB_SCRIPT=SCRIPT python -m tests.nvml_stub.drive CONFIG.json

The sampler must load NVML the way it does in production, in a process of its own whose loader
path puts the stand-in first: this is that process. CONFIG (JSON):

    samples         stop after this many /hardware payloads
    interval_s      the sampler's period
    nvml_timeout_s  how long a GPU read may take
    child_env       the child's environment, for the GPU filter
    gpus            --gpus
    pod_sidecar     true: a pod's native sidecar sharing the pod's process namespace, whose GPUs
                    are those the pod's processes (every other process here) run on
    trainer         true: this process is the trainer (its pid is the one the stand-in reports)
    calls           [[gpu, "nvmlFunction"], ...]: stand-in call counts to report
    environment     true: also take the environment snapshot
    bench           true: time `samples` samples back to back instead (CPU seconds per sample)

Output: {"payloads", "max_tick_gap_s", "stats", "calls", "threads", "environment", "bench"};
"threads" names every thread alive whenever a payload was emitted.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sidecar import log as sidecar_log
from sidecar.node import Node
from sidecar.sources.telemetry.environment import environment_snapshot
from sidecar.sources.telemetry.gpus import choose_gpus
from sidecar.sources.telemetry.sampler import HardwareSampler, SamplerStats

TICK_S = 0.01
RUN_TIMEOUT_S = 30.0


async def drive(config: dict[str, Any]) -> dict[str, Any]:
    hardware: list[dict[str, Any]] = []
    threads: set[str] = set()
    enough = asyncio.Event()

    def emit(route: str, payload: dict[str, Any]) -> None:
        assert route == "hardware", route
        hardware.append(payload)
        threads.update(thread.name for thread in threading.enumerate())
        if len(hardware) >= config["samples"]:
            enough.set()

    ticks: list[float] = []

    async def tick() -> None:  # stands for log forwarding: it must keep running
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(TICK_S)

    child_env = config.get("child_env", {})
    gpus = choose_gpus(config.get("gpus", ""), child_env, {}, watching=False)
    if config.get("pod_sidecar"):
        gpus = gpus._replace(by_processes=True, rule="those on which this pod's processes run")
    sampler = HardwareSampler(
        run_id="run-1", node="node-a", interval_s=config.get("interval_s", 0.05), emit=emit,
        gpu_filter=gpus.filter,
        by_processes=gpus.by_processes, gpu_rule=gpus.rule,
        trainer_pid=os.getpid if config.get("trainer") else None,
        disk_paths=[Path(tempfile.gettempdir())], sysfs_root=Path("/nonexistent-sysfs"),
        nvml_timeout_s=config.get("nvml_timeout_s", 2.0))
    result: dict[str, Any] = {}
    if config.get("bench"):
        result["bench"] = await bench(sampler, config["samples"])
    else:
        ticker = asyncio.create_task(tick())
        runner = asyncio.create_task(sampler.run())
        await asyncio.wait_for(enough.wait(), RUN_TIMEOUT_S)
        runner.cancel()
        ticker.cancel()
        await asyncio.gather(runner, ticker, return_exceptions=True)
    if config.get("environment"):
        result["environment"] = await environment_snapshot(
            run_id="run-1", node=Node("node-a", 0), python=Path(sys.executable), child_env={},
            environ={})
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    result.update(payloads=hardware, max_tick_gap_s=max(gaps, default=0.0),
                  stats={name: getattr(sampler.stats, name) for name in SamplerStats.__slots__},
                  calls=stub_calls(config.get("calls", [])), threads=sorted(threads))
    return result


async def bench(sampler: HardwareSampler, samples: int) -> dict[str, float]:
    await sampler.start()
    await sampler.sample_once()  # the first sample primes rates and GPM buffers
    cpu, wall = [], []
    for _ in range(samples):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await sampler.sample_once()
        cpu.append(time.process_time() - cpu0)
        wall.append(time.perf_counter() - wall0)
    sampler.close()
    return {"gpus": sampler.stats.gpus, "samples": samples,
            "cpu_ms_mean": 1000 * statistics.mean(cpu),
            "cpu_ms_median": 1000 * statistics.median(cpu),
            "wall_ms_median": 1000 * statistics.median(wall)}


def stub_calls(wanted: list[list[Any]]) -> dict[str, int]:
    """How often the stand-in saw each call ("gpu:function"); empty without the stand-in."""
    if not wanted:
        return {}
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        count = lib.stubCallCount
    except (OSError, AttributeError):
        return {}
    count.restype = ctypes.c_ulonglong
    count.argtypes = [ctypes.c_int, ctypes.c_char_p]
    return {f"{gpu}:{name}": int(count(gpu, name.encode())) for gpu, name in wanted}


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    sidecar_log.setup("debug" if config.get("debug") else "info")
    print(json.dumps(asyncio.run(drive(config))))


if __name__ == "__main__":
    main()
