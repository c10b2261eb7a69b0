"""The sidecar's own messages say what happens, and never contradict themselves: a /logs 401 is
not "kept and retried", nothing says "dropped 0", a timeout names its reason, a marker that
never came is said."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

from sidecar.commands.receive import Fault
from sidecar.delivery.client import IngestClient
from sidecar.delivery.logs import LogShipper
from sidecar.log import log
from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest, wait_until


def events(ingest: RunningIngest) -> list[str]:
    return [r["event"] for r in ingest.records("lifecycle")]


def lines_with(stderr: bytes, text: str) -> list[str]:
    return [line for line in stderr.decode().splitlines() if text in line]


def test_a_marker_that_never_came_is_said_at_the_end(ingest: RunningIngest,
                                                     tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--running-when", "marker", "--", *python_child("print('hi')")], env,
                   tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert events(ingest) == ["starting", "succeeded"]
    [warning] = lines_with(done.stderr, "never ran `sidecar lifecycle running`")
    assert " WARNING " in warning and "`running` was never posted" in warning
    assert "exited (status 0)" in warning


def test_a_marker_that_came_is_not_warned_about(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    marked = "import subprocess, sys\nsubprocess.check_call([sys.executable, '-m', 'sidecar', " \
             "'lifecycle', 'running'])\n"
    done = sidecar(["run", "--running-when", "marker", "--", *python_child(marked)], env,
                   tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert events(ingest) == ["starting", "running", "succeeded"]
    assert lines_with(done.stderr, "never ran") == []


def test_a_rejected_token_on_logs_says_the_output_is_dropped(ingest: RunningIngest,
                                                            tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="logs", status=401))
    go = tmp_path / "go"
    child = python_child(f"import os, time\nprint('x' * 55, flush=True)\n"
                         f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n")
    run = Sidecar(["run", "--", *child],
                  platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="2"),
                  tmp_path / "sc")
    try:  # while the command runs, /logs is best-effort: its output is dropped on a 401
        wait_until(lambda: ingest.stats.routes["logs"].rejected.get(401, 0) >= 1, 20,
                   "the ingest refused the output")
        wait_until(lambda: b"/logs: dropped" in (tmp_path / "sc" / "stderr").read_bytes(), 20,
                   "the shipper said what it dropped")
    finally:
        go.touch()
    done = run.wait(60)
    assert done.status == 0, done.stderr
    [rejected] = lines_with(done.stderr, "/logs: HTTP 401")
    assert "dropped and counted (/logs is best-effort)" in rejected
    assert "kept" not in rejected and "retried" not in rejected
    dropped = lines_with(done.stderr, "/logs: dropped")
    assert dropped and "dropped 56 characters" in dropped[0]
    assert lines_with(done.stderr, "dropped 0 ") == []
    assert TOKEN.encode() not in done.stderr


async def test_nothing_dropped_is_neither_counted_nor_said() -> None:
    client = IngestClient("http://127.0.0.1:9/api/ingest", ("X-StarForge-Token",), lambda: "t")
    shipper = LogShipper(client, RUN_ID)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        shipper.count_dropped(0, "the command writes faster than --log-rate forwards")
    finally:
        log.removeHandler(handler)
    assert seen == []
    assert shipper.dropped_chars == 0 and client.route_stats("logs").dropped == 0


def test_a_lifecycle_timeout_names_its_reason(ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="lifecycle", latency_s=30))
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["lifecycle", "failed", "--timeout", "1"], env, tmp_path / "sc")
    assert done.status == 1
    [line] = lines_with(done.stderr, "not acknowledged within 1 s")
    assert "()" not in line
    assert "(the ingest has not answered yet)" in line


def test_replay_draws_no_carriage_return_into_a_log_file(ingest: RunningIngest,
                                                         tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / RUN_ID).mkdir(parents=True)
    done = sidecar(["replay", "--timeout", "5"], platform_env(ingest, state), tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert b"replay: 0/0 payloads delivered\n" in done.stderr
    assert b"\r" not in done.stderr


# -- --message-format json: every message one object, with what it concerns ------------------


def json_lines(stderr: bytes) -> list[dict[str, object]]:
    """Every line of stderr, each of which must be one JSON object."""
    return [json.loads(line) for line in stderr.decode().splitlines()]


def test_json_messages_carry_the_run_the_node_and_the_route_or_source(
        ingest: RunningIngest, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("{'step': 0, 'loss': 1.0}\n")
    ingest.add_fault(Fault(route="hardware", status=400, times=1))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_MESSAGE_FORMAT="json",
                       NODE_NAME="gpu-07", SIDECAR_HARDWARE_INTERVAL="1")
    watch = Sidecar(["watch", "--jsonl", str(metrics)], env, tmp_path / "watch")
    try:
        said = tmp_path / "watch" / "stderr"
        wait_until(lambda: b'"route": "hardware"' in said.read_bytes(), 20,
                   "the refused /hardware sample said")
    finally:
        watch.proc.send_signal(signal.SIGTERM)
        done = watch.wait(60)
    assert done.status == 0, done.stderr
    messages = json_lines(done.stderr)
    assert all(m["run_id"] == RUN_ID and m["node"] == "gpu-07" for m in messages), messages
    assert {m["path"] for m in messages if m.get("source") == "jsonl"} == {str(metrics)}
    [bad_line] = [m for m in messages if m.get("source") == "jsonl" and m["level"] == "warning"]
    assert "single quotes: a Python dict" in str(bad_line["msg"])
    refused = next(m for m in messages if m.get("route") == "hardware")
    assert refused["level"] == "error" and "HTTP 400" in str(refused["msg"])


def test_json_messages_include_configuration_and_usage_errors(tmp_path: Path) -> None:
    env = platform_env("http://127.0.0.1:9/api/ingest", tmp_path / "state",
                       NODE_NAME="gpu-07")
    del env["STARFORGE_TOKEN"]
    done = sidecar(["run", "--message-format", "json", "--", "true"], env, tmp_path / "a")
    assert done.status == 2
    [error] = json_lines(done.stderr)
    assert error["level"] == "error" and error["command"] == "run"
    assert (error["run_id"], error["node"], error["variable"]) == (RUN_ID, "gpu-07",
                                                                   "STARFORGE_TOKEN")
    assert str(error["msg"]).startswith("configuration error: STARFORGE_TOKEN is not set")
    typo = sidecar(["watch", "--message-format=json", "--jsnol", "x"], env, tmp_path / "b")
    assert typo.status == 2
    [usage] = json_lines(typo.stderr)
    assert usage["msg"] == "unknown option --jsnol; did you mean --jsonl?"
    assert usage["command"] == "watch" and usage["run_id"] == RUN_ID
    bad_addr = sidecar(["watch", "--log", "x", "--status-addr", "nowhere"],
                       {**env, "SIDECAR_MESSAGE_FORMAT": "json", "STARFORGE_TOKEN": TOKEN},
                       tmp_path / "c")
    [addr] = json_lines(bad_addr.stderr)
    assert addr["option"] == "--status-addr" and bad_addr.status == 2
