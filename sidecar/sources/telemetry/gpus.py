"""Which of the node's GPUs are the job's: `--gpus`, else the job's CUDA_VISIBLE_DEVICES or
NVIDIA_VISIBLE_DEVICES (indexes, UUIDs, MIG instances), else in a pod those its processes run
on, else every GPU the node shows."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from sidecar.log import log
from sidecar.sources.telemetry.nvml.bindings import NvmlError
from sidecar.sources.telemetry.nvml.processes import ProcessList

if TYPE_CHECKING:
    from sidecar.sources.telemetry.nvml.handle import Gpu

G = TypeVar("G", bound="Gpu")  # the GPUs picked among are handed back as they came


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


class GpuChoice(NamedTuple):
    """Which of the node's GPUs are the job's, and the rule that says so (said once at INFO)."""

    filter: GpuFilter | None  # the GPUs that may be the job's; None: every GPU the node shows
    by_processes: bool  # of those, only the ones on which this pod's processes run
    rule: str


def choose_gpus(option: str, child_env: Mapping[str, str], environ: Mapping[str, str], *,
                watching: bool, proc: Path = Path("/proc")) -> GpuChoice:
    """The job's GPUs by the first rule that applies: `--gpus`; the job's CUDA_VISIBLE_DEVICES
    or NVIDIA_VISIBLE_DEVICES naming them; for a pod sidecar (`watch` in Kubernetes) that shares
    the pod's process namespace, those on which the pod's processes run; else every GPU the
    node shows. (The kubelet's pod-resources socket, which names a pod's devices, is not read.)
    """
    if option:
        return GpuChoice(gpu_filter_from_option(option), False, f"those --gpus names ({option})")
    named = gpu_filter_from_env(child_env)
    if named is not None:
        return GpuChoice(named, False, f"those {named.describe()} names")
    in_a_pod = "KUBERNETES_SERVICE_HOST" in environ or "POD_NAME" in environ
    if watching and in_a_pod:
        if shares_process_namespace(proc):
            return GpuChoice(None, True, "those on which this pod's processes run (NVML's "
                             "process list; --gpus names them otherwise)")
        return GpuChoice(None, False, "every GPU this node shows, other pods' too: this pod's "
                         "processes are not visible to the sidecar (`shareProcessNamespace: "
                         "true` in the pod's spec shows them); --gpus names the job's")
    return GpuChoice(None, False, "every GPU this node shows (nothing names the job's: --gpus, "
                     "CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES would)")


def shares_process_namespace(proc: Path = Path("/proc")) -> bool:
    """Whether this container sees its pod's processes: PID 1 is the pod's pause process, as
    with `shareProcessNamespace: true`, not this container's own entrypoint."""
    try:
        argv0 = (proc / "1" / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0) == b"pause"


def pod_pids(proc: Path = Path("/proc")) -> frozenset[int]:
    """The processes this one sees but itself: in a pod sharing its process namespace, the
    pod's (the trainer's among them)."""
    ours = os.getpid()
    try:
        return frozenset(int(name) for name in os.listdir(proc)
                         if name.isdigit() and int(name) != ours)
    except OSError:
        return frozenset()


class PodGpus(Generic[G]):
    """For a pod sidecar that sees its pod's processes: the job's GPUs, found among the
    `candidates` as those on which one of the pod's processes runs (NVML's process lists).
    A GPU once found stays the job's."""

    def __init__(self, candidates: list[G]) -> None:
        self.candidates = candidates  # the GPUs not seen used yet
        self._process_lists: dict[str, ProcessList] = {}

    def used(self) -> list[G]:
        """The candidate GPUs whose compute processes include one of this pod's (a thread)."""
        pids = pod_pids()
        used = []
        for device in self.candidates:
            processes = self._process_lists.get(device.key)
            if processes is None:
                processes = self._process_lists[device.key] = ProcessList(device.handle)
            try:
                running = processes.read()
            except NvmlError as exc:
                log.debug("%s: its processes cannot be listed: %s", device.describe(), exc)
                continue
            if any(pid in pids for pid, _ in running):
                used.append(device)
        return used

    def taken(self, used: list[G]) -> None:
        """`used` are the job's from now on: no longer candidates."""
        self.candidates = [d for d in self.candidates if d not in used]
