"""JsonlParser: JSONL metric logs -> /metrics points (docs/ingest.md#jsonl)."""

from __future__ import annotations

import json
import math
import signal
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.sources.files import jsonl
from sidecar.sources.files.jsonl import MAX_LINE_BYTES, JsonlParser
from tests.conftest import RUN_ID, Sidecar, cut_at, platform_env
from tests.ingest_server import RunningIngest, wait_until

NOW = 1_790_000_000.25  # the read time the caller supplies
NOW_TS = datetime.fromtimestamp(NOW, UTC)


@dataclass
class Fed:
    """Everything a run of parse calls produced, added up, as a file follower would see it."""

    points: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    unusable: int = 0  # lines that gave no point: counted as invalid
    records: int = 0
    invalid: dict[str, int] = field(default_factory=dict)
    left: bytes = b""  # bytes offered but not consumed yet
    most_held: int = 0  # the largest buffer the follower had to keep between calls


def _follow(parser: JsonlParser, blocks: Sequence[bytes], now: float = NOW) -> Fed:
    """Feed `blocks` as a follower does: the unconsumed rest is offered again with new bytes."""
    fed = Fed()
    for block in blocks:
        fed.left += block
        parsed = parser.parse(fed.left, now)
        assert 0 <= parsed.consumed <= len(fed.left)
        fed.left = fed.left[parsed.consumed:]
        fed.most_held = max(fed.most_held, len(fed.left))
        fed.points += parsed.points
        fed.skipped += parsed.skipped
        fed.unusable += parsed.unusable
        fed.records += parsed.records
        for key, count in parsed.invalid.items():
            fed.invalid[key] = fed.invalid.get(key, 0) + count
    return fed


def _parse(text: str, parser: JsonlParser | None = None) -> Fed:
    return _follow(parser or JsonlParser(), [text.encode()])


def _by_key(fed: Fed) -> dict[str, dict[str, Any]]:
    keyed = {p["key"]: p for p in fed.points}
    assert len(keyed) == len(fed.points), f"a key was sent twice: {fed.points}"
    return keyed


def _when(point: dict[str, Any]) -> datetime:
    """The point's time, which must be ISO-8601 in UTC."""
    when = datetime.fromisoformat(point["ts"])
    assert when.utcoffset() is not None and when.utcoffset() == UTC.utcoffset(None), point
    return when


# --- {"key", "value"} points -----------------------------------------------------------------


def test_key_value_object_is_one_point_with_its_step() -> None:
    fed = _parse('{"key": "loss", "value": 0.25, "step": 7, "epoch": 3, "note": "x"}\n')
    assert fed.points == [{"key": "loss", "step": 7, "value": 0.25, "ts": fed.points[0]["ts"]}]
    assert _when(fed.points[0]) == NOW_TS
    assert fed.skipped == fed.unusable == 0 and fed.records == 1


def test_key_value_lines_without_a_step_are_counted_up_not_piled_on_step_0() -> None:
    fed = _parse('\n\n{"key": "acc", "value": 1}\n\n{"key": "acc", "value": 2}\n'
                 '{"key": "acc", "value": 3}\n')
    assert [(p["key"], p["step"], p["value"]) for p in fed.points] == [
        ("acc", 0, 1), ("acc", 1, 2), ("acc", 2, 3)]


@pytest.mark.parametrize(("value", "sent"), [("true", 1), ("false", 0), ("3", 3), ("-2.5", -2.5)])
def test_key_value_accepts_numbers_and_booleans(value: str, sent: float) -> None:
    fed = _parse(f'{{"key": "k", "value": {value}}}\n')
    assert [p["value"] for p in fed.points] == [sent]
    assert not isinstance(fed.points[0]["value"], bool)


# --- records ---------------------------------------------------------------------------------


def test_record_numeric_leaves_become_points_nested_keys_joined_with_slash() -> None:
    line = {"loss": 0.5, "acc": 2, "done": True, "off": False, "name": "resnet",
            "sizes": [1, 2, 3], "none": None,
            "opt": {"lr": 0.001, "betas": {"b1": 0.9, "label": "adam"}, "empty": {}}}
    fed = _parse(json.dumps(line) + "\n")
    assert {k: p["value"] for k, p in _by_key(fed).items()} == {
        "loss": 0.5, "acc": 2, "done": 1, "off": 0, "opt/lr": 0.001, "opt/betas/b1": 0.9}
    assert all(not isinstance(p["value"], bool) for p in fed.points)
    assert {p["step"] for p in fed.points} == {0}
    assert all(_when(p) == NOW_TS for p in fed.points)


@pytest.mark.parametrize(("fields", "step"), [
    ({"step": 5, "global_step": 6, "_step": 7, "iteration": 8}, 5),
    ({"global_step": 6, "_step": 7, "iteration": 8}, 6),
    ({"_step": 7, "iteration": 8}, 7),
    ({"iteration": 8}, 8),
    ({"step": 9.0}, 9),
    ({}, 1),  # counted: one record without a step comes before it
])
def test_record_step_is_the_first_step_field_present_else_counted(
        fields: dict[str, Any], step: int) -> None:
    fed = _parse('{"warmup": 1}\n\n' + json.dumps({**fields, "loss": 0.1}) + "\n")
    assert [(p["key"], p["step"]) for p in fed.points] == [("warmup", 0), ("loss", step)]


def test_step_and_time_fields_are_not_points() -> None:
    fed = _parse(json.dumps({"step": 1, "global_step": 2, "_step": 3, "iteration": 4,
                             "ts": 1.7e9, "timestamp": 1.7e9, "_timestamp": 1.7e9,
                             "time": 1.7e9, "loss": 0.5}) + "\n")
    assert [p["key"] for p in fed.points] == ["loss"]


@pytest.mark.parametrize(("fields", "expected"), [
    ({"ts": 1_700_000_000}, datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)),
    ({"timestamp": 1_700_000_000.5}, datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=UTC)),
    ({"_timestamp": "2026-11-30T10:00:00Z"}, datetime(2026, 11, 30, 10, tzinfo=UTC)),
    ({"time": "2026-11-30T12:00:00+02:00"}, datetime(2026, 11, 30, 10, tzinfo=UTC)),
    ({"ts": "2026-11-30T10:00:00"}, datetime(2026, 11, 30, 10, tzinfo=UTC)),  # no zone: UTC
    ({"time": 1_600_000_000, "ts": 1_700_000_000},
     datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)),  # ts comes first
    ({"_timestamp": "2026-11-30T10:00:00Z", "timestamp": 1_700_000_000},
     datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)),  # timestamp comes first
    ({}, NOW_TS),  # the time it was read
])
def test_record_time_from_the_first_time_field_else_the_read_time(
        fields: dict[str, Any], expected: datetime) -> None:
    fed = _parse(json.dumps({**fields, "loss": 1}) + "\n")
    assert [p["key"] for p in fed.points] == ["loss"]
    assert _when(fed.points[0]) == expected


def test_record_with_only_ignored_values_gives_no_points_and_is_counted() -> None:
    parser = JsonlParser()
    fed = _parse('{"name": "x", "tags": [1, 2], "none": null, "nested": {"s": "y"}}\n', parser)
    assert fed.points == [] and fed.unusable == 1
    assert parser.problem.startswith("line 1: no number in it")


# --- the step of a record without one -----------------------------------------------------


def test_records_without_a_step_are_counted_past_blank_and_bad_lines() -> None:
    fed = _parse('\n   \nnot json\n[1, 2]\n{"loss": 1}\n{"loss": 2}\n{"key": "lr", "value": 3}\n')
    assert [(p["key"], p["step"]) for p in fed.points] == [("loss", 0), ("loss", 1), ("lr", 2)]
    assert fed.unusable == 2


def test_records_without_a_step_take_the_last_step_given_before_them() -> None:
    fed = _parse('{"loss": 1}\n{"step": 10, "loss": 2}\n{"eval": 3}\n'
                 '{"key": "lr", "value": 0.1}\n{"global_step": 20, "loss": 4}\n{"eval": 5}\n')
    assert [(p["key"], p["step"]) for p in fed.points] == [
        ("loss", 0), ("loss", 10), ("eval", 10), ("lr", 10), ("loss", 20), ("eval", 20)]


def test_the_count_and_the_last_step_continue_across_calls_and_a_resume() -> None:
    parser = JsonlParser()
    first = _follow(parser, [b'{"a": 1}\n\nbad\n{"b": 2}\n{"c": '])
    assert [(p["key"], p["step"]) for p in first.points] == [("a", 0), ("b", 1)]
    # the unfinished fifth line is not counted yet
    assert parser.state() == {"line": 4, "counted": 2, "step": None}
    resumed = JsonlParser.resume(json.loads(json.dumps(parser.state())))
    rest = _follow(resumed, [first.left + b'3}\n{"step": 7, "d": 4}\n'])
    assert [(p["key"], p["step"]) for p in rest.points] == [("c", 2), ("d", 7)]
    again = JsonlParser.resume(json.loads(json.dumps(resumed.state())))
    assert [p["step"] for p in _parse('{"e": 5}\n', again).points] == [7]


def test_fresh_parser_and_empty_state_start_counting_at_zero() -> None:
    assert JsonlParser().state() == {"line": 0, "counted": 0, "step": None}
    assert JsonlParser.resume({}).state() == {"line": 0, "counted": 0, "step": None}
    assert [p["step"] for p in _parse('{"a": 1}\n', JsonlParser.resume({"line": 3})).points] == [0]


# --- invalid numbers and bad lines -------------------------------------------------------------


def test_nan_and_infinities_are_counted_per_key_and_never_sent() -> None:
    fed = _parse('{"loss": NaN, "acc": 0.5}\n'
                 '{"loss": Infinity, "grad": {"norm": -Infinity}}\n'
                 '{"key": "lr", "value": NaN}\n'
                 '{"key": "lr", "value": Infinity, "step": 3}\n')
    assert [(p["key"], p["value"]) for p in fed.points] == [("acc", 0.5)]
    assert fed.invalid == {"loss": 2, "grad/norm": 1, "lr": 2}
    assert all(math.isfinite(p["value"]) for p in fed.points)
    assert fed.skipped == fed.unusable == 0


@pytest.mark.parametrize("line", [
    "not json", "{bad", '{"a": 1', "[1, 2]", "3", '"text"', "null", "true", "{} {}",
    '{"a": 1}}'])
def test_a_line_not_json_or_not_an_object_is_counted_as_unusable(line: str) -> None:
    fed = _parse(f'{{"before": 1}}\n{line}\n{{"after": 2}}\n')
    assert [(p["key"], p["step"]) for p in fed.points] == [("before", 0), ("after", 1)]
    assert fed.unusable == 1


def test_invalid_utf8_line_is_skipped_not_fatal() -> None:
    fed = _follow(JsonlParser(), [b'{"a": "\xff\xfe"}\n\xc3\x28\n{"b": 1}\n'])
    assert [(p["key"], p["step"]) for p in fed.points] == [("b", 0)]
    assert fed.unusable == 2


def test_crlf_line_endings_are_accepted() -> None:
    fed = _follow(JsonlParser(), [b'{"a": 1}\r\n{"b": 2}\r\n'])
    assert [(p["key"], p["step"]) for p in fed.points] == [("a", 0), ("b", 1)]


# --- unfinished and over-long lines ----------------------------------------------------------


def test_last_line_without_newline_waits_and_is_then_parsed_once() -> None:
    parser = JsonlParser()
    first = parser.parse(b'{"a": 1}\n{"b": 2}', NOW)
    assert first.consumed == len(b'{"a": 1}\n')
    assert [p["key"] for p in first.points] == ["a"]
    assert parser.parse(b'{"b": 2}', NOW).consumed == 0  # offered again, still unfinished
    done = parser.parse(b'{"b": 2}\n', NOW)
    assert done.consumed == len(b'{"b": 2}\n')
    assert [(p["key"], p["step"]) for p in done.points] == [("b", 1)]
    assert parser.parse(b"", NOW).points == []


@pytest.mark.parametrize("data", [b'{"b": 2}', b'{"a": 1}\n', b"", b"garbage"])
def test_quiet_never_consumes(data: bytes) -> None:
    parser = JsonlParser()
    quiet = parser.quiet(data, NOW)
    assert quiet.consumed == 0 and quiet.points == [] and quiet.skipped == 0
    assert parser.state() == JsonlParser().state()


def test_over_long_line_is_skipped_and_counted_without_holding_it() -> None:
    chunk = 1 << 20  # what a follower reads at a time
    long_line = b'{"huge": "' + b"x" * (MAX_LINE_BYTES + 3 * chunk) + b'"}\n'
    data = b'{"a": 1}\n' + long_line + b'{"b": 2}\n'
    fed = _follow(JsonlParser(), cut_at(data, range(0, len(data), chunk)))
    assert [(p["key"], p["step"]) for p in fed.points] == [("a", 0), ("b", 1)]
    assert fed.unusable == 1
    assert fed.left == b""
    assert fed.most_held <= MAX_LINE_BYTES + chunk


def test_over_long_line_skipping_ends_at_its_newline_even_in_small_pieces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 32)
    data = b'{"a": 1}\n' + b"y" * 200 + b'\n{"b": 2}\n{"c": 3}\n'
    parser = JsonlParser()
    fed = _follow(parser, cut_at(data, range(0, len(data), 7)))
    assert [(p["key"], p["step"]) for p in fed.points] == [("a", 0), ("b", 1), ("c", 2)]
    assert fed.unusable == 1
    assert fed.most_held <= 32 + 7
    assert parser.state() == {"line": 4, "counted": 3, "step": None}


def test_over_long_line_is_skipped_however_it_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 64)
    data = json.dumps({"loss": 1, "pad": "z" * 100}).encode() + b"\n"
    in_pieces = _follow(JsonlParser(), cut_at(data, range(0, len(data), 8)))
    whole = _follow(JsonlParser(), [data])
    assert (in_pieces.points, in_pieces.unusable) == ([], 1)
    assert (whole.points, whole.unusable) == ([], 1)


# --- robustness --------------------------------------------------------------------------------


_cuts = st.lists(st.integers(min_value=0, max_value=700), max_size=30)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=600), cuts=_cuts)
def test_random_bytes_never_raise_and_split_anywhere_gives_the_same_result(
        data: bytes, cuts: list[int]) -> None:
    whole = _follow(JsonlParser(), [data])
    split = _follow(JsonlParser(), cut_at(data, cuts))
    assert split.points == whole.points
    assert split.unusable == whole.unusable
    assert split.invalid == whole.invalid
    assert split.left == whole.left == data[data.rfind(b"\n") + 1:]


_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**62), max_value=2**62),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5))
_name = st.sampled_from(["loss", "acc", "lr", "key", "value", "step", "global_step", "_step",
                         "iteration", "a", "é"])
_json = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(_name, inner, max_size=4)), max_leaves=12)
_line = st.one_of(
    st.dictionaries(_name, _json, max_size=6).map(json.dumps),
    st.builds(lambda k, v, s: json.dumps({"key": k, "value": v, "step": s}),
              _name, _scalar, st.integers(min_value=0, max_value=10**6)),
    _json.map(json.dumps),
    st.sampled_from(["", "  ", "not json", "{", '{"a":'])).map(str.encode)


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(_line, max_size=12), cuts=_cuts, tail=st.booleans())
def test_splitting_json_lines_at_any_byte_gives_the_same_points(
        lines: list[bytes], cuts: list[int], tail: bool) -> None:
    data = b"\n".join(lines) + (b"\n" if tail else b"")
    one, many = JsonlParser(), JsonlParser()
    whole = _follow(one, [data])
    split = _follow(many, cut_at(data, cuts))
    assert split.points == whole.points
    assert (split.unusable, split.records, split.invalid) == (
        whole.unusable, whole.records, whole.invalid)
    assert many.state() == one.state()
    assert one.state()["line"] == data.count(b"\n")
    assert all(math.isfinite(p["value"]) and not isinstance(p["value"], bool)
               for p in whole.points)


def test_many_lines_in_one_call() -> None:
    data = "".join(json.dumps({"step": i, "loss": i / 10}) + "\n" for i in range(5000))
    fed = _parse(data)
    assert [p["step"] for p in fed.points] == list(range(5000))
    assert fed.records == 5000


# --- bugs found --------------------------------------------------------------------------------


@pytest.mark.parametrize("line", [
    '{"ts": 1700000000000, "loss": 1}', '{"ts": 1e20, "loss": 1}',
    '{"timestamp": -1e15, "loss": 1}', '{"time": "0001-01-01T00:00:00+01:00", "loss": 1}'],
    ids=["milliseconds", "huge", "negative", "iso-min"])
def test_out_of_range_time_does_not_raise(line: str) -> None:
    fed = _parse(line + "\n")
    assert len(fed.points) + fed.unusable == 1
    assert all(p["key"] == "loss" for p in fed.points)


@pytest.mark.parametrize("line", ['{"loss": 1%s}', '{"key": "loss", "value": 1%s}'],
                         ids=["record", "key-value"])
def test_integer_too_large_for_a_float_is_invalid_not_fatal(line: str) -> None:
    fed = _parse(line % ("0" * 400) + "\n")
    assert fed.points == []
    assert fed.invalid.get("loss", 0) + fed.unusable == 1


def test_deeply_nested_line_is_skipped_not_fatal() -> None:
    fed = _parse("[" * 100_000 + '\n{"after": 1}\n')
    assert [(p["key"], p["step"]) for p in fed.points] == [("after", 0)]
    assert fed.unusable == 1


def test_record_with_an_empty_key_sends_no_empty_key() -> None:
    fed = _parse('{"": 1, "ok": 2}\n')
    assert [p["key"] for p in fed.points] == ["ok"]


# --- empty charts explained ----------------------------------------------------------------------


@pytest.mark.parametrize(("lines", "said"), [
    ("{'step': 0, 'loss': 1.0}", "line 1: single quotes: a Python dict"),
    ('{"step": 0, "loss": "1.0"}', "line 1: no number in it: 'loss' is the string '1.0'"),
    ('{"epoch": "one"}', "line 1: no number in it"),
    ("epoch 1 loss 0.5", "line 1: not JSON (epoch 1 loss 0.5); a plain-text log goes to --log"),
    ('[1, 2]', "line 1: a JSON array, not an object"),
    ('{"loss": 1}\n{"loss": 2, ', "line 2: not JSON"),
])
def test_the_first_bad_line_is_described_with_its_number_and_fix(lines: str, said: str) -> None:
    parser = JsonlParser()
    fed = _parse(lines + "\n", parser)
    assert parser.problem.startswith(said), parser.problem
    assert fed.unusable == 1


def test_a_python_dict_gets_the_json_dumps_hint_and_is_counted_every_time(
        caplog: pytest.LogCaptureFixture) -> None:
    parser = JsonlParser(source="out/metrics.jsonl")
    fed = _parse("".join(f"{{'step': {i}, 'loss': 1.0}}\n" for i in range(5)), parser)
    assert fed.points == [] and fed.unusable == 5 and fed.skipped == 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1
    assert said[0].startswith("--jsonl out/metrics.jsonl: line 1: single quotes: a Python dict")
    assert "write json.dumps(record)" in said[0]


# --- edge cases: keys given twice, steps no point can carry ----------------------------------


def test_a_key_given_twice_in_a_record_sends_the_first_and_counts_the_other() -> None:
    parser = JsonlParser()
    fed = _parse('{"a/b": 1, "a": {"b": 2}, "c": 3}\n{"a": {"b": 4}, "a/b": 5}\n', parser)
    assert [(p["key"], p["step"], p["value"]) for p in fed.points] == [
        ("a/b", 0, 1), ("c", 0, 3), ("a/b", 1, 4)]
    assert fed.unusable == 2
    assert "the key 'a/b' is given twice" in parser.problem


@pytest.mark.parametrize("step", ["1e300", str(2**63), str(-(2**63) - 1), "2.5", "-1e19"])
@pytest.mark.parametrize("form", ['{"step": %s, "loss": 1}', '{"key": "loss", "value": 1, '
                                  '"step": %s}'], ids=["record", "key-value"])
def test_a_step_no_signed_64_bit_integer_holds_is_skipped_and_counted(step: str,
                                                                      form: str) -> None:
    parser = JsonlParser()
    fed = _parse(form % step + '\n{"step": 3, "ok": 1}\n', parser)
    assert [(p["key"], p["step"]) for p in fed.points] == [("ok", 3)]
    assert fed.unusable == 1
    assert "which is no step" in parser.problem


@pytest.mark.parametrize("step", [2**63 - 1, -(2**63), 1e18])
def test_steps_at_the_ends_of_the_signed_64_bit_range_are_sent(step: float) -> None:
    fed = _parse(json.dumps({"step": step, "loss": 1}) + "\n")
    assert [p["step"] for p in fed.points] == [int(step)]
    assert isinstance(fed.points[0]["step"], int)


# --- through the real process -----------------------------------------------------------------


# `sidecar` with the minute after which a file that gave no point is said shortened to 1 s
QUICK_SILENCE = (sys.executable, "-c", "import sys; import sidecar.sources.files.follow as f; "
                 "f.NO_POINT_S = 1.0; from sidecar.cli import main; sys.exit(main())")


def _status_source(address: str, kind: str) -> dict[str, Any]:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(f"http://{address}/status", timeout=5) as response:
        doc = json.loads(response.read())
    return next(s for s in doc["sources"] if s["kind"] == kind)


def test_watch_says_a_file_of_python_dicts_at_once_after_its_first_minute_and_at_the_end(
        ingest: RunningIngest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", QUICK_SILENCE)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f"{{'step': {i}, 'loss': 1.0}}\n" for i in range(5)))
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 1, "acc": 0.5}\n')
    unfinished = tmp_path / "unfinished.jsonl"
    unfinished.write_text('{"step": 1, "acc": 0.5}')
    env = platform_env(ingest, tmp_path / "state", SIDECAR_STATUS_ADDR="127.0.0.1:0",
                       SIDECAR_HARDWARE_INTERVAL="0")
    watch = Sidecar(["watch", "--jsonl", str(metrics), "--jsonl", str(good), "--jsonl",
                     str(unfinished)], env, tmp_path / "watch")
    stderr = tmp_path / "watch" / "stderr"
    try:
        addr_file = tmp_path / "state" / RUN_ID / "status-addr"
        wait_until(addr_file.exists, 20, "the status address")
        address = addr_file.read_text().strip()
        wait_until(lambda: _status_source(address, "jsonl")["invalid"] == 5, 20,
                   "five invalid lines counted")
        assert _status_source(address, "jsonl")["skipped"] == 0
        ingest.wait_for(lambda: any(p["key"] == "acc" for r in ingest.records("metrics")
                                    for p in r["points"]), 10)
        wait_until(lambda: f"{metrics}: no point in its first 1 s" in stderr.read_text(), 20,
                   "the file of Python dicts said after its first second")
    finally:
        watch.proc.send_signal(signal.SIGTERM)
        done = watch.wait(60)
    assert done.status == 0, done.stderr
    warnings = [line for line in done.stderr.decode().splitlines() if " WARNING " in line]
    said = [line for line in warnings if str(metrics) in line]
    assert len(said) == 2, warnings
    assert f"--jsonl {metrics}: line 1: single quotes: a Python dict" in said[0]
    assert "write json.dumps(record)" in said[0]
    # said again once it is clear that nothing came of it, with the same diagnosis
    assert f"--jsonl {metrics}: no point in its first 1 s: 5 lines read; line 1: single " \
           "quotes: a Python dict" in said[1]
    assert "write json.dumps(record)" in said[1]
    assert not [line for line in warnings if str(good) in line]
    # the line that never got its newline is said by the end at the latest, with why
    [open_line] = [line for line in warnings if str(unfinished) in line]
    assert "no point" in open_line and "have no newline yet" in open_line


def test_watch_counts_records_without_a_step_and_names_the_file_and_step_of_a_nan(
        ingest: RunningIngest, tmp_path: Path) -> None:
    counted = tmp_path / "counted.jsonl"
    counted.write_text("".join(json.dumps({"loss": i / 10}) + "\n" for i in range(5)))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"key": "lr", "value": i}) + "\n" for i in range(3)))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"step": 10, "loss": 1}\n{"eval": 2}\n{"step": 20, "loss": 3, '
                     '"grad": NaN}\n{"eval": 4}\n')
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    watch = Sidecar(["watch", "--jsonl", str(counted), "--jsonl", str(pairs), "--jsonl",
                     str(mixed)], env, tmp_path / "watch")
    try:
        ingest.wait_for(lambda: sum(len(r["points"]) for r in ingest.records("metrics")) >= 12,
                        20)
    finally:
        watch.proc.send_signal(signal.SIGTERM)
        done = watch.wait(60)
    assert done.status == 0, done.stderr
    steps: dict[str, list[int]] = {}
    for record in ingest.records("metrics"):
        for point in record["points"]:
            steps.setdefault(point["key"], []).append(point["step"])
    assert {key: sorted(set(found)) for key, found in steps.items()} == {
        "loss": [0, 1, 2, 3, 4, 10, 20], "lr": [0, 1, 2], "eval": [10, 20]}
    lines = done.stderr.decode().splitlines()
    for path, rule in ((counted, "are counted, 0, 1, 2, ..."), (pairs, "are counted"),
                       (mixed, "take the step of the last record before them that had one")):
        said = [line for line in lines if f"--jsonl {path}: " in line and "no step" in line]
        assert len(said) == 1 and " INFO " in said[0] and rule in said[0], said
    [nan] = [line for line in lines if "'grad'" in line]
    assert " WARNING " in nan and f"at step 20 in --jsonl {mixed}" in nan


def test_a_record_of_5000_keys_is_refused_past_the_limit_in_one_error_line(
        ingest: RunningIngest, tmp_path: Path) -> None:
    metrics = tmp_path / "wide.jsonl"
    metrics.write_text(json.dumps({"step": 1, **{f"k{i:05d}": i for i in range(5000)}}) + "\n")
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    watch = Sidecar(["watch", "--jsonl", str(metrics)], env, tmp_path / "watch")
    try:
        ingest.wait_for(lambda: sum(len(r["points"]) for r in ingest.records("metrics")) >= 4096,
                        20)
    finally:
        watch.proc.send_signal(signal.SIGTERM)
        done = watch.wait(60)
    assert done.status == 0, done.stderr
    assert {p["key"] for r in ingest.records("metrics") for p in r["points"]} == {
        f"k{i:05d}" for i in range(4096)}
    errors = [line for line in done.stderr.decode().splitlines() if " ERROR " in line]
    assert len(errors) == 1, errors[:3]
    assert "904 metric keys refused ('k04096', 'k04097', 'k04098', 'k04099', 'k04100' and " \
           "899 more)" in errors[0]
