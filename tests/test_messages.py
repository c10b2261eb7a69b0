"""The sidecar's own messages say what happens, and never contradict themselves: a /logs 401 is
not "kept and retried", nothing says "dropped 0", a timeout names its reason, a marker that
never came is said."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import time
from pathlib import Path

from sidecar.delivery.client import IngestClient
from sidecar.delivery.logs import LogShipper
from sidecar.log import log
from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until


def lines_with(stderr: bytes, text: str) -> list[str]:
    return [line for line in stderr.decode().splitlines() if text in line]


def test_a_marker_that_never_came_is_said_at_the_end(ingest: RunningIngest,
                                                     tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--running-when", "marker", "--", *python_child("print('hi')")], env,
                   tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert ingest.events() == ["starting", "succeeded"]
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
    assert ingest.events() == ["starting", "running", "succeeded"]
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
    # the bad line at once, and that the file gave no point by the end
    bad_line, no_point = [m for m in messages
                          if m.get("source") == "jsonl" and m["level"] == "warning"]
    assert "single quotes: a Python dict" in str(bad_line["msg"])
    assert "no point by the end" in str(no_point["msg"])
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


# -- an outage, a rejected token: what is said happened -------------------------------------------


def test_an_outage_is_said_waited_out_and_said_over(ingest: RunningIngest,
                                                    tmp_path: Path) -> None:
    """/logs keeps what it holds through an outage its buffer outlasts: one line says the
    ingest did not take it and that it is retried, one says when /logs takes output again, and
    nothing is said dropped, or is (an outage used to drop a request after three attempts)."""
    go = tmp_path / "go"
    child = python_child(f"import os, time\ni = 0\nwhile not os.path.exists({str(go)!r}):\n"
                         "    print(f'line {i:04d}', flush=True)\n    i += 1\n"
                         "    time.sleep(0.1)\n"
                         "for j in range(i, i + 5):\n    print(f'line {j:04d}', flush=True)\n")
    run = Sidecar(["run", "--", *child], platform_env(ingest, tmp_path / "state"),
                  tmp_path / "sc")
    stderr = tmp_path / "sc" / "stderr"
    try:
        wait_until(lambda: len(ingest.log_lines()) >= 5, 20, "output before the outage")
        ingest.stop_listening()  # between two requests: one a line, 0.1 s apart
        wait_until(lambda: b"/logs: the ingest did not take a payload" in stderr.read_bytes(),
                   20, "the outage said")
        ingest.start_listening()
        wait_until(lambda: b"reachable again" in stderr.read_bytes(), 20, "the ingest back")
    finally:
        ingest.start_listening()
        go.touch()
    done = run.wait(60)
    assert done.status == 0, done.stderr
    received = ingest.log_lines()
    numbers = [int(line.removeprefix("line ")) for line in received if line.startswith("line ")]
    assert numbers == list(range(len(numbers))), "a line lost, repeated or out of its place"
    assert not [line for line in received if line.startswith("[sidecar] ")]
    [said] = lines_with(done.stderr, "/logs: the ingest did not take a payload")
    assert "it is kept and retried with backoff" in said
    [back] = lines_with(done.stderr, "/logs: the ingest is reachable again")  # once, for /logs
    # one line for the cause's end, naming /logs among the routes that came back with it
    assert re.search(r" INFO (/[\w/]+, )*/logs(, /[\w/]+)*: the ingest is reachable again after ",
                     back), back
    assert lines_with(done.stderr, "dropped") == []
    assert lines_with(done.stderr, "not delivered") == []


def test_a_rejected_token_says_what_is_kept_and_does_not_wait_out_the_drain(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Every answer 401: no event is said as if delivered, no internal route or "crash tail"
    is named, and the exit says what `sidecar replay` will deliver instead of waiting out the
    drain (a 1 s command took 21 s, in silence)."""
    ingest.add_fault(Fault(status=401))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="30")
    started = time.monotonic()
    done = sidecar(["run", "--", *python_child("import time\nprint('hi', flush=True)\n"
                                               "time.sleep(1)\nprint('bye')\n")],
                   env, tmp_path / "sc")
    took_s = time.monotonic() - started
    assert done.status == 0, done.stderr
    assert took_s < 15, f"waited out the drain: {took_s:.1f} s"
    text = done.stderr.decode()
    assert "/logs/tail" not in text and "crash tail" not in text
    said = lines_with(done.stderr, " INFO lifecycle: ")
    assert [line.split(" INFO ")[1] for line in said] == [
        f"lifecycle: {event} recorded (journaled, to be posted)"
        for event in ("starting", "running", "succeeded")]
    [kept] = lines_with(done.stderr, "no payload of this run was accepted")
    assert " WARNING " in kept and "every answer was HTTP 401/403" in kept
    assert "`sidecar replay` (once the token is accepted)" in kept
    assert "the lifecycle events starting, running, succeeded" in kept
    assert ingest.records("lifecycle") == []
    ingest.clear_faults()  # the token fixed: replay delivers what was kept, once
    replayed = sidecar(["replay", "--timeout", "10"], env, tmp_path / "replay")
    assert replayed.status == 0, replayed.stderr
    assert ingest.events() == ["starting", "running", "succeeded"]
    if "the command's last output" in kept:  # `bye`, unanswered at the exit (the usual case):
        assert ingest.log_lines() == [  # replayed, after a line of ours where `hi` was dropped
            "[sidecar] 3 characters of output were dropped here: the ingest did not take it "
            "(token rejected)", "bye"]
    else:
        assert ingest.log_lines() == []


def test_an_ingest_never_reachable_is_waited_for_and_what_is_kept_said(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """A refused connection is transient (an ingest restarting): the drain waits for it, says
    so at once, and at its deadline says what is kept, for what."""
    ingest.stop_listening()  # every connection refused, for the whole run
    env = platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="4")
    done = sidecar(["run", "--", *python_child("print('hi')")], env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert not lines_with(done.stderr, "no payload of this run was accepted")
    [waits] = lines_with(done.stderr, "waiting up to")
    assert "more (--drain-timeout 4s from the exit) for the ingest to take what is left " \
        "(failing now: " in waits
    [kept] = lines_with(done.stderr, "drain deadline reached")
    assert "3 lifecycle event(s) (starting, running, succeeded) not yet delivered" in kept
    assert "`sidecar replay` delivers them" in kept


def test_a_drain_that_waits_says_what_for(ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="lifecycle", status=503))
    go = tmp_path / "go"
    child = python_child(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n"
                         "    time.sleep(0.02)\n")
    run = Sidecar(["run", "--", *child],
                  platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="2"),
                  tmp_path / "sc")
    try:
        wait_until(lambda: b"/lifecycle: the ingest did not take" in (
            tmp_path / "sc" / "stderr").read_bytes(), 20, "the failure said")
    finally:
        go.touch()
    done = run.wait(60)
    assert done.status == 0, done.stderr
    [waits] = lines_with(done.stderr, "waiting up to")
    assert "for the ingest to take what is left (failing now: /lifecycle)" in waits


async def test_a_route_back_after_a_said_failure_is_said_once_as_often_as_the_failure(
        ingest: RunningIngest) -> None:
    """A failure said once a minute has its end said as often: a flapping ingest does not get
    one line per recovery."""
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        for ts in ("2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z"):
            # failing longer than a failure gathers its routes (one over in less is not said)
            ingest.add_fault(Fault(route="lifecycle", status=503))
            body = json.dumps({"run_id": RUN_ID, "event": "starting", "ts": ts}).encode()
            delivered = asyncio.ensure_future(client.deliver("lifecycle", body))
            deadline = time.monotonic() + 20
            # until the cause is past its gathering: said, or held as said under a minute ago
            while not (client._cause is not None and client._gathering is None):
                assert time.monotonic() < deadline, "the failure was never gathered"
                await asyncio.sleep(0.05)
            ingest.clear_faults()
            assert (await delivered).ok
    finally:
        log.setLevel(level)
        log.removeHandler(handler)
        await client.close()
    said = [r.getMessage() for r in seen]
    assert len([m for m in said if "did not take a payload (HTTP 503)" in m]) == 1, said
    back = [m for m in said if "reachable again" in m]
    assert len(back) == 1 and back[0].startswith("/lifecycle: the ingest is reachable again "
                                                 "after "), said
    assert back[0].endswith(" failed attempts; delivery goes on"), said
