"""InfiniBand and RoCE: per device and port traffic and error counters from sysfs."""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.log import log
from sidecar.sources.telemetry import procfs
from sidecar.sources.telemetry.readings import Readings

IB_WORD_BYTES = 4  # port_xmit_data / port_rcv_data count 4-byte words (IB spec, PortCounters)
SATURATED = (2**32 - 1, 2**64 - 1)  # IB counters stop at their maximum instead of wrapping

# counters/ files that are data or packet counters: (sysfs name, key, multiplier).
IB_TRAFFIC = (
    ("port_xmit_data", "tx_bytes", IB_WORD_BYTES),
    ("port_rcv_data", "rx_bytes", IB_WORD_BYTES),
    ("port_xmit_packets", "tx_packets", 1),
    ("port_rcv_packets", "rx_packets", 1),
)
# Error counters posted as totals (`<name>_count`), from counters/ and RoCE's hw_counters/.
IB_ERRORS = (
    ("counters", "symbol_error"), ("counters", "link_error_recovery"),
    ("counters", "link_downed"), ("counters", "port_rcv_errors"),
    ("counters", "port_rcv_remote_physical_errors"), ("counters", "port_rcv_switch_relay_errors"),
    ("counters", "port_xmit_discards"), ("counters", "port_xmit_constraint_errors"),
    ("counters", "port_rcv_constraint_errors"), ("counters", "local_link_integrity_errors"),
    ("counters", "excessive_buffer_overrun_errors"), ("counters", "VL15_dropped"),
    ("hw_counters", "out_of_sequence"), ("hw_counters", "packet_seq_err"),
    ("hw_counters", "local_ack_timeout_err"), ("hw_counters", "rnr_nak_retry_err"),
)


class InfinibandCollector:
    """Per device and port traffic and error counters from <sysfs>/class/infiniband.

    A port has twenty counter files: each is kept open (`procfs.ProcFile`), read again from
    its start each sample; a port that went (its files fail) has them opened anew by path."""

    def __init__(self, sysfs_root: Path) -> None:
        self.root = sysfs_root / "class" / "infiniband"
        self._saturated: set[str] = set()
        self._files: dict[str, procfs.ProcFile] = {}

    def read(self, now_s: float) -> Readings:
        out = Readings()
        for device, port, folder in self._ports():
            prefix = f"ib/{device}/{port}"
            for filename, key, scale in IB_TRAFFIC:
                value = self._read_int(f"{folder}/counters/{filename}")
                if value is None or self._saturated_now(f"{prefix}/{filename}", value):
                    continue
                out.counters[f"{prefix}/{key}"] = (value * scale, now_s)
            for kind, filename in IB_ERRORS:
                value = self._read_int(f"{folder}/{kind}/{filename}")
                if value is not None:
                    out.gauges[f"{prefix}/{filename.lower()}_count"] = value
        return out

    def _read_int(self, path: str) -> int | None:
        file = self._files.get(path)
        if file is None:
            file = self._files[path] = procfs.ProcFile(path)
        try:
            return int(file.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _ports(self) -> list[tuple[str, str, str]]:
        """(device, port, folder) of every port, in name order; none without InfiniBand."""
        try:
            devices = sorted(os.listdir(self.root))
        except OSError:
            return []
        ports = []
        for device in devices:
            folder = f"{self.root}/{device}/ports"
            try:
                ports += [(device, port, f"{folder}/{port}") for port in sorted(os.listdir(folder))]
            except OSError:
                continue
        return ports

    def _saturated_now(self, what: str, value: int) -> bool:
        if value not in SATURATED:
            return False
        if what not in self._saturated:
            self._saturated.add(what)
            log.info("%s is stuck at its maximum (a 32-bit counter saturates): "
                     "its rate is left out", what)
        return True
