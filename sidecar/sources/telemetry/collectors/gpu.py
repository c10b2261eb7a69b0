"""One GPU's read in a sample (nvml/devices.py), counting the trainer's GPU memory by the pids
the host read found."""

from __future__ import annotations

from sidecar.sources.telemetry.collectors import Part
from sidecar.sources.telemetry.nvml.devices import GpuDevice


def gpu_part(device: GpuDevice, timeout_s: float) -> Part:
    return Part(device.key, device.describe(), lambda sample: device.read(sample.trainer_pids),
                 timeout_s)
