"""Benchmark (not a test, not in run_all.py): a steady training run for hours, an outage inside.

    python tests/bench/bench_soak.py [--minutes 120] [--outage-at 55] [--outage-minutes 10]
                                     [--quick]

`sidecar run --jsonl FILE --tensorboard DIR --hardware-interval 10 -- _soak_trainer.py` with 8
stand-in GPUs (tests/nvml_stub, built with gcc; without it, no GPU and a line saying so): the
trainer prints 100 log lines a second, appends 10 JSONL points a second and writes 10
TensorBoard scalars a second (tensorboardX), each its own write, for --minutes. The ingest
(_receiver.py in soak mode) is unreachable from --outage-at for --outage-minutes (each request
read, then its connection closed unanswered). Each minute: the sidecar's RSS, open
descriptors, CPU share of a core, and requests a second to each route; at the end the points
lost and repeated, by key (both must be 0), and whether the run's end arrived.

--quick: 6 minutes, a 2-minute outage at minute 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from _harness import (
    HERE,
    REPO,
    SIDECAR,
    Receiver,
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
    stop,
)

BENCH = "soak"
LINES_PER_S, POINTS_PER_S, TB_PER_S = 100, 10, 10
HARDWARE_INTERVAL_S = 10
GPUS = 8
REFUSED = "refused during the outage"  # the receiver's count of requests it closed unanswered
DRAIN_S = 120.0  # after the trainer's end: the backlog has this long to arrive


def stand_in_gpus(work: Path) -> dict[str, str]:
    """The environment that gives the sidecar 8 stand-in GPUs, or {} (said) without gcc."""
    sys.path.insert(0, str(REPO))
    from tests.bench.bench_hardware import gpu_script
    from tests.nvml_stub.build import BuildError, build
    try:
        lib_dir = build(work / "nvml")
    except (BuildError, OSError, subprocess.CalledProcessError) as exc:
        print(f"  no stand-in GPUs ({exc}): hardware sampling sees none")
        return {}
    script = work / "gpus.txt"
    script.write_text(gpu_script(GPUS))
    return {"LD_LIBRARY_PATH": str(lib_dir), "NVML_STUB_SCRIPT": str(script)}


def _get(rec: Receiver, path: str) -> Any:
    with urllib.request.urlopen(rec.base + path, timeout=30) as answer:
        return json.load(answer)


def descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def soak(minutes: float, outage_at: float, outage_minutes: float) -> list[Row]:
    with receiver("soak") as rec, tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        work = Path(tmp)
        jsonl, tbdir, done = work / "metrics.jsonl", work / "tb", work / "trainer.done"
        jsonl.touch()
        tbdir.mkdir()
        env = sidecar_env(rec.endpoint, work / "state", hardware_interval=str(HARDWARE_INTERVAL_S))
        env.update(stand_in_gpus(work))
        trainer = [sys.executable, str(HERE / "_soak_trainer.py"), str(minutes * 60),
                   str(LINES_PER_S), str(POINTS_PER_S), str(TB_PER_S), str(jsonl), str(tbdir),
                   str(done)]
        with (work / "sidecar.log").open("ab") as messages:
            proc = subprocess.Popen([*SIDECAR, "run", "--jsonl", str(jsonl), "--tensorboard",
                                     str(tbdir), "--", *trainer], env=env, cwd=work,
                                    stdout=subprocess.DEVNULL, stderr=messages)
        ps = psutil.Process(proc.pid)
        started = time.monotonic()
        print(f"  {minutes:g} minutes, outage from minute {outage_at:g} for {outage_minutes:g}; "
              "per minute:", flush=True)
        print("  minute  ingest  RSS MB  fds  CPU %  req/s: logs metrics hardware  others  "
              "refused",
              flush=True)
        per_minute: list[dict[str, float]] = []
        down = False
        before, cpu_before, at = rec.stats()["routes"], cpu_seconds(ps), started
        try:
            minute = 0
            while proc.poll() is None:
                minute += 1
                due = started + 60 * minute
                while time.monotonic() < due and proc.poll() is None:
                    now_min = (time.monotonic() - started) / 60
                    want_down = outage_at <= now_min < outage_at + outage_minutes
                    if want_down != down:
                        _get(rec, "/_down" if want_down else "/_up")
                        down = want_down
                        print(f"  -- the ingest is {'down' if down else 'back'} at "
                              f"{now_min:.1f} min", flush=True)
                    time.sleep(min(1.0, max(due - time.monotonic(), 0.0)))
                if proc.poll() is not None:
                    break
                routes, cpu, now = rec.stats()["routes"], cpu_seconds(ps), time.monotonic()
                span = now - at
                rate = {r: (routes.get(r, 0) - before.get(r, 0)) / span for r in routes}
                refused = rate.pop(REFUSED, 0.0)
                others = sum(v for r, v in rate.items()
                             if r not in ("/logs", "/metrics", "/hardware"))
                row = {"minute": minute, "rss_mb": ps.memory_info().rss / 1e6,
                       "fds": descriptors(proc.pid), "cpu_pct": 100 * (cpu - cpu_before) / span,
                       "logs": rate.get("/logs", 0.0), "metrics": rate.get("/metrics", 0.0),
                       "hardware": rate.get("/hardware", 0.0), "others": others,
                       "refused": refused,
                       "down": float(down)}
                per_minute.append(row)
                print(f"  {minute:6d}  {'down' if down else 'up':6}  {row['rss_mb']:6.1f} "
                      f"{row['fds']:4d}  {row['cpu_pct']:5.2f}  {row['logs']:10.2f} "
                      f"{row['metrics']:7.2f} {row['hardware']:8.2f}  {others:6.2f}"
                      f"  {refused:7.2f}",
                      flush=True)
                before, cpu_before, at = routes, cpu, now
                if minute > minutes + DRAIN_S / 60 + 2:
                    raise RuntimeError("the run did not end after its trainer")
            status = proc.wait(DRAIN_S)
        finally:
            stop(proc)
            show_warnings(work)
        written = json.loads(done.read_text()) if done.exists() else {}
        received = _get(rec, "/_soak")
        stats = rec.stats()
    rows: list[Row] = [limit_row(BENCH, "the wrapper's exit status", status, "", "<=", 0)]
    for key in ("soak_jsonl", "soak_tb"):
        got = next((v for k, v in received.items() if k.endswith(key)),
                   {"distinct": 0, "repeated": 0})
        lost = written.get(key, 0) - got["distinct"]
        print(f"  {key}: {written.get(key, 0):,} written, {got['distinct']:,} distinct "
              f"received, {lost:,} lost, {got['repeated']:,} repeated")
        rows += [limit_row(BENCH, f"{key}: points lost", lost, "points", "<=", 0),
                 limit_row(BENCH, f"{key}: points repeated", got["repeated"], "points", "<=", 0)]
    print(f"  log lines: {written.get('lines', 0):,} written, {stats['lines']:,} received "
          "(best-effort: an outage longer than the buffer drops the oldest)")
    steady = [r for r in per_minute if not r["down"]]
    if per_minute:
        first, last = per_minute[0], per_minute[-1]
        rows += [info_row(BENCH, "RSS, first minute", first["rss_mb"], "MB"),
                 info_row(BENCH, "RSS, largest", max(r["rss_mb"] for r in per_minute), "MB"),
                 info_row(BENCH, "RSS, last minute", last["rss_mb"], "MB"),
                 info_row(BENCH, "descriptors, first and largest", max(r["fds"] for r in
                                                                      per_minute), "fds",
                          first["fds"], "first minute"),
                 info_row(BENCH, "CPU while the ingest is up (mean of minutes)",
                          sum(r["cpu_pct"] for r in steady) / max(len(steady), 1), "%"),
                 info_row(BENCH, "requests/s to the ingest while up (mean of minutes)",
                          sum(r["logs"] + r["metrics"] + r["hardware"] + r["others"]
                              for r in steady) / max(len(steady), 1), "req/s")]
    rows.append(info_row(BENCH, "log lines received", 100 * stats["lines"] /
                         max(written.get("lines", 1), 1), "%"))
    return rows


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--minutes", type=float, help="how long the trainer runs (120)")
    options.add_argument("--outage-at", type=float, help="minute the outage begins (middle)")
    options.add_argument("--outage-minutes", type=float, help="how long it lasts (10)")
    args = parse(options)
    minutes = args.minutes or (6.0 if args.quick else 120.0)
    outage_minutes = args.outage_minutes or (2.0 if args.quick else 10.0)
    outage_at = args.outage_at if args.outage_at is not None else \
        (minutes - outage_minutes) / 2
    finish(soak(minutes, outage_at, outage_minutes), args.json)


if __name__ == "__main__":
    main()
