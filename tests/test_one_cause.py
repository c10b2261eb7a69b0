"""One cause, one message (issue 35, item 5): a wrong token, or an ingest that cannot be reached,
is said once with the routes it hits, not once a route (a wrong token gave five ERROR lines),
and its end once, when it clears."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TOKEN, Sidecar, platform_env, python_child
from tests.ingest_server import RunningIngest, wait_until


def _child(go: Path, jsonl: Path) -> list[str]:
    """A trainer writing a metric a tenth of a second, printing a line each, until `go`."""
    return python_child(
        "import json, os, time\ni = 0\n"
        f"while not os.path.exists({str(go)!r}):\n"
        f"    with open({str(jsonl)!r}, 'a') as f:\n"
        "        f.write(json.dumps({'step': i, 'loss': 1.0 / (i + 1)}) + '\\n')\n"
        "    print(f'step {i}', flush=True)\n    i += 1\n    time.sleep(0.1)\n")


def _lines(stderr: Path, text: str) -> list[str]:
    return [line for line in stderr.read_text().splitlines() if text in line]


def test_a_wrong_token_is_one_error_naming_the_routes_and_its_end_one_line(
        ingest: RunningIngest, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    stale = "stale-token-0123456789"
    token_file.write_text(stale + "\n")
    go, jsonl = tmp_path / "go", tmp_path / "m.jsonl"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="5")
    run = Sidecar(["run", "--token-file", str(token_file), "--jsonl", str(jsonl),
                   "--hardware-interval", "1", "--", *_child(go, jsonl)], env, tmp_path / "sc")
    stderr = tmp_path / "sc" / "stderr"
    try:
        # every route the run posts to has been refused, and the refusal said
        wait_until(lambda: all(ingest.stats.routes[r].rejected.get(401, 0) for r in
                               ("lifecycle", "logs", "metrics", "hardware")), 30,
                   "each route refused")
        wait_until(lambda: _lines(stderr, "rejected the token"), 20, "the refusal said")
        rotated = tmp_path / "token.new"
        rotated.write_text(TOKEN + "\n")
        rotated.replace(token_file)
        wait_until(lambda: _lines(stderr, "accepts the token again"), 30, "the token accepted")
    finally:
        go.touch()
    done = run.wait(60)
    assert done.status == 0, done.stderr
    text = done.stderr.decode()
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1, text
    [error] = errors
    assert ": HTTP 401: the ingest rejected the token; " in error, error
    named = error.split(" ERROR ")[1].split(": HTTP")[0].split(", ")
    assert len(named) >= 3 and set(named) <= {"/lifecycle", "/logs", "/metrics", "/hardware",
                                              "/environment", "/environment/nodes"}, error
    [back] = [line for line in text.splitlines() if "accepts the token again" in line]
    assert " INFO " in back and "delivery goes on" in back
    assert len(back.split(" INFO ")[1].split(": the ingest")[0].split(", ")) >= 3, back
    assert TOKEN not in text and stale not in text


def test_an_ingest_that_went_away_is_one_warning_for_every_route(
        ingest: RunningIngest, tmp_path: Path) -> None:
    go, jsonl = tmp_path / "go", tmp_path / "m.jsonl"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="5")
    run = Sidecar(["run", "--jsonl", str(jsonl), "--hardware-interval", "1", "--",
                   *_child(go, jsonl)], env, tmp_path / "sc")
    stderr = tmp_path / "sc" / "stderr"
    try:
        wait_until(lambda: ingest.records("metrics") and ingest.records("hardware"), 30,
                   "metrics and hardware delivered")
        ingest.stop_listening()
        wait_until(lambda: _lines(stderr, "did not take a payload"), 20, "the outage said")
        # long enough for every route to have failed: 2 s of training (hardware: each 1 s)
        steps = len(jsonl.read_text().splitlines())
        wait_until(lambda: len(jsonl.read_text().splitlines()) >= steps + 20, 30,
                   "2 s of training in the outage")
        ingest.start_listening()
        wait_until(lambda: _lines(stderr, "reachable again"), 30, "the ingest back")
    finally:
        ingest.start_listening()
        go.touch()
    done = run.wait(60)
    assert done.status == 0, done.stderr
    said = _lines(tmp_path / "sc" / "stderr", "did not take a payload")
    assert len(said) == 1, said
    assert "retried with backoff" in said[0]
    assert "/logs" in said[0] and "/metrics" in said[0], said
    assert len(_lines(tmp_path / "sc" / "stderr", "reachable again")) == 1


def test_a_tls_failure_is_one_error_naming_the_routes(ingest: RunningIngest,
                                                      tmp_path: Path) -> None:
    """https:// to a port serving plain HTTP: the handshake fails on every route alike."""
    go, jsonl = tmp_path / "go", tmp_path / "m.jsonl"
    env = platform_env(ingest.base_url.replace("http://", "https://"), tmp_path / "state",
                       SIDECAR_DRAIN_TIMEOUT="1")
    run = Sidecar(["run", "--jsonl", str(jsonl), "--hardware-interval", "1", "--",
                   *_child(go, jsonl)], env, tmp_path / "sc")
    stderr = tmp_path / "sc" / "stderr"
    try:
        wait_until(lambda: _lines(stderr, "over TLS"), 20, "the TLS failure said")
        # the others' failures past it: 2 s of training (hardware posts each 1 s)
        steps = len(jsonl.read_text().splitlines())
        wait_until(lambda: len(jsonl.read_text().splitlines()) >= steps + 20, 30,
                   "2 s of training after it")
    finally:
        go.touch()
    done = run.wait(60)
    text = done.stderr.decode()
    said = [line for line in text.splitlines() if "TLS" in line]
    assert len(said) == 1, text
    assert " ERROR " in said[0] and "--ca-file" in said[0], said
    assert len(said[0].split(" ERROR ")[1].split(": the ingest")[0].split(", ")) >= 2, said
