"""The wrapped command of the wrapper benchmark: writes TOTAL bytes of LINE-byte lines to stdout
as fast as it can, then writes its own start and end times (epoch seconds) to TIMES_FILE.

    python tests/bench/_writer_child.py TOTAL LINE TIMES_FILE [blocks|prints]

`blocks` (the default): 10,000 lines a write. `prints`: one `print()` a line, as a training loop
prints, each a write of its own under PYTHONUNBUFFERED=1 (which `sidecar run` sets; the benchmark
sets it for `tee` too).
"""

from __future__ import annotations

import os
import sys
import time

BLOCK_LINES = 10_000
HEAD = b"2025-01-01T00:00:00.000Z INFO train step=%09d loss=0.4321 "


def blocks(total: int, line_bytes: int) -> None:
    template = HEAD + b"x" * (line_bytes - len(HEAD % 0) - 1) + b"\n"
    block = b"".join(template % i for i in range(BLOCK_LINES))
    view = memoryview(block)
    written = 0
    while written < total:
        part = view[: min(len(block), total - written)]
        while part:
            part = part[os.write(1, part):]
        written += len(block)


def prints(total: int, line_bytes: int) -> None:
    template = (HEAD + b"x" * (line_bytes - len(HEAD % 0) - 1)).decode()
    for i in range(total // line_bytes):
        print(template % i)


def main(total: int, line_bytes: int, times_file: str, mode: str) -> None:
    started = time.time()
    (prints if mode == "prints" else blocks)(total, line_bytes)
    ended = time.time()
    with open(times_file, "w") as f:
        f.write(f"{started} {ended}\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
         sys.argv[4] if len(sys.argv) > 4 else "blocks")
