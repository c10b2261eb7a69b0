"""The sidecar's own messages: one line an event, text or JSON, repeats held back, no token."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from sidecar import log as sidecar_log
from sidecar.log import add_secret, log, setup

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
    assert sidecar_log.mask("start a thing") == "start a thing"


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
