"""Benchmark (not a test): what `sidecar watch` spends before its first line is on its way.

    python tests/bench/bench_startup.py [--quick] [--runs N] [--against REF]

`sidecar watch --log FILE` is started with FILE already holding one line, against the counting
receiver; the sidecar's CPU time (user + system, all threads) is read the moment that line has
arrived. Issue 17 asks to halve it: the same is measured, in the same run and alternating with
it, for the package as it was at REF (default d7156d7, main when the issue was filed, taken
with `git archive`), and the medians' ratio must be at most 0.5. `python -c pass` is shown
beside them, the interpreter's own share.

Both packages are byte-compiled first, as `pip install` does: the environment here sets
PYTHONDONTWRITEBYTECODE, which left an editable checkout compiling its 50 modules on every
start (a quarter of a second that no installed sidecar pays).
"""

from __future__ import annotations

import compileall
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _harness import (
    REPO,
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    info_row,
    parse,
    ratio_row,
    receiver,
    sidecar_env,
    start_sidecar,
    stop,
)

BENCH = "start-up"
TARGET_RATIO = 0.5  # issue 17: halve it
BASELINE_REF = "d7156d7"  # main when issue 17 was filed
TIMEOUT_S = 30.0


def first_line_cpu(work: Path, package_root: Path | None) -> float:
    """CPU-s of one `sidecar watch` until its first line arrived; `package_root`: the folder
    holding the `sidecar` package to run, None for the installed one."""
    log = work / "train.log"
    log.write_text("the first line\n")
    with receiver("count") as rec, tempfile.TemporaryDirectory(dir=work) as state:
        env = sidecar_env(rec.endpoint, Path(state))
        if package_root is not None:
            env["PYTHONPATH"] = str(package_root)
        proc = start_sidecar(["watch", "--log", str(log)], env, work)
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


def baseline_package(ref: str, into: Path) -> None:
    """The `sidecar` package as it was at `ref`, extracted and byte-compiled under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "sidecar"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    compileall.compile_dir(into / "sidecar", quiet=1)


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--runs", type=int, default=7, help="runs (median)")
    options.add_argument("--against", default=BASELINE_REF, metavar="REF",
                         help=f"the commit to compare with (default {BASELINE_REF})")
    args = parse(options)
    runs = 3 if args.quick else args.runs
    compileall.compile_dir(REPO / "sidecar", quiet=1)
    now: list[float] = []
    before: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        old = Path(tmp) / "baseline"  # not the runs' working folder: `-m` would import it
        old.mkdir()
        baseline_package(args.against, old)
        for _ in range(runs):  # alternated, so that a busy moment weighs on both
            now.append(first_line_cpu(Path(tmp), None))
            before.append(first_line_cpu(Path(tmp), old))
    bare = interpreter_cpu(runs)
    median, median_before = statistics.median(now), statistics.median(before)
    print(f"sidecar watch, CPU-s until its first line arrived: "
          f"{', '.join(f'{c:.3f}' for c in now)} (median {median:.3f}); at {args.against}: "
          f"{', '.join(f'{c:.3f}' for c in before)} (median {median_before:.3f}); "
          f"python -c pass {bare:.3f}")
    rows: list[Row] = [
        ratio_row(BENCH, "CPU-s of sidecar watch before its first line arrived", median,
                  median_before, "CPU-s", args.against, "<=", TARGET_RATIO),
        info_row(BENCH, "CPU-s of python -c pass (the interpreter alone)", bare, "CPU-s"),
    ]
    finish(rows, args.json)


if __name__ == "__main__":
    main()
