"""nvmlDeviceGetFieldValues: a request kept for reuse, and the values it answers with."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

from sidecar.sources.telemetry.nvml.bindings import Function, Handle, pynvml
from sidecar.sources.telemetry.nvml.structs import members, unpacker

_GET_FIELD_VALUES = Function("nvmlDeviceGetFieldValues")


class FieldRequest:
    """A reusable nvmlDeviceGetFieldValues request, its answers read out of the array in one
    struct call: (timestamp in microseconds, value type, return code, value as 8 raw bytes
    unsigned) for each field, flat. pynvml's wrapper builds the array anew on every call, one
    ctypes attribute at a time: that made NVLink's 36 fields the costliest query of a sample."""

    def __init__(self, fields: Sequence[tuple[int, int]]) -> None:
        value_type = pynvml().c_nvmlFieldValue_t
        self._values = (value_type * len(fields))()
        for slot, (field_id, scope_id) in enumerate(fields):
            self._values[slot].fieldId = field_id
            self._values[slot].scopeId = scope_id
        size = ctypes.sizeof(value_type)
        names = ("timestamp", "valueType", "nvmlReturn", "value")
        self._unpack = unpacker([m for slot in range(len(fields))
                                  for m in members(value_type, names, slot * size)])
        self._args = (ctypes.c_int32(len(fields)), ctypes.byref(self._values))

    def flat(self, handle: Handle) -> tuple[int, ...]:
        _GET_FIELD_VALUES(handle, *self._args)
        return self._unpack(self._values)

    def read(self, handle: Handle) -> list[tuple[int, float, float]]:
        """(return code, value, timestamp in microseconds) of each field."""
        flat = self.flat(handle)
        return [(ret, field_value(kind, raw), float(at_us))
                for at_us, kind, ret, raw in zip(*[iter(flat)] * 4, strict=True)]


def field_value(kind: int, raw: int) -> float:
    """An nvmlValue_t's 8 bytes (read as unsigned) as its nvmlValueType_t says they hold."""
    if kind == 0:  # double
        return float(struct.unpack("=d", struct.pack("=Q", raw))[0])
    if kind == 1:  # unsigned int
        return float(raw & 0xFFFFFFFF)
    if kind == 4:  # signed long long
        return float(raw - (1 << 64) if raw >> 63 else raw)
    if kind == 5:  # signed int
        low = raw & 0xFFFFFFFF
        return float(low - (1 << 32) if low >> 31 else low)
    if kind == 6:  # unsigned short
        return float(raw & 0xFFFF)
    return float(raw)  # unsigned long (long)
