"""Benchmark (not a test): what a flood of progress-bar updates costs the wrapper.

    python tests/bench/bench_tqdm_flood.py [--quick] [--seconds 8] [--rate 100000]

`sidecar run` wraps a child that redraws tqdm-style bars 100,000 times a second (paced, in
writes of 100 updates each millisecond), first one bar (`\\r` + state), then a nested pair
(position 0 and 1: the inner one drawn with `\\n`, `\\r`, its state, `ESC[A`, as tqdm does), and
a counting receiver that answers at once. For comparison, the same states as plain lines first
(the cost of forwarding that much output at all). The sidecar's own CPU time (all its threads,
not the child's) is read over the flood, start-up excluded, and given as a share of one core.

Target (issue 15): at most a tenth of a core.
"""

from __future__ import annotations

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
    profiled,
    receiver,
    show_warnings,
    sidecar_env,
    stop,
    wait_until_posted,
)

BENCH = "tqdm flood"
TARGET_CORE_SHARE = 0.1
WARMUP_S = 1.0  # of the flood, not measured: the sidecar's start-up and first imports

FLOOD_CHILD = """
import sys, time
rate, seconds, kind = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
per_ms = rate // 1000
out = sys.stdout.buffer
def state(i, total=10**7):
    return (f"\\rtrain: {i * 100 // total:3d}%|{'#' * (i * 10 // total):10s}| {i}/{total} "
            f"[00:01<00:10, {rate:.2f}it/s]").encode()
start = time.monotonic()
i = 0
while time.monotonic() - start < seconds:
    batch = []
    for _ in range(per_ms):
        i += 1
        drawn = state(i)
        batch.append(b"\\n" + drawn + b"\\x1b[A" if kind == "nested" else
                     drawn[1:] + b"\\n" if kind == "lines" else drawn)
    out.write(b"".join(batch))
    out.flush()
    wake = start + i / rate
    delay = wake - time.monotonic()
    if delay > 0:
        time.sleep(delay)
out.write(b"\\n\\n")
print("updates", i, file=sys.stderr)
"""


def flood(kind: str, rate: int, seconds: float, work: Path, profile: Path | None) -> float:
    """The sidecar's CPU share of one core while its child floods at `rate` updates a second."""
    with receiver("count") as rec, tempfile.TemporaryDirectory(dir=work) as state:
        env = sidecar_env(rec.endpoint, Path(state))
        with (work / "sidecar.log").open("ab") as messages:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "run", "--", sys.executable, "-c",
                 FLOOD_CHILD, str(rate), str(seconds), kind],
                env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=messages)
        try:
            ps = psutil.Process(proc.pid)
            wait_until_posted(rec, "/logs")
            time.sleep(WARMUP_S)
            with profiled(proc.pid, profile, f"tqdm-flood-{kind}"):
                cpu0, wall0 = cpu_seconds(ps), time.monotonic()
                time.sleep(max(seconds - 2 * WARMUP_S, 1.0))
                cpu_s, wall_s = cpu_seconds(ps) - cpu0, time.monotonic() - wall0
            proc.wait(60)
        finally:
            stop(proc)
            show_warnings(work)
            (work / "sidecar.log").unlink(missing_ok=True)
    share = cpu_s / wall_s
    print(f"  {kind:7s} bar(s), {rate:,} updates/s: sidecar {cpu_s:.2f} CPU-s in {wall_s:.1f} s "
          f"= {share:.3f} of a core")
    return share


def main() -> int:
    options = bench_arguments(__doc__ or "")
    options.add_argument("--seconds", type=float, default=None, help="flood length (default 8)")
    options.add_argument("--rate", type=int, default=100_000, help="updates a second")
    args = parse(options)
    seconds = args.seconds or (5.0 if args.quick else 8.0)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-tqdm-flood-") as tmp:
        lines = flood("lines", args.rate, seconds, Path(tmp), args.profile)
        for kind in ("single", "nested"):
            share = flood(kind, args.rate, seconds, Path(tmp), args.profile)
            rows.append(limit_row(BENCH, f"{kind} bar, {args.rate:,} updates/s: CPU share",
                                  share, "cores", "<=", TARGET_CORE_SHARE))
            rows.append(info_row(BENCH, f"{kind} bar against as many plain lines", share,
                                 "cores", lines, "lines"))
    rows.append(info_row(BENCH, "flood length", seconds, "s"))
    finish(rows, args.json)
    return 0 if all(row.passed is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
