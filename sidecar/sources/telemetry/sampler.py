"""The /hardware sampler: the loop over the collectors (collectors/: the host, disk usage, each
GPU through NVML in nvml/), on the GPUs gpus.py chooses.

Every `interval_s`, on a fixed schedule that does not drift, one sample becomes one `/hardware`
payload (docs/ingest.md#routes-and-bodies) with this node's name. Keys are slash-separated
with the unit last (docs/ingest.md#nodes-and-ranks): `gpu/0/power_watts`,
`net/eth0/rx_bytes_per_second`, `ib/mlx5_0/1/tx_bytes_per_second`.

A sample's reads (the host, each GPU, disk usage) run one after another on one worker thread,
each with its own timeout: a GPU fallen off the bus, or a dead NFS mount under the state dir,
is left to that thread, and the reads after it go on on another. While a thread is still stuck
in a read, that read is skipped, and it resumes once the thread comes back. The event loop, and
so log forwarding, never waits on a read.

Counters become rates from consecutive readings (`readings.Rates`): the first reading gives no
rate, and a counter that went backwards (reset, wrap, a new process) gives none for that
interval rather than a negative or a spike. A value that could not be read is left out, never
sent as zero.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sidecar.log import log
from sidecar.records import MAX_POINTS_PER_REQUEST, iso_ts
from sidecar.sources.telemetry.collectors import Part, Sample
from sidecar.sources.telemetry.collectors.disk import DiskUsageCollector, disk_part
from sidecar.sources.telemetry.collectors.gpu import gpu_part
from sidecar.sources.telemetry.collectors.host import HostCollector, host_part
from sidecar.sources.telemetry.collectors.infiniband import InfinibandCollector
from sidecar.sources.telemetry.collectors.probe import HostProbe
from sidecar.sources.telemetry.gpus import GpuFilter, PodGpus
from sidecar.sources.telemetry.nvml.bindings import NVML_TIMEOUT_S, NvmlError
from sidecar.sources.telemetry.nvml.devices import GpuDevice, discover
from sidecar.sources.telemetry.nvml.xid import XidEvent, XidWatcher
from sidecar.sources.telemetry.readings import Rates, Readings
from sidecar.supervise import fault_point
from sidecar.threads import Worker

Emit = Callable[[str, dict[str, Any]], None]

HOST_TIMEOUT_S = 5.0  # the same for the psutil/sysfs read and for disk usage
MAX_XIDS_KEPT = 64  # the run's XID events kept for the failure summary
# an XID of a GPU the pod may still come to use is held this long for it: the XID of a GPU
# that fails as the trainer first touches it comes before NVML lists the trainer there
XID_HELD_S = 60.0


class SamplerStats:
    """What the status endpoint shows of the sampler."""

    __slots__ = ("disabled", "gpu_status", "gpus", "last_sample_s", "samples", "skipped_reads")

    def __init__(self) -> None:
        self.samples = 0
        self.last_sample_s: float | None = None  # how long the last sample took
        self.gpus = 0  # GPUs being sampled
        self.gpu_status = "not started"  # how many GPUs, or why there is no GPU telemetry
        self.skipped_reads = 0  # reads skipped because the worker's previous read still hangs
        self.disabled: dict[str, dict[str, str]] = {}  # "gpu/0": {query: why}


class _Sweep:
    """One sample's reads, run one after another on one worker thread.

    One hand-off to a thread and back per sample: a thread for each read cost more CPU in
    wake-ups and GIL hand-offs than eight GPUs' reads themselves. `current` tells the loop which
    read runs and since when, so that it tells a read that hangs from a sample that is merely
    long; it then leaves the hung read to that thread and hands the reads after it to another.

    The thread also makes each read's gauges into the payload's points (`gauge_points`), while
    they are in its CPU's cache: the loop's thread, finding them in the other core's, took up
    to twice as long over the same points.
    """

    def __init__(self, parts: Sequence[Part], ts: str) -> None:
        self.parts = parts
        self.ts = ts  # the sample's time, as its points carry it
        self.results: dict[str, Readings] = {}
        self.gauge_points: dict[str, list[dict[str, Any]]] = {}
        self.errors: dict[str, Exception] = {}
        self.sample = Sample()  # what its reads hand on to those after them
        self.current = (0, time.monotonic())  # the read running, and when it began
        self.runner: object | None = None  # the one thread that may go on reading

    def run(self, start: int, runner: object) -> None:
        """The reads from `start` on, while `runner` is still the one that may go on."""
        for index in range(start, len(self.parts)):
            if self.runner is not runner:  # given up on: the loop went on without this thread
                return
            part = self.parts[index]
            self.current = (index, time.monotonic())
            try:
                readings = part.read(self.sample)
            except Exception as exc:  # one failing read never stops the others
                self.errors[part.name] = exc
                continue
            self.gauge_points[part.name] = _gauge_points(readings.gauges, self.ts)
            self.results[part.name] = readings


def _gauge_points(gauges: dict[str, float], ts: str) -> list[dict[str, Any]]:
    """The payload's points of a read's gauges, but those not finite (never sent)."""
    finite = math.isfinite
    if finite(sum(gauges.values())):  # a NaN or infinity would make the sum one
        return [{"key": k, "value": v, "ts": ts} for k, v in gauges.items()]
    return [{"key": k, "value": v, "ts": ts} for k, v in gauges.items() if finite(v)]


class HardwareSampler:
    """Samples this node every `interval_s` and emits each sample to `/hardware`."""

    def __init__(self, *, run_id: str, node: str, interval_s: float, emit: Emit,
                 gpu_filter: GpuFilter | None,
                 trainer_pid: Callable[[], int | None] | None,
                 disk_paths: Sequence[Path], sysfs_root: Path = Path("/sys"),
                 nvml_timeout_s: float = NVML_TIMEOUT_S,
                 host_timeout_s: float = HOST_TIMEOUT_S, probe: HostProbe | None = None,
                 gpus: bool = True, by_processes: bool = False, gpu_rule: str = "") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: the sampler needs a positive period")
        self.run_id = run_id
        self.node = node
        self.interval_s = interval_s
        self.emit = emit
        self.gpu_filter = gpu_filter
        self.nvml_timeout_s = nvml_timeout_s
        self.host_timeout_s = host_timeout_s
        self.use_gpus = gpus
        self.by_processes = by_processes  # of the GPUs the filter allows, those the pod uses
        self.gpu_rule = gpu_rule or (f"those {gpu_filter.describe()} names" if gpu_filter
                                     else "every GPU this node shows")
        self._pod: PodGpus[GpuDevice] | None = None  # by_processes: GPUs the pod may come to use
        self._count = 0  # the GPUs the node shows
        probe = probe or HostProbe()
        self._rates = Rates()
        self._devices: list[GpuDevice] = []
        self._host_part = host_part(HostCollector(probe, trainer_pid),
                                    InfinibandCollector(sysfs_root), host_timeout_s)
        self._disk_part = disk_part(DiskUsageCollector(probe, disk_paths), host_timeout_s)
        self._gpu_parts: dict[str, Part] = {}
        self._worker: Worker | None = None  # the thread sweeps run on
        self._stuck: dict[str, Worker] = {}  # part -> the thread left behind in it
        self._stalled: set[str] = set()  # parts said to hang, until they answer again
        self._xid: XidWatcher | None = None
        self.xids: collections.deque[XidEvent] = collections.deque(maxlen=MAX_XIDS_KEPT)
        self._xids_held: list[XidEvent] = []  # of GPUs the pod may come to use
        self._gpu_readings: list[Readings] = []  # the last sample's, for gpu_gauges
        self._stats = SamplerStats()
        self._started = False

    @property
    def gpu_gauges(self) -> dict[str, float]:
        """The last sample's GPU gauges, for a stall line."""
        return {k: v for readings in self._gpu_readings for k, v in readings.gauges.items()}

    @property
    def stats(self) -> SamplerStats:
        self._stats.gpus = len(self._devices)
        self._stats.disabled = {d.key: dict(d.disabled) for d in self._devices if d.disabled}
        return self._stats

    async def run(self) -> None:
        """Sample on a fixed schedule until cancelled; a late sample skips the ticks it missed."""
        try:
            await self.sample_forever()
        finally:
            self.close()

    async def sample_forever(self) -> None:
        """Sample on a fixed schedule until cancelled, leaving the workers to `close()`: a
        supervisor may call it again after a failure."""
        loop = asyncio.get_running_loop()
        await self.start()
        start = loop.time()
        tick = 0
        while True:
            fault_point()
            await self.sample_once()
            tick = max(tick + 1, math.floor((loop.time() - start) / self.interval_s) + 1)
            await asyncio.sleep(start + tick * self.interval_s - loop.time())

    async def start(self) -> None:
        """Open the job's GPUs (once); without NVML, say why at INFO and sample the rest. A
        fault of ours on the way is not taken for "no GPU": the supervisor's restart of the
        sampling looks again."""
        if self._started:
            return
        self._started = True
        try:
            await self._open_gpus()
        except Exception:
            self._started = False
            raise

    async def _open_gpus(self) -> None:
        if not self.use_gpus:
            self._stats.gpu_status = "GPU sampling off"
            return
        worker = self._sweeper()
        try:
            devices, count = await worker.call(lambda: discover(self.gpu_filter),
                                               self.nvml_timeout_s)
        except NvmlError as exc:
            self._no_gpus(exc.reason())
            return
        except TimeoutError:
            self._leave(worker)
            self._no_gpus(f"NVML did not answer within {self.nvml_timeout_s:g} s")
            return
        if not devices:
            self._no_gpus("no NVIDIA GPU found" if count == 0 or self.gpu_filter is None else
                          f"{self.gpu_filter.describe()} selects none of this node's "
                          f"{count} GPUs")
            return
        self._count = count
        if self.by_processes:
            self._pod = PodGpus(devices)
            self._stats.gpu_status = f"0 of {count} GPUs (none used by this pod yet)"
            log.info("GPUs sampled: %s; none runs one of them yet", self.gpu_rule)
        else:
            self._select(devices)
            log.info("GPUs sampled: %s: %d, %s", self.gpu_rule, len(devices),
                     ", ".join(f"{d.index} {d.name}" for d in devices))
        self._xid = XidWatcher(devices)
        self._xid.start()

    def _select(self, devices: list[GpuDevice]) -> None:
        """Sample `devices` from now on, beside those sampled already."""
        self._devices += devices
        self._gpu_parts.update({d.key: gpu_part(d, self.nvml_timeout_s) for d in devices})
        self._stats.gpu_status = f"{len(self._devices)} of {self._count} GPUs"

    async def _select_used_by_the_pod(self) -> None:
        """Add the GPUs on which a process of this pod now runs; a GPU once the job's stays."""
        if self._pod is None or not self._pod.candidates:
            return
        worker = self._sweeper()
        try:
            used = await worker.call(self._pod.used, self.nvml_timeout_s)
        except TimeoutError:
            self._leave(worker)
            return
        if used:
            self._pod.taken(used)
            self._select(used)
            log.info("sampling GPU(s) %s: this pod's processes run on them",
                     ", ".join(f"{d.index} {d.name}" for d in used))

    def _no_gpus(self, reason: str) -> None:
        self._stats.gpu_status = reason
        log.info("no GPU telemetry on this node: %s; CPU, memory, disk and network are sampled",
                 reason)

    def close(self) -> None:
        """Stop the XID watcher and the workers; a worker stuck in a call is left behind."""
        if self._xid is not None:
            self._xid.stop()
        for worker in [self._worker, *self._stuck.values()]:
            if worker is not None:
                worker.stop()

    async def sample_once(self) -> None:
        """Read everything once and emit the sample."""
        await self.start()
        began = time.perf_counter()
        if self.by_processes:
            await self._select_used_by_the_pod()
        gpu_parts = [self._gpu_parts[d.key] for d in self._devices]
        in_order = [self._host_part, self._disk_part, *gpu_parts]  # the order points go out in
        sweep = _Sweep(self._ready([self._host_part, *gpu_parts, self._disk_part]),
                       iso_ts(time.time()))
        await self._run(sweep)
        answered = [part.name for part in in_order if self._collect(part, sweep)]
        self._gpu_readings = [sweep.results[p.name] for p in gpu_parts if p.name in sweep.results]
        self._forget_lost()
        self._emit(self._points(sweep, answered))
        self._stats.samples += 1
        self._stats.last_sample_s = time.perf_counter() - began

    def _ready(self, parts: list[Part]) -> list[Part]:
        """The parts to read now: not those whose thread is still stuck in their last read."""
        ready = []
        for part in parts:
            stuck = self._stuck.get(part.name)
            if stuck is not None and stuck.busy:
                self._stats.skipped_reads += 1
                continue
            self._stuck.pop(part.name, None)
            ready.append(part)
        return ready

    async def _run(self, sweep: _Sweep) -> None:
        """The sweep's reads on the sampler's thread. A read that outlives its timeout is left
        to that thread, said once, and the reads after it go on on a new one."""
        start = 0
        while start < len(sweep.parts):
            worker = self._sweeper()
            runner = sweep.runner = object()
            sweep.current = (start, time.monotonic())
            done = worker.submit(functools.partial(sweep.run, start, runner))
            try:
                hung = await _hung_read(sweep, done)
            except asyncio.CancelledError:  # the thread stops after the read it is in
                sweep.runner = None
                self._stuck[sweep.parts[sweep.current[0]].name] = worker
                self._leave(worker)
                raise
            if hung is None:
                return
            part = sweep.parts[hung]
            self._stuck[part.name] = worker
            self._leave(worker)
            self._stalled.add(part.name)
            log.warning("%s did not answer within %g s: left out of the samples until it does",
                        part.what, part.timeout_s)
            start = hung + 1

    def _collect(self, part: Part, sweep: _Sweep) -> bool:
        """Whether the part was read; says so when it answers again, or why it failed."""
        read = part.name in sweep.results
        if read and part.name in self._stalled:
            self._stalled.discard(part.name)
            log.info("%s answers again", part.what)
        error = sweep.errors.get(part.name)
        if error is not None:
            log.warning("reading %s failed: %s", part.what, error)
        return read

    def _sweeper(self) -> Worker:
        if self._worker is None:
            self._worker = Worker("sample")
        return self._worker

    def _leave(self, worker: Worker) -> None:
        """Leave `worker` to its stuck read: it ends once that returns; reads go to a new one."""
        worker.stop()
        if self._worker is worker:
            self._worker = None

    def _forget_lost(self) -> None:
        for device in [d for d in self._devices if d.lost]:
            log.warning("%s is lost (%s): no longer sampled", device.describe(), device.lost)
            self._devices.remove(device)
            del self._gpu_parts[device.key]

    def _points(self, sweep: _Sweep, parts: list[str]) -> list[dict[str, Any]]:
        """The parts' gauges, then their counters' rates, in the parts' order."""
        points = []
        for name in parts:
            points += sweep.gauge_points[name]
        rates, ts = self._rates, sweep.ts
        for name in parts:
            readings = sweep.results[name]
            for key in readings.restarted:
                rates.forget(key)
            for key, (value, at_s) in readings.counters.items():
                rate = rates.rate(key, value, at_s)
                if rate is not None and math.isfinite(rate):
                    points.append({"key": f"{key}_per_second", "value": rate, "ts": ts})
        if self._xid is not None:
            maybe = {d.index for d in self._pod.candidates} if self._pod is not None else set()
            xids, self._xids_held = ours(
                [*self._xids_held, *self._xid.drain()], {d.index for d in self._devices},
                maybe, time.time())
            self.xids.extend(xids)
            points += [{"key": f"gpu/{e.index}/xid_code", "value": e.xid, "ts": iso_ts(e.at_s)}
                       for e in xids]
        return points

    def _emit(self, points: list[dict[str, Any]]) -> None:
        for start in range(0, len(points), MAX_POINTS_PER_REQUEST):
            self.emit("hardware", {"run_id": self.run_id, "node": self.node,
                                   "points": points[start:start + MAX_POINTS_PER_REQUEST]})


def ours(events: Sequence[XidEvent], sampled: set[int], maybe: set[int],
         now: float) -> tuple[list[XidEvent], list[XidEvent]]:
    """The XIDs to post now (of a GPU sampled), and those to hold (of a GPU the pod may yet
    use, for XID_HELD_S): another pod's GPU's XIDs are not ours, and one drained before its GPU
    was known to be the pod's was dropped for good."""
    posted = [e for e in events if e.index in sampled]
    held = [e for e in events
            if e.index not in sampled and e.index in maybe and now - e.at_s < XID_HELD_S]
    return posted, held[-MAX_XIDS_KEPT:]


class _ReadHung(Exception):
    """A sweep's read `index` outlived its timeout: how the watchdog ends the wait for it."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


async def _hung_read(sweep: _Sweep, done: asyncio.Future[None]) -> int | None:
    """Wait for the sweep to end: None once it has, or the index of the read that outlived
    its timeout. One timer watches, due when the read in progress would time out, or sooner
    when a read after it could (it cannot see one begin): the loop never wakes while a sample
    is merely quick, and a quick sample costs that one timer (asyncio.wait's own futures and
    callbacks, one more wake-up of the loop, cost 25 us a sample)."""
    loop = asyncio.get_running_loop()
    shortest_s = min(part.timeout_s for part in sweep.parts)
    timer: asyncio.TimerHandle

    def watch() -> None:
        nonlocal timer
        if done.done():
            return
        index, began = sweep.current
        left = began + sweep.parts[index].timeout_s - time.monotonic()
        if left <= 0 and sweep.current == (index, began):
            done.set_exception(_ReadHung(index))
        else:
            timer = loop.call_later(min(max(left, 0.0), shortest_s), watch)

    timer = loop.call_later(shortest_s, watch)  # no read can time out sooner
    try:
        await done
    except _ReadHung as hung:
        return hung.index
    finally:
        timer.cancel()
    return None
