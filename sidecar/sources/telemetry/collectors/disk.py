"""Usage of the file systems holding the state dir and the declared folders."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sidecar.log import log
from sidecar.sources.telemetry.collectors import Part
from sidecar.sources.telemetry.collectors.probe import HostProbe
from sidecar.sources.telemetry.readings import Readings


class DiskUsageCollector:
    """Usage of the file systems holding the state dir and the declared folders."""

    def __init__(self, probe: HostProbe, paths: Sequence[Path]) -> None:
        self.probe = probe
        self.paths = tuple(paths)
        self._mounts: dict[Path, tuple[int, str]] = {}  # path -> (its device, mount point)

    def read(self) -> Readings:
        out = Readings()
        for mount in sorted({self._mount_of(p) for p in self.paths}):
            try:
                total, used, available = self.probe.disk_usage(mount)
            except OSError as exc:
                log.debug("disk usage of %s unavailable: %s", mount, exc)
                continue
            name = mount.strip("/").replace("/", "_") or "root"
            out.gauges.update({f"fs/{name}/total_bytes": total, f"fs/{name}/used_bytes": used,
                               f"fs/{name}/available_bytes": available})
        return out

    def _mount_of(self, path: Path) -> str:
        """The mount point of `path`, walked up to once and again only when the path moved to
        another device (something was mounted or unmounted on the way): one stat a sample."""
        try:
            device = os.stat(path).st_dev
        except OSError:  # not there (yet): its nearest existing parent's
            return _mount_point(path)
        known = self._mounts.get(path)
        if known is None or known[0] != device:
            known = self._mounts[path] = (device, _mount_point(path))
        return known[1]


def _mount_point(path: Path) -> str:
    """The mount point of `path`, or of its nearest existing parent."""
    current = os.path.abspath(path)
    while not os.path.ismount(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def disk_part(disks: DiskUsageCollector, timeout_s: float) -> Part:
    return Part("disk-usage", "disk usage", lambda _: disks.read(), timeout_s)
