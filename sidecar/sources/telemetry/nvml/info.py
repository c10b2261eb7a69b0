"""The environment snapshot's NVIDIA part: the driver, and every GPU's model, UUID and memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar.log import log
from sidecar.sources.telemetry.nvml.bindings import (
    NvmlError,
    compute_capability,
    cuda_driver_version,
    device_count,
    device_handle,
    device_name,
    device_uuid,
    driver_version,
    init,
    shutdown,
)
from sidecar.sources.telemetry.nvml.memory import MemoryInfo


def nvidia_info() -> dict[str, Any]:
    """Driver and CUDA driver versions and every GPU's model, UUID and memory.

    Raises NvmlError when NVML is unavailable; a single value that cannot be read is left out.
    """
    init()
    try:
        info: dict[str, Any] = {}
        for key, read in (("driver_version", driver_version),
                          ("cuda_driver_version", cuda_driver_version)):
            try:
                info[key] = read()
            except NvmlError as exc:
                log.debug("environment: %s unavailable: %s", key, exc)
        info["gpus"] = [_gpu_info(index) for index in range(device_count())]
        return info
    finally:
        shutdown()


def _gpu_info(index: int) -> dict[str, Any]:
    gpu: dict[str, Any] = {"index": index}
    try:
        handle = device_handle(index)
    except NvmlError as exc:
        gpu["error"] = str(exc)
        return gpu
    reads: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("name", lambda: device_name(handle)),
        ("uuid", lambda: device_uuid(handle)),
        ("memory_total_bytes", lambda: MemoryInfo(handle).read().total),
        ("compute_capability", lambda: compute_capability(handle)),
    )
    for key, read in reads:
        try:
            gpu[key] = read()
        except NvmlError as exc:
            log.debug("environment: GPU %d %s unavailable: %s", index, key, exc)
    return gpu
