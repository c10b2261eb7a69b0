"""Benchmark (not a test, not in run_all.py): a fleet of sidecars against one ingest that goes
down and comes back.

    python tests/bench/bench_fleet.py [--quick] [--nodes 1000] [--png FILE] [--compare JSON]

1,000 nodes, each the real delivery code of a sidecar (`IngestClient` with its retry policy and
keep-alive connections, a /metrics `Batcher` with its pacing), in 2 processes
(_fleet_nodes.py), each node putting a point every 2 s, against one ingest of fixed capacity
(_fleet_ingest.py: 1.5x the steady rate, 503 with Retry-After beyond it) on loopback: steady for
a minute, down for 5 minutes (connection refused), back for 2. Bounded: at most 3 million
requests, and every process is stopped at the end of its phases.

Shown: the steady request rate; after the recovery, the busiest second (target: at most 2x the
steady rate), the time until the backlog was in, the longest wait of any node for its backlog
(no node starves), and the points lost and repeated (target 0 and 0). A PNG of the requests a
second over time is written beside the table (--png; matplotlib); --compare JSON draws an
earlier run's series (its --json-series) in the same picture.

--quick: 200 nodes, 20 s steady, 60 s down, 60 s back.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import HERE, Row, bench_arguments, finish, info_row, limit_row, parse

BENCH = "fleet"
INTERVAL_S = 2.0  # a point a node every 2 s
PROCESSES = 2
CAPACITY_SHARE = 1.5  # of the steady rate
MAX_REQUESTS = 3_000_000
PEAK_LIMIT = 2.0  # of the steady rate


def control(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=120) as answer:
        return json.load(answer)


def sleep_until(when: float) -> None:
    time.sleep(max(when - time.time(), 0))


def run(nodes: int, steady_s: float, down_s: float, back_s: float) -> dict[str, Any]:
    capacity = CAPACITY_SHARE * nodes / INTERVAL_S
    ingest = subprocess.Popen([sys.executable, str(HERE / "_fleet_ingest.py"), str(capacity),
                               str(MAX_REQUESTS)], stdout=subprocess.PIPE, text=True)
    assert ingest.stdout is not None
    _, port, _, control_port = ingest.stdout.readline().split()
    start = time.time() + 5 + nodes / 200  # the processes import and make their nodes
    generate_s = steady_s + down_s + back_s
    end = start + generate_s + 30
    workers = []
    share = -(-nodes // PROCESSES)
    for first in range(0, nodes, share):
        workers.append(subprocess.Popen(
            [sys.executable, str(HERE / "_fleet_nodes.py"), str(first),
             str(min(share, nodes - first)), f"http://127.0.0.1:{port}/api/ingest", str(start),
             str(generate_s), str(INTERVAL_S), str(end)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    try:
        print(f"  {nodes} nodes in {len(workers)} processes, a point a node every "
              f"{INTERVAL_S:g} s; ingest capacity {capacity:.0f} requests/s", flush=True)
        sleep_until(start + steady_s)
        control(int(control_port), "/_down")
        print(f"  the ingest is down at {time.time() - start:.0f} s", flush=True)
        sleep_until(start + steady_s + down_s)
        control(int(control_port), "/_up")
        print(f"  the ingest is back at {time.time() - start:.0f} s", flush=True)
        results: list[dict[str, Any]] = []
        for worker in workers:
            out, _ = worker.communicate(timeout=max(end - time.time(), 0) + 120)
            results += json.loads(out)
        stats: dict[str, Any] = control(int(control_port), "/_stats")
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        with contextlib.suppress(OSError):
            control(int(control_port), "/_quit")
        ingest.kill()
        ingest.wait()
    return {"start": start, "steady_s": steady_s, "down_s": down_s, "back_s": back_s,
            "nodes": nodes, "results": results, "stats": stats}


def analyse(data: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    start, stats = data["start"], data["stats"]
    up_at = stats["up_at"]
    per_second = {int(k): v for k, v in stats["requests"].items()}
    refused = {int(k): v for k, v in stats["refused"].items()}
    first = int(start)
    last = int(start + data["steady_s"] + data["down_s"] + data["back_s"])
    series = [[s - first, per_second.get(s, 0), refused.get(s, 0)] for s in range(first, last)]
    steady = [per_second.get(s, 0) for s in range(first + 10, int(start + data["steady_s"]))]
    steady_rate = statistics.fmean(steady)
    after = [(s, per_second.get(s, 0)) for s in range(int(up_at), last)]
    peak_at, peak = max(after, key=lambda sv: sv[1])
    lost = repeated = 0
    waits: list[float] = []
    points = stats["points"]
    for node in data["results"]:
        got = {step: (at, put_at) for step, at, put_at in points.get(node["key"], [])}
        lost += sum(1 for step in range(node["put"]) if step not in got)
        backlog = [at - up_at for at, put_at in got.values() if put_at < up_at <= at]
        waits.append(max(backlog, default=0.0))
    backlog_in = max(waits, default=0.0)
    repeated = stats["repeated"]
    starving = sorted(waits)[-1] if waits else 0.0
    p99_wait = sorted(waits)[int(0.99 * (len(waits) - 1))] if waits else 0.0
    print(f"  steady: {steady_rate:.0f} requests/s; after the recovery the busiest second had "
          f"{peak} ({peak / steady_rate:.2f}x), {peak_at - up_at:.0f} s after it; "
          f"{sum(refused.values()):,} answered 503 (over capacity)")
    print(f"  every node's last point in by {backlog_in:.1f} s after the recovery "
          f"(p99 of nodes {p99_wait:.1f} s); {lost} points lost, {repeated} repeated; "
          f"{stats['total']:,} requests in all" + (" (BOUNDED: stopped early)"
                                                   if stats["bounded"] else ""))
    rows = [info_row(BENCH, "steady request rate", steady_rate, "req/s"),
            Row(BENCH, "busiest second after the recovery", peak, "req/s", steady_rate,
                "steady", peak / steady_rate, f"<= {PEAK_LIMIT:g}x steady",
                peak / steady_rate <= PEAK_LIMIT),
            info_row(BENCH, "requests answered 503 (over capacity)", sum(refused.values()),
                     "req"),
            info_row(BENCH, "backlog in, after the recovery (slowest node)", starving, "s"),
            info_row(BENCH, "backlog in, after the recovery (p99 of nodes)", p99_wait, "s"),
            limit_row(BENCH, "nodes whose backlog never came in",
                      sum(1 for n in data["results"] if n["unacknowledged"]), "nodes", "<=", 0),
            limit_row(BENCH, "points lost", lost, "points", "<=", 0),
            limit_row(BENCH, "points repeated", repeated, "points", "<=", 0)]
    return rows, {"series": series, "steady": steady_rate, "down": data["steady_s"],
                  "up": up_at - first}


def draw(png: Path, runs: list[tuple[str, dict[str, Any]]]) -> None:
    import matplotlib  # a benchmark's dependency only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False,
                                sharex=True)
    for (label, run), ax in zip(runs, axes[:, 0], strict=True):
        t = [s for s, _, _ in run["series"]]
        ax.plot(t, [n for _, n, _ in run["series"]], lw=0.8, label="requests/s")
        ax.plot(t, [r for _, _, r in run["series"]], lw=0.8, label="of which 503")
        ax.axhline(2 * run["steady"], color="red", ls="--", lw=0.8, label="2x steady")
        ax.axvspan(run["down"], run["up"], color="grey", alpha=0.2, label="ingest down")
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("requests/s")
        ax.legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    print(f"  picture written to {png}")


def picture_and_table(args: Any, series: dict[str, Any], rows: list[Row],
                      draw: Callable[[Path, list[tuple[str, dict[str, Any]]]], None],
                      png: Path) -> None:
    """The run's series written (--json-series) and drawn beside an earlier one (--compare),
    then the table."""
    series["label"] = args.label
    if args.json_series:
        args.json_series.write_text(json.dumps(series))
    runs = [(args.label, series)]
    if args.compare:
        earlier = json.loads(args.compare.read_text())
        runs.insert(0, (earlier["label"], earlier))
    try:
        draw(args.png or png, runs)
    except ImportError:
        print("  no picture: matplotlib is not installed (pip install matplotlib)")
    finish(rows, args.json)


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--nodes", type=int, help="sidecars simulated (1000, quick 200)")
    options.add_argument("--png", type=Path, help="the picture (default fleet.png here)")
    options.add_argument("--label", default="this tree", help="the run's name in the picture")
    options.add_argument("--json-series", type=Path, help="write the series here")
    options.add_argument("--compare", type=Path, help="an earlier run's --json-series")
    args = parse(options)
    nodes = args.nodes or (200 if args.quick else 1000)
    phases = (20.0, 60.0, 60.0) if args.quick else (60.0, 300.0, 120.0)
    rows, series = analyse(run(nodes, *phases))
    picture_and_table(args, series, rows, draw, Path("fleet.png"))


if __name__ == "__main__":
    main()
