"""The /logs buffer through the real `sidecar run`: a short outage loses no line, and when the
output outruns a slow ingest, the oldest is dropped, every dropped character is marked, and the
end of the run (its last line, its traceback, the failure summary) arrives all the same."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import Sidecar, platform_env, python_child
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until

MARKER = re.compile(r"\[sidecar\] (\d+) (?:characters|bytes) of output were dropped here")

# A numbered line every 20 ms until the go file exists.
NUMBERED = """
import os, sys, time
i = 0
while not os.path.exists(sys.argv[1]):
    print(f"step {i:05d}", flush=True)
    i += 1
    time.sleep(0.02)
print("the end", flush=True)
"""


def steps(text: str) -> list[int]:
    return [int(line[5:]) for line in text.splitlines() if line.startswith("step ")]


def test_a_3_s_outage_mid_run_loses_no_line(ingest: RunningIngest, tmp_path: Path) -> None:
    """The ingest refuses connections for 150 lines' worth (3 s at least): every line arrives
    once, in order, with no gap (a request was dropped after three attempts)."""
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state")
    proc = Sidecar(["run", "--hardware-interval", "0", "--", *python_child(NUMBERED), str(go)],
                   env, tmp_path / "sc")
    passed = tmp_path / "sc" / "stdout"
    try:
        ingest.wait_for(lambda: "step 00050" in ingest.log_text(), 30, "50 lines arrived")
        ingest.stop_listening()
        at_stop = max(steps(passed.read_text()))
        # the outage's length, counted in the command's own lines (20 ms apart, or slower)
        wait_until(lambda: max(steps(passed.read_text())) >= at_stop + 150, 60,
                   "150 lines written during the outage")
        ingest.start_listening()
        at_back = max(steps(passed.read_text()))
        ingest.wait_for(lambda: f"step {at_back + 50:05d}" in ingest.log_text(), 60,
                        "50 lines after the outage arrived")
    finally:
        ingest.start_listening()
        go.touch()
    done = proc.wait(60)
    assert done.status == 0, done.stderr
    text = ingest.log_text()
    assert "[sidecar]" not in text, MARKER.findall(text)
    got = steps(text)
    assert got == list(range(len(got))), "lines lost, repeated or out of order"
    assert got == steps(done.stdout.decode())
    assert text.endswith("the end\n")


# 1,000 lines of 100 B every 25 ms for 4 s, then a last line and a traceback on stderr.
FLOOD_THEN_CRASH = """
import sys, time
n = 0
t0 = time.monotonic()
while time.monotonic() - t0 < 4.0:
    sys.stdout.write("".join(f"L{n + i:08d} " + "x" * 89 + "\\n" for i in range(1000)))
    sys.stdout.flush()
    n += 1000
    time.sleep(0.025)
print("the real last line", flush=True)
raise RuntimeError("the real exception")
"""
LINE_CHARS = 100


def test_a_flood_into_a_slow_ingest_keeps_the_end_and_marks_every_drop(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """/logs answering in 3 s, 16 MB in 4 s: the oldest is dropped, the markers add up to
    exactly what did not arrive (the last drop too), and the last line, the traceback and a
    summary that quotes the exception arrive (the blocks past a full buffer bypassed the
    failure scanner and the crash tail: the summary named an old line on stdout)."""
    ingest.add_fault(Fault(route="logs", slow_answer_s=3))
    env = platform_env(ingest, tmp_path / "state")
    # time for a few 3-s answers before the crash tail's (how the drain divides its time is
    # not what this test is about)
    proc = Sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "60", "--",
                    *python_child(FLOOD_THEN_CRASH)], env, tmp_path / "sc")
    done = proc.wait(180)
    assert done.status == 1, done.stderr
    text = ingest.log_text()
    lines = text.splitlines()
    assert "the real last line" in lines
    traceback = [line for line in lines if line.startswith(("Traceback", "  File", "Runtime"))]
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "RuntimeError: the real exception"
    summary = [line for line in lines if line.startswith("[sidecar] run failed")]
    assert len(summary) == 1 and "RuntimeError: the real exception" in summary[0], summary
    assert lines.index("the real last line") < lines.index(summary[0])
    written = [line for line in done.stdout.decode().splitlines() if line.startswith("L")]
    # what arrived of the numbered lines: whole lines, and the parts of a line cut where the
    # crash tail's window began (a line's start, its newline ours, or its end)
    arrived = 0
    numbers = []
    for line in lines:
        if not line or not re.fullmatch(r"L?\d* ?x*", line):
            continue
        if len(line) == LINE_CHARS - 1:
            numbers.append(int(line[1:9]))
            arrived += LINE_CHARS
        else:
            arrived += len(line) + (0 if line.startswith("L") else 1)
    assert numbers == sorted(set(numbers)), "lines repeated or out of order"
    marked = sum(int(count) for count in MARKER.findall(text))
    lost = len(written) * LINE_CHARS - arrived
    assert lost > 0  # the buffer really overflowed
    assert marked == lost, (marked, lost)
