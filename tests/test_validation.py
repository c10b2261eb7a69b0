"""--validation: samples files -> /validation rounds (docs/validation.md), through the real
process: verl's layout (tests/verl_writer.py writes as verl's trainer does) and a generic one."""

from __future__ import annotations

import json
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.sources.files.validation import (
    CUT_KEY,
    DEFAULT_KEPT,
    MAX_CHUNK_BYTES,
    MAX_TEXT_CHARS,
    ValidationParser,
)
from tests.conftest import TOKEN, Sidecar, platform_env, sidecar
from tests.ingest_server import RunningIngest, wait_until
from tests.verl_writer import round_of

ROOT = Path(__file__).resolve().parents[1]


def _env(ingest: RunningIngest, tmp_path: Path, **extra: str) -> dict[str, str]:
    return platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                        PYTHONPATH=str(ROOT), **extra)


def _verl_child(folder: Path, spec: Sequence[tuple[int, int, int]]) -> list[str]:
    """A trainer that writes rounds (step, samples, characters of output) as verl does."""
    return [sys.executable, "-m", "tests.verl_writer", str(folder), json.dumps(spec)]


def _rounds(ingest: RunningIngest) -> dict[int, list[dict[str, Any]]]:
    """The chunks received, by step, in arrival order."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for body in ingest.records("validation"):
        by_step.setdefault(body["step"], []).append(body)
    return by_step


def _whole(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A round's samples, once each of its chunks arrived exactly once."""
    total = chunks[0]["total_chunks"]
    assert sorted(c["chunk_index"] for c in chunks) == list(range(total))
    assert {(c["avg_reward"], c.get("accuracy"), c["total_chunks"]) for c in chunks} == {
        (chunks[0]["avg_reward"], chunks[0].get("accuracy"), total)}
    return [s for c in sorted(chunks, key=lambda c: c["chunk_index"]) for s in c["samples"]]


def _stop(watch: Sidecar) -> None:
    watch.proc.send_signal(signal.SIGTERM)
    done = watch.wait(60)
    assert done.status == 0, done.stderr.decode()[-3000:]


def test_verl_rounds_are_posted_once_each_with_exact_statistics_capped_and_chunked(
        ingest: RunningIngest, tmp_path: Path) -> None:
    folder = tmp_path / "val"
    spec = [(10, 40, 200), (20, 300, 6000), (30, 129, 40), (40, 3, 40_000)]
    done = sidecar(["run", "--validation", str(folder), "--validation-samples", "200", "--",
                    *_verl_child(folder, spec)], _env(ingest, tmp_path), tmp_path / "run")
    assert done.status == 0, done.stderr.decode()[-3000:]

    rounds = _rounds(ingest)
    assert sorted(rounds) == [10, 20, 30, 40]
    for step, samples, text_chars in spec:
        made = round_of(step, samples, text_chars)
        sent = _whole(rounds[step])
        scores = made["scores"]
        chunk = rounds[step][0]
        assert chunk["avg_reward"] == math.fsum(scores) / len(scores)
        acc = made["reward_extra_infos_dict"]["acc"]
        assert chunk["accuracy"] == sum(acc) / len(acc)
        # the cap: 200 of the 300; every sample of the smaller rounds
        assert len(sent) == min(samples, 200)
        # chosen across the rewards, not the first ones: the lowest and the highest are shown
        assert {min(scores), max(scores)} <= {s["reward"] for s in sent}
        inputs = made["inputs"]
        for sample in sent:
            index = inputs.index(sample["user"])
            assert sample["reward"] == scores[index]
            assert sample["extra"]["gts"] == made["gts"][index]
            assert sample["extra"]["acc"] == acc[index]
            assert set(sample["extra"]) - {CUT_KEY} == {"gts", "acc", "pred"}
    # a round over the size limit is split across chunks, each under it
    assert len(rounds[20]) > 1
    assert all(len(json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode())
               < MAX_CHUNK_BYTES
               for chunks in rounds.values() for c in chunks)
    # text over the per-sample limit is cut, and the cut said in extra
    long = _whole(rounds[40])[0]
    assert long["extra"][CUT_KEY] == {"assistant": {"kept": MAX_TEXT_CHARS, "of": 40_000}}
    assert long["assistant"].startswith("Answer ") and "characters cut by the sidecar" in \
        long["assistant"]
    assert len(long["assistant"]) < MAX_TEXT_CHARS + 100


def test_a_restart_posts_the_new_rounds_and_repeats_none(
        ingest: RunningIngest, tmp_path: Path) -> None:
    folder = tmp_path / "val"
    env = _env(ingest, tmp_path)
    first = sidecar(["run", "--validation", str(folder), "--",
                     *_verl_child(folder, [(1, 20, 100), (2, 300, 100)])], env, tmp_path / "a")
    assert first.status == 0, first.stderr.decode()[-3000:]
    assert sorted(_rounds(ingest)) == [1, 2]

    second = sidecar(["run", "--validation", str(folder), "--",
                      *_verl_child(folder, [(3, 5, 100)])], env, tmp_path / "b")
    assert second.status == 0, second.stderr.decode()[-3000:]
    assert [(b["step"], b["chunk_index"]) for b in ingest.records("validation")] == [
        (1, 0), (2, 0), (3, 0)]


def _record(step: int, i: int, reward: float, completion: str = "") -> str:
    return json.dumps({"question": f"q{i} of {step}", "completion": completion or f"c{i}",
                       "reward": reward, "global_step": step, "passed": reward > 0.5,
                       "env": "math"}) + "\n"


def test_one_file_of_rounds_in_the_generic_layout_with_a_field_map_and_masked_text(
        ingest: RunningIngest, tmp_path: Path) -> None:
    rollouts = tmp_path / "rollouts.jsonl"
    rewards = {1: [((i * 37) % 150) / 149 for i in range(150)], 2: [0.1, 0.2, 0.9, 0.3, 0.4],
               3: [0.0, 1.0, 1.0, 0.0]}
    with rollouts.open("w") as out:
        for step, values in rewards.items():
            for i, reward in enumerate(values):
                secret = f"my token is {TOKEN}!" if step == 2 and reward == 0.9 else ""
                out.write(_record(step, i, reward, secret))
    watch = Sidecar(["watch", "--validation", str(rollouts), "--validation-map", "user=question",
                     "--validation-map", "correct=passed"], _env(ingest, tmp_path),
                    tmp_path / "watch")
    try:
        # a round ends where the next step begins: the first two go before the stop
        ingest.wait_for(lambda: {1, 2} <= set(_rounds(ingest)), 30, "steps 1 and 2")
    finally:
        _stop(watch)

    rounds = _rounds(ingest)
    assert sorted(rounds) == [1, 2, 3] and all(len(c) == 1 for c in rounds.values())
    for step, values in rewards.items():
        chunk = rounds[step][0]
        assert chunk["avg_reward"] == math.fsum(values) / len(values)
        assert chunk["accuracy"] == sum(v > 0.5 for v in values) / len(values)
    # 150 samples: the text of 32 by default, across the rewards
    sent = rounds[1][0]["samples"]
    assert len(sent) == DEFAULT_KEPT
    assert {min(rewards[1]), max(rewards[1])} <= {s["reward"] for s in sent}
    assert [s["user"] for s in sent] != [f"q{i} of 1" for i in range(DEFAULT_KEPT)]
    assert sent[0]["extra"] == {"env": "math", "passed": sent[0]["reward"] > 0.5}
    masked = next(s for s in rounds[2][0]["samples"] if s["reward"] == 0.9)
    assert masked["assistant"] == "my token is ***!"
    assert TOKEN not in (tmp_path / "received" / "validation.jsonl").read_text()


def test_a_round_file_still_being_written_is_not_posted_half(
        ingest: RunningIngest, tmp_path: Path) -> None:
    folder = tmp_path / "val"  # made by the trainer, after the sidecar started
    made = round_of(7, 60, 100)
    lines = [json.dumps({"input": q, "output": a, "score": s, "step": 7}, ensure_ascii=False)
             + "\n" for q, a, s in zip(made["inputs"], made["outputs"], made["scores"],
                                       strict=True)]
    watch = Sidecar(["watch", "--validation", str(folder), "--log-level", "debug"],
                    _env(ingest, tmp_path), tmp_path / "watch")
    try:
        folder.mkdir()
        with (folder / "7.jsonl").open("w") as writer:
            writer.write("".join(lines[:30]))
            writer.flush()
            # the sidecar read the half, and a quiet second later judged the round unfinished
            wait_until(lambda: b"waits until the file has not grown" in
                       (tmp_path / "watch" / "stderr").read_bytes(), 30, "the round held back")
            assert ingest.records("validation") == []
            writer.write("".join(lines[30:]))
        # the file settled: the round goes, whole
        ingest.wait_for(lambda: bool(ingest.records("validation")), 40, "the round of step 7")
    finally:
        _stop(watch)
    [chunk] = ingest.records("validation")
    assert len(chunk["samples"]) == 60
    assert chunk["avg_reward"] == math.fsum(made["scores"]) / 60


def test_check_reports_each_validation_source(ingest: RunningIngest, tmp_path: Path) -> None:
    from tests.verl_writer import dump_generations

    folder = tmp_path / "val"
    for step in (5, 10):
        dump_generations(str(folder), **round_of(step, 12))
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(_record(1, i, 0.5) for i in range(3)))
    done = sidecar(["check", "--validation", str(folder), "--validation", str(rollouts)],
                   _env(ingest, tmp_path), tmp_path / "check")
    out = done.stdout.decode()
    lines = [line for line in out.splitlines() if "--validation " in line]
    assert len(lines) == 2, out
    assert lines[0].startswith("ok") and "2 files, 2 rounds (steps 5..10), 24 samples" in lines[0]
    assert "user from 'input'; assistant from 'output'; reward from 'score'; step from " \
           "'step'; correct from 'acc'" in lines[0]
    assert "to extra: acc, gts, pred" in lines[0]
    assert lines[1].startswith("warn") and "no user field" in lines[1], lines[1]
    assert "1 round (step 1), 3 samples" in lines[1]

    refused = sidecar(["watch", "--validation-map", "answer=completion"],
                      _env(ingest, tmp_path), tmp_path / "refused")
    assert refused.status == 2
    assert "--validation-map='answer=completion' is not FIELD=NAME with FIELD one of user, " \
           "assistant, reward, step, correct" in refused.stderr.decode()


def test_samples_shown_are_spread_over_the_rewards() -> None:
    lines = "".join(json.dumps({"input": str(i), "output": "", "score": float(i % 2)}) + "\n"
                    for i in range(200))
    parser = ValidationParser(name_step=3, kept=10)
    [chunk] = parser.quiet(lines.encode(), 0.0, final=True).documents
    # half the rewards are 0 and half 1: so are the samples shown, from across the file
    assert sorted(s["reward"] for s in chunk["samples"]) == [0.0] * 5 + [1.0] * 5
    shown = [int(s["user"]) for s in chunk["samples"]]
    assert shown[0] < 10 and shown[-1] > 190 and chunk["step"] == 3


def test_a_round_without_a_step_or_rewards_is_not_posted_and_said() -> None:
    no_step = "".join(json.dumps({"prompt": "p", "completion": "c", "reward": 1}) + "\n"
                      for _ in range(3))
    parser = ValidationParser()
    assert parser.quiet(no_step.encode(), 0.0, final=True).documents == []
    assert "has no step" in parser.problem and "--validation-map step=NAME" in parser.problem

    unscored = "".join(json.dumps({"prompt": "p", "completion": "c", "step": 4}) + "\n"
                       for _ in range(3))
    parser = ValidationParser()
    assert parser.quiet(unscored.encode(), 0.0, final=True).documents == []
    assert "--validation-map reward=NAME" in parser.problem and parser.unscored == 3


def test_a_sample_with_invalid_utf8_is_counted_its_bytes_replaced() -> None:
    """A model's output cut inside a character is still a sample: it counts in avg_reward (it
    was dropped as "not JSON", and the round's mean was that of the others)."""
    lines = [json.dumps({"input": "q", "output": "fine", "score": 1.0}).encode(),
             b'{"input": "q", "output": "cut \xe2\x82", "score": 4.0}',
             json.dumps({"input": "q", "output": "fine", "score": 1.0}).encode()]
    parser = ValidationParser(name_step=2, kept=3)
    [chunk] = parser.quiet(b"\n".join(lines) + b"\n", 0.0, final=True).documents
    assert chunk["avg_reward"] == 2.0 and parser.unusable == 0
    assert any("cut \ufffd" in s["assistant"] for s in chunk["samples"]), chunk["samples"]


def test_scores_only_is_one_chunk_without_samples() -> None:
    lines = "".join(json.dumps({"input": "q", "output": "a", "score": i, "acc": i > 1}) + "\n"
                    for i in range(4))
    [chunk] = ValidationParser(name_step=9, kept=0).quiet(lines.encode(), 0.0,
                                                         final=True).documents
    assert chunk == {"step": 9, "avg_reward": 1.5, "accuracy": 0.5, "samples": [],
                     "chunk_index": 0, "total_chunks": 1}


def test_on_a_multi_node_run_only_rank_0_follows_the_samples(
        ingest: RunningIngest, tmp_path: Path) -> None:
    folder = tmp_path / "val"
    done = sidecar(["run", "--validation", str(folder), "--",
                    *_verl_child(folder, [(1, 3, 10)])],
                   _env(ingest, tmp_path, NODE_RANK="1", NNODES="2"), tmp_path / "run")
    assert done.status == 0, done.stderr.decode()[-3000:]
    assert ingest.records("validation") == []
    assert "--validation: not followed on node rank 1" in done.stderr.decode()


def test_the_platform_s_cap_on_validation_text_is_the_default_and_zero_scores_only(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES, the platform's cap, read under either family's name
    through the real `sidecar run`: 5 of a round of 40 keep their text; 0 sends scores only."""
    folder = tmp_path / "val"
    done = sidecar(["run", "--validation", str(folder), "--", *_verl_child(folder, [(10, 40, 20)])],
                   _env(ingest, tmp_path, TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES="5"), tmp_path / "run")
    assert done.status == 0, done.stderr.decode()[-3000:]
    [chunk] = _rounds(ingest)[10]
    assert len(chunk["samples"]) == 5 and chunk["total_chunks"] == 1
    made = round_of(10, 40, 20)
    assert chunk["avg_reward"] == math.fsum(made["scores"]) / 40  # every sample counted

    again = sidecar(["run", "--validation", str(folder), "--",
                     *_verl_child(folder, [(20, 40, 20)])],
                    _env(ingest, tmp_path, STARFORGE_VAL_UPLOAD_SAMPLES="0"), tmp_path / "again")
    assert again.status == 0, again.stderr.decode()[-3000:]
    [scores_only] = _rounds(ingest)[20]
    assert scores_only["samples"] == [] and scores_only["total_chunks"] == 1
