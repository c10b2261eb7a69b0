"""The console shows lines in the order they were printed: `/logs` chunks carry no stream and no
time, so their order across the command's stdout and stderr is all the platform has. A real
`sidecar run`, real children writing on two pipes, real HTTP over loopback."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.conftest import Finished, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest

# Each child waits, instead of sleeping, for two files the test makes: `go` once the sidecar
# is up (its environment snapshot arrived: the pipeline is imported and posting; what a command
# writes before that is the start-up exception that docs/running.md#the-commands-output names),
# `done` once its last line arrived, so that /logs itself carried everything (what the crash
# tail takes over at the exit is its own test).
WAIT = """
import os, sys, time
def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
go, done = sys.argv[1:3]
"""


def run_in_order(ingest: RunningIngest, tmp_path: Path, script: str, last_line: str,
                 *args: str) -> Finished:
    """`sidecar run` of the child `script` (WAIT first), released once the sidecar is up and
    let exit once `last_line` arrived."""
    go, done = tmp_path / "go", tmp_path / "done"

    def release() -> None:
        try:
            ingest.wait_for(lambda: bool(ingest.records("environment")), 60, "the sidecar is up")
            go.touch()
            ingest.wait_for(lambda: last_line in ingest.log_text().splitlines(), 60,
                            "the last line arrived")
        finally:
            go.touch()
            done.touch()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    env = platform_env(ingest, tmp_path / "state")
    result = sidecar(["run", "--", *python_child(WAIT + script), str(go), str(done), *args],
                     env, tmp_path / "sc")
    releaser.join(60)
    return result

# Lines on both streams, each its own write, `gap` seconds apart, in a fixed order: both
# streams in a row, several lines in a row on one of them, and single alternations.
ALTERNATING = """
import os, sys, time
gap = float(sys.argv[3])
wait_for(go)
plan = "oeoeooeeoeeeoooeoeoeooeoeeoeoeoooeeoeoeo" * 2
for n, stream in enumerate(plan):
    os.write(1 if stream == "o" else 2, f"line {n} on {stream}\\n".encode())
    time.sleep(gap)
wait_for(done)
"""

# A tqdm-style loop: a line on stdout, a bar redrawn on stderr and closed with its final state
# and a newline, then a line on stdout; three epochs.
BAR_THEN_LINE = """
import sys, time
wait_for(go)
for epoch in range(3):
    print(f"epoch {epoch} starts", flush=True)
    for step in range(1, 11):
        sys.stderr.write(f"\\rtrain: {step * 10:3d}%|{'#' * step:<10}| {step}/10")
        sys.stderr.flush()
        time.sleep(0.003)
    sys.stderr.write("\\n")
    sys.stderr.flush()
    time.sleep(0.005)
    print(f"epoch {epoch} done", flush=True)
    time.sleep(0.005)
wait_for(done)
"""


# Two bars drawn as tqdm draws nested ones: the inner one a line below, reached with a line
# feed and left with a cursor move up, so the screen model holds a line the cursor left until
# it is sure the cursor does not come back; then a line on stdout.
NESTED_BARS_THEN_LINE = """
import sys, time
wait_for(go)
for epoch in range(3):
    sys.stderr.write(f"\\repoch {epoch}: 0/1")
    for step in range(1, 6):
        sys.stderr.write(f"\\n\\rbatch {step}/5\\x1b[A\\repoch {epoch}: 0/1")
        sys.stderr.flush()
        time.sleep(0.003)
    sys.stderr.write(f"\\repoch {epoch}: 1/1\\n\\rbatch 5/5 done\\n")
    sys.stderr.flush()
    time.sleep(0.01)
    print(f"epoch {epoch} done", flush=True)
    time.sleep(0.01)
wait_for(done)
"""


def test_writes_5_ms_apart_on_two_streams_arrive_in_the_order_written(
        ingest: RunningIngest, tmp_path: Path) -> None:
    done = run_in_order(ingest, tmp_path, ALTERNATING, "line 79 on o", "0.005")
    assert done.status == 0, done.stderr
    lines = ingest.log_text().splitlines()
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers == list(range(80)), lines


def test_a_closed_bar_reaches_the_log_before_the_line_printed_after_it(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """The bar's final state is held while the screen model waits to see whether the cursor
    comes back up; a line on the other stream would have ended that wait on a shared terminal."""
    done = run_in_order(ingest, tmp_path, BAR_THEN_LINE, "epoch 2 done")
    assert done.status == 0, done.stderr
    lines = ingest.log_text().splitlines()
    for epoch in range(3):
        final = lines.index(f"epoch {epoch} done") - 1
        assert lines[final] == "train: 100%|##########| 10/10", lines
        assert lines.index(f"epoch {epoch} starts") < final


def test_lines_held_by_the_screen_model_go_before_a_later_line_of_the_other_stream(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """After the cursor once went up, a line it left is held for a few seconds in case it
    comes back; on a terminal shared with stdout, stdout's next line would have ended that."""
    done = run_in_order(ingest, tmp_path, NESTED_BARS_THEN_LINE, "epoch 2 done")
    assert done.status == 0, done.stderr
    lines = ingest.log_text().splitlines()
    for epoch in range(3):
        at = lines.index(f"epoch {epoch} done")
        assert lines[at - 2:at] == [f"epoch {epoch}: 1/1", "batch 5/5 done"], lines


# Log lines and one redraw in a single write on stderr: the whole write goes to the terminal
# model, which draws it a slice per turn of the loop; a line on stdout right after must still
# come after all of it.
BIG_REDRAWN_BLOCK_THEN_LINE = """
import os, sys, time
wait_for(go)
block = "".join(f"INFO step {n} of the warm-up\\n" for n in range(2000))
block += "\\rloading 1/2\\rloading 2/2\\n"
os.write(2, block.encode())
time.sleep(0.002)
os.write(1, b"after the block\\n")
wait_for(done)
"""

def test_a_line_after_a_block_the_terminal_draws_in_slices_comes_after_all_of_it(
        ingest: RunningIngest, tmp_path: Path) -> None:
    done = run_in_order(ingest, tmp_path, BIG_REDRAWN_BLOCK_THEN_LINE, "after the block")
    assert done.status == 0, done.stderr
    lines = ingest.log_text().splitlines()
    assert lines[-1] == "after the block", lines[-5:]
    assert lines[:2000] == [f"INFO step {n} of the warm-up" for n in range(2000)]  # none cut

