"""Secrets through the real `sidecar run`: no run of 8 characters of the token reaches /logs,
whatever redraws, truncations, cuts or prefixes surround it (docs/ingest.md#logs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TOKEN, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest

# each a way output puts a token, or a part of it, where a redraw, a cut or a prefix could
# leave a part of it showing
REDRAWS = [
    f"{TOKEN[:-1]}\r{TOKEN}\n",  # a longer state over the token's beginning
    f"{TOKEN}\r{TOKEN[:5]}\n",  # a shorter state over it
    f"{TOKEN[:12]}\x1b[12D{TOKEN}\n",  # cursor left, then the whole token over its beginning
    f"{TOKEN[:14]}\r  0% |###|\n",  # a bar state cut at the width, then the bar
    f"{TOKEN[:10]}\x1b[K\rstep {TOKEN[10:]}\n",  # erase and redraw with the rest
    f"{TOKEN[:6]}\x1b[6C{TOKEN[12:]}\r\x1b[6C{TOKEN[6:12]}\n",  # pieces put together by moves
]
CHILD = """
import os, sys, time
for data in sys.argv[1:]:
    raw = data.encode()
    half = len(raw) // 2
    os.write(1, raw[:half])  # a cut between two reads
    time.sleep(0.05)
    os.write(1, raw[half:])
"""


def _runs(text: str) -> list[str]:
    return [TOKEN[i:i + 8] for i in range(len(TOKEN) - 7) if TOKEN[i:i + 8] in text]


@pytest.mark.parametrize("tty", [False, True])
def test_no_run_of_the_token_survives_a_redraw(ingest: RunningIngest, tmp_path: Path,
                                               tty: bool) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", *(["--tty"] if tty else []), "--", *python_child(CHILD), *REDRAWS,
                    "end\n"], env, tmp_path / "sc")
    assert done.status == 0, done.stderr.decode()[-3000:]
    text = ingest.log_text()
    assert "end" in text
    assert _runs(text) == [], text


def test_a_log_prefix_holding_the_token_is_refused_at_start(ingest: RunningIngest,
                                                            tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--log-prefix", f"[{TOKEN}] ", "--", *python_child("print(1)")], env,
                   tmp_path / "sc")
    assert done.status == 2
    assert b"--log-prefix" in done.stderr
    assert TOKEN[:8].encode() not in done.stderr
    assert ingest.log_text() == ""


def test_a_followed_cri_file_and_its_path_keep_no_run_of_the_token(ingest: RunningIngest,
                                                                   tmp_path: Path) -> None:
    folder = tmp_path / f"logs-{TOKEN}"
    folder.mkdir()
    log = folder / "train.log"
    stamp = "2026-01-01T00:00:00.000000000Z stdout"
    log.write_text(f"{stamp} P {TOKEN[:-1]}\r\n{stamp} F {TOKEN}\n{stamp} P {TOKEN[:9]}\n")
    state = tmp_path / "state"
    env = platform_env(ingest, state)
    done = sidecar(["run", "--log", str(log), "--", *python_child("import time; time.sleep(1)")],
                   env, tmp_path / "sc")
    assert done.status == 0, done.stderr.decode()[-3000:]
    assert _runs(ingest.log_text()) == [], ingest.log_text()
    written = [path for path in state.rglob("*") if path.is_file()]
    assert any(path.name == "offsets.json" for path in written)
    for path in written:
        assert _runs(path.read_bytes().decode("latin-1")) == [], path
