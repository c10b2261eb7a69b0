"""The compute processes NVML sees on a device, and the GPU memory each uses."""

from __future__ import annotations

import ctypes

from sidecar.sources.telemetry.nvml.bindings import (
    INSUFFICIENT_SIZE,
    Function,
    Handle,
    NvmlError,
    pynvml,
)
from sidecar.sources.telemetry.nvml.structs import members, unpacker

_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for an unsigned long long
_INITIAL_PROCESSES = 4  # room for this many compute processes before the list grows
_GET_PROCESSES = Function("nvmlDeviceGetComputeRunningProcesses_v3",
                          "nvmlDeviceGetComputeRunningProcesses_v2")


class ProcessList:
    """The compute processes on a device, into an array kept for it; grown when NVML says
    it is short (by pynvml's margin: twice the count and five, for processes starting)."""

    def __init__(self, handle: Handle) -> None:
        nv = pynvml()
        self._type = getattr(nv, "c_nvmlProcessInfo_v3_t", None) or nv.c_nvmlProcessInfo_t
        self._handle = handle
        self._count = ctypes.c_uint()
        self._size = ctypes.sizeof(self._type)
        self._entry = unpacker(members(self._type, ("pid", "usedGpuMemory")))
        self._grow(_INITIAL_PROCESSES)

    def _grow(self, room: int) -> None:
        self._room = room
        self._array = (self._type * room)()
        self._args = (self._handle, ctypes.byref(self._count), self._array)

    def read(self) -> list[tuple[int, int | None]]:
        """(pid, GPU memory in bytes, None where NVML cannot tell) of each process."""
        self._count.value = self._room
        try:
            _GET_PROCESSES(*self._args)
        except NvmlError as exc:
            if exc.code != INSUFFICIENT_SIZE:
                raise
            self._grow(self._count.value * 2 + 5)
            self._count.value = self._room
            _GET_PROCESSES(*self._args)
        found = [self._entry(self._array, slot * self._size)
                 for slot in range(min(self._count.value, self._room))]
        return [(pid, None if used == _NOT_AVAILABLE else used) for pid, used in found]
