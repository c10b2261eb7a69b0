"""Secrets through the real `sidecar run`: no run of 8 characters of the token reaches /logs,
whatever redraws, truncations, cuts or prefixes surround it (docs/ingest.md#logs)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from sidecar.commands.ingest_checks import ROUTE_NAMES
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


EVERYTHING = """
import json, os, sys, time
work = sys.argv[1]
print("the token in the output: " + sys.argv[2], flush=True)
with open(os.path.join(work, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 1, "loss": 0.5}) + "\\n")
time.sleep(4)  # a stall: the stacks, in a script whose path holds the token, are kept
raise RuntimeError("gave up holding " + sys.argv[2])
"""


def test_no_file_the_sidecar_writes_and_nothing_it_says_or_posts_holds_the_token(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """A run whose script, folders, output, checkpoint and exception all hold the
    token: no file of the state folder, no line of the sidecar's own on stderr and no body
    the ingest took holds a run of it. A checkpoint whose path holds it is refused (its object
    key would keep it), the other one is registered."""
    from tests.test_upload import hf_export, save

    work = tmp_path / f"work-{TOKEN}"
    work.mkdir()
    script = work / f"train_{TOKEN}.py"
    script.write_text(EVERYTHING)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    save(checkpoints, f"step-1-{TOKEN}", hf_export([64]))
    save(checkpoints, "step-2", hf_export([64], seed=1))
    state = tmp_path / "state"
    done = sidecar(["run", "--hardware-interval", "1", "--stall-after", "1",
                    "--jsonl", str(work / "metrics.jsonl"), "--checkpoints", str(checkpoints),
                    "--artifact-uri", f"{checkpoints}=s3://bucket/checkpoints", "--",
                    sys.executable, str(script), str(work), TOKEN],
                   platform_env(ingest, state), tmp_path / "sc")
    assert done.status == 1, done.stderr.decode()[-3000:]
    said = done.stderr.decode()
    assert "step-1-*** is neither uploaded nor registered: its path holds the ingest's token" in (
        said), said[-3000:]
    registered = [r["path"] for r in ingest.records("artifact")]
    assert registered == ["s3://bucket/checkpoints/step-2"]
    assert "the token in the output: ***" in ingest.log_text()
    written = [path for path in state.rglob("*") if path.is_file()]
    assert {"lifecycle.journal", "offsets.json", "artifacts.json"} <= {p.name for p in written}
    assert any(path.parent.name == "stacks" for path in written), written  # the stall's dump
    for path in written:
        assert _runs(path.read_bytes().decode("latin-1")) == [], path
    # the command's own output passes through unchanged; the sidecar's lines are its own
    own = [line for line in said.splitlines() if re.match(r"\d{4}-\d\d-\d\dT\S+ sidecar ", line)]
    assert len(own) > 5 and _runs("\n".join(own)) == [], own
    for route in ROUTE_NAMES:
        for body in ingest.records(route):
            assert _runs(json.dumps(body)) == [], (route, body)
