"""Run every benchmark of issue 8 and print one table: each figure, its baseline measured in the
same run, the ratio, the target and whether it was met.

    python tests/bench/run_all.py [--quick] [--only NAME[,NAME...]] [--profile DIR]
                                  [--set NAME=VALUE ...]

NAME is one of: throughput, masking, wrapper, tensorboard, latency, idle, startup, hardware,
checkpoints, trickle, validation, timeshare. Each benchmark runs in a process of its own and can
be run alone (tests/bench/bench_NAME.py, the same options). About 27 minutes on a 2-core machine
(timeshare 7 of them); --quick (smaller sizes, shorter runs) about 8. To measure a modified copy
of the package:
PYTHONPATH=/path/to/copy python tests/bench/run_all.py (the sidecar runs in a scratch folder, so
the copy is what it imports).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from _harness import HERE, REPO, Row, print_table, ratio_row

TENSORBOARD_TARGET = 30.0  # issue 17 (issue 8: 20)
# name -> (script, options, options with --quick)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "throughput": ("bench_throughput.py", [], ["--quick"]),
    "masking": ("bench_mask.py", [], ["--quick"]),
    "wrapper": ("bench_wrapper.py", ["--repeat", "5"], ["--quick"]),
    "tensorboard": ("bench_tensorboard.py", ["--mb", "100"], ["--mb", "10"]),
    "latency": ("bench_latency.py", [], ["--quick"]),
    "idle": ("bench_idle.py", [], ["--quick"]),
    "startup": ("bench_startup.py", [], ["--quick"]),
    "hardware": ("bench_hardware.py", [], ["--quick"]),
    "checkpoints": ("bench_checkpoints.py", [], ["--quick"]),
    "trickle": ("bench_trickle.py", [], ["--quick"]),
    "validation": ("bench_validation.py", [], ["--quick"]),
    "timeshare": ("bench_timeshare.py", [], ["--quick"]),
}


def run(name: str, quick: bool, passed_on: list[str]) -> list[Row]:
    script, full, short = BENCHMARKS[name]
    print(f"\n=== {name}: {script} {' '.join(short if quick else full)}", flush=True)
    started = time.monotonic()
    if name == "tensorboard":  # not written for this runner: its printed figures are read
        rows = _tensorboard(script, short if quick else full)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            subprocess.run([sys.executable, str(HERE / script), *(short if quick else full),
                            "--json", str(out), *passed_on], check=True)
            rows = [Row(**row) for row in json.loads(out.read_text())]
    print(f"=== {name}: {time.monotonic() - started:.0f} s", flush=True)
    return rows


def _tensorboard(script: str, options: list[str]) -> list[Row]:
    done = subprocess.run([sys.executable, str(HERE / script), *options], check=True,
                          stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    rates = {label: float(value.replace(",", "")) for label, value in re.findall(
        r"^(EventFileParser|tensorboard EventFileLoader).*?([\d,]+) points/s", done.stdout,
        re.MULTILINE)}
    if len(rates) != 2:
        raise RuntimeError(f"{script}: its output no longer shows both rates")
    return [ratio_row("tensorboard decoding", "points/s decoded from one event file",
                      rates["EventFileParser"], rates["tensorboard EventFileLoader"],
                      "points/s", "EventFileLoader", ">=", TENSORBOARD_TARGET)]


def _describe_tree() -> str:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = git("status", "--porcelain", "--", "sidecar")
    copy = os.environ.get("PYTHONPATH")
    return (f"sidecar at {commit}{' with uncommitted changes' if dirty else ''}"
            + (f", PYTHONPATH={copy}" if copy else ""))


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--quick", action="store_true", help="smaller sizes, shorter runs")
    options.add_argument("--only", help="comma-separated benchmarks to run (default: all)")
    options.add_argument("--profile", type=Path, metavar="DIR",
                         help="record the sidecar with py-spy into DIR (figures then skewed)")
    options.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                         help="an option for every sidecar started, as SIDECAR_NAME")
    options.add_argument("--json", type=Path, help="also write every row here")
    args = options.parse_args()
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        options.error(f"unknown benchmark {sorted(unknown)[0]!r}; "
                      f"known: {', '.join(BENCHMARKS)}")
    passed_on = [f"--set={s}" for s in args.set]
    if args.profile:
        passed_on += ["--profile", str(args.profile)]

    started = time.monotonic()
    rows: list[Row] = []
    failed: list[str] = []
    for name in names:
        try:
            rows += run(name, args.quick, passed_on)
        except (subprocess.CalledProcessError, RuntimeError, OSError, ValueError) as exc:
            print(f"=== {name} did not finish: {exc}", flush=True)
            failed.append(name)

    print(f"\n{_describe_tree()}; Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{'quick' if args.quick else 'full'} run of {time.monotonic() - started:.0f} s\n")
    print_table(rows)
    missed = [r for r in rows if r.passed is False]
    print(f"\n{sum(r.passed is True for r in rows)} targets met, {len(missed)} missed"
          + (f"; did not finish: {', '.join(failed)}" if failed else ""))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    sys.exit(1 if missed or failed else 0)


if __name__ == "__main__":
    main()
