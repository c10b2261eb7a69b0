"""The trainer of the soak benchmark: a steady run's output for SECONDS seconds.

    python tests/bench/_soak_trainer.py SECONDS LINES_PER_S POINTS_PER_S TB_PER_S JSONL TBDIR DONE

Prints LINES_PER_S log lines a second to stdout (each its own write), appends POINTS_PER_S
JSONL points a second to JSONL (`{"step": N, "soak_jsonl": ...}`, each its own write) and writes
TB_PER_S TensorBoard scalars a second (tag `soak_tb`) with tensorboardX into TBDIR, on a fixed
schedule. At the end it writes the counts to DONE as JSON: what the ingest must hold once, each
step of each key.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tensorboardX import SummaryWriter

PAD = "x" * 60


def main(seconds: float, lines_per_s: int, points_per_s: int, tb_per_s: int, jsonl: str,
         tbdir: str, done: str) -> None:
    jsonl_fd = os.open(jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    writer = SummaryWriter(tbdir, flush_secs=5)
    events = sorted([(i / lines_per_s, 0, i) for i in range(round(seconds * lines_per_s))]
                    + [(j / points_per_s, 1, j) for j in range(round(seconds * points_per_s))]
                    + [(k / tb_per_s, 2, k) for k in range(round(seconds * tb_per_s))])
    start = time.monotonic()
    counts = [0, 0, 0]
    for due, kind, seq in events:
        time.sleep(max(0.0, start + due - time.monotonic()))
        if kind == 0:
            os.write(1, f"step {seq:09d} {time.time():.3f} {PAD}\n".encode())
        elif kind == 1:
            os.write(jsonl_fd, (json.dumps({"step": seq, "soak_jsonl": seq / 7}) + "\n").encode())
        else:
            writer.add_scalar("soak_tb", seq / 3, seq)
        counts[kind] += 1
    writer.close()
    os.close(jsonl_fd)
    with open(done + ".tmp", "w", encoding="utf-8") as fh:
        json.dump({"lines": counts[0], "soak_jsonl": counts[1], "soak_tb": counts[2]}, fh)
    os.replace(done + ".tmp", done)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
         sys.argv[6], sys.argv[7])
