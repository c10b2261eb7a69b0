"""Members of NVML's ctypes structs read in one struct call, at offsets and in formats ctypes
gives: ctypes' own attributes cost a Python call each, and a sample reads thousands."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

from sidecar.sources.telemetry.nvml.bindings import FUNCTION_NOT_FOUND, NvmlError


def members(structure: Any, names: Sequence[str], base: int = 0) -> list[tuple[int, str]]:
    """(offset, struct format) of the named members of a ctypes Structure placed `base` bytes
    in: offsets and types from ctypes, never hard-coded. A union member reads as its first
    8 bytes, unsigned."""
    types = dict(structure._fields_)
    return [(base + getattr(structure, name).offset, _format(types[name])) for name in names]


def _format(ctype: Any) -> str:
    code = getattr(ctype, "_type_", None)
    if not isinstance(code, str):  # a union: nvmlValue_t
        if ctypes.sizeof(ctype) < 8:
            raise NvmlError(FUNCTION_NOT_FOUND, f"unexpected layout of {ctype.__name__}")
        return "Q"
    if code in "fd?":
        return code
    letter = {1: "b", 2: "h", 4: "i", 8: "q"}[ctypes.sizeof(ctype)]
    return letter.upper() if code.isupper() else letter


def unpacker(members: Sequence[tuple[int, str]]) -> Callable[..., tuple[Any, ...]]:
    """One struct call reading `members` ((offset, format) by increasing offset) out of a
    ctypes object's memory, skipping the bytes between them."""
    fmt, at = "=", 0
    for offset, code in members:
        if offset < at:
            raise NvmlError(FUNCTION_NOT_FOUND, "struct members out of order")
        fmt += f"{offset - at}x{code}" if offset > at else code
        at = offset + struct.calcsize("=" + code)
    return struct.Struct(fmt).unpack_from
