"""What a sample reads of a GPU: one `Query` a thing (`QUERIES`), each building at its first
read the reader every sample then runs."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from sidecar.sources.telemetry.nvml import gpm, mig
from sidecar.sources.telemetry.nvml.bindings import NOT_SUPPORTED, Function, NvmlError, pynvml
from sidecar.sources.telemetry.nvml.fields import FieldRequest, field_value
from sidecar.sources.telemetry.nvml.memory import MemoryInfo
from sidecar.sources.telemetry.nvml.processes import ProcessList
from sidecar.sources.telemetry.nvml.structs import members, unpacker
from sidecar.sources.telemetry.readings import Readings

if TYPE_CHECKING:
    from sidecar.sources.telemetry.nvml.handle import Gpu, Reader

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

# Arguments of the calls a sample makes (nvml.h enums, part of the C ABI like the return codes).
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_CLOCK_SM, _CLOCK_MEM = 1, 2  # NVML_CLOCK_SM, NVML_CLOCK_MEM
_PCIE_TX, _PCIE_RX = 0, 1  # NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES
_ECC_CORRECTED, _ECC_UNCORRECTED = 0, 1  # NVML_MEMORY_ERROR_TYPE_*
_ECC_VOLATILE = 0  # NVML_VOLATILE_ECC: since the driver was loaded

_FI_NVLINK_LINK_COUNT = 91
_FI_NVLINK_DATA_TX_KIB = 138
_FI_NVLINK_DATA_RX_KIB = 139
_UNSIGNED_64 = frozenset({2, 3})  # nvmlValueType_t: unsigned long, unsigned long long
_KIB = 1024
_MILLI = 1e-3
_MEGA = 1e6

# the calls the queries make every sample, straight through ctypes
_GET_UTILIZATION = Function("nvmlDeviceGetUtilizationRates")
_GET_TEMPERATURE = Function("nvmlDeviceGetTemperature")
_GET_POWER = Function("nvmlDeviceGetPowerUsage")
_GET_POWER_LIMIT = Function("nvmlDeviceGetEnforcedPowerLimit")
_GET_ENERGY = Function("nvmlDeviceGetTotalEnergyConsumption")
_GET_CLOCK = Function("nvmlDeviceGetClockInfo")
_GET_PCIE = Function("nvmlDeviceGetPcieThroughput")
_GET_CLOCK_EVENTS = Function("nvmlDeviceGetCurrentClocksEventReasons",
                             "nvmlDeviceGetCurrentClocksThrottleReasons")
_GET_ECC = Function("nvmlDeviceGetTotalEccErrors")
_GET_REMAPPED_ROWS = Function("nvmlDeviceGetRemappedRows")

class Query(NamedTuple):
    """One thing read from a GPU; turned off on its own when the GPU does not support it.

    `build` runs at the query's first read, on the sampler's thread: it asks NVML once what
    does not change (how many NVLinks, which MIG instances, whether there is GPM), makes the
    output structs, their pointers and the keys, and returns the reader each sample runs.
    A build that fails is tried again at the next sample, unless the query is turned off.
    """

    name: str
    build: Callable[[Gpu], Reader]


def _utilization(dev: Gpu) -> Reader:
    rates = pynvml().c_nvmlUtilization_t()
    args = (dev.handle, ctypes.byref(rates))
    values = unpacker(members(type(rates), ("gpu", "memory")))
    keys = dev.keys("utilization_percent", "memory_utilization_percent")

    def read(out: Readings) -> None:
        _GET_UTILIZATION(*args)
        out.gauges.update(zip(keys, values(rates), strict=True))

    return read


def _memory(dev: Gpu) -> Reader:
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


def _scalars(*scalars: _Scalar) -> Callable[[Gpu], Reader]:
    """A query of one-number calls: all made, then all put (a failure leaves out them all)."""

    def build(dev: Gpu) -> Reader:
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


def _nvlink(dev: Gpu) -> Reader:
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
            field_value(kind, raw) for kind, raw in zip(kinds, raws, strict=True)]
        if ok is every:
            tx, rx, at_us = sum(values[:links]), sum(values[links:]), max(stamps)
        else:
            tx = sum(values[i] for i in ok if i < links)
            rx = sum(values[i] for i in ok if i >= links)
            at_us = max(stamps[i] for i in ok)
        out.counters[tx_key] = (tx * _KIB, at_us / _MEGA)
        out.counters[rx_key] = (rx * _KIB, at_us / _MEGA)

    return read


def _clock_events(dev: Gpu) -> Reader:
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


def _remapped_rows(dev: Gpu) -> Reader:
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


def _trainer_memory(dev: Gpu) -> Reader:
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
    Query("mig", mig.instance_memory),
    Query("gpm", gpm.interval_averages),
)
