"""One GPU as each NVML query sees it (its NVML handle, index and UUID, the keys its values go
under, the MIG instances to report, the trainer's processes on it) and the `Reader` a query
builds for it. `devices.GpuDevice` adds which queries are on; the queries (queries.py, gpm.py,
mig.py), the XID watcher and the pod's GPU picker take a `Gpu`, so none of them imports the
module that builds them."""

from __future__ import annotations

from collections.abc import Callable

from sidecar.sources.telemetry.nvml.bindings import Handle
from sidecar.sources.telemetry.readings import Readings

Reader = Callable[[Readings], None]  # what a query builds for one GPU: it adds its values


class Gpu:
    """A GPU's identity and what its queries read it with."""

    def __init__(self, index: int, handle: Handle, uuid: str, name: str,
                 mig_filter: Callable[[str], bool] | None = None) -> None:
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.name = name
        self.key = f"gpu/{index}"
        self.mig_filter = mig_filter  # which MIG instances to report; None: all of them
        self.trainer_pids: frozenset[int] | None = None  # set by each read; None: not known

    def describe(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    def keys(self, *names: str) -> tuple[str, ...]:
        return tuple(f"{self.key}/{name}" for name in names)
