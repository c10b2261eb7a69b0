"""A stand-in training script for `sidecar demo`: log lines, a tqdm-style bar (lines printed
beside it as tqdm.write prints them), a checkpoint saved at step 40 into the folder given as its
argument (when one is), exit 0."""

import json
import os
import struct
import sys
import time

STEPS = 120
SAVE_AT = 40


def save_checkpoint(folder: str, step: int) -> None:
    """A safetensors file of 64 KiB written beside its place, then renamed in, as safetensors
    0.8 does: whole when it appears."""
    data = bytes(range(256)) * 256
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)],
                               "data_offsets": [0, len(data)]}}).encode()
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, f"step_{step}.safetensors")
    with open(final + ".tmp", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + data)
    os.replace(final + ".tmp", final)
    print(f"saved {final}", flush=True)


def main() -> int:
    save_to = sys.argv[1] if len(sys.argv) > 1 else ""
    print("loading the dataset: 1,024 examples", flush=True)
    loss = 2.0
    for step in range(1, STEPS + 1):
        loss *= 0.985
        done = step * 30 // STEPS
        bar = f"\rtrain: {step * 100 // STEPS:3d}%|{'#' * done}{' ' * (30 - done)}| {step}/{STEPS}"
        sys.stderr.write(bar)
        sys.stderr.flush()
        if step % 40 == 0 or (step == SAVE_AT and save_to):
            # as tqdm.write does: the bar cleared, the lines printed, the bar drawn again
            sys.stderr.write("\r" + " " * len(bar) + "\r")
            sys.stderr.flush()
            if step % 40 == 0:
                print(f"step {step} | loss {loss:.4f}", flush=True)
            if step == SAVE_AT and save_to:
                save_checkpoint(save_to, step)
            sys.stderr.write(bar)
            sys.stderr.flush()
        time.sleep(0.03)
    sys.stderr.write("\n")
    print(f"training finished: final loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
