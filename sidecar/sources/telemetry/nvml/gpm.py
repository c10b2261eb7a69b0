"""GPM (Hopper and newer): metrics averaged by the GPU over the interval between two samples."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from sidecar.sources.telemetry.nvml.bindings import (
    FUNCTION_NOT_FOUND,
    NOT_SUPPORTED,
    Function,
    NvmlError,
    call,
    constant,
    pynvml,
)
from sidecar.sources.telemetry.nvml.structs import members, unpacker
from sidecar.sources.telemetry.readings import Readings

if TYPE_CHECKING:
    from sidecar.sources.telemetry.nvml.handle import Gpu, Reader

# GPM metrics (Hopper and newer), interval averages between two GPM samples: nvmlGpmMetricId_t.
GPM_METRICS: dict[int, str] = {
    2: "sm_active_percent",  # NVML_GPM_METRIC_SM_UTIL
    3: "sm_occupancy_percent",  # NVML_GPM_METRIC_SM_OCCUPANCY
    5: "tensor_active_percent",  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    10: "dram_bandwidth_percent",  # NVML_GPM_METRIC_DRAM_BW_UTIL
}

_GPM_SAMPLE_GET = Function("nvmlGpmSampleGet")
_GPM_METRICS_GET = Function("nvmlGpmMetricsGet")


class GpmSampler:
    """Two GPM sample buffers, and a metrics request for each order of them, kept for a
    device: each read takes a new sample into one buffer, in turn, and averages the metrics
    over the interval since the sample in the other."""

    def __init__(self, dev: Gpu) -> None:
        nv = pynvml()
        if not hasattr(nv, "c_nvmlGpmMetricsGet_t"):
            raise NvmlError(FUNCTION_NOT_FOUND, "nvidia-ml-py predates GPM")
        self._handle = dev.handle
        first: Any = call("nvmlGpmSampleAlloc")
        second: Any = call("nvmlGpmSampleAlloc")
        # each turn: the buffer the new sample goes into, the request from the other to it
        self._turns = [(second, self._request(first, second)),
                       (first, self._request(second, first))]
        self._turn = 1
        self._primed = False  # whether the other buffer holds the sample before
        metric_type = nv.c_nvmlGpmMetric_t
        base = nv.c_nvmlGpmMetricsGet_t.metrics.offset
        size = ctypes.sizeof(metric_type)
        self._results = unpacker([
            m for slot in range(len(GPM_METRICS))
            for m in members(metric_type, ("nvmlReturn", "value"), base + slot * size)])
        self._keys = dev.keys(*GPM_METRICS.values())

    @staticmethod
    def _request(earlier: Any, later: Any) -> Any:
        request = pynvml().c_nvmlGpmMetricsGet_t()
        request.version = constant("NVML_GPM_METRICS_GET_VERSION", 1)
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


def interval_averages(dev: Gpu) -> Reader:
    """GPM interval averages (Hopper and newer); the first read only primes the buffers."""
    support = call("nvmlGpmQueryDeviceSupport", dev.handle)
    if not int(support.isSupportedDevice):
        raise NvmlError(NOT_SUPPORTED, "no GPM on this GPU")
    return GpmSampler(dev).read
