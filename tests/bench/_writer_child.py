"""The wrapped command of the wrapper benchmark: writes TOTAL bytes of LINE-byte lines to stdout
as fast as it can, then writes its own start and end times (epoch seconds) to TIMES_FILE.

    python tests/bench/_writer_child.py TOTAL LINE TIMES_FILE
"""

from __future__ import annotations

import os
import sys
import time

BLOCK_LINES = 10_000


def main(total: int, line_bytes: int, times_file: str) -> None:
    started = time.time()
    head = b"2025-01-01T00:00:00.000Z INFO train step=%09d loss=0.4321 "
    template = head + b"x" * (line_bytes - len(head % 0) - 1) + b"\n"
    block = b"".join(template % i for i in range(BLOCK_LINES))
    view = memoryview(block)
    written = 0
    while written < total:
        part = view[: min(len(block), total - written)]
        while part:
            part = part[os.write(1, part):]
        written += len(block)
    ended = time.time()
    with open(times_file, "w") as f:
        f.write(f"{started} {ended}\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
