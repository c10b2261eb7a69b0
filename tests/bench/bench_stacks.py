"""What a stack dump costs the trainer and the sidecar (docs/stalls.md#what-it-costs).

A stand-in trainer (torch, a 256x256 matmul a step, one thread, its step ends stamped) runs for
the whole benchmark; it is dumped with `py-spy dump --json` as the sidecar dumps it, first with
Python frames only (what a SIGTERM takes), then with `--native` (what a stall takes), DUMPS
times each, a second apart. Figures, each against the same run's steps with no dump near them:
the longest step that overlaps a dump against the median step, the time the trainer lost to each
dump (the steps under it beyond their median), and the sidecar's side: each dump's wall time and
the CPU time of its py-spy process. Alone: `python tests/bench/bench_stacks.py [--dumps N]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sidecar.stacks import find_tool

TRAINER = r'''
import struct, sys, time
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
out = open(sys.argv[1], "wb", buffering=0)
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    a = torch.mm(a, a).clamp_(-1, 1)
    out.write(struct.pack("d", time.monotonic()))
'''


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dumps", type=int, default=10, help="dumps of each kind")
    args = parser.parse_args()
    tool = find_tool()
    if tool is None:
        print("py-spy is not installed: nothing to measure")
        return 1
    with tempfile.TemporaryDirectory() as folder:
        stamps_path = Path(folder) / "steps"
        run_s = 4 + 2 * args.dumps * 1.5 + 10
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(stamps_path), str(run_s)],
                                   stdout=subprocess.PIPE)
        assert trainer.stdout is not None
        trainer.stdout.readline()
        time.sleep(2)  # its steady state
        windows: dict[str, list[tuple[float, float]]] = {"python": [], "native": []}
        cpu: dict[str, list[float]] = {"python": [], "native": []}
        for kind in ("python", "native"):
            for _ in range(args.dumps):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.monotonic()
                done = subprocess.run([tool, "dump", "--pid", str(trainer.pid), "--json",
                                       *(("--native",) if kind == "native" else ())],
                                      capture_output=True, check=False, timeout=30)
                end = time.monotonic()
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                assert done.returncode == 0 and json.loads(done.stdout), done.stderr[-500:]
                windows[kind].append((start, end))
                cpu[kind].append(after.ru_utime - before.ru_utime
                                 + after.ru_stime - before.ru_stime)
                time.sleep(1.0)
        trainer.wait(run_s + 30)
        raw = stamps_path.read_bytes()
    ends = list(struct.unpack(f"{len(raw) // 8}d", raw))
    steps = list(itertools.pairwise(ends))  # (start, end) of each step but the first
    every = windows["python"] + windows["native"]

    def near(step: tuple[float, float]) -> bool:
        return any(step[1] > a - 0.2 and step[0] < b + 0.2 for a, b in every)

    quiet = [b - a for a, b in steps if not near((a, b))]
    median_s = statistics.median(quiet)
    print(f"steps: {len(steps)}, median away from dumps {median_s * 1e3:.2f} ms "
          f"(p99 {sorted(quiet)[int(len(quiet) * 0.99)] * 1e3:.2f} ms)")
    print("kind    dump wall ms (median/max)  py-spy CPU ms  longest step under it  "
          "trainer lost ms a dump (median/max)")
    for kind, spans in windows.items():
        walls = [b - a for a, b in spans]
        longest, lost = [], []
        for a, b in spans:
            under = [e - s for s, e in steps if e > a and s < b]
            longest.append(max(under, default=0.0))
            lost.append(max(sum(under) - len(under) * median_s, 0.0))
        print(f"{kind:7} {statistics.median(walls) * 1e3:8.1f} / {max(walls) * 1e3:8.1f}"
              f"        {statistics.median(cpu[kind]) * 1e3:8.1f}"
              f"       {max(longest) / median_s:6.1f}x median"
              f"          {statistics.median(lost) * 1e3:6.2f} / {max(lost) * 1e3:6.2f}")
    print(f"(the machine: {os.cpu_count()} CPUs, shared with other work while measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
