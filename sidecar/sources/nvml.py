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
import contextlib
import ctypes
import importlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from sidecar.log import log

LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux


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


def _first_of(*names: str) -> Callable[..., Any]:
    """A call to the newest of `names` the driver has (remembered once found)."""
    remaining = list(names)

    def call(*args: Any) -> Any:  # from every GPU's worker thread at once
        while len(remaining) > 1:
            name = remaining[0]
            try:
                return _call(name, *args)
            except NvmlError as exc:
                if exc.code != FUNCTION_NOT_FOUND:
                    raise
                with contextlib.suppress(ValueError):  # another thread got there first
                    remaining.remove(name)
        return _call(remaining[-1], *args)

    return call


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


@dataclass(frozen=True)
class Memory:
    total: int
    used: int
    reserved: int | None  # nvmlMemory_v2 only: what the driver keeps for itself


_memory_v1_only = False  # set once the driver turns out to predate nvmlDeviceGetMemoryInfo_v2


def memory(handle: Handle) -> Memory:
    """Device memory: the v2 query (with the driver's reserved share), else v1."""
    global _memory_v1_only
    if not _memory_v1_only:
        try:
            info = _call("nvmlDeviceGetMemoryInfo", handle,
                         _constant("nvmlMemory_v2", 0x02000028))
            return Memory(int(info.total), int(info.used), int(info.reserved))
        except NvmlError as exc:
            if exc.code not in (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                raise
            _memory_v1_only = True
    info = _call("nvmlDeviceGetMemoryInfo", handle)
    return Memory(int(info.total), int(info.used), None)


def compute_capability(handle: Handle) -> str:
    major, minor = _call("nvmlDeviceGetCudaComputeCapability", handle)
    return f"{int(major)}.{int(minor)}"


def driver_version() -> str:
    return _text(_call("nvmlSystemGetDriverVersion"))


def cuda_driver_version() -> str:
    """The CUDA version the driver supports, e.g. 12040 -> "12.4"."""
    version = int(_first_of("nvmlSystemGetCudaDriverVersion_v2",
                            "nvmlSystemGetCudaDriverVersion")())
    return f"{version // 1000}.{version % 1000 // 10}"


# ---- the job's GPUs -------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuFilter:
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


@dataclass
class Readings:
    """What one read produced, the shape every collector fills.

    Gauges are posted as they are. Counters are cumulative values with the time they were read
    (seconds); the sampler turns consecutive ones into `<key>_per_second`. A key in `restarted`
    had its counter start over (a different set of links added up), so no rate spans it.
    """

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, tuple[float, float]] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)

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

_FI_NVLINK_LINK_COUNT = 91
_FI_NVLINK_DATA_TX_KIB = 138
_FI_NVLINK_DATA_RX_KIB = 139
# nvmlValueType_t -> the member of the nvmlValue_t union that holds the value
# nvmlValueType_t -> how the 8 bytes of the value union read (nvmlValue_t, little-endian).
_VALUE_FORMATS = {0: struct.Struct("<d"), 1: struct.Struct("<I4x"), 2: struct.Struct("<Q"),
                  3: struct.Struct("<Q"), 4: struct.Struct("<q"), 5: struct.Struct("<i4x"),
                  6: struct.Struct("<H6x")}
_U64 = _VALUE_FORMATS[3]
_KIB = 1024
_MILLI = 1e-3
_MEGA = 1e6


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance of a GPU: its slot on the GPU, UUID and handle."""

    index: int
    uuid: str
    handle: Handle


class GpmSampler:
    """Two GPM sample buffers: each read takes a new sample and averages over the interval."""

    def __init__(self) -> None:
        if not hasattr(_BINDINGS.get(), "c_nvmlGpmMetricsGet_t"):
            raise NvmlError(FUNCTION_NOT_FOUND, "nvidia-ml-py predates GPM")
        self._older: Any = _call("nvmlGpmSampleAlloc")
        self._newer: Any = _call("nvmlGpmSampleAlloc")
        self._primed = False  # whether the buffer that becomes `_older` holds a sample

    def read(self, handle: Handle) -> dict[int, float]:
        """Metric id -> its average since the last read; empty on the first."""
        self._older, self._newer = self._newer, self._older
        primed, self._primed = self._primed, False
        _call("nvmlGpmSampleGet", handle, self._newer)
        self._primed = True
        if not primed:
            return {}
        request = _BINDINGS.get().c_nvmlGpmMetricsGet_t()
        request.version = _constant("NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = self._older  # NVML wants the earlier sample first
        request.sample2 = self._newer
        for slot, metric in enumerate(GPM_METRICS):
            request.metrics[slot].metricId = metric
        _call("nvmlGpmMetricsGet", request)
        return {int(m.metricId): float(m.value)
                for m in request.metrics[:len(GPM_METRICS)] if int(m.nvmlReturn) == 0}


class GpuDevice:
    """One GPU the sampler reads: its identity, the queries still on, and query state."""

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
        self.migs: list[MigDevice] | None = None
        self.gpm: GpmSampler | None = None
        self.nvlink_links: int | None = None
        self.nvlink_ok: frozenset[int] = frozenset()
        self.nvlink_request: FieldRequest | None = None

    def describe(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    def read(self, trainer_pids: frozenset[int] | None = None) -> Readings:
        """Run every query still on; a lost GPU stops the read and sets `lost`."""
        self.trainer_pids = trainer_pids
        out = Readings()
        for query in QUERIES:
            if query.name in self.disabled or self.lost:
                continue
            try:
                query.read(self, out)
            except NvmlError as exc:
                self._failed(query.name, exc)
            except Exception as exc:  # a binding unlike the one expected: this query alone stops
                log.warning("%s: %s turned off: %r", self.describe(), query.name, exc)
                self.disabled[query.name] = repr(exc)
        return out

    def _failed(self, query: str, exc: NvmlError) -> None:
        if exc.lost:
            self.lost = str(exc)
        elif exc.unsupported:
            self.disabled[query] = str(exc)
            log.debug("%s: %s turned off: %s", self.describe(), query, exc)
        else:
            self.errors += 1
            log.debug("%s: %s left out of this sample: %s", self.describe(), query, exc)

    def put(self, out: Readings, name: str, value: float) -> None:
        out.gauges[f"{self.key}/{name}"] = value


@dataclass(frozen=True)
class Query:
    """One thing read from a GPU; turned off on its own when the GPU does not support it."""

    name: str
    read: Callable[[GpuDevice, Readings], None]


def _utilization(dev: GpuDevice, out: Readings) -> None:
    rates = _call("nvmlDeviceGetUtilizationRates", dev.handle)
    dev.put(out, "utilization_percent", int(rates.gpu))
    dev.put(out, "memory_utilization_percent", int(rates.memory))


def _memory(dev: GpuDevice, out: Readings) -> None:
    mem = memory(dev.handle)
    dev.put(out, "memory_used_bytes", mem.used)
    dev.put(out, "memory_total_bytes", mem.total)
    if mem.reserved is not None:
        dev.put(out, "memory_reserved_bytes", mem.reserved)


def _temperature(dev: GpuDevice, out: Readings) -> None:
    celsius = _call("nvmlDeviceGetTemperature", dev.handle, _constant("NVML_TEMPERATURE_GPU", 0))
    dev.put(out, "temperature_celsius", int(celsius))


def _power(dev: GpuDevice, out: Readings) -> None:
    dev.put(out, "power_watts", int(_call("nvmlDeviceGetPowerUsage", dev.handle)) * _MILLI)


def _power_limit(dev: GpuDevice, out: Readings) -> None:
    limit = int(_call("nvmlDeviceGetEnforcedPowerLimit", dev.handle))
    dev.put(out, "power_limit_watts", limit * _MILLI)


def _energy(dev: GpuDevice, out: Readings) -> None:
    """Energy since the driver was loaded."""
    energy = int(_call("nvmlDeviceGetTotalEnergyConsumption", dev.handle))
    dev.put(out, "energy_joules", energy * _MILLI)


def _clocks(dev: GpuDevice, out: Readings) -> None:
    sm = int(_call("nvmlDeviceGetClockInfo", dev.handle, _constant("NVML_CLOCK_SM", 1)))
    mem = int(_call("nvmlDeviceGetClockInfo", dev.handle, _constant("NVML_CLOCK_MEM", 2)))
    dev.put(out, "sm_clock_hertz", sm * _MEGA)
    dev.put(out, "memory_clock_hertz", mem * _MEGA)


def _pcie(dev: GpuDevice, out: Readings) -> None:
    """NVML's own PCIe throughput (KB/s over its last 20 ms)."""
    tx = int(_call("nvmlDeviceGetPcieThroughput", dev.handle, 0))  # NVML_PCIE_UTIL_TX_BYTES
    rx = int(_call("nvmlDeviceGetPcieThroughput", dev.handle, 1))  # NVML_PCIE_UTIL_RX_BYTES
    dev.put(out, "pcie_tx_bytes_per_second", tx * _KIB)
    dev.put(out, "pcie_rx_bytes_per_second", rx * _KIB)


def _nvlink(dev: GpuDevice, out: Readings) -> None:
    """NVLink data counters (KiB) summed over the links; the sampler makes rates of them."""
    if dev.nvlink_links is None:
        (count,) = _field_values(dev.handle, [(_FI_NVLINK_LINK_COUNT, 0)])
        dev.nvlink_links = int(count[1]) if count[0] == 0 else 0
    if not dev.nvlink_links:
        raise NvmlError(NOT_SUPPORTED, "no NVLink")
    links = range(dev.nvlink_links)
    if dev.nvlink_request is None:
        dev.nvlink_request = FieldRequest([(_FI_NVLINK_DATA_TX_KIB, link) for link in links]
                                          + [(_FI_NVLINK_DATA_RX_KIB, link) for link in links])
    values = dev.nvlink_request.read(dev.handle)
    ok = frozenset(i for i, (ret, _, _) in enumerate(values) if ret == 0)
    if not ok:
        raise NvmlError(values[0][0], "NVLink throughput fields failed")
    if ok != dev.nvlink_ok:  # a different set of links adds up to a different counter
        out.restarted |= {f"{dev.key}/nvlink_tx_bytes", f"{dev.key}/nvlink_rx_bytes"}
        dev.nvlink_ok = ok
    at_s = max(values[i][2] for i in ok) / _MEGA
    n = len(links)
    tx = sum(values[i][1] for i in ok if i < n) * _KIB
    rx = sum(values[i][1] for i in ok if i >= n) * _KIB
    out.counters[f"{dev.key}/nvlink_tx_bytes"] = (tx, at_s)
    out.counters[f"{dev.key}/nvlink_rx_bytes"] = (rx, at_s)


def _field_values(handle: Handle, fields: Sequence[tuple[int, int]]) -> list[
        tuple[int, float, float]]:
    """(return code, value, timestamp in microseconds) of each (field id, scope id)."""
    return FieldRequest(fields).read(handle)


class FieldRequest:
    """A reusable nvmlDeviceGetFieldValues request, its answers read from the array's bytes
    in one struct call. pynvml's wrapper builds the array anew on every call, one ctypes
    attribute at a time, and its answers are read the same way: that made NVLink's 36 fields
    the costliest query of a sample (240 us a GPU, the other fourteen queries together 110)."""

    def __init__(self, fields: Sequence[tuple[int, int]]) -> None:
        nv = _BINDINGS.get()
        if nv is None:
            raise NvmlError(LIBRARY_NOT_FOUND, _BINDINGS.missing)
        value_type = nv.c_nvmlFieldValue_t
        self._values = (value_type * len(fields))()
        for slot, (field_id, scope_id) in enumerate(fields):
            self._values[slot].fieldId = field_id
            self._values[slot].scopeId = scope_id
        self._count = ctypes.c_int32(len(fields))
        self._function = _call("_nvmlGetFunctionPointer", "nvmlDeviceGetFieldValues")
        self._layout = _struct_layout(value_type, ("timestamp", "valueType", "nvmlReturn",
                                                   "value"))

    def read(self, handle: Handle) -> list[tuple[int, float, float]]:
        code = int(self._function(handle, self._count, ctypes.byref(self._values)))
        if code:
            raise NvmlError(code, f"nvmlDeviceGetFieldValues: {_error_text(code)}")
        return [(int(ret), float(_VALUE_FORMATS.get(kind, _U64).unpack(raw)[0]), float(at_us))
                for at_us, kind, ret, raw in self._layout.iter_unpack(bytes(self._values))]


def _struct_layout(structure: Any, names: Sequence[str]) -> struct.Struct:
    """A struct reading the members `names` of a ctypes Structure (a union member as its raw
    bytes), in order of offset, skipping the rest: offsets from ctypes, not hard-coded."""
    codes = {1: "B", 2: "H", 4: "I", 8: "q"}
    members = sorted((getattr(structure, name).offset, getattr(structure, name).size, name)
                     for name in names)
    if [name for _, _, name in members] != list(names):
        raise NvmlError(FUNCTION_NOT_FOUND, f"unexpected layout of {structure.__name__}")
    fmt, at = "<", 0
    for offset, size, name in members:
        fmt += f"{offset - at}x" if offset > at else ""
        fmt += f"{size}s" if name == "value" else codes[size]
        at = offset + size
    return struct.Struct(fmt + f"{ctypes.sizeof(structure) - at}x")


def _error_text(code: int) -> str:
    try:
        return _text(_call("nvmlErrorString", code))
    except NvmlError:
        return f"NVML error {code}"


_clock_event_reasons = _first_of("nvmlDeviceGetCurrentClocksEventReasons",
                                 "nvmlDeviceGetCurrentClocksThrottleReasons")


def _clock_events(dev: GpuDevice, out: Readings) -> None:
    reasons = int(_clock_event_reasons(dev.handle))
    for name, bit in CLOCK_EVENT_REASONS.items():
        dev.put(out, f"clock_event/{name}_flag", 1 if reasons & bit else 0)


def _ecc(dev: GpuDevice, out: Readings) -> None:
    """ECC errors since the driver was loaded (NVML_VOLATILE_ECC)."""
    for name, kind in (("ecc_corrected_count", 0), ("ecc_uncorrected_count", 1)):
        dev.put(out, name, int(_call("nvmlDeviceGetTotalEccErrors", dev.handle, kind, 0)))


def _remapped_rows(dev: GpuDevice, out: Readings) -> None:
    corrected, uncorrected, pending, failure = _call("nvmlDeviceGetRemappedRows", dev.handle)
    dev.put(out, "remapped_rows_correctable_count", int(corrected))
    dev.put(out, "remapped_rows_uncorrectable_count", int(uncorrected))
    dev.put(out, "row_remap_pending_flag", 1 if pending else 0)
    dev.put(out, "row_remap_failure_flag", 1 if failure else 0)


_compute_processes = _first_of("nvmlDeviceGetComputeRunningProcesses_v3",
                               "nvmlDeviceGetComputeRunningProcesses_v2")


def _trainer_memory(dev: GpuDevice, out: Readings) -> None:
    """GPU memory of the trainer's process tree (wrapper mode only)."""
    pids = dev.trainer_pids
    if pids is None:
        return
    processes = [(int(p.pid), p.usedGpuMemory) for p in _compute_processes(dev.handle)]
    if processes and not any(os.path.exists(f"/proc/{pid}") for pid, _ in processes):
        raise NvmlError(NOT_SUPPORTED, "NVML reports processes of another PID namespace")
    used = sum(int(mem) for pid, mem in processes if pid in pids and mem is not None)
    dev.put(out, "trainer_memory_used_bytes", used)


def _mig(dev: GpuDevice, out: Readings) -> None:
    """Memory of each MIG instance, when MIG is on."""
    if dev.migs is None:
        dev.migs = mig_devices(dev.handle)
        if dev.mig_filter is not None:
            dev.migs = [m for m in dev.migs if dev.mig_filter(m.uuid)]
    if not dev.migs:
        raise NvmlError(NOT_SUPPORTED, "MIG is off")
    for mig in dev.migs:
        mem = memory(mig.handle)
        dev.put(out, f"mig/{mig.index}/memory_used_bytes", mem.used)
        dev.put(out, f"mig/{mig.index}/memory_total_bytes", mem.total)


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


def _gpm(dev: GpuDevice, out: Readings) -> None:
    """GPM interval averages (Hopper and newer); the first read only primes the buffers."""
    if dev.gpm is None:
        support = _call("nvmlGpmQueryDeviceSupport", dev.handle)
        if not int(support.isSupportedDevice):
            raise NvmlError(NOT_SUPPORTED, "no GPM on this GPU")
        dev.gpm = GpmSampler()
    for metric, value in dev.gpm.read(dev.handle).items():
        dev.put(out, GPM_METRICS[metric], value)


QUERIES: tuple[Query, ...] = (
    Query("utilization", _utilization),
    Query("memory", _memory),
    Query("temperature", _temperature),
    Query("power", _power),
    Query("power_limit", _power_limit),
    Query("energy", _energy),
    Query("clocks", _clocks),
    Query("pcie", _pcie),
    Query("nvlink", _nvlink),
    Query("clock_events", _clock_events),
    Query("ecc", _ecc),
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


@dataclass(frozen=True)
class XidEvent:
    """An XID critical error NVML reported for GPU `index`, at wall time `at_s`."""

    index: int
    xid: int
    at_s: float


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
        ("memory_total_bytes", lambda: memory(handle).total),
        ("compute_capability", lambda: compute_capability(handle)),
    )
    for key, read in reads:
        try:
            gpu[key] = read()
        except NvmlError as exc:
            log.debug("environment: GPU %d %s unavailable: %s", index, key, exc)
    return gpu
