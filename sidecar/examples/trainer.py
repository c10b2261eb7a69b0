"""A stand-in training script for `sidecar demo`: log lines, a tqdm-style bar, exit 0."""

import sys
import time

STEPS = 120


def main() -> int:
    print("loading the dataset: 1,024 examples", flush=True)
    loss = 2.0
    for step in range(1, STEPS + 1):
        loss *= 0.985
        done = step * 30 // STEPS
        bar = f"\rtrain: {step * 100 // STEPS:3d}%|{'#' * done}{' ' * (30 - done)}| {step}/{STEPS}"
        sys.stderr.write(bar)
        sys.stderr.flush()
        if step % 40 == 0:
            print(f"step {step} | loss {loss:.4f}", flush=True)
        time.sleep(0.03)
    sys.stderr.write("\n")
    print(f"training finished: final loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
