"""Benchmark (not a test): log throughput of `sidecar watch --log FILE` against the floor loop.

    python tests/bench/bench_throughput.py [--quick] [--lines N] [--line-bytes B ...]

A file of N lines of B bytes (default 2,000,000 of 100 B, then 200,000 of 1 KiB) is forwarded
from its start to a counting receiver on loopback (_receiver.py, its own process), once by the
floor loop of issue 8 (_floor.py: 1 MiB blocks cut at the last newline, one JSON chunk a POST,
aiohttp, one kept-alive connection) and once by `sidecar watch`, each until the receiver counted
every line. The clock and the CPU reading start when the work can start: for the floor when it
is told to go, for the sidecar when the file appears under the name it follows (hard-linked
there once the sidecar had started and gone quiet, so that its start-up is not counted; it then
reads the file from its start). CPU is the process's user + system time, all threads.
With --repeat N the two alternate N times and the median run of each is reported.

Targets (issue 8): lines/s at least half the floor's, CPU-seconds per GB at most three times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _harness import (
    HERE,
    RUN_ID,
    TOKEN,
    Receiver,
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    info_row,
    limit_row,
    parse,
    profiled,
    ratio_row,
    receiver,
    show_warnings,
    sidecar_env,
    start_sidecar,
    stop,
    wait_quiet,
    wait_until_posted,
)

BENCH = "log throughput"
TIMEOUT_S = 300.0
STALL_S = 10.0  # no new line for this long: what is missing is not coming
SIZES = ((2_000_000, 100), (200_000, 1024))
QUICK_SIZES = ((500_000, 100), (50_000, 1024))


def write_log(path: Path, lines: int, line_bytes: int) -> None:
    """`lines` lines of exactly `line_bytes` bytes (newline included), numbered."""
    head = b"2025-01-01T00:00:00.000Z INFO train step=%09d loss=0.4321 "
    pad = line_bytes - len(head % 0) - 1
    template = head + b"x" * pad + b"\n"
    with path.open("wb") as f:
        for start in range(0, lines, 100_000):
            f.write(b"".join(template % i for i in range(start, min(start + 100_000, lines))))


class Measured:
    """Rates over what arrived: lines counted by the receiver, their share of the file's bytes."""

    def __init__(self, lines: int, arrived: int, size: int, wall_s: float, cpu_s: float) -> None:
        self.lines, self.arrived = lines, arrived
        self.lines_per_s = arrived / wall_s
        self.mb_per_s = size * arrived / lines / 1e6 / wall_s
        self.cpu_s_per_gb = cpu_s / (size * arrived / lines / 1e9)
        self.wall_s, self.cpu_s = wall_s, cpu_s

    def __str__(self) -> str:
        missing = "" if self.arrived == self.lines else \
            f"  ONLY {self.arrived:,} OF {self.lines:,} LINES ARRIVED"
        return (f"{self.lines_per_s:12,.0f} lines/s {self.mb_per_s:7.1f} MB/s  "
                f"{self.cpu_s_per_gb:6.2f} CPU-s/GB  ({self.wall_s:.2f} s, {self.cpu_s:.2f} CPU-s)"
                + missing)


def _until_counted(rec: Receiver, lines: int, started_at: float) -> tuple[int, float]:
    """(lines arrived, seconds to the last arrival): all of them, or what came before a stall."""
    deadline = time.monotonic() + TIMEOUT_S
    seen, seen_at = -1, time.monotonic()
    while True:
        stats = rec.stats()
        if stats["lines"] >= lines or time.monotonic() > deadline or \
                time.monotonic() - seen_at > STALL_S:
            break
        if stats["lines"] != seen:
            seen, seen_at = stats["lines"], time.monotonic()
        time.sleep(0.01)
    if not stats["lines"]:
        raise RuntimeError(f"no line arrived in {time.monotonic() - seen_at:.0f} s")
    return stats["lines"], float(stats["last_log_at"]) - started_at


def floor(path: Path, lines: int) -> Measured:
    with receiver("count") as rec:
        proc = subprocess.Popen([sys.executable, str(HERE / "_floor.py"), str(path),
                                 rec.endpoint, TOKEN, RUN_ID],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the floor loop did not start")
            ps = psutil.Process(proc.pid)
            cpu0, started_at = cpu_seconds(ps), time.time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            arrived, wall_s = _until_counted(rec, lines, started_at)
            cpu_s = cpu_seconds(ps) - cpu0
        finally:
            proc.stdin.close()
            proc.wait(30)
    return Measured(lines, arrived, path.stat().st_size, wall_s, cpu_s)


def sidecar(path: Path, lines: int, work: Path, profile: Path | None, name: str) -> Measured:
    size = path.stat().st_size
    followed = work / "logs" / "train.log"
    followed.parent.mkdir(exist_ok=True)
    with receiver("count") as rec, tempfile.TemporaryDirectory(dir=work) as state:
        env = sidecar_env(rec.endpoint, Path(state))
        proc = start_sidecar(["watch", "--log", str(followed)], env, work)
        try:
            wait_until_posted(rec, "/environment")
            ps = psutil.Process(proc.pid)
            wait_quiet(ps)
            with profiled(proc.pid, profile, name):
                cpu0, started_at = cpu_seconds(ps), time.time()
                os.link(path, followed)  # appears at once, whole, under the followed name
                arrived, wall_s = _until_counted(rec, lines, started_at)
                cpu_s = cpu_seconds(ps) - cpu0
        finally:
            stop(proc)
            followed.unlink(missing_ok=True)
            show_warnings(work)
            (work / "sidecar.log").unlink(missing_ok=True)
    return Measured(lines, arrived, size, wall_s, cpu_s)


def measure(lines: int, line_bytes: int, profile: Path | None, repeat: int) -> list[Row]:
    label = f"{line_bytes} B lines" if line_bytes < 1024 else f"{line_bytes // 1024} KiB lines"
    bases, runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        work = Path(tmp)
        path = work / "input.log"
        write_log(path, lines, line_bytes)
        print(f"{label}: {lines:,} lines, {path.stat().st_size / 1e6:.0f} MB")
        for _ in range(repeat):  # alternated, so that a slow spell of the machine hits both
            bases.append(floor(path, lines))
            print(f"  floor loop:     {bases[-1]}")
            runs.append(sidecar(path, lines, work, profile, f"throughput-{line_bytes}"))
            print(f"  sidecar watch:  {runs[-1]}")
    base, ours = _median(bases), _median(runs)
    return [
        limit_row(BENCH, f"{label}: share of lines delivered", 100 * ours.arrived / lines, "%",
                  ">=", 100.0),
        ratio_row(BENCH, f"{label}: lines/s", ours.lines_per_s, base.lines_per_s, "lines/s",
                  "floor", ">=", 0.5),
        info_row(BENCH, f"{label}: MB/s", ours.mb_per_s, "MB/s", base.mb_per_s, "floor"),
        ratio_row(BENCH, f"{label}: CPU-s/GB", ours.cpu_s_per_gb, base.cpu_s_per_gb, "CPU-s/GB",
                  "floor", "<=", 3.0),
    ]


def _median(runs: list[Measured]) -> Measured:
    """The run with the median lines/s (its other figures with it)."""
    return sorted(runs, key=lambda m: m.lines_per_s)[(len(runs) - 1) // 2]


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--lines", type=int, help="lines in the file (one size only)")
    options.add_argument("--line-bytes", type=int, help="bytes a line, newline included")
    options.add_argument("--repeat", type=int, default=1, help="runs of each (median)")
    args = parse(options)
    sizes: tuple[tuple[int, int], ...] = QUICK_SIZES if args.quick else SIZES
    if args.lines or args.line_bytes:
        sizes = ((args.lines or sizes[0][0], args.line_bytes or 100),)
    rows: list[Row] = []
    for lines, line_bytes in sizes:
        rows += measure(lines, line_bytes, args.profile, args.repeat)
    finish(rows, args.json)


if __name__ == "__main__":
    main()
