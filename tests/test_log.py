"""The sidecar's own messages: one line an event, text or JSON, repeats held back, no token."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar import log as sidecar_log
from sidecar.log import log, setup
from sidecar.masking import add_secret, mask
from tests.conftest import SIDECAR, platform_env, python_child
from tests.ingest_server import RunningIngest

SECRET = "tok-SECRET-for-the-log-tests"


@pytest.fixture
def restore() -> Iterator[None]:
    yield
    setup()


@pytest.mark.parametrize("message_format", ["text", "json"])
def test_one_line_an_event_with_the_token_masked(capsys: pytest.CaptureFixture[str],
                                                 restore: None, message_format: str) -> None:
    setup("info", message_format)
    add_secret(SECRET)
    log.info("connecting with %s\nand a second line", SECRET)
    err = capsys.readouterr().err
    assert SECRET not in err
    lines = err.splitlines()
    if message_format == "json":
        assert len(lines) == 1
        assert json.loads(lines[0])["level"] == "info"
    assert "***" in err


def test_short_strings_are_never_treated_as_secrets() -> None:
    add_secret("t")
    assert mask("start a thing") == "start a thing"


def test_repeated_errors_are_held_back_and_counted(capsys: pytest.CaptureFixture[str],
                                                   restore: None) -> None:
    setup("info")
    for _ in range(5):
        log.error("the ingest is unreachable")
    log.error("another problem")
    log.info("an info line is never held back")
    log.info("an info line is never held back")
    lines = capsys.readouterr().err.splitlines()
    assert sum("the ingest is unreachable" in line for line in lines) == 1
    assert sum("another problem" in line for line in lines) == 1
    assert sum("an info line" in line for line in lines) == 2
    handler = log.handlers[0]
    flt = next(f for f in handler.filters if hasattr(f, "_throttle"))
    flt._throttle._last = {k: v - 61 for k, v in flt._throttle._last.items()}
    log.error("the ingest is unreachable")
    assert "(4 more like this in the last minute)" in capsys.readouterr().err


def test_levels(capsys: pytest.CaptureFixture[str], restore: None) -> None:
    setup("warning")
    log.info("quiet")
    log.warning("loud")
    err = capsys.readouterr().err
    assert "quiet" not in err and "loud" in err
    assert logging.getLogger("sidecar").level == logging.WARNING


# A bar left mid-line on stderr (tqdm's way: a carriage return, then the state), or a line left
# open on stdout, when the command exits.
BAR_MID_LINE = """
import sys
stream = getattr(sys, sys.argv[1])
for i in range(41):
    stream.write(f"\\r{i}/50 [00:00<00:00, 45.92it/s]")
    stream.flush()
sys.exit(1)
"""


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_our_messages_start_a_line_of_their_own_in_a_file(ingest: RunningIngest,
                                                          tmp_path: Path, stream: str) -> None:
    """`2>err.log` (and `>all.log 2>&1` for stdout): no terminal, and still our message after
    the command's open line starts on a line of its own."""
    env = platform_env(ingest, tmp_path / "state")
    with open(tmp_path / "err.log", "w+b") as out:
        status = subprocess.run(
            [*SIDECAR, "run", "--hardware-interval", "0", "--", *python_child(BAR_MID_LINE),
             stream], env=env, stdout=out if stream == "stdout" else subprocess.DEVNULL,
            stderr=out, stdin=subprocess.DEVNULL, timeout=60).returncode
        out.seek(0)
        text = out.read().decode()
    assert status == 1
    assert "40/50 [00:00<00:00, 45.92it/s]\n" in text
    assert re.search(r"it/s\]\n[0-9T:.-]+Z sidecar [A-Z]+ ", text), text
    assert not re.search(r"[^\n][0-9]{4}-[0-9T:.-]+Z sidecar ", text), text


def test_the_repeat_throttle_forgets_messages_past_their_interval_but_not_what_it_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(sidecar_log, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    throttle = sidecar_log.Throttle(60.0)
    assert throttle.admit("the same") == 0
    assert throttle.admit("the same") is None  # held back, counted
    for i in range(20_000):  # a message that differs each time, once a second for hours
        clock.now += 1.0
        assert throttle.admit(f"1 metric key refused ('k{i}')") == 0
    assert len(throttle._last) <= 2 * sidecar_log.THROTTLE_PRUNE_FROM
    assert throttle.admit("the same") == 1  # what it held is still said


# -- what a message concerns: fields given where it is written, never read back from its text -


def test_json_carries_the_fields_a_message_is_given_and_reads_none_from_its_text(
        capsys: pytest.CaptureFixture[str], restore: None) -> None:
    setup("info", "json")
    log.warning("/artifact/upload-url: HTTP 503: kept and retried",
                extra={"route": "artifact/upload-url"})
    log.warning("--jsonl %s: line 3 is not JSON", Path("out/m.jsonl"),
                extra={"source": "jsonl", "path": Path("out/m.jsonl")})
    log.warning("--jsonl out/m.jsonl: said without its fields")
    upload_url, jsonl, bare = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert upload_url["route"] == "artifact/upload-url"
    assert (jsonl["source"], jsonl["path"]) == ("jsonl", "out/m.jsonl")
    assert not {"route", "source", "path", "option", "variable"} & bare.keys()


PACKAGE = Path(sidecar_log.__file__).parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
# a message starts by naming what it concerns: a route ("/metrics: ", "/%s: ") or an option
# ("--checkpoints %s: ", "--status-addr %s: ")
NAMES_A_ROUTE = re.compile(r"/(?:%s|[a-z]+(?:/[a-z-]+)?): ")
NAMES_AN_OPTION = re.compile(r"--[a-z][a-z-]*[ :]")


def _log_calls() -> Iterator[tuple[str, str, set[str]]]:
    """Each `log.<level>(...)` of the package: where, its message's literal start, the fields
    its `extra=` gives."""
    import ast

    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                continue
            extra = next((k.value for k in node.keywords if k.arg == "extra"), None)
            fields = ({key.value for key in extra.keys if isinstance(key, ast.Constant)}
                      if isinstance(extra, ast.Dict) else set())
            yield f"{path.relative_to(PACKAGE)}:{node.lineno}", node.args[0].value, fields


def test_a_message_that_names_a_route_or_an_option_gives_it_as_a_field() -> None:
    calls = list(_log_calls())
    assert len(calls) > 100
    missing = [
        f"{where} {message[:40]!r}" for where, message, fields in calls
        if (NAMES_A_ROUTE.match(message) and "route" not in fields)
        or (NAMES_AN_OPTION.match(message) and not fields & {"source", "option"})
    ]
    assert missing == []
    unknown = {field for _, _, fields in calls for field in fields} - set(sidecar_log.EXTRA_FIELDS)
    assert unknown == set()
