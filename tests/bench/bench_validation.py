"""Benchmark (not a test): the cost of --validation rounds beside a training run's trickle.

    python tests/bench/bench_validation.py [--quick] [--seconds 60]

A `sidecar watch --log FILE --jsonl FILE --validation DIR` follows a trickle (_trickle_writer.py:
100 log lines and 10 JSONL points a second) twice, one run after the other, each with a fresh
state folder:
- `trickle`: the trickle alone (the baseline, measured in the same run);
- `trickle + rounds`: and, every 10 s, a validation round of 1,000 samples of 4 KiB of output
  each, written as verl writes one (tests/verl_writer.py: `<step>.jsonl`, one `f.write`).
For each: the sidecar's CPU (user + system, all threads) as a share of one core over the span
and the drain, and the requests of each route; for the rounds, /validation requests a round and
whether every round arrived.

Target (issue 36): a round costs the trainer nothing (the sidecar's own CPU only) and a few
requests (its chunks: the text of 32 samples, under 1 MiB), and the trickle's requests stay
about one a second a route.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _harness import (
    HERE,
    REPO,
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    info_row,
    limit_row,
    parse,
    receiver,
    show_warnings,
    sidecar_env,
    start_sidecar,
    stop,
    wait_quiet,
)

sys.path.insert(0, str(REPO))
from tests.verl_writer import dump_generations

BENCH = "validation"
LINES_PER_S = 100
POINTS_PER_S = 10
ROUND_EVERY_S = 10.0
SAMPLES = 1000
SAMPLE_BYTES = 4096
MAX_REQUESTS_PER_ROUND = 4  # the text of 32 samples of 4 KiB: one chunk
MAX_REQUESTS_PER_S = 1.5  # /logs and /metrics: "about one a second"
ARRIVAL_TIMEOUT_S = 60.0


def _rounds(folder: Path, seconds: float, stop_at: threading.Event) -> int:
    """Write a round every ROUND_EVERY_S for `seconds`; returns how many."""
    written = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds and not stop_at.is_set():
        step = (written + 1) * 10
        scores = [(i * 7 % 11) / 10 for i in range(SAMPLES)]
        dump_generations(str(folder), step, [f"prompt {i} of step {step}" for i in range(SAMPLES)],
                         ["y" * SAMPLE_BYTES for _ in range(SAMPLES)],
                         [str(i) for i in range(SAMPLES)], scores,
                         {"acc": [s >= 0.5 for s in scores]})
        written += 1
        stop_at.wait(max(start + written * ROUND_EVERY_S - time.monotonic(), 0))
    return written


def measure(name: str, seconds: float, with_rounds: bool) -> tuple[float, dict[str, int], int]:
    """One run: the sidecar's CPU % of a core, its requests by route, the rounds written."""
    with tempfile.TemporaryDirectory(prefix="bench-validation-") as scratch, \
            receiver("count") as rec:
        work = Path(scratch)
        log, jsonl, folder, go = (work / "trickle.log", work / "trickle.jsonl", work / "val",
                                  work / "go")
        folder.mkdir()
        log.touch()
        jsonl.touch()
        env = sidecar_env(rec.endpoint, work / "state")
        proc = start_sidecar(["watch", "--log", str(log), "--jsonl", str(jsonl),
                              "--validation", str(folder)], env, work)
        sidecar = psutil.Process(proc.pid)
        wait_quiet(sidecar)
        writer = subprocess.Popen([sys.executable, str(HERE / "_trickle_writer.py"), str(go),
                                   str(seconds), str(LINES_PER_S), str(POINTS_PER_S), str(jsonl),
                                   str(log)])
        before = cpu_seconds(sidecar)
        began = time.monotonic()
        go.touch()
        stop_at = threading.Event()
        written = _rounds(folder, seconds, stop_at) if with_rounds else 0
        writer.wait(seconds + 30)
        # the last round settles (10 s) before it goes; the drain would post it too
        if written:
            rec.wait_for(lambda s: s["routes"].get("/validation", 0) >= written,
                         ARRIVAL_TIMEOUT_S)
        cpu_s = cpu_seconds(sidecar) - before
        span_s = time.monotonic() - began
        status = stop(proc)
        stats = rec.stats()
        if status != 0:
            show_warnings(work)
        cpu_pct = 100 * cpu_s / span_s
        routes = {route: int(n) for route, n in stats["routes"].items()}
        print(f"{name:18} CPU {cpu_pct:5.2f} % of a core over {span_s:.0f} s; requests "
              + ", ".join(f"{route} {n}" for route, n in sorted(routes.items()))
              + (f"; {written} rounds written" if with_rounds else ""))
        return cpu_pct, routes, written


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--seconds", type=float, default=60.0)
    args = parse(options)
    seconds = 30.0 if args.quick else args.seconds
    base_cpu, _, _ = measure("trickle", seconds, with_rounds=False)
    cpu, routes, written = measure("trickle + rounds", seconds, with_rounds=True)
    posted = routes.get("/validation", 0)
    rows: list[Row] = [
        info_row(BENCH, "CPU, trickle + a round every 10 s", cpu, "% core", base_cpu,
                 "trickle alone"),
        info_row(BENCH, "CPU a round (beyond the trickle)",
                 (cpu - base_cpu) * ROUND_EVERY_S / 100, "core-s"),
        limit_row(BENCH, "/validation requests a round", posted / max(written, 1), "req",
                  "<=", MAX_REQUESTS_PER_ROUND),
        limit_row(BENCH, "/validation requests, one a round at least", posted, "req", ">=",
                  written),
    ]
    for route in ("/logs", "/metrics"):
        rows.append(limit_row(BENCH, f"{route} requests a second, with rounds",
                              routes.get(route, 0) / seconds, "req/s", "<=", MAX_REQUESTS_PER_S))
    finish(rows, args.json)


if __name__ == "__main__":
    main()
