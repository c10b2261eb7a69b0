"""The wrapped command of the latency-under-load benchmark: floods stdout with 100-byte lines at
RATE bytes/s (in 10 ms steps) for SECONDS seconds, then writes to COUNT_FILE the lines it wrote
and the seconds that took (more than SECONDS when its reader held it back).

    python tests/bench/_flood_child.py RATE SECONDS COUNT_FILE
"""

from __future__ import annotations

import os
import sys
import time

TICK_S = 0.01
LINE = b"2025-01-01T00:00:00.000Z INFO flood " + b"x" * 63 + b"\n"  # 100 B


def main(rate: float, seconds: float, count_file: str) -> None:
    per_tick = max(1, round(rate * TICK_S / len(LINE)))
    block = memoryview(LINE * per_tick)
    start, lines = time.monotonic(), 0
    for tick in range(1, round(seconds / TICK_S) + 1):
        part = block
        while part:
            part = part[os.write(1, part):]
        lines += per_tick
        time.sleep(max(0.0, start + tick * TICK_S - time.monotonic()))
    with open(count_file, "w") as f:
        f.write(f"{lines} {time.monotonic() - start:.3f}\n")


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
