"""The writer of the latency benchmark: appends log lines and JSONL points at a steady rate, each
stamped with the time of its write, for SECONDS seconds.

    python tests/bench/_latency_writer.py LOG JSONL SECONDS LINES_PER_S POINTS_PER_S

Every 10 ms (on a fixed schedule) it appends its share of log lines (`LAT <epoch> <seq> ...`) in
one write, and its share of JSONL records (`{"latency_probe": 1, "step": N, "ts": <epoch>}`) in
another, each stamped just before its write. Prints the counts written as JSON at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

TICK_S = 0.01
PAD = "x" * 60


def main(log: str, jsonl: str, seconds: float, lines_per_s: int, points_per_s: int) -> None:
    log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    jsonl_fd = os.open(jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    ticks = round(seconds / TICK_S)
    lines = points = 0
    start = time.monotonic()
    for tick in range(1, ticks + 1):
        due_lines = round(lines_per_s * tick * TICK_S)
        due_points = round(points_per_s * tick * TICK_S)
        now = time.time()
        if due_lines > lines:
            os.write(log_fd, "".join(f"LAT {now:.6f} {seq:09d} {PAD}\n"
                                     for seq in range(lines, due_lines)).encode())
            lines = due_lines
        now = time.time()
        if due_points > points:
            os.write(jsonl_fd, "".join(json.dumps({"latency_probe": 1, "step": step, "ts": now})
                                       + "\n" for step in range(points, due_points)).encode())
            points = due_points
        time.sleep(max(0.0, start + tick * TICK_S - time.monotonic()))
    os.close(log_fd)
    os.close(jsonl_fd)
    print(json.dumps({"lines": lines, "points": points}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
