"""A GPU's MIG instances, and the memory of each as a query reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.sources.telemetry.nvml.bindings import (
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    Handle,
    NvmlError,
    call,
    device_uuid,
)
from sidecar.sources.telemetry.nvml.memory import MemoryInfo
from sidecar.sources.telemetry.readings import Readings

if TYPE_CHECKING:
    from sidecar.sources.telemetry.nvml.handle import Gpu, Reader


class MigDevice:
    """One MIG instance of a GPU: its slot on the GPU, UUID and handle. (Not a NamedTuple:
    `index` would hide tuple.index.)"""

    __slots__ = ("handle", "index", "uuid")

    def __init__(self, index: int, uuid: str, handle: Handle) -> None:
        self.index = index
        self.uuid = uuid
        self.handle = handle


def mig_devices(handle: Handle) -> list[MigDevice]:
    """The GPU's MIG instances; empty when MIG is off."""
    current, _pending = call("nvmlDeviceGetMigMode", handle)
    if int(current) != 1:  # NVML_DEVICE_MIG_ENABLE
        return []
    found = []
    for slot in range(int(call("nvmlDeviceGetMaxMigDeviceCount", handle))):
        try:
            mig = Handle(call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot))
        except NvmlError as exc:
            if exc.code in (NOT_FOUND, INVALID_ARGUMENT):
                continue
            raise
        found.append(MigDevice(slot, device_uuid(mig), mig))
    return found


def instance_memory(dev: Gpu) -> Reader:
    """Memory of each MIG instance, when MIG is on."""
    migs = mig_devices(dev.handle)
    if dev.mig_filter is not None:
        migs = [m for m in migs if dev.mig_filter(m.uuid)]
    if not migs:
        raise NvmlError(NOT_SUPPORTED, "MIG is off")
    instances = [(MemoryInfo(m.handle), f"{dev.key}/mig/{m.index}/memory_used_bytes",
                  f"{dev.key}/mig/{m.index}/memory_total_bytes") for m in migs]

    def read(out: Readings) -> None:
        for info, used_key, total_key in instances:
            total, used, _ = info.read()
            out.gauges[used_key] = used
            out.gauges[total_key] = total

    return read
