"""Benchmark (not a test): what masking costs a block of output, per secret.

    python tests/bench/bench_mask.py [--quick]

sidecar.log.Secrets.mask on 1 MiB blocks of the throughput benchmark's 100 B lines, and of lines
padded with one repeated letter, once for each of the two tokens of the throughput benchmark
(the first one made str.find's skip table three times slower than the second), against a plain
`secret in text`. Nanoseconds a character; best of a few rounds (the machine is shared).

Target (issue 15): the two tokens within 1.5x of each other with Secrets.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _harness import Row, bench_arguments, finish, info_row, limit_row, parse
from bench_throughput import TOKENS, write_log

from sidecar.log import Secrets

BENCH = "masking"
BLOCK_CHARS = 1 << 20
MAX_TOKEN_RATIO = 1.5


def ns_per_char(text: str, work: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(10):
            work()
        best = min(best, (time.perf_counter() - started) / 10)
    return best / len(text) * 1e9


def texts() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lines.log"
        write_log(path, BLOCK_CHARS // 100, 100)
        words = path.read_text()
    head = "2025-01-01T00:00:00.000Z INFO train step=%09d loss=0.4321 "
    padded = "".join(head % i + "x" * (99 - len(head % 0)) + "\n"
                     for i in range(BLOCK_CHARS // 100))
    return {"random words": words, "one letter": padded}


def main() -> int:
    args = parse(bench_arguments(__doc__ or ""))
    rounds = 3 if args.quick else 10
    rows: list[Row] = []
    for name, text in texts().items():
        costs = {}
        for token in TOKENS:
            secrets = Secrets([token])
            secrets.mask(text)  # the first long text picks what is searched for
            costs[token] = ns_per_char(text, lambda s=secrets, t=text: s.mask(t), rounds)
            plain = ns_per_char(text, lambda k=token, t=text: k in t, rounds)
            print(f"  {name}, {token}: Secrets.mask {costs[token]:.3f} ns/char, "
                  f"`in` {plain:.3f} ns/char")
            rows.append(info_row(BENCH, f"{name}, {token}", costs[token], "ns/char", plain,
                                 "`in`"))
        ratio = max(costs.values()) / min(costs.values())
        rows.append(limit_row(BENCH, f"{name}: slower token / faster token", ratio, "x", "<=",
                              MAX_TOKEN_RATIO))
    finish(rows, args.json)
    return 0 if all(row.passed is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
