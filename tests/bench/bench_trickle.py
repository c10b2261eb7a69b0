"""Benchmark (not a test): the cost of a training run's steady trickle, Fluent Bit beside us.

    python tests/bench/bench_trickle.py [--quick] [--seconds 40] [--modes watch,run]

A writer (_trickle_writer.py, its own process) writes 100 log lines a second and 10 JSONL points
a second, each line and each point its own write, stamped with its write time, for 40 s (15 s
with --quick). Fluent Bit 5.1.1 (`Flush 1`, the tail input; shared/anchors/fluent-bit) tails
the same lines in the same run, into a receiver of its own. Two modes, one after the other, each
with Fluent Bit beside it:
- `watch`: `sidecar watch --log FILE --jsonl FILE` follows the files the writer appends to;
- `run`: `sidecar run --jsonl FILE -- _trickle_writer.py`, the command printing the lines itself
  (and appending them to the file Fluent Bit tails).
For each process, over the writer's span: CPU (user + system, all threads; not the command's)
as a share of one core, /logs and /metrics requests a second, and write -> arrival p50 and p99
(_receiver.py in latency mode, one receiver a process, same clock).

Targets (issue 25): CPU at most 0.5x Fluent Bit's measured beside it; about one request a second
per route (at most 1.5); p99 write -> arrival at most 1 s for lines and points.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _harness import (
    HERE,
    SIDECAR,
    Receiver,
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    fluent_bit,
    info_row,
    limit_row,
    parse,
    profiled,
    ratio_row,
    receiver,
    show_warnings,
    sidecar_env,
    stop,
    wait_quiet,
    wait_until_posted,
)
from bench_latency import percentile
from bench_throughput import fluent_bit_unavailable

BENCH = "trickle"
LINES_PER_S = 100
POINTS_PER_S = 10
CPU_RATIO = 0.5  # of Fluent Bit's
MAX_REQUESTS_PER_S = 1.5  # a route, "about one a second"
MAX_P99_S = 1.0
ARRIVAL_TIMEOUT_S = 5.0
FLUENT_BIT_CONFIG = """\
[SERVICE]
    Flush        1
    Grace        1
    Log_Level    warn
    storage.path {dir}/storage
[INPUT]
    Name              tail
    Path              {path}
    DB                {dir}/tail.db
[OUTPUT]
    Name         http
    Match        *
    Host         127.0.0.1
    Port         {port}
    URI          /api/ingest/logs
    Format       json
    Retry_Limit  no_limits
"""


class Figures:
    """One process over the writer's span."""

    def __init__(self, name: str, cpu_s: float, span_s: float, before: dict[str, Any],
                 after: dict[str, Any], delays: dict[str, list[float]],
                 written: dict[str, int]) -> None:
        self.name = name
        self.cpu_pct = 100 * cpu_s / span_s

        def rate(route: str) -> float:
            return (after["routes"].get(route, 0) - before["routes"].get(route, 0)) / span_s
        self.logs_per_s, self.metrics_per_s = rate("/logs"), rate("/metrics")
        self.delays = delays
        self.written = written

    def quantiles(self, kind: str) -> tuple[float, float] | None:
        values = self.delays[kind]
        return (percentile(values, 50), percentile(values, 99)) if values else None

    def __str__(self) -> str:
        text = (f"{self.name:24} CPU {self.cpu_pct:5.2f} % of a core, /logs "
                f"{self.logs_per_s:5.2f} req/s, /metrics {self.metrics_per_s:5.2f} req/s")
        for kind, count in (("logs", self.written["lines"]), ("points", self.written["points"])):
            q = self.quantiles(kind)
            if q is not None:
                text += (f"; {kind} {len(self.delays[kind])}/{count} p50 {q[0]:.3f} s "
                         f"p99 {q[1]:.3f} s")
        return text


class FluentBit:
    def __init__(self, path: Path, work: Path, rec: Receiver) -> None:
        binary = fluent_bit()
        assert binary is not None
        state = work / "fluent-bit"
        state.mkdir()
        config = state / "fluent-bit.conf"
        config.write_text(FLUENT_BIT_CONFIG.format(dir=state, path=path, port=rec.port))
        with (state / "fluent-bit.log").open("wb") as messages:
            self.proc = subprocess.Popen([str(binary), "-c", str(config)], stdout=messages,
                                         stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)

    def close(self) -> None:
        stop(self.proc, 10)


def arrived(rec: Receiver, written: dict[str, int], logs_only: bool) -> dict[str, list[float]]:
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while True:
        delays = rec.delays()
        if (len(delays["logs"]) >= written["lines"]
                and (logs_only or len(delays["points"]) >= written["points"])) \
                or time.monotonic() > deadline:
            return delays
        time.sleep(0.1)


def measure(mode: str, seconds: float, profile: Path | None) -> list[Figures]:
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(receiver("latency"))
        theirs = stack.enter_context(receiver("latency")) if fluent_bit_unavailable() is None \
            else None
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-trickle-")))
        log, jsonl, go = work / "train.log", work / "metrics.jsonl", work / "go"
        log.touch()
        jsonl.touch()
        writer = [sys.executable, str(HERE / "_trickle_writer.py"), str(go), str(seconds),
                  str(LINES_PER_S), str(POINTS_PER_S), str(jsonl)]
        env = sidecar_env(ours.endpoint, work / "state")
        messages = stack.enter_context((work / "sidecar.log").open("ab"))
        if mode == "watch":
            child = subprocess.Popen([*writer, str(log)])
            args = ["watch", "--log", str(log), "--jsonl", str(jsonl)]
        else:
            child = None
            args = ["run", "--jsonl", str(jsonl), "--", *writer, "-", str(log)]
        proc = subprocess.Popen([*SIDECAR, *args], env=env, cwd=work, stderr=messages,
                                stdout=subprocess.DEVNULL)
        stack.callback(show_warnings, work)
        stack.callback(stop, proc)
        if child is not None:
            stack.callback(stop, child)
        anchor = FluentBit(log, work, theirs) if theirs is not None else None
        if anchor is not None:
            stack.callback(anchor.close)
        ps = psutil.Process(proc.pid)
        wait_until_posted(ours, "/environment")
        wait_quiet(ps)
        if anchor is not None:
            wait_quiet(anchor.ps)
        with profiled(proc.pid, profile, f"trickle-{mode}"):
            before = [ours.stats(), theirs.stats() if theirs else {}]
            cpu0 = [cpu_seconds(ps), cpu_seconds(anchor.ps) if anchor else 0.0]
            started = time.monotonic()
            go.touch()
            done = go.with_name("go.done")
            while not done.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the sidecar exited ({proc.returncode}) mid-run")
                time.sleep(0.05)
            span = time.monotonic() - started
            cpu1 = [cpu_seconds(ps), cpu_seconds(anchor.ps) if anchor else 0.0]
            after = [ours.stats(), theirs.stats() if theirs else {}]
        written = json.loads(done.read_text())
        figures = [Figures(f"sidecar {mode}", cpu1[0] - cpu0[0], span, before[0], after[0],
                           arrived(ours, written, False), written)]
        if anchor is not None and theirs is not None:
            figures.append(Figures(f"Fluent Bit (beside {mode})", cpu1[1] - cpu0[1], span,
                                   before[1], after[1], arrived(theirs, written, True), written))
    for f in figures:
        print(f"  {f}", flush=True)
    return figures


def rows_of(mode: str, ours: Figures, anchor: Figures | None) -> list[Row]:
    what = f"sidecar {mode}"
    rows = []
    if anchor is not None:
        rows.append(ratio_row(BENCH, f"{what}: CPU, % of a core", ours.cpu_pct, anchor.cpu_pct,
                              "%", "Fluent Bit", "<=", CPU_RATIO))
        rows.append(info_row(BENCH, f"Fluent Bit beside {mode}: /logs requests/s",
                             anchor.logs_per_s, "req/s"))
        q = anchor.quantiles("logs")
        if q is not None:
            rows.append(info_row(BENCH, f"Fluent Bit beside {mode}: log lines p99", 1000 * q[1],
                                 "ms"))
    else:
        rows.append(info_row(BENCH, f"{what}: CPU, % of a core", ours.cpu_pct, "%"))
    rows.append(limit_row(BENCH, f"{what}: /logs requests/s", ours.logs_per_s, "req/s", "<=",
                          MAX_REQUESTS_PER_S))
    rows.append(limit_row(BENCH, f"{what}: /metrics requests/s", ours.metrics_per_s, "req/s",
                          "<=", MAX_REQUESTS_PER_S))
    for kind, label, count in (("logs", "log lines", ours.written["lines"]),
                               ("points", "JSONL points", ours.written["points"])):
        q = ours.quantiles(kind)
        if q is None:
            rows.append(limit_row(BENCH, f"{what}: {label} arrived", 0, "%", ">=", 100))
            continue
        rows.append(info_row(BENCH, f"{what}: {label} p50 write to arrival", 1000 * q[0], "ms"))
        rows.append(limit_row(BENCH, f"{what}: {label} p99 write to arrival", 1000 * q[1], "ms",
                              "<=", 1000 * MAX_P99_S))
        if len(ours.delays[kind]) < count:
            rows.append(limit_row(BENCH, f"{what}: {label} arrived",
                                  100 * len(ours.delays[kind]) / count, "%", ">=", 100))
    return rows


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--seconds", type=float, help="how long the writer writes (40, quick 15)")
    options.add_argument("--modes", default="watch,run", help="watch, run or both (default)")
    args = parse(options)
    seconds = args.seconds or (15.0 if args.quick else 40.0)
    skipped = fluent_bit_unavailable()
    if skipped:
        print(f"  Fluent Bit: SKIPPED: {skipped}")
    rows: list[Row] = []
    for mode in args.modes.split(","):
        figures = measure(mode, seconds, args.profile)
        rows += rows_of(mode, figures[0], figures[1] if len(figures) > 1 else None)
    finish(rows, args.json)


if __name__ == "__main__":
    main()
