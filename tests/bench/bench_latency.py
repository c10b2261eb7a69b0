"""Benchmark (not a test): append-to-ingest latency of `sidecar watch` (issues 3 and 8).

    python tests/bench/bench_latency.py [--quick] [--seconds 20]

A writer (_latency_writer.py, its own process) appends 1,000 log lines/s to a `--log` file and
200 JSONL points/s to a `--jsonl` file for 20 s (8 s with --quick), every line and point stamped
with the time of its write. The receiver (_receiver.py in latency mode) notes the arrival time of
each; the delay is arrival - write, same machine, same clock. The sidecar follows both files
from their start with its default file watching (inotify plus the safety poll).

Target: p99 at most 1 s (issue 3: within a second; issue 25 paces requests to about one a
second per route while output keeps coming, so the 250 ms of issue 8 no longer applies).

Under load (issue 17): `sidecar run --jsonl FILE -- _flood_child.py` while the command floods
its stdout at 50 MB/s and the writer appends 200 JSONL points/s: the points' p99 at most 100 ms
(metrics must not queue behind logs), and the share of the flood that reaches /logs at the
default --log-rate is shown. Issue 17 asked 100 ms there; with paced requests the points' p99
is set by the pace, not by the flood: at most 1 s (they do not queue behind logs).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _harness import (
    HERE,
    SIDECAR,
    Receiver,
    Row,
    bench_arguments,
    finish,
    info_row,
    limit_row,
    parse,
    profiled,
    receiver,
    show_warnings,
    sidecar_env,
    start_sidecar,
    stop,
    wait_quiet,
    wait_until_posted,
)

BENCH = "latency"
LINES_PER_S = 1000
POINTS_PER_S = 200
TARGET_P99_MS = 1000.0
FLOOD_BYTES_PER_S = 50e6
FLOOD_TARGET_P99_MS = 1000.0
ARRIVAL_TIMEOUT_S = 3.0  # after the writer stopped, the longest the last items may take


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def arrived(rec: Receiver, lines: int, points: int) -> dict[str, list[float]]:
    """The receiver's delays once every line and point written has arrived, or those that
    arrived within ARRIVAL_TIMEOUT_S (the rows then say how many are missing)."""
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while True:
        delays = rec.delays()
        if ((len(delays["logs"]) >= lines and len(delays["points"]) >= points)
                or time.monotonic() > deadline):
            return delays
        time.sleep(0.05)


def measure(seconds: float, profile: Path | None) -> list[Row]:
    with receiver("latency") as rec, tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
        work = Path(tmp)
        log, jsonl = work / "train.log", work / "metrics.jsonl"
        log.touch()
        jsonl.touch()
        env = sidecar_env(rec.endpoint, work / "state")
        proc = start_sidecar(["watch", "--log", str(log), "--jsonl", str(jsonl)], env, work)
        try:
            wait_until_posted(rec, "/environment")
            wait_quiet(psutil.Process(proc.pid))
            with profiled(proc.pid, profile, "latency"):
                done = subprocess.run(
                    [sys.executable, str(HERE / "_latency_writer.py"), str(log), str(jsonl),
                     str(seconds), str(LINES_PER_S), str(POINTS_PER_S)],
                    capture_output=True, text=True, check=True)
                written = json.loads(done.stdout)
                delays = arrived(rec, written["lines"], written["points"])
        finally:
            stop(proc)
            show_warnings(work)
    rows = []
    both = delays["logs"] + delays["points"]
    for name, values, count in (("log lines", delays["logs"], written["lines"]),
                                ("JSONL points", delays["points"], written["points"]),
                                ("all", both, written["lines"] + written["points"])):
        if not values:
            rows.append(limit_row(BENCH, f"{name}: arrived", 0, "%", ">=", 100))
            continue
        ms = [1000 * v for v in values]
        p50, p99, worst = percentile(ms, 50), percentile(ms, 99), max(ms)
        print(f"  {name:12} {len(ms):6,} of {count:6,} arrived; p50 {p50:6.1f} ms, "
              f"p99 {p99:6.1f} ms, max {worst:6.1f} ms, mean {statistics.fmean(ms):6.1f} ms")
        rows.append(info_row(BENCH, f"{name}: p50 write to arrival", p50, "ms"))
        rows.append(limit_row(BENCH, f"{name}: p99 write to arrival", p99, "ms", "<=",
                              TARGET_P99_MS))
        if len(ms) < count:
            rows.append(limit_row(BENCH, f"{name}: arrived", 100 * len(ms) / count, "%",
                                  ">=", 100))
    return rows


def measure_flood(seconds: float, profile: Path | None) -> list[Row]:
    """JSONL points through `sidecar run` while its command floods stdout."""
    with receiver("latency") as rec, tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        work = Path(tmp)
        jsonl, count_file = work / "metrics.jsonl", work / "flood-lines"
        jsonl.touch()
        env = sidecar_env(rec.endpoint, work / "state")
        child = [sys.executable, str(HERE / "_flood_child.py"), str(FLOOD_BYTES_PER_S),
                 str(seconds + 2), str(count_file)]
        with (work / "sidecar.log").open("ab") as messages:
            proc = subprocess.Popen([*SIDECAR, "run", "--jsonl", str(jsonl), "--", *child],
                                    env=env, cwd=work, stdout=subprocess.DEVNULL,
                                    stderr=messages)
        try:
            wait_until_posted(rec, "/environment")
            with profiled(proc.pid, profile, "latency-flood"):
                done = subprocess.run(
                    [sys.executable, str(HERE / "_latency_writer.py"), os.devnull, str(jsonl),
                     str(seconds), "0", str(POINTS_PER_S)],
                    capture_output=True, text=True, check=True)
                written = json.loads(done.stdout)
                proc.wait(60)
            delays = rec.delays()
            lines_text, took_text = count_file.read_text().split()
            flood_lines, flood_s = int(lines_text), float(took_text)
            arrived_lines = rec.stats()["lines"]
        finally:
            stop(proc)
            show_warnings(work)
    rows = []
    ms = [1000 * v for v in delays["points"]]
    if not ms:
        return [limit_row(BENCH, "under a 50 MB/s flood, JSONL points: arrived", 0, "%", ">=",
                          100)]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    share = 100 * arrived_lines / flood_lines
    print(f"  under a 50 MB/s flood: JSONL points {len(ms):,} of {written['points']:,} arrived; "
          f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(ms):.1f} ms; "
          f"{arrived_lines:,} of {flood_lines:,} flood lines reached /logs ({share:.1f} %); "
          f"the flood ran at {flood_lines * 100 / flood_s / 1e6:.1f} MB/s")
    rows.append(info_row(BENCH, "under a 50 MB/s flood, JSONL points: p50", p50, "ms"))
    rows.append(limit_row(BENCH, "under a 50 MB/s flood, JSONL points: p99", p99, "ms", "<=",
                          FLOOD_TARGET_P99_MS))
    if len(ms) < written["points"]:
        rows.append(limit_row(BENCH, "under a 50 MB/s flood, JSONL points: arrived",
                              100 * len(ms) / written["points"], "%", ">=", 100))
    rows.append(info_row(BENCH, "share of the 50 MB/s flood reaching /logs (default --log-rate)",
                         share, "%"))
    rows.append(info_row(BENCH, "the flood's rate through sidecar run",
                         flood_lines * 100 / flood_s / 1e6, "MB/s"))
    return rows


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--seconds", type=float, help="how long the writer writes (20, quick 8)")
    args = parse(options)
    seconds = args.seconds or (8.0 if args.quick else 20.0)
    rows = measure(seconds, args.profile)
    finish(rows + measure_flood(seconds, args.profile), args.json)


if __name__ == "__main__":
    main()
