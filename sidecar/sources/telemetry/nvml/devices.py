"""The job's GPUs opened through NVML, each a `GpuDevice` that reads its queries one by one.

A query the device does not support (NOT_SUPPORTED, FUNCTION_NOT_FOUND with an older driver,
NO_PERMISSION) is turned off for that device at its first failure and never retried; the other
queries go on. GPU_IS_LOST marks the device lost. Any other error leaves that query's values out
of this one sample.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.log import log
from sidecar.sources.telemetry.gpus import GpuFilter
from sidecar.sources.telemetry.nvml.bindings import (
    Handle,
    NvmlError,
    device_count,
    device_handle,
    device_name,
    device_uuid,
    init,
)
from sidecar.sources.telemetry.nvml.handle import Gpu, Reader
from sidecar.sources.telemetry.nvml.mig import mig_devices
from sidecar.sources.telemetry.nvml.queries import QUERIES, Query
from sidecar.sources.telemetry.readings import Readings


class GpuDevice(Gpu):
    """One GPU the sampler reads: its identity, the queries still on, and their readers."""

    def __init__(self, index: int, handle: Handle, uuid: str, name: str,
                 mig_filter: Callable[[str], bool] | None = None) -> None:
        super().__init__(index, handle, uuid, name, mig_filter)
        self.disabled: dict[str, str] = {}  # query name -> why it was turned off
        self.lost: str | None = None  # why the GPU is gone, once it is
        self.errors = 0
        self._on = list(QUERIES)  # the queries not turned off
        self._readers: dict[str, Reader] = {}  # query name -> its reader, once built

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
