"""Benchmark (not a test): what `sidecar watch` spends before its first line is on its way.

    python tests/bench/bench_startup.py [--quick] [--runs N]

`sidecar watch --log FILE` is started with FILE already holding one line, against the counting
receiver; the sidecar's CPU time (user + system, all threads) is read the moment that line has
arrived. The median of the runs is compared with issue 17's target: half of the 0.16 CPU-s
measured before. `python -c pass` in the same run is shown beside it, the interpreter's own
share.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _harness import (
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    info_row,
    limit_row,
    parse,
    receiver,
    sidecar_env,
    start_sidecar,
    stop,
)

BENCH = "start-up"
TARGET_CPU_S = 0.08  # issue 17: half of 0.16
TIMEOUT_S = 30.0


def first_line_cpu(work: Path) -> float:
    log = work / "train.log"
    log.write_text("the first line\n")
    with receiver("count") as rec, tempfile.TemporaryDirectory(dir=work) as state:
        proc = start_sidecar(["watch", "--log", str(log)], sidecar_env(rec.endpoint, Path(state)),
                             work)
        try:
            ps = psutil.Process(proc.pid)
            deadline = time.monotonic() + TIMEOUT_S
            cpu = cpu_seconds(ps)
            while rec.stats()["lines"] < 1:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the first line never arrived")
                cpu = cpu_seconds(ps)  # read before the check: the arrival is not counted late
                time.sleep(0.002)
        finally:
            stop(proc)
    return cpu


def interpreter_cpu(runs: int) -> float:
    """CPU-s of `python -c pass`, the interpreter's own start-up (median-free: a mean)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(runs):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / runs


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--runs", type=int, default=7, help="runs (median)")
    args = parse(options)
    runs = 3 if args.quick else args.runs
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        cpu = [first_line_cpu(Path(tmp)) for _ in range(runs)]
    bare = interpreter_cpu(runs)
    median = statistics.median(cpu)
    print(f"sidecar watch, CPU-s until its first line arrived: "
          f"{', '.join(f'{c:.3f}' for c in cpu)} (median {median:.3f}); python -c pass {bare:.3f}")
    rows: list[Row] = [
        limit_row(BENCH, "CPU-s of sidecar watch before its first line arrived", median, "CPU-s",
                  "<=", TARGET_CPU_S),
        info_row(BENCH, "CPU-s of python -c pass (the interpreter alone)", bare, "CPU-s"),
    ]
    finish(rows, args.json)


if __name__ == "__main__":
    main()
