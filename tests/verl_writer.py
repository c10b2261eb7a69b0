"""Validation rounds written as verl writes them, for the tests and the benchmark.

`dump_generations` follows verl's trainer (`RayPPOTrainer._dump_generations`, called with
`trainer.validation_data_dir` after each validation and with `trainer.rollout_data_dir` for the
training rollouts): one file a round, `<dump_path>/<global_step>.jsonl`, one JSON object a
sample, written with `json.dumps(entry, ensure_ascii=False)` a line; keys `input`, `output`,
`gts`, `score`, `step`, then each field of the reward function's extra information that has one
value a sample (`acc`, `pred`, `reward`, ...), in that order.

Run as a script it is a trainer that writes `rounds` rounds and exits: `python -m
tests.verl_writer DUMP_PATH SPEC_JSON`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def dump_generations(dump_path: str, global_steps: int, inputs: Sequence[str],
                     outputs: Sequence[str], gts: Sequence[Any], scores: Sequence[float],
                     reward_extra_infos_dict: dict[str, Sequence[Any]]) -> str:
    """Write one round as verl's trainer does; returns the file's path."""
    os.makedirs(dump_path, exist_ok=True)
    filename = os.path.join(dump_path, f"{global_steps}.jsonl")

    n = len(inputs)
    base_data: dict[str, Sequence[Any]] = {
        "input": inputs,
        "output": outputs,
        "gts": gts,
        "score": scores,
        "step": [global_steps] * n,
    }

    for k, v in reward_extra_infos_dict.items():
        if len(v) == n:
            base_data[k] = v

    lines = []
    for i in range(n):
        entry = {k: v[i] for k, v in base_data.items()}
        lines.append(json.dumps(entry, ensure_ascii=False))

    with open(filename, "w") as f:
        f.write("\n".join(lines) + "\n")
    return filename


def round_of(step: int, samples: int, text_chars: int = 40) -> dict[str, Any]:
    """A round's arguments: sample i has the score (i * 7 % 11) / 10 (varied, not sorted), is
    correct when its score is 0.5 or more, and has `text_chars` characters of output."""
    scores = [(i * 7 % 11) / 10 for i in range(samples)]
    return {
        "global_steps": step,
        "inputs": [f"Question {i} of step {step}: what is {i} + {step}? ünïcode" for i in
                   range(samples)],
        "outputs": [(f"Answer {i}: " + "x" * text_chars)[:text_chars] for i in range(samples)],
        "gts": [str(i + step) for i in range(samples)],
        "scores": scores,
        "reward_extra_infos_dict": {"acc": [s >= 0.5 for s in scores],
                                    "pred": [str(i) for i in range(samples)]},
    }


def main(argv: Sequence[str]) -> int:
    dump_path, spec = argv[0], json.loads(argv[1])
    for step, samples, text_chars in spec:
        dump_generations(dump_path, **round_of(step, samples, text_chars))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
