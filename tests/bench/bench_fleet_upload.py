"""Benchmark (not a test, not in run_all.py): a fleet of sidecars uploading the same step's
checkpoint at the same instant, through one signing route to one object store.

    python tests/bench/bench_fleet_upload.py [--quick] [--nodes 1000] [--png FILE]
        [--json-series FILE] [--compare JSON] [--label TEXT]

1,000 nodes, each the real upload code of a sidecar (`Uploads` with its staging, ledger and
PUTs in threads, the strict `/artifact` sender, an `IngestClient` with its retry policy), in 2
processes (_fleet_upload_nodes.py), every one submitting its checkpoint (4 files of 64 KiB) at
the same instant, as the runs of a sweep saving at the same step do. Against, on
loopback: the fleet ingest (_fleet_ingest.py) signing `artifact/upload-url` at most 0.5 requests
a second a node (500/s for 1,000 nodes; 503 with `Retry-After: 1` beyond), and taking
/artifact; an object store (_fleet_store.py) taking at most 0.5 PUTs a second a node (503
SlowDown beyond, as S3). Bounded: at most 2 million requests to each, and every process is
stopped when the checkpoints are in or 240 s (quick 120 s) have passed.

Shown: the busiest second at the signer and at the store against its capacity (target: at most
2x), the time until every checkpoint was registered, the checkpoints registered 0 times and more
than once (target 0 and 0), files stored more than once, and the requests each file took. A PNG
of the requests a second at each over time (--png; matplotlib); --compare JSON draws an earlier
run's series (its --json-series) in the same picture.

--quick: 200 nodes (capacities scale with the node count). --sign-capacity and --store-capacity
set them (requests a second, a node).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import HERE, Row, bench_arguments, info_row, limit_row, parse
from bench_fleet import control, picture_and_table

BENCH = "fleet-upload"
PROCESSES = 2
FILES = 4
FILE_BYTES = 64 << 10
SIGN_PER_NODE = 0.5  # the signer's capacity, requests a second a node of the fleet
STORE_PER_NODE = 0.5  # the store's, PUTs a second a node
INGEST_PER_NODE = 0.5  # the rest of the ingest's (/artifact)
MAX_REQUESTS = 2_000_000
PEAK_LIMIT = 2.0  # of the capacity
STEP = 1000


def run(nodes: int, limit_s: float, sign_per_node: float = SIGN_PER_NODE,
        store_per_node: float = STORE_PER_NODE) -> dict[str, Any]:
    sign_capacity, store_capacity = sign_per_node * nodes, store_per_node * nodes
    store = subprocess.Popen([sys.executable, str(HERE / "_fleet_store.py"),
                              str(store_capacity), str(MAX_REQUESTS)],
                             stdout=subprocess.PIPE, text=True)
    assert store.stdout is not None
    _, store_port, _, store_control = store.stdout.readline().split()
    ingest = subprocess.Popen([sys.executable, str(HERE / "_fleet_ingest.py"),
                               str(INGEST_PER_NODE * nodes), str(MAX_REQUESTS),
                               str(sign_capacity), f"http://127.0.0.1:{store_port}"],
                              stdout=subprocess.PIPE, text=True)
    assert ingest.stdout is not None
    _, ingest_port, _, ingest_control = ingest.stdout.readline().split()
    workers = []
    try:
        # the processes import and make their nodes; the save on a whole second, so that its
        # instant's requests are counted in one second, never split between two
        start = float(math.ceil(time.time() + 5 + nodes / 100))
        end = start + limit_s
        share = -(-nodes // PROCESSES)
        for first in range(0, nodes, share):
            workers.append(subprocess.Popen(
                [sys.executable, str(HERE / "_fleet_upload_nodes.py"), str(first),
                 str(min(share, nodes - first)), f"http://127.0.0.1:{ingest_port}/api/ingest",
                 str(start), str(end), str(FILES), str(FILE_BYTES)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        print(f"  {nodes} nodes in {len(workers)} processes, a checkpoint of {FILES} files of "
              f"{FILE_BYTES >> 10} KiB each, all submitted at once; signer capacity "
              f"{sign_capacity:.0f} requests/s, store {store_capacity:.0f} PUTs/s", flush=True)
        results: list[dict[str, Any]] = []
        for worker in workers:
            out, _ = worker.communicate(timeout=max(end - time.time(), 0) + 120)
            results += json.loads(out)
        signer: dict[str, Any] = control(int(ingest_control), "/_stats")
        objects: dict[str, Any] = control(int(store_control), "/_stats")
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for process, port_text in ((ingest, ingest_control), (store, store_control)):
            with contextlib.suppress(OSError):
                control(int(port_text), "/_quit")
            process.kill()
            process.wait()
    return {"start": start, "nodes": nodes, "sign_capacity": sign_capacity,
            "store_capacity": store_capacity, "results": results, "signer": signer,
            "store": objects}


def analyse(data: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    start, nodes, results = data["start"], data["nodes"], data["results"]
    signer, store = data["signer"], data["store"]

    def counts(doc: dict[str, Any] | None) -> dict[int, int]:
        return {int(k): v for k, v in (doc or {}).items()}

    signs = counts(signer["by_route"].get("sign"))
    signs_refused = counts(signer["refused_by_route"].get("sign"))
    artifact = counts(signer["by_route"].get("artifact"))
    puts, puts_refused = counts(store["requests"]), counts(store["refused"])
    done = [r["registered_at"] for r in results if r["registered_at"] is not None]
    first = int(start) - 1
    last = max([*signs, *puts, *artifact, int(start)]) + 2
    series = [[s - first, signs.get(s, 0), signs_refused.get(s, 0), puts.get(s, 0),
               puts_refused.get(s, 0), artifact.get(s, 0)] for s in range(first, last)]
    sign_peak = max(signs.values(), default=0)
    put_peak = max(puts.values(), default=0)
    sign_cap, store_cap = data["sign_capacity"], data["store_capacity"]
    expected = {f"{r['run_id']} s3://fleet/{r['run_id']}/checkpoints/step-{STEP}"
                for r in results}
    registered = signer["registered"]
    never = sum(1 for key in expected if not registered.get(key))
    twice = sum(1 for n in registered.values() if n > 1)
    stray = sum(1 for key in registered if key not in expected)
    objects = store["objects"]
    files = nodes * FILES
    put_twice = sum(1 for _, _, n in objects.values() if n > 1)
    not_stored = files - sum(1 for size, _, n in objects.values() if n and size == FILE_BYTES)
    all_in = max(done) - start if len(done) == nodes else float("inf")
    median_in = statistics.median(d - start for d in done) if done else float("inf")
    sign_requests, put_requests = sum(signs.values()), sum(puts.values())
    first_ask = signer["first_at"].get("sign", start) - start
    print(f"  the first upload-url request came {first_ask:.2f} s after the save")
    print(f"  signer: busiest second {sign_peak} requests ({sign_peak / sign_cap:.2f}x its "
          f"capacity), {sign_requests:,} requests for {files:,} files, "
          f"{sum(signs_refused.values()):,} answered 503")
    print(f"  store: busiest second {put_peak} PUTs ({put_peak / store_cap:.2f}x its capacity), "
          f"{put_requests:,} PUTs for {files:,} files, {sum(puts_refused.values()):,} answered "
          f"503 SlowDown; {put_twice} files stored more than once, {not_stored} not stored")
    late = [r["late_s"] for r in results if r["late_s"] > 0]
    if late:
        print(f"  WARNING: {len(late)} nodes were made after the save's instant (up to "
              f"{max(late):.1f} s late): the burst is spread by the benchmark itself")
    print(f"  every checkpoint registered {all_in:.1f} s after the save (median node "
          f"{median_in:.1f} s); registered 0 times: {never}, more than once: {twice}, "
          f"unexpected: {stray}" + (" (BOUNDED: stopped early)"
                                    if signer["bounded"] or store["bounded"] else ""))
    rows = [Row(BENCH, "busiest second at the signer", sign_peak, "req/s", sign_cap,
                "capacity", sign_peak / sign_cap, f"<= {PEAK_LIMIT:g}x capacity",
                sign_peak / sign_cap <= PEAK_LIMIT),
            Row(BENCH, "busiest second at the store", put_peak, "PUT/s", store_cap, "capacity",
                put_peak / store_cap, f"<= {PEAK_LIMIT:g}x capacity",
                put_peak / store_cap <= PEAK_LIMIT),
            info_row(BENCH, "seconds above 2x capacity at the signer",
                     sum(1 for n in signs.values() if n > PEAK_LIMIT * sign_cap), "s"),
            info_row(BENCH, "seconds above 2x capacity at the store",
                     sum(1 for n in puts.values() if n > PEAK_LIMIT * store_cap), "s"),
            info_row(BENCH, "signer requests a file", sign_requests / files, "req"),
            info_row(BENCH, "store PUTs a file", put_requests / files, "PUT"),
            info_row(BENCH, "every checkpoint registered, after the save", all_in, "s"),
            info_row(BENCH, "median node's checkpoint registered, after the save", median_in,
                     "s"),
            limit_row(BENCH, "checkpoints registered 0 times", never, "checkpoints", "<=", 0),
            limit_row(BENCH, "checkpoints registered more than once", twice + stray,
                      "checkpoints", "<=", 0),
            info_row(BENCH, "files stored more than once", put_twice, "files"),
            limit_row(BENCH, "files not stored", not_stored, "files", "<=", 0)]
    return rows, {"series": series, "sign_capacity": sign_cap, "store_capacity": store_cap,
                  "save": start - first}


def draw(png: Path, runs: list[tuple[str, dict[str, Any]]]) -> None:
    import matplotlib  # a benchmark's dependency only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(runs), 2, figsize=(12, 3.2 * len(runs)), squeeze=False,
                                sharex=True, sharey="col")
    for (label, run), row in zip(runs, axes, strict=True):
        t = [s[0] for s in run["series"]]
        for ax, (title, asked, refused, capacity) in zip(row, (
                ("signer (upload-url)", 1, 2, run["sign_capacity"]),
                ("object store (PUT)", 3, 4, run["store_capacity"])), strict=True):
            ax.step(t, [s[asked] for s in run["series"]], where="post", lw=0.8,
                    label="requests/s")
            ax.step(t, [s[refused] for s in run["series"]], where="post", lw=0.8,
                    label="of which 503")
            if asked == 1:
                ax.step(t, [s[5] for s in run["series"]], where="post", lw=0.8,
                        label="/artifact")
            ax.axhline(capacity, color="grey", ls=":", lw=0.8, label="capacity")
            ax.axhline(2 * capacity, color="red", ls="--", lw=0.8, label="2x capacity")
            ax.axvline(run["save"], color="black", lw=0.5)
            ax.set_title(f"{label}: {title}", fontsize=10)
            ax.set_ylabel("requests/s")
            ax.legend(fontsize=7, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel("seconds (the save at the vertical line)")
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    print(f"  picture written to {png}")


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--nodes", type=int, help="sidecars simulated (1000, quick 200)")
    options.add_argument("--sign-capacity", type=float, default=SIGN_PER_NODE,
                         help="the signer's requests a second, a node of the fleet (0.5)")
    options.add_argument("--store-capacity", type=float, default=STORE_PER_NODE,
                         help="the store's PUTs a second, a node of the fleet (0.5)")
    options.add_argument("--png", type=Path, help="the picture (default fleet-upload.png here)")
    options.add_argument("--label", default="this tree", help="the run's name in the picture")
    options.add_argument("--json-series", type=Path, help="write the series here")
    options.add_argument("--compare", type=Path, help="an earlier run's --json-series")
    args = parse(options)
    nodes = args.nodes or (200 if args.quick else 1000)
    rows, series = analyse(run(nodes, 120.0 if args.quick else 240.0, args.sign_capacity,
                               args.store_capacity))
    picture_and_table(args, series, rows, draw, Path("fleet-upload.png"))


if __name__ == "__main__":
    main()
