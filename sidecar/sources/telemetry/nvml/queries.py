"""GPUs through NVML: a typed wrapper over nvidia-ml-py, the per-device queries, XID events.

Every function here blocks: NVML is a C library, and a call can hang for good when a GPU falls
off the bus. The sampler (hardware.py) runs them on its worker threads, never on the event loop.

A device reads its queries one by one (`QUERIES`). A query the device does not support
(NOT_SUPPORTED, FUNCTION_NOT_FOUND with an older driver, NO_PERMISSION) is turned off for that
device at its first failure and never retried; the other queries go on. GPU_IS_LOST marks the
device lost. Any other error leaves that query's values out of this one sample.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, NewType

from sidecar.log import log

LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux
NVML_TIMEOUT_S = 5.0  # how long one GPU's read may take before it counts as hung


class _Bindings:
    """nvidia-ml-py's `pynvml`, untyped, kept behind this module and imported at first use, and
    only where the driver's library loads: on a node without GPUs its 4 MB of Python are never
    paid for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self._module: Any = None
        self.missing = ""  # why there are none: the library, or the bindings

    def get(self) -> Any:
        with self._lock:  # the sampler's worker threads may ask at once
            if not self._loaded:
                self._loaded = True
                self._module = self._load()
            return self._module

    def _load(self) -> Any:
        try:
            ctypes.CDLL(LIBRARY)
        except OSError as exc:
            self.missing = f"cannot load {LIBRARY}: {exc}"
            return None
        try:
            return importlib.import_module("pynvml")
        except ImportError:
            self.missing = "nvidia-ml-py is not installed"
            return None


_BINDINGS = _Bindings()

# NVML return codes (nvml.h, nvmlReturn_t): part of the C ABI, stable across driver versions.
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
LIB_RM_VERSION_MISMATCH = 18
ARGUMENT_VERSION_MISMATCH = 25
DEPRECATED = 26

_NEVER_WORKS = frozenset({INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND,
                          ARGUMENT_VERSION_MISMATCH, DEPRECATED})
_GONE = frozenset({GPU_IS_LOST, RESET_REQUIRED})

_UNAVAILABLE_REASONS = {
    LIBRARY_NOT_FOUND: "the NVIDIA driver library libnvidia-ml.so.1 is not installed",
    DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
    LIB_RM_VERSION_MISMATCH: "libnvidia-ml.so.1 does not match the loaded NVIDIA driver",
    NO_PERMISSION: "no permission to open the NVIDIA devices",
}


class NvmlError(Exception):
    """An NVML call failed with `code` (an nvmlReturn_t)."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code

    @property
    def unsupported(self) -> bool:
        """The call will never work on this device or driver: stop asking."""
        return self.code in _NEVER_WORKS

    @property
    def lost(self) -> bool:
        """The GPU is gone (fallen off the bus, or needs a reset)."""
        return self.code in _GONE

    def reason(self) -> str:
        """Why there is no NVML at all, in words an operator can act on."""
        return _UNAVAILABLE_REASONS.get(self.code, f"NVML failed: {self}")


Handle = NewType("Handle", object)  # an nvmlDevice_t as the bindings hand it out


def _call(name: str, *args: Any) -> Any:
    """Call pynvml.`name`, turning every failure into NvmlError."""
    nv = _BINDINGS.get()
    if nv is None:
        raise NvmlError(LIBRARY_NOT_FOUND, _BINDINGS.missing)
    function = getattr(nv, name, None)
    if function is None:
        raise NvmlError(FUNCTION_NOT_FOUND, f"nvidia-ml-py has no {name}")
    try:
        return function(*args)
    except nv.NVMLError as exc:
        raise NvmlError(int(exc.value), f"{name}: {exc}") from None
    except (TypeError, getattr(nv, "NVMLLibraryMismatchError", TypeError)) as exc:
        raise NvmlError(FUNCTION_NOT_FOUND, f"{name}: {exc}") from None  # an older binding


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _constant(name: str, default: int) -> int:
    return int(getattr(_BINDINGS.get(), name, default))


def init() -> None:
    _call("nvmlInit")


def shutdown() -> None:
    _call("nvmlShutdown")


def device_count() -> int:
    return int(_call("nvmlDeviceGetCount"))


def device_handle(index: int) -> Handle:
    return Handle(_call("nvmlDeviceGetHandleByIndex", index))


def device_uuid(handle: Handle) -> str:
    return _text(_call("nvmlDeviceGetUUID", handle))


def device_name(handle: Handle) -> str:
    return _text(_call("nvmlDeviceGetName", handle))


def handle_address(handle: Handle) -> int:
    """The nvmlDevice_t pointer value, which events carry to say which device they are about."""
    pointer: Any = handle
    return int(ctypes.cast(pointer, ctypes.c_void_p).value or 0)


def compute_capability(handle: Handle) -> str:
    major, minor = _call("nvmlDeviceGetCudaComputeCapability", handle)
    return f"{int(major)}.{int(minor)}"


def driver_version() -> str:
    return _text(_call("nvmlSystemGetDriverVersion"))


def cuda_driver_version() -> str:
    """The CUDA version the driver supports, e.g. 12040 -> "12.4"."""
    reported = ctypes.c_int()
    _CUDA_DRIVER_VERSION(ctypes.byref(reported))
    version = reported.value
    return f"{version // 1000}.{version % 1000 // 10}"


# ---- the job's GPUs -------------------------------------------------------------------------


class GpuFilter(NamedTuple):
    """The job's GPUs as its CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES names them.

    Indexes are NVML's (PCI bus order), which is CUDA's order on a node of one GPU model and
    under CUDA_DEVICE_ORDER=PCI_BUS_ID. UUIDs may be GPU-... or MIG-..., or a unique prefix, as
    CUDA accepts them.
    """

    variable: str
    value: str
    indexes: frozenset[int] = frozenset()
    uuids: tuple[str, ...] = ()

    def selects(self, index: int, uuid: str) -> bool:
        """Whether the whole GPU `index`/`uuid` is the job's."""
        return index in self.indexes or any(_uuid_matches(token, uuid) for token in self.uuids)

    def selects_mig(self, uuid: str) -> bool:
        """Whether the MIG instance `uuid` is the job's (on a GPU not selected whole)."""
        return any(_uuid_matches(token, uuid) for token in self.uuids)

    @property
    def names_mig(self) -> bool:
        return any(token.upper().startswith("MIG-") for token in self.uuids)

    def describe(self) -> str:
        return f"{self.variable}={self.value!r}"


def _uuid_matches(token: str, uuid: str) -> bool:
    return len(token) > 4 and uuid.lower().startswith(token.lower())


_NO_GPU_VALUES = frozenset({"", "none", "void", "nodevfiles"})


def gpu_filter_from_env(child_env: Mapping[str, str]) -> GpuFilter | None:
    """The job's GPUs from its environment; None when it uses every GPU this node shows.

    CUDA_VISIBLE_DEVICES is what CUDA in the child honours: indexes and UUIDs, up to the first
    entry CUDA would reject; empty selects none. NVIDIA_VISIBLE_DEVICES is the container
    runtime's: when it lists indexes the runtime has already hidden the other GPUs from this
    container and renumbered the rest (and outside a container it does nothing), so only UUIDs
    are taken from it; `none`, `void` and empty select none; `all` every one.
    """
    if "CUDA_VISIBLE_DEVICES" in child_env:
        return _parse_cuda_visible(child_env["CUDA_VISIBLE_DEVICES"])
    if "NVIDIA_VISIBLE_DEVICES" not in child_env:
        return None
    value = child_env["NVIDIA_VISIBLE_DEVICES"]
    tokens = [t.strip() for t in value.split(",")]
    if value.strip().lower() in _NO_GPU_VALUES:
        return GpuFilter("NVIDIA_VISIBLE_DEVICES", value)
    if value.strip().lower() == "all" or not all(_is_uuid(t) for t in tokens):
        return None
    return GpuFilter("NVIDIA_VISIBLE_DEVICES", value, uuids=tuple(tokens))


def gpu_filter_from_option(value: str) -> GpuFilter:
    """The GPUs `--gpus` names: NVML indexes and UUIDs, comma-separated (checked by config)."""
    tokens = [t.strip() for t in value.split(",")]
    return GpuFilter("--gpus", value, frozenset(int(t) for t in tokens if t.isdigit()),
                     tuple(t for t in tokens if _is_uuid(t)))


def _parse_cuda_visible(value: str) -> GpuFilter | None:
    if value.strip().lower() == "all":
        return None
    indexes: set[int] = set()
    uuids: list[str] = []
    for raw in value.split(","):
        token = raw.strip()
        if token.isdigit():
            indexes.add(int(token))
        elif _is_uuid(token):
            uuids.append(token)
        else:  # CUDA stops at the first entry it cannot use ("-1" included)
            break
    return GpuFilter("CUDA_VISIBLE_DEVICES", value, frozenset(indexes), tuple(uuids))


def _is_uuid(token: str) -> bool:
    return token.upper().startswith(("GPU-", "MIG-")) and len(token) > 4


# ---- what a read produces -------------------------------------------------------------------


class Readings:
    """What one read produced, the shape every collector fills.

    Gauges are posted as they are. Counters are cumulative values with the time they were read
    (seconds); the sampler turns consecutive ones into `<key>_per_second`. A key in `restarted`
    had its counter start over (a different set of links added up), so no rate spans it.
    """

    __slots__ = ("counters", "gauges", "restarted")

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.counters: dict[str, tuple[float, float]] = {}
        self.restarted: set[str] = set()

    def merge(self, other: Readings) -> None:
        self.gauges.update(other.gauges)
        self.counters.update(other.counters)
        self.restarted |= other.restarted


# Clock-event (throttle) reasons: nvml.h's nvmlClocksEventReason* bits.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

# GPM metrics (Hopper and newer), interval averages between two GPM samples: nvmlGpmMetricId_t.
GPM_METRICS: dict[int, str] = {
    2: "sm_active_percent",  # NVML_GPM_METRIC_SM_UTIL
    3: "sm_occupancy_percent",  # NVML_GPM_METRIC_SM_OCCUPANCY
    5: "tensor_active_percent",  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    10: "dram_bandwidth_percent",  # NVML_GPM_METRIC_DRAM_BW_UTIL
}

# Arguments of the calls a sample makes (nvml.h enums, part of the C ABI like the return codes).
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_CLOCK_SM, _CLOCK_MEM = 1, 2  # NVML_CLOCK_SM, NVML_CLOCK_MEM
_PCIE_TX, _PCIE_RX = 0, 1  # NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES
_ECC_CORRECTED, _ECC_UNCORRECTED = 0, 1  # NVML_MEMORY_ERROR_TYPE_*
_ECC_VOLATILE = 0  # NVML_VOLATILE_ECC: since the driver was loaded
INSUFFICIENT_SIZE = 7
_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for an unsigned long long
_INITIAL_PROCESSES = 4  # room for this many compute processes before the list grows

_FI_NVLINK_LINK_COUNT = 91
_FI_NVLINK_DATA_TX_KIB = 138
_FI_NVLINK_DATA_RX_KIB = 139
_UNSIGNED_64 = frozenset({2, 3})  # nvmlValueType_t: unsigned long, unsigned long long
_KIB = 1024
_MILLI = 1e-3
_MEGA = 1e6


# ---- the calls a sample makes -----------------------------------------------------------------


class Function:
    """An NVML function a sample calls: resolved once, then called straight through ctypes with
    arguments its caller built once (its output structs and their pointers).

    pynvml's wrapper does per call what never changes: it looks the function up under a lock,
    allocates the output, wraps it in byref, and its structs answer every attribute through a
    Python-level __getattribute__; that made 0.67 ms of CPU a GPU a sample. nvidia-ml-py still
    loads the library, resolves the symbol and defines the structs. The first of `names` the
    driver has is used (an older driver lacks the newer ones, or answers FUNCTION_NOT_FOUND);
    any other nonzero return code raises NvmlError.
    """

    def __init__(self, *names: str) -> None:
        self._names = names
        self._at = 0  # the name in use
        self._function: Any = None
        self._lock = threading.Lock()  # only to resolve or move on: never around a call

    def __call__(self, *args: Any) -> None:
        at = self._at
        code = (self._function or self._resolve())(*args)
        if code:
            self._failed(code, at, args)

    def _failed(self, code: int, at: int, args: tuple[Any, ...]) -> None:
        with self._lock:
            older = self._move_on(code, at)
        if not older:
            raise NvmlError(code, f"{self._names[at]}: {_error_text(code)}")
        self(*args)

    def _resolve(self) -> Any:
        with self._lock:
            while self._function is None:
                at = self._at
                try:
                    self._function = _call("_nvmlGetFunctionPointer", self._names[at])
                except NvmlError as exc:
                    if not self._move_on(exc.code, at):
                        raise NvmlError(exc.code, f"{self._names[at]}: {exc}") from None
            return self._function

    def _move_on(self, code: int, at: int) -> bool:
        """After FUNCTION_NOT_FOUND from the name `at`, use the next older one (unless another
        thread already did); False where there is none."""
        if code != FUNCTION_NOT_FOUND:
            return False
        if at == self._at:
            if at + 1 == len(self._names):
                return False
            self._at, self._function = at + 1, None
        return True


_GET_UTILIZATION = Function("nvmlDeviceGetUtilizationRates")
_GET_MEMORY_V2 = Function("nvmlDeviceGetMemoryInfo_v2")
_GET_MEMORY = Function("nvmlDeviceGetMemoryInfo")
_GET_TEMPERATURE = Function("nvmlDeviceGetTemperature")
_GET_POWER = Function("nvmlDeviceGetPowerUsage")
_GET_POWER_LIMIT = Function("nvmlDeviceGetEnforcedPowerLimit")
_GET_ENERGY = Function("nvmlDeviceGetTotalEnergyConsumption")
_GET_CLOCK = Function("nvmlDeviceGetClockInfo")
_GET_PCIE = Function("nvmlDeviceGetPcieThroughput")
_GET_FIELD_VALUES = Function("nvmlDeviceGetFieldValues")
_GET_CLOCK_EVENTS = Function("nvmlDeviceGetCurrentClocksEventReasons",
                             "nvmlDeviceGetCurrentClocksThrottleReasons")
_GET_ECC = Function("nvmlDeviceGetTotalEccErrors")
_GET_REMAPPED_ROWS = Function("nvmlDeviceGetRemappedRows")
_GET_PROCESSES = Function("nvmlDeviceGetComputeRunningProcesses_v3",
                          "nvmlDeviceGetComputeRunningProcesses_v2")
_GPM_SAMPLE_GET = Function("nvmlGpmSampleGet")
_GPM_METRICS_GET = Function("nvmlGpmMetricsGet")
_CUDA_DRIVER_VERSION = Function("nvmlSystemGetCudaDriverVersion_v2",
                                "nvmlSystemGetCudaDriverVersion")


def _nv() -> Any:
    """The bindings, which define the structs; NvmlError where they cannot load."""
    nv = _BINDINGS.get()
    if nv is None:
        raise NvmlError(LIBRARY_NOT_FOUND, _BINDINGS.missing)
    return nv


def _error_text(code: int) -> str:
    try:
        return _text(_call("nvmlErrorString", code))
    except NvmlError:
        return f"NVML error {code}"


def _members(structure: Any, names: Sequence[str], base: int = 0) -> list[tuple[int, str]]:
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


def _unpacker(members: Sequence[tuple[int, str]]) -> Callable[..., tuple[Any, ...]]:
    """One struct call reading `members` ((offset, format) by increasing offset) out of a
    ctypes object's memory, skipping the bytes between them."""
    fmt, at = "=", 0
    for offset, code in members:
        if offset < at:
            raise NvmlError(FUNCTION_NOT_FOUND, "struct members out of order")
        fmt += f"{offset - at}x{code}" if offset > at else code
        at = offset + struct.calcsize("=" + code)
    return struct.Struct(fmt).unpack_from


Reader = Callable[[Readings], None]


class Memory(NamedTuple):
    total: int
    used: int
    reserved: int | None  # nvmlMemory_v2 only: what the driver keeps for itself


_memory_v1_only = False  # set once the driver turns out to predate nvmlDeviceGetMemoryInfo_v2


class MemoryInfo:
    """A device's memory through structs kept for it: nvmlDeviceGetMemoryInfo_v2 (with the
    driver's reserved share), else v1, for every device, once the driver predates v2."""

    def __init__(self, handle: Handle) -> None:
        nv = _nv()
        self._v2 = nv.c_nvmlMemory_v2_t()
        self._v2.version = _constant("nvmlMemory_v2", 0x02000028)
        self._v1 = nv.c_nvmlMemory_t()
        self._v2_args = (handle, ctypes.byref(self._v2))
        self._v1_args = (handle, ctypes.byref(self._v1))
        self._v2_values = _unpacker(_members(type(self._v2), ("total", "reserved", "used")))
        self._v1_values = _unpacker(_members(type(self._v1), ("total", "used")))

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


class FieldRequest:
    """A reusable nvmlDeviceGetFieldValues request, its answers read out of the array in one
    struct call: (timestamp in microseconds, value type, return code, value as 8 raw bytes
    unsigned) for each field, flat. pynvml's wrapper builds the array anew on every call, one
    ctypes attribute at a time: that made NVLink's 36 fields the costliest query of a sample."""

    def __init__(self, fields: Sequence[tuple[int, int]]) -> None:
        value_type = _nv().c_nvmlFieldValue_t
        self._values = (value_type * len(fields))()
        for slot, (field_id, scope_id) in enumerate(fields):
            self._values[slot].fieldId = field_id
            self._values[slot].scopeId = scope_id
        size = ctypes.sizeof(value_type)
        names = ("timestamp", "valueType", "nvmlReturn", "value")
        self._unpack = _unpacker([m for slot in range(len(fields))
                                  for m in _members(value_type, names, slot * size)])
        self._args = (ctypes.c_int32(len(fields)), ctypes.byref(self._values))

    def flat(self, handle: Handle) -> tuple[int, ...]:
        _GET_FIELD_VALUES(handle, *self._args)
        return self._unpack(self._values)

    def read(self, handle: Handle) -> list[tuple[int, float, float]]:
        """(return code, value, timestamp in microseconds) of each field."""
        flat = self.flat(handle)
        return [(ret, _field_value(kind, raw), float(at_us))
                for at_us, kind, ret, raw in zip(*[iter(flat)] * 4, strict=True)]


def _field_value(kind: int, raw: int) -> float:
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


class MigDevice:
    """One MIG instance of a GPU: its slot on the GPU, UUID and handle. (Not a NamedTuple:
    `index` would hide tuple.index.)"""

    __slots__ = ("handle", "index", "uuid")

    def __init__(self, index: int, uuid: str, handle: Handle) -> None:
        self.index = index
        self.uuid = uuid
        self.handle = handle


class GpuDevice:
    """One GPU the sampler reads: its identity, the queries still on, and their readers."""

    def __init__(self, index: int, handle: Handle, uuid: str, name: str,
                 mig_filter: Callable[[str], bool] | None = None) -> None:
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.name = name
        self.key = f"gpu/{index}"
        self.mig_filter = mig_filter  # which MIG instances to report; None: all of them
        self.disabled: dict[str, str] = {}  # query name -> why it was turned off
        self.lost: str | None = None  # why the GPU is gone, once it is
        self.errors = 0
        self.trainer_pids: frozenset[int] | None = None
        self._on = list(QUERIES)  # the queries not turned off
        self._readers: dict[str, Reader] = {}  # query name -> its reader, once built

    def describe(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    def keys(self, *names: str) -> tuple[str, ...]:
        return tuple(f"{self.key}/{name}" for name in names)

    def read(self, trainer_pids: frozenset[int] | None = None) -> Readings:
        """Run every query still on; a lost GPU stops the read and sets `lost`."""
        self.trainer_pids = trainer_pids
        out = Readings()
        readers = self._readers
        for query in self._on:
            try:
                (readers.get(query.name) or self._build(query))(out)
            except NvmlError as exc:
                self._failed(query, exc)
                if self.lost:
                    break
            except Exception as exc:  # a binding unlike the one expected: this query alone stops
                log.warning("%s: %s turned off: %r", self.describe(), query.name, exc)
                self._turn_off(query, repr(exc))
        return out

    def _build(self, query: Query) -> Reader:
        reader = self._readers[query.name] = query.build(self)
        return reader

    def _failed(self, query: Query, exc: NvmlError) -> None:
        if exc.lost:
            self.lost = str(exc)
        elif exc.unsupported:
            self._turn_off(query, str(exc))
            log.debug("%s: %s turned off: %s", self.describe(), query.name, exc)
        else:
            self.errors += 1
            log.debug("%s: %s left out of this sample: %s", self.describe(), query.name, exc)

    def _turn_off(self, query: Query, why: str) -> None:
        self.disabled[query.name] = why
        self._on = [q for q in self._on if q is not query]


class Query(NamedTuple):
    """One thing read from a GPU; turned off on its own when the GPU does not support it.

    `build` runs at the query's first read, on the sampler's thread: it asks NVML once what
    does not change (how many NVLinks, which MIG instances, whether there is GPM), makes the
    output structs, their pointers and the keys, and returns the reader each sample runs.
    A build that fails is tried again at the next sample, unless the query is turned off.
    """

    name: str
    build: Callable[[GpuDevice], Reader]


def _utilization(dev: GpuDevice) -> Reader:
    rates = _nv().c_nvmlUtilization_t()
    args = (dev.handle, ctypes.byref(rates))
    values = _unpacker(_members(type(rates), ("gpu", "memory")))
    keys = dev.keys("utilization_percent", "memory_utilization_percent")

    def read(out: Readings) -> None:
        _GET_UTILIZATION(*args)
        out.gauges.update(zip(keys, values(rates), strict=True))

    return read


def _memory(dev: GpuDevice) -> Reader:
    info = MemoryInfo(dev.handle)
    used_key, total_key, reserved_key = dev.keys(
        "memory_used_bytes", "memory_total_bytes", "memory_reserved_bytes")

    def read(out: Readings) -> None:
        total, used, reserved = info.read()
        out.gauges[used_key] = used
        out.gauges[total_key] = total
        if reserved is not None:
            out.gauges[reserved_key] = reserved

    return read


class _Scalar(NamedTuple):
    """A call that writes one number through its last argument: its arguments between the
    device and that pointer, the C type written, the key, and the factor to the key's unit."""

    function: Function
    args: tuple[int, ...]
    ctype: Any
    name: str
    scale: float = 1


def _scalars(*scalars: _Scalar) -> Callable[[GpuDevice], Reader]:
    """A query of one-number calls: all made, then all put (a failure leaves out them all)."""

    def build(dev: GpuDevice) -> Reader:
        cells = [s.ctype() for s in scalars]
        calls = [(s.function, (dev.handle, *s.args, ctypes.byref(cell)))
                 for s, cell in zip(scalars, cells, strict=True)]
        puts = [(key, cell, s.scale) for s, cell, key
                in zip(scalars, cells, dev.keys(*(s.name for s in scalars)), strict=True)]

        def read(out: Readings) -> None:
            for function, args in calls:
                function(*args)
            gauges = out.gauges
            for key, cell, scale in puts:
                gauges[key] = cell.value * scale

        return read

    return build


def _nvlink(dev: GpuDevice) -> Reader:
    """NVLink data counters (KiB) summed over the links; the sampler makes rates of them."""
    ((ret, count, _),) = FieldRequest([(_FI_NVLINK_LINK_COUNT, 0)]).read(dev.handle)
    links = int(count) if ret == 0 else 0
    if not links:
        raise NvmlError(NOT_SUPPORTED, "no NVLink")
    request = FieldRequest([(_FI_NVLINK_DATA_TX_KIB, link) for link in range(links)]
                           + [(_FI_NVLINK_DATA_RX_KIB, link) for link in range(links)])
    every = frozenset(range(2 * links))
    tx_key, rx_key = dev.keys("nvlink_tx_bytes", "nvlink_rx_bytes")
    summed = frozenset[int]()  # the fields the last counters added up

    def read(out: Readings) -> None:
        nonlocal summed
        flat = request.flat(dev.handle)
        stamps, kinds, rets, raws = flat[0::4], flat[1::4], flat[2::4], flat[3::4]
        ok = every if not any(rets) else frozenset(i for i, r in enumerate(rets) if r == 0)
        if not ok:
            raise NvmlError(rets[0], "NVLink throughput fields failed")
        if ok is not summed and ok != summed:  # another set of links: another counter
            out.restarted |= {tx_key, rx_key}
            summed = ok
        values = raws if _UNSIGNED_64.issuperset(kinds) else [
            _field_value(kind, raw) for kind, raw in zip(kinds, raws, strict=True)]
        if ok is every:
            tx, rx, at_us = sum(values[:links]), sum(values[links:]), max(stamps)
        else:
            tx = sum(values[i] for i in ok if i < links)
            rx = sum(values[i] for i in ok if i >= links)
            at_us = max(stamps[i] for i in ok)
        out.counters[tx_key] = (tx * _KIB, at_us / _MEGA)
        out.counters[rx_key] = (rx * _KIB, at_us / _MEGA)

    return read


def _clock_events(dev: GpuDevice) -> Reader:
    reasons = ctypes.c_ulonglong()
    args = (dev.handle, ctypes.byref(reasons))
    flags = list(zip(dev.keys(*(f"clock_event/{name}_flag" for name in CLOCK_EVENT_REASONS)),
                     CLOCK_EVENT_REASONS.values(), strict=True))

    def read(out: Readings) -> None:
        _GET_CLOCK_EVENTS(*args)
        value, gauges = reasons.value, out.gauges
        for key, bit in flags:
            gauges[key] = 1 if value & bit else 0

    return read


def _remapped_rows(dev: GpuDevice) -> Reader:
    cells = [ctypes.c_uint() for _ in range(4)]
    args = (dev.handle, *(ctypes.byref(cell) for cell in cells))
    corrected, uncorrected, pending, failure = cells
    keys = dev.keys("remapped_rows_correctable_count", "remapped_rows_uncorrectable_count",
                    "row_remap_pending_flag", "row_remap_failure_flag")

    def read(out: Readings) -> None:
        _GET_REMAPPED_ROWS(*args)
        out.gauges.update(zip(keys, (corrected.value, uncorrected.value,
                                     1 if pending.value else 0, 1 if failure.value else 0),
                              strict=True))

    return read


class ProcessList:
    """The compute processes on a device, into an array kept for it; grown when NVML says
    it is short (by pynvml's margin: twice the count and five, for processes starting)."""

    def __init__(self, handle: Handle) -> None:
        nv = _nv()
        self._type = getattr(nv, "c_nvmlProcessInfo_v3_t", None) or nv.c_nvmlProcessInfo_t
        self._handle = handle
        self._count = ctypes.c_uint()
        self._size = ctypes.sizeof(self._type)
        self._entry = _unpacker(_members(self._type, ("pid", "usedGpuMemory")))
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


def _trainer_memory(dev: GpuDevice) -> Reader:
    """GPU memory of the trainer's process tree (wrapper mode only)."""
    processes = ProcessList(dev.handle)
    (key,) = dev.keys("trainer_memory_used_bytes")
    ours = False  # whether NVML's pids were seen to be this PID namespace's (then they stay)

    def read(out: Readings) -> None:
        nonlocal ours
        pids = dev.trainer_pids
        if pids is None:
            return
        running = processes.read()
        if running and not ours:
            if not any(os.path.exists(f"/proc/{pid}") for pid, _ in running):
                raise NvmlError(NOT_SUPPORTED, "NVML reports processes of another PID namespace")
            ours = True
        out.gauges[key] = sum(used for pid, used in running if pid in pids and used is not None)

    return read


def _mig(dev: GpuDevice) -> Reader:
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


def mig_devices(handle: Handle) -> list[MigDevice]:
    """The GPU's MIG instances; empty when MIG is off."""
    current, _pending = _call("nvmlDeviceGetMigMode", handle)
    if int(current) != 1:  # NVML_DEVICE_MIG_ENABLE
        return []
    found = []
    for slot in range(int(_call("nvmlDeviceGetMaxMigDeviceCount", handle))):
        try:
            mig = Handle(_call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot))
        except NvmlError as exc:
            if exc.code in (NOT_FOUND, INVALID_ARGUMENT):
                continue
            raise
        found.append(MigDevice(slot, device_uuid(mig), mig))
    return found


class GpmSampler:
    """Two GPM sample buffers, and a metrics request for each order of them, kept for a
    device: each read takes a new sample into one buffer, in turn, and averages the metrics
    over the interval since the sample in the other."""

    def __init__(self, dev: GpuDevice) -> None:
        nv = _nv()
        if not hasattr(nv, "c_nvmlGpmMetricsGet_t"):
            raise NvmlError(FUNCTION_NOT_FOUND, "nvidia-ml-py predates GPM")
        self._handle = dev.handle
        first: Any = _call("nvmlGpmSampleAlloc")
        second: Any = _call("nvmlGpmSampleAlloc")
        # each turn: the buffer the new sample goes into, the request from the other to it
        self._turns = [(second, self._request(first, second)),
                       (first, self._request(second, first))]
        self._turn = 1
        self._primed = False  # whether the other buffer holds the sample before
        metric_type = nv.c_nvmlGpmMetric_t
        base = nv.c_nvmlGpmMetricsGet_t.metrics.offset
        size = ctypes.sizeof(metric_type)
        self._results = _unpacker([
            m for slot in range(len(GPM_METRICS))
            for m in _members(metric_type, ("nvmlReturn", "value"), base + slot * size)])
        self._keys = dev.keys(*GPM_METRICS.values())

    @staticmethod
    def _request(earlier: Any, later: Any) -> Any:
        request = _nv().c_nvmlGpmMetricsGet_t()
        request.version = _constant("NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = earlier  # NVML wants the earlier sample first
        request.sample2 = later
        for slot, metric in enumerate(GPM_METRICS):
            request.metrics[slot].metricId = metric
        return request

    def read(self, out: Readings) -> None:
        """The averages since the last read; nothing on the first."""
        self._turn ^= 1
        into, request = self._turns[self._turn]
        primed, self._primed = self._primed, False
        _GPM_SAMPLE_GET(self._handle, into)
        self._primed = True
        if not primed:
            return
        _GPM_METRICS_GET(ctypes.byref(request))
        results = self._results(request)
        for key, ret, value in zip(self._keys, results[0::2], results[1::2], strict=True):
            if ret == 0:
                out.gauges[key] = value


def _gpm(dev: GpuDevice) -> Reader:
    """GPM interval averages (Hopper and newer); the first read only primes the buffers."""
    support = _call("nvmlGpmQueryDeviceSupport", dev.handle)
    if not int(support.isSupportedDevice):
        raise NvmlError(NOT_SUPPORTED, "no GPM on this GPU")
    return GpmSampler(dev).read


QUERIES: tuple[Query, ...] = (
    Query("utilization", _utilization),
    Query("memory", _memory),
    Query("temperature", _scalars(
        _Scalar(_GET_TEMPERATURE, (_TEMPERATURE_GPU,), ctypes.c_uint, "temperature_celsius"))),
    Query("power", _scalars(_Scalar(_GET_POWER, (), ctypes.c_uint, "power_watts", _MILLI))),
    Query("power_limit", _scalars(
        _Scalar(_GET_POWER_LIMIT, (), ctypes.c_uint, "power_limit_watts", _MILLI))),
    Query("energy", _scalars(  # since the driver was loaded
        _Scalar(_GET_ENERGY, (), ctypes.c_ulonglong, "energy_joules", _MILLI))),
    Query("clocks", _scalars(
        _Scalar(_GET_CLOCK, (_CLOCK_SM,), ctypes.c_uint, "sm_clock_hertz", _MEGA),
        _Scalar(_GET_CLOCK, (_CLOCK_MEM,), ctypes.c_uint, "memory_clock_hertz", _MEGA))),
    Query("pcie", _scalars(  # NVML's own throughput, KB/s over its last 20 ms
        _Scalar(_GET_PCIE, (_PCIE_TX,), ctypes.c_uint, "pcie_tx_bytes_per_second", _KIB),
        _Scalar(_GET_PCIE, (_PCIE_RX,), ctypes.c_uint, "pcie_rx_bytes_per_second", _KIB))),
    Query("nvlink", _nvlink),
    Query("clock_events", _clock_events),
    Query("ecc", _scalars(  # since the driver was loaded
        _Scalar(_GET_ECC, (_ECC_CORRECTED, _ECC_VOLATILE), ctypes.c_ulonglong,
                "ecc_corrected_count"),
        _Scalar(_GET_ECC, (_ECC_UNCORRECTED, _ECC_VOLATILE), ctypes.c_ulonglong,
                "ecc_uncorrected_count"))),
    Query("remapped_rows", _remapped_rows),
    Query("trainer_memory", _trainer_memory),
    Query("mig", _mig),
    Query("gpm", _gpm),
)


def discover(gpu_filter: GpuFilter | None) -> tuple[list[GpuDevice], int]:
    """Initialise NVML and open the job's GPUs; returns them and how many the node has.

    Raises NvmlError when NVML itself is unavailable (no library, no driver).
    """
    init()
    count = device_count()
    devices = []
    for index in range(count):
        try:
            device = _open(index, gpu_filter)
        except NvmlError as exc:
            log.warning("GPU %d cannot be opened, it is not sampled: %s", index, exc)
            continue
        if device is not None:
            devices.append(device)
    return devices, count


def _open(index: int, gpu_filter: GpuFilter | None) -> GpuDevice | None:
    handle = device_handle(index)
    uuid = device_uuid(handle)
    if gpu_filter is None or gpu_filter.selects(index, uuid):
        return GpuDevice(index, handle, uuid, device_name(handle))
    if not gpu_filter.names_mig:
        return None
    try:
        migs = mig_devices(handle)
    except NvmlError:
        return None
    if not any(gpu_filter.selects_mig(m.uuid) for m in migs):
        return None
    return GpuDevice(index, handle, uuid, device_name(handle), gpu_filter.selects_mig)


# ---- XID events -----------------------------------------------------------------------------


class XidEvent:
    """An XID critical error NVML reported for GPU `index`, at wall time `at_s`."""

    __slots__ = ("at_s", "index", "xid")

    def __init__(self, index: int, xid: int, at_s: float) -> None:
        self.index = index
        self.xid = xid
        self.at_s = at_s


_XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
XID_WAIT_MS = 500  # how long one wait blocks; also how quickly the watcher notices a stop


class XidWatcher:
    """A daemon thread waiting on NVML's XID critical-error events; the sampler drains them."""

    def __init__(self, devices: Iterable[GpuDevice]) -> None:
        self._by_address = {handle_address(d.handle): d for d in devices}
        self._events: collections.deque[XidEvent] = collections.deque(maxlen=1024)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nvml-xid", daemon=True)

    def start(self) -> None:
        if self._by_address:
            self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end after its current wait; it frees the event set itself."""
        self._stop.set()

    def drain(self) -> list[XidEvent]:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def _watch(self) -> None:
        try:
            event_set = _call("nvmlEventSetCreate")
        except NvmlError as exc:
            log.debug("no XID events: %s", exc)
            return
        try:
            if self._register(event_set):
                self._wait_loop(event_set)
        finally:
            try:
                _call("nvmlEventSetFree", event_set)
            except NvmlError as exc:
                log.debug("freeing the NVML event set failed: %s", exc)

    def _register(self, event_set: Any) -> bool:
        registered = False
        for device in self._by_address.values():
            try:
                _call("nvmlDeviceRegisterEvents", device.handle, _XID_CRITICAL_ERROR, event_set)
                registered = True
            except NvmlError as exc:
                log.debug("%s: no XID events: %s", device.describe(), exc)
        return registered

    def _wait_loop(self, event_set: Any) -> None:
        while not self._stop.is_set():
            try:
                data = _call("nvmlEventSetWait_v2", event_set, XID_WAIT_MS)
            except NvmlError as exc:
                if exc.code == TIMEOUT:
                    continue
                log.debug("XID event wait failed, no more XID events: %s", exc)
                return
            device = self._by_address.get(handle_address(Handle(data.device)))
            if device is None or not int(data.eventType) & _XID_CRITICAL_ERROR:
                continue
            xid = int(data.eventData)
            log.warning("%s reported XID %d (a critical error; see NVIDIA's XID catalogue)",
                        device.describe(), xid)
            self._events.append(XidEvent(device.index, xid, time.time()))


# ---- the environment snapshot's NVIDIA part -------------------------------------------------


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
