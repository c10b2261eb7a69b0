"""Why a run failed, from what the sidecar saw of it (docs/ingest.md#lines-the-sidecar-adds).

The evidence, strongest first: the kernel's OOM killer in the cgroup (a SIGKILL while a count
went up), a signature of the output table (sources/console/signatures.py) in its rank order
with an XID the sampler saw placed after CUDA out of memory, the signal the command died of, the
last exception line of a Python traceback, the last non-empty stderr line (stdout's when stderr
has none). Signatures and tracebacks are read on both streams, stderr's quoted first. The
summary is one line:

    [sidecar] run failed: exit status 1 after 2h13m; likely cause: CUDA out of memory
    (stderr: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB ...")
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any, NamedTuple

from sidecar.exits import EXIT_SIGNAL_BASE
from sidecar.log import format_duration
from sidecar.node import Node
from sidecar.sources.console.signatures import ONE_PIPE, TTY, Scanner
from sidecar.sources.telemetry.cgroup import OomKill
from sidecar.sources.telemetry.nvml.xid import XidEvent

# the last resort, in this order; on one terminal or one pipe both streams are one; stdout last (a
# command run with `2>&1` or through `| tee`)
LAST_LINE_STREAMS = ("stderr", TTY, ONE_PIPE, "stdout")
XID_AFTER = "cuda_oom"  # an XID is named after this row and before the rest of the table
_SIGNAL_CAUSES: dict[int, str] = {
    signal.SIGSEGV: "segmentation fault (SIGSEGV)",
    signal.SIGBUS: "bus error (SIGBUS)",
    signal.SIGABRT: "aborted (SIGABRT)",
    signal.SIGILL: "illegal instruction (SIGILL)",
    signal.SIGFPE: "floating-point exception (SIGFPE)",
    signal.SIGKILL: "killed by SIGKILL from outside (not the kernel's out-of-memory killer)",
}


class Failure(NamedTuple):
    """The facts of one failed run on one node."""

    exit_status: int
    duration_s: float
    cause: str
    signature: str  # the evidence's label: a table row, "host_oom_kill", "xid", "signal", ...
    stream: str = ""  # where the quote is from: stdout, stderr, cgroup, nvml; "" for none
    quote: str = ""
    node: str = ""
    rank: int = 0
    multi_node: bool = False
    stall: str = ""  # a stall before the end, and where the ranks were (docs/stalls.md)

    def line(self) -> str:
        """The summary line for /logs and the sidecar's own log (without a line end)."""
        where = f" on node {self.node} (rank {self.rank})" if self.multi_node else ""
        quoted = f" ({self.stream}: \"{self.quote}\")" if self.quote else ""
        stall = f"; {self.stall}" if self.stall else ""
        return (f"[sidecar] run failed{where}: exit status {self.exit_status} after "
                f"{format_duration(self.duration_s)}; likely cause: {self.cause}{quoted}{stall}")

    def to_json(self) -> dict[str, Any]:
        """/status's `failure`: the fields in order; `stall` only after one."""
        doc = self._asdict()
        if not self.stall:
            del doc["stall"]
        return doc


def diagnose(exit_status: int, duration_s: float, scanner: Scanner, node: Node,
             oom_kills: Sequence[OomKill] = (), xids: Sequence[XidEvent] = (),
             stall: str = "", forwarded: int = 0) -> Failure:
    """The likeliest cause of a failed run, from the evidence at hand. `forwarded`: the
    signal the wrapper forwarded to the command while it ran (the platform stopping the run),
    which is the cause whatever a launcher prints on its way out (torchrun's SignalException
    traceback)."""
    if forwarded and exit_status != 0 and not (
            exit_status == EXIT_SIGNAL_BASE + signal.SIGKILL and oom_kills):
        return Failure(exit_status, duration_s, f"killed by {_signal_name(forwarded)}",
                       "signal", "", "", node.name, node.rank, node.multi_node, stall)
    cause, signature, stream, quote = _cause(exit_status, scanner, oom_kills, xids)
    return Failure(exit_status, duration_s, cause, signature, stream, quote, node.name,
                   node.rank, node.multi_node, stall)


def _cause(exit_status: int, scanner: Scanner, oom_kills: Sequence[OomKill],
           xids: Sequence[XidEvent]) -> tuple[str, str, str, str]:
    signum = exit_status - EXIT_SIGNAL_BASE if exit_status > EXIT_SIGNAL_BASE else 0
    if signum == signal.SIGKILL and oom_kills:
        kill = oom_kills[0]
        limit = (f"cgroup memory limit {format_bytes(kill.limit_bytes)}"
                 if kill.limit_bytes is not None else "no cgroup memory limit")
        return (f"host out of memory: the kernel's OOM killer ({limit})", "host_oom_kill",
                "cgroup", f"{kill.folder}: oom_kill +{kill.kills}")
    for row in scanner.table:
        seen = scanner.seen.get(row.name)
        if seen is not None and row.weight == "cause":
            return row.cause.format(**seen.groups), row.name, seen.stream, seen.line
        if row.name == XID_AFTER and xids:
            xid = xids[0]
            return (f"GPU XID {xid.xid} on GPU {xid.index}", "xid", "nvml",
                    f"GPU {xid.index} reported XID {xid.xid}")
    if signum:
        name = _signal_name(signum)
        return (_SIGNAL_CAUSES.get(signum, f"killed by {name}"), "signal", "", "")
    for row in scanner.table:
        seen = scanner.seen.get(row.name)
        if seen is not None and row.weight == "fallback":
            return row.cause.format(**seen.groups), row.name, seen.stream, seen.line
    for stream in LAST_LINE_STREAMS:
        last = scanner.last_line(stream)
        if last:
            return f"the last line on {stream}", stream, stream, last
    return "unknown (no output)", "unknown", "", ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def format_bytes(size: int) -> str:
    """64.0 MiB, 80.0 GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"
