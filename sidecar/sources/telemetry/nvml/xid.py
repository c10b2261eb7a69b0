"""XID critical errors: a thread waits on NVML's events for them; the sampler drains them."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sidecar.log import log
from sidecar.sources.telemetry.nvml.bindings import (
    TIMEOUT,
    Handle,
    NvmlError,
    call,
    handle_address,
)

if TYPE_CHECKING:
    from sidecar.sources.telemetry.nvml.handle import Gpu


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

    def __init__(self, devices: Iterable[Gpu]) -> None:
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
            event_set = call("nvmlEventSetCreate")
        except NvmlError as exc:
            log.debug("no XID events: %s", exc)
            return
        try:
            if self._register(event_set):
                self._wait_loop(event_set)
        finally:
            try:
                call("nvmlEventSetFree", event_set)
            except NvmlError as exc:
                log.debug("freeing the NVML event set failed: %s", exc)

    def _register(self, event_set: Any) -> bool:
        registered = False
        for device in self._by_address.values():
            try:
                call("nvmlDeviceRegisterEvents", device.handle, _XID_CRITICAL_ERROR, event_set)
                registered = True
            except NvmlError as exc:
                log.debug("%s: no XID events: %s", device.describe(), exc)
        return registered

    def _wait_loop(self, event_set: Any) -> None:
        while not self._stop.is_set():
            try:
                data = call("nvmlEventSetWait_v2", event_set, XID_WAIT_MS)
            except NvmlError as exc:
                if exc.code == TIMEOUT:
                    continue
                # the events registered are gone (a GPU lost, the driver reset): the failure
                # summary can no longer name an XID, which the operator must know
                log.warning("XID events are no longer watched: waiting for them failed (%s); "
                            "the GPUs are still sampled", exc)
                return
            device = self._by_address.get(handle_address(Handle(data.device)))
            if device is None or not int(data.eventType) & _XID_CRITICAL_ERROR:
                continue
            xid = int(data.eventData)
            # kept before it is said: a failure of the saying does not lose it
            self._events.append(XidEvent(device.index, xid, time.time()))
            log.warning("%s reported XID %d (a critical error; see NVIDIA's XID catalogue)",
                        device.describe(), xid)
