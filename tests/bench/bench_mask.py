"""Benchmark (not a test): what masking costs a block of output, for every text and every token.

    python tests/bench/bench_mask.py [--quick]

sidecar.masking.Secrets.mask_raw (how the command's output and followed log files are masked) on
1 MiB blocks of each text below, with each token below as the secret; GB/s of the block, the
best of a few rounds (the machine is shared), after one call that lets the search settle on the
text (as a stream's first block does).

Texts: each printable ASCII character repeated (lines of 1 KiB), base64 (76-character lines),
JSON log lines, UTF-8 CJK, one line of `-` (1 MiB, no newline).
Tokens: the throughput benchmark's two (`tok-bench-0123456789` made CPython's substring search,
keyed on the low 6 bits of each character, slow on a line of `x`s); 20 random tokens of the
platform's shape (`tok-` and 16 hex digits); tokens built against the search: for every
printable character, 18 of it and two of a common letter (a substring search's prefilter finds
a candidate at every byte of a line of that character), and for the JSON and base64 texts,
tokens made of their own bytes that begin like each of their lines; and each benchmark token
with a second secret beside it (a token re-read after a 401).
Beside each column, `secret in text` on the decoded text (the search masking made before) with
the column's first token, over every text: its worst cell.

Target (issue 25): at least 2 GB/s in every cell.
"""

from __future__ import annotations

import base64
import json
import random
import string
import sys
import time
from collections.abc import Callable

from _harness import Row, bench_arguments, finish, info_row, limit_row, parse
from bench_throughput import TOKENS

from sidecar.masking import Secrets

BENCH = "masking"
BLOCK_BYTES = 1 << 20
QUICK_BLOCK_BYTES = 1 << 18
MIN_GB_S = 2.0
PRINTABLE = string.printable[:95]  # space to tilde
REREAD = "tok-7e51b08d463f9c2a"  # the second secret of the two-secret column


def texts(size: int) -> dict[str, bytes]:
    rng = random.Random(25)
    found = {f"{c!r} repeated": ((c * 1023 + "\n") * (size // 1024)).encode() for c in PRINTABLE}
    b64 = base64.b64encode(rng.randbytes(size * 3 // 4)).decode()
    found["base64"] = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)).encode()[:size]
    found["JSON log lines"] = "".join(
        json.dumps({"ts": f"2025-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}.000Z", "level": "info",
                    "msg": f"step {i} loss {rng.random():.4f}"}) + "\n"
        for i in range(size // 80)).encode()[:size]
    found["UTF-8 CJK"] = (("训练步骤损失学习率梯度批次" * 26 + "\n") * (size // 1015)).encode()
    found["a line of -"] = b"-" * size
    return found


def token_groups() -> dict[str, list[tuple[str, ...]]]:
    """Column -> its secrets (each a tuple: the secrets of one Secrets)."""
    rng = random.Random(17)
    shaped = ["tok-" + "".join(rng.choice("0123456789abcdef") for _ in range(16))
              for _ in range(20)]
    against = [c * 18 + ("ee" if c == "t" else "tt") for c in PRINTABLE.replace(" ", "")]
    against += ['"level": "info", "msg": "step 1234567 loss',  # each JSON line begins a match
                '{"ts": "2025-01-01T00:59:59.999Z", "level"',
                'Zm9vYmFyYmF6cXV4cXV1eA', 'AAAAAAAAAAAAAAAAAAAAAA9']  # base64's own bytes
    return {TOKENS[0]: [(TOKENS[0],)], TOKENS[1]: [(TOKENS[1],)],
            "20 random tokens": [(t,) for t in shaped],
            f"{len(against)} tokens built against the search": [(t,) for t in against],
            "a benchmark token + a re-read one": [(t, REREAD) for t in TOKENS]}


def gb_per_s(size: int, work: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return size / best / 1e9


def main() -> int:
    args = parse(bench_arguments(__doc__ or ""))
    rounds = 3 if args.quick else 7
    size = QUICK_BLOCK_BYTES if args.quick else BLOCK_BYTES
    blocks = texts(size)
    decoded = {name: block.decode() for name, block in blocks.items()}
    groups = token_groups()
    text_groups = {"each printable character repeated (worst)":
                   [n for n in blocks if n.endswith(" repeated")]}
    text_groups.update({n: [n] for n in blocks if not n.endswith(" repeated")})
    table: dict[tuple[str, str], tuple[float, str, str]] = {}  # (text row, column) -> worst
    before: dict[str, tuple[float, str, str]] = {}  # column -> worst `in` cell
    for column, secret_sets in groups.items():
        for row, names in text_groups.items():
            for name in names:
                block = blocks[name]
                for secret_set in secret_sets:
                    secrets = Secrets(secret_set)
                    secrets.mask_raw(block)  # the first block: the gate learns the text
                    cell = (gb_per_s(len(block), lambda s=secrets, b=block: s.mask_raw(b),
                                     rounds), name, secret_set[0])
                    table[row, column] = min(table.get((row, column), cell), cell)
                text = decoded[name]  # `in`, slow, for the column's first token alone
                plain = (gb_per_s(len(block), lambda t=text, k=secret_sets[0]: any(
                    secret in t for secret in k), 3), name, secret_sets[0][0])
                before[column] = min(before.get(column, plain), plain)
    _print_matrix(table, list(text_groups), list(groups), before)
    rows: list[Row] = []
    for column in groups:
        worst = min(table[row, column] for row in text_groups)
        rows.append(info_row(BENCH, f"{column}: worst cell ({worst[1]}, {worst[2]!r})",
                             worst[0], "GB/s", before[column][0],
                             f"`in` before, {before[column][1]}"))
    worst = min(table.values())
    rows.append(limit_row(BENCH, f"worst cell of {len(blocks)} texts x "
                          f"{sum(len(s) for s in groups.values())} tokens ({worst[1]}, "
                          f"{worst[2]!r})", worst[0], "GB/s", ">=", MIN_GB_S))
    finish(rows, args.json)
    return 0 if all(row.passed is not False for row in rows) else 1


def _print_matrix(table: dict[tuple[str, str], tuple[float, str, str]], rows: list[str],
                  columns: list[str], before: dict[str, tuple[float, str, str]]) -> None:
    """GB/s, texts down, tokens across (a group's worst cell), `in` before at the foot."""
    width = max(map(len, rows)) + 2
    print("GB/s of Secrets.mask_raw (worst cell of each group)")
    for i, column in enumerate(columns):
        print(f"  column {i + 1}: {column}")
    print(" " * width + "".join(f"{i + 1:>9}" for i in range(len(columns))))
    for row in rows:
        print(row.ljust(width) + "".join(f"{table[row, c][0]:9.1f}" for c in columns))
    print("`in` before".ljust(width) + "".join(f"{before[c][0]:9.2f}" for c in columns))


if __name__ == "__main__":
    sys.exit(main())
