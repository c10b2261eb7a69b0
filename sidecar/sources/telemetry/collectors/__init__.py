"""What the sampler reads each sample, one module a collector, each offering its read as a `Part`.

- host.py: CPU, load, memory, swap, disk I/O and network counters and the trainer's process
  tree, asked of probe.py (/proc, else psutil; processes.py keeps the table of parents); with
  InfiniBand's counters (infiniband.py) they make the sample's `host` read
- disk.py: usage of the file systems the run writes to
- gpu.py: one GPU's read (nvml/devices.py)

The sampler (`telemetry/sampler.py`) runs a sample's parts one after another on its worker
thread, each with its own timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from sidecar.sources.telemetry.readings import Readings


class Sample:
    """What a sample's reads hand on to those after them."""

    __slots__ = ("trainer_pids",)

    def __init__(self) -> None:
        self.trainer_pids: frozenset[int] | None = None  # the host read's, for the GPUs' reads


class Part(NamedTuple):
    """One read of a sample: its name (`host`, `disk-usage`, `gpu/0`), how a message names
    it, the read itself, and how long it may take before it counts as hung."""

    name: str
    what: str
    read: Callable[[Sample], Readings]
    timeout_s: float
