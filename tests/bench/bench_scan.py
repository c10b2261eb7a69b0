"""Benchmark (not a test): what the hooks beside the `run` log path cost the event loop.

    python tests/bench/bench_scan.py

CPU per MB of 100-byte lines on stdout through the loop's part of the /logs path but the HTTP
post (LineAssembler.feed, then the request body's encoding), alone and with what `Stream.feed`
adds beside it (issue 16): the failure-signature scanner, the crash tail's piece and the stall
clock. The two alternate, medians of 15 runs of 20 blocks of 1 MB. Target: the hooks add at most
5 % of what the whole /logs path costs a MB (bench_throughput.py's CPU-s/GB, about 4 ms/MB on the
2-core machine, of which what is measured here is a small part), that is 0.2 ms/MB.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from sidecar.delivery.client import json_body
from sidecar.delivery.crashtail import new_tails
from sidecar.masking import secrets
from sidecar.sources.console.lines import LineAssembler
from sidecar.sources.console.signatures import Scanner
from sidecar.stall import StallWatch

BLOCK_BYTES = 1 << 20
BLOCKS = 20
RUNS = 15
WHOLE_PATH_MS_PER_MB = 4.0  # bench_throughput.py: sidecar CPU-s/GB of 100 B lines, on this machine
TARGET_MS_PER_MB = 0.05 * WHOLE_PATH_MS_PER_MB
WORDS = (b"step loss lr grad norm epoch train val accuracy tokens per second throughput samples "
         b"batch").split()


def block_of(line: Callable[[], bytes]) -> bytes:
    lines: list[bytes] = []
    size = 0
    while size < BLOCK_BYTES:
        lines.append(line())
        size += len(lines[-1])
    return b"".join(lines)


def word_line() -> bytes:
    text = b"[2026-12-01 08:00:00] " + b" ".join(random.choice(WORDS) for _ in range(12))
    return text[:99].ljust(99) + b"\n"


def ms_per_mb(block: bytes, hooks: bool) -> float:
    assembler = LineAssembler(secrets, "")
    scanner, tail = Scanner(), new_tails(1)[0]
    stall = StallWatch(1800, lambda line: None, lambda: "")
    started = time.process_time()
    for _ in range(BLOCKS):
        if hooks:
            stall.activity()
            scanner.feed("stdout", block)
        text = assembler.feed(block, 0.0)
        if hooks:
            tail.add(text)
        json_body({"run_id": "run-1", "chunks": [text], "eof": False})
    return (time.process_time() - started) / BLOCKS * 1e3


def main() -> None:
    random.seed(1)
    for name, block in (("100 B lines of x", block_of(lambda: b"x" * 99 + b"\n")),
                        ("100 B lines of words", block_of(word_line))):
        alone, hooked = [], []
        for _ in range(RUNS):
            alone.append(ms_per_mb(block, hooks=False))
            hooked.append(ms_per_mb(block, hooks=True))
        added = statistics.median(hooked) - statistics.median(alone)
        print(f"{name}: {statistics.median(alone):.3f} ms/MB alone, "
              f"{statistics.median(hooked):.3f} ms/MB with the hooks: {added:+.3f} ms/MB "
              f"({'pass' if added <= TARGET_MS_PER_MB else 'FAIL'}, target <= "
              f"{TARGET_MS_PER_MB:.2f} ms/MB)")


if __name__ == "__main__":
    main()
