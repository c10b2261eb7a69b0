"""A device's memory: nvmlDeviceGetMemoryInfo_v2, else v1 on a driver that predates it."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from sidecar.process import held
from sidecar.sources.telemetry.nvml.bindings import (
    ARGUMENT_VERSION_MISMATCH,
    FUNCTION_NOT_FOUND,
    Function,
    Handle,
    NvmlError,
    constant,
    pynvml,
)
from sidecar.sources.telemetry.nvml.structs import members, unpacker

_GET_MEMORY_V2 = Function("nvmlDeviceGetMemoryInfo_v2")
_GET_MEMORY = Function("nvmlDeviceGetMemoryInfo")


class Memory(NamedTuple):
    total: int
    used: int
    reserved: int | None  # nvmlMemory_v2 only: what the driver keeps for itself


_memory_v1_only = False  # set once the driver turns out to predate nvmlDeviceGetMemoryInfo_v2


class MemoryInfo:
    """A device's memory through structs kept for it: nvmlDeviceGetMemoryInfo_v2 (with the
    driver's reserved share), else v1, for every device, once the driver predates v2."""

    def __init__(self, handle: Handle) -> None:
        nv = pynvml()
        self._v2 = nv.c_nvmlMemory_v2_t()
        self._v2.version = constant("nvmlMemory_v2", 0x02000028)
        self._v1 = nv.c_nvmlMemory_t()
        self._v2_args = (handle, ctypes.byref(self._v2))
        self._v1_args = (handle, ctypes.byref(self._v1))
        self._v2_values = unpacker(members(type(self._v2), ("total", "reserved", "used")))
        self._v1_values = unpacker(members(type(self._v1), ("total", "used")))

    def read(self) -> Memory:
        global _memory_v1_only
        if not _memory_v1_only:
            try:
                _GET_MEMORY_V2(*self._v2_args)
            except NvmlError as exc:
                if exc.code not in (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                    raise
                _memory_v1_only = True
            else:
                total, reserved, used = self._v2_values(self._v2)
                return Memory(total, used, reserved)
        _GET_MEMORY(*self._v1_args)
        total, used = self._v1_values(self._v1)
        return Memory(total, used, None)


def _fresh() -> None:
    global _memory_v1_only
    _memory_v1_only = False


held(_fresh)
