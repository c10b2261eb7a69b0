"""The trainer of the time-sampling benchmark: a CPU-bound step in a loop, each step timed.

    python tests/bench/_steps_trainer.py OUT SECONDS

A step is what a small CPU trainer's is: torch matmuls on one thread (torch.set_num_threads(1))
and a little pure Python between them (the loop py-spy reads the frames of). After a second of
warm-up, untimed, it steps for SECONDS, each step's duration taken with
time.perf_counter; it prints a line a second (a trainer's log: the sidecar sees output, so no
stall is said and no stack dump taken). At the end it writes OUT, as doubles: the timed span's
start and end (time.monotonic, the same clock across processes), every step's duration, then
every step's CPU time on the main thread (time.thread_time: what the step cost the trainer
itself, without the waits for a core that the machine's other work adds to its duration).
"""

from __future__ import annotations

import array
import sys
import time
from pathlib import Path

import torch

SIZE = 256  # a 256x256 float matmul on one core
MATMULS = 5  # a step: about 2 ms
PYTHON_LOOP = 3000  # and a pure-Python sum after each (the frames py-spy reads)


def step(a: torch.Tensor) -> tuple[torch.Tensor, int]:
    total = 0
    for _ in range(MATMULS):
        a = torch.mm(a, a).clamp_(-1, 1)
        total += sum(i * i for i in range(PYTHON_LOOP))
    return a, total


def main(out: Path, seconds: float) -> None:
    torch.set_num_threads(1)
    a = torch.randn(SIZE, SIZE)
    warm_until = time.monotonic() + 1.0
    while time.monotonic() < warm_until:
        a, _ = step(a)
    durations, cpu = array.array("d"), array.array("d")
    start = time.monotonic()
    deadline = start + seconds
    next_line = start + 1.0
    clock, thread_clock = time.perf_counter, time.thread_time
    while True:
        began, began_cpu = clock(), thread_clock()
        a, _ = step(a)
        durations.append(clock() - began)
        cpu.append(thread_clock() - began_cpu)
        now = time.monotonic()
        if now >= next_line:
            print(f"step {len(durations)} {now - start:.0f} s", flush=True)
            next_line += 1.0
            if now >= deadline:
                break
    end = time.monotonic()
    with out.open("wb") as fh:
        array.array("d", [start, end]).tofile(fh)
        durations.tofile(fh)
        cpu.tofile(fh)


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
