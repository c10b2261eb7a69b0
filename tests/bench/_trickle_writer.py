"""The writer of the trickle benchmark: a training run's steady output, each line its own write.

    python tests/bench/_trickle_writer.py GO SECONDS LINES_PER_S POINTS_PER_S JSONL LOG [LOG ...]

Waits until the file GO exists (the benchmark creates it once every process measured is
started and quiet), then for SECONDS seconds writes LINES_PER_S log lines a second
(`LAT <epoch> <seq> ...`, stamped just before the write) to every LOG, one write each (`-` is
stdout), and POINTS_PER_S JSONL points a second (`{"latency_probe": 1, "step": N, "ts":
<epoch>}`) to JSONL, one write each, on a fixed schedule. Writes the counts written as JSON to
GO.done at the end (stdout may be one of the logs, and `sidecar run` sends stderr to /logs).
"""

from __future__ import annotations

import json
import os
import sys
import time

PAD = "x" * 60
GO_POLL_S = 0.05


def main(go: str, seconds: float, lines_per_s: int, points_per_s: int, jsonl: str,
         logs: list[str]) -> None:
    fds = [1 if name == "-" else os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
           for name in logs]
    jsonl_fd = os.open(jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while not os.path.exists(go):
        time.sleep(GO_POLL_S)
    # one schedule: the i-th line is due at i / lines_per_s, the j-th point at j / points_per_s
    events = sorted([(i / lines_per_s, 0, i) for i in range(round(seconds * lines_per_s))]
                    + [(j / points_per_s, 1, j) for j in range(round(seconds * points_per_s))])
    start = time.monotonic()
    lines = points = 0
    for due, kind, seq in events:
        time.sleep(max(0.0, start + due - time.monotonic()))
        now = time.time()
        if kind == 0:
            line = f"LAT {now:.6f} {seq:09d} {PAD}\n".encode()
            for fd in fds:
                os.write(fd, line)
            lines += 1
        else:
            os.write(jsonl_fd, (json.dumps({"latency_probe": 1, "step": seq, "ts": now})
                                + "\n").encode())
            points += 1
    with open(go + ".done.tmp", "w", encoding="utf-8") as done:
        json.dump({"lines": lines, "points": points}, done)
    os.replace(go + ".done.tmp", go + ".done")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
         sys.argv[6:])
