"""The command's output at its exit, through the real `sidecar run`: every line a healthy ingest
can take arrives exactly once, whether it was sent best-effort, was in flight at the exit or went
by the crash tail; a slow ingest is waited for, not sent the same lines twice."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import Sidecar, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest

# 213-byte lines written in one go just before the exit: most of them are still queued (or in
# the pipe) when the command has gone.
QUICK_EXIT = """
import sys
stream = getattr(sys, sys.argv[1])
stream.write("".join(f"line {i:05d} " + "x" * 201 + "\\n" for i in range(int(sys.argv[2]))))
stream.flush()
sys.exit(int(sys.argv[3]))
"""


# Lines, a pause shorter than the ingest's answer, more lines and a failure: the first request
# is still in flight when the command exits.
PAUSED = """
import sys, time
for i in range(200):
    if i == 100:
        time.sleep(0.3)
    sys.stderr.write(f"line {i:05d} " + "x" * 201 + "\\n")
sys.exit(1)
"""


def assert_every_line_once(lines: list[str], count: int) -> None:
    wanted = [f"line {i:05d} " + "x" * 201 for i in range(count)]
    got = [line for line in lines if line.startswith("line ")]
    missing = sorted(set(wanted) - set(got))
    assert not missing, f"{len(missing)} lines lost, first {missing[0][:10]}"
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} lines repeated"
    assert got == wanted  # in order


@pytest.mark.parametrize(("stream", "count", "status"), [
    ("stdout", 5000, 0), ("stdout", 5000, 1), ("stderr", 600, 1)])
def test_a_quick_exit_after_a_flood_delivers_every_line_once(
        ingest: RunningIngest, tmp_path: Path, stream: str, count: int, status: int) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", "--",
                    *python_child(QUICK_EXIT), stream, str(count), str(status)],
                   env, tmp_path / "sc")
    assert done.status == status, done.stderr
    assert_every_line_once(ingest.log_lines(), count)


def test_a_slow_ingest_gets_a_failing_runs_lines_once(ingest: RunningIngest,
                                                     tmp_path: Path) -> None:
    """/logs answers in 1.2 s: the request in flight at the exit is waited for, not repeated."""
    ingest.add_fault(Fault(route="logs", slow_answer_s=1.2))
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "10", "--",
                    *python_child(PAUSED)], env, tmp_path / "sc")
    assert done.status == 1, done.stderr
    lines = ingest.log_lines()
    assert_every_line_once(lines, 200)
    assert sum(line.startswith("[sidecar] run failed") for line in lines) == 1


def test_a_slow_ingest_gets_a_flood_before_a_failure_once_and_in_order(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """3 MB written at the exit, /logs answering in 1.2 s: the older text's requests are each
    waited for before the crash tail (a flush gave up after a second, sent the tail beside it
    and dropped what was left as if the drain deadline had passed)."""
    ingest.add_fault(Fault(route="logs", slow_answer_s=1.2))
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", "--",
                    *python_child(QUICK_EXIT), "stdout", "15000", "1"], env, tmp_path / "sc")
    assert done.status == 1, done.stderr
    assert_every_line_once(ingest.log_lines(), 15000)
    assert b"dropped" not in done.stderr


# A line left open (a download's progress) through a stall, then finished; or the exit.
OPEN_LINE = """
import os, sys, time
sys.stdout.write("Downloading shard 3/8: ")
sys.stdout.flush()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
if sys.argv[2] == "finish":
    sys.stdout.write("done\\n")
    sys.exit(0)
sys.exit(1)
"""


def test_our_lines_are_never_spliced_into_an_open_line(ingest: RunningIngest,
                                                       tmp_path: Path) -> None:
    """The stall and resume lines end the partial line sent first, and what follows of it
    starts a line of its own, with the prefix."""
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state")
    proc = Sidecar(["run", "--hardware-interval", "0", "--stall-after", "1.5",
                    "--log-prefix", "[vm:0] ", "--", *python_child(OPEN_LINE), str(go),
                    "finish"], env, tmp_path / "sc")
    ingest.wait_for(lambda: "no output" in ingest.log_text(), 20, "the stall is said")
    go.touch()
    assert proc.wait(30).status == 0
    # the stacks block, when it was taken before the resume, follows the stall line
    lines = [line for line in ingest.log_text().splitlines(keepends=True)
             if not line.startswith(("[vm:0] [sidecar] stacks of", "[vm:0] [sidecar]   "))]
    assert lines[0] == "[vm:0] Downloading shard 3/8: \n"
    assert lines[1].startswith("[vm:0] [sidecar] no output and no new metric step for ")
    assert lines[2].startswith("[vm:0] [sidecar] output resumed after ")
    assert lines[3:] == ["[vm:0] done\n"]


def test_the_failure_summary_is_never_spliced_into_the_last_line(ingest: RunningIngest,
                                                                 tmp_path: Path) -> None:
    go = tmp_path / "go"
    go.touch()
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", "--log-prefix", "[vm:0] ", "--",
                    *python_child(OPEN_LINE), str(go), "fail"], env, tmp_path / "sc")
    assert done.status == 1
    lines = ingest.log_text().splitlines(keepends=True)
    assert lines[0] == "[vm:0] Downloading shard 3/8: \n"
    assert lines[1].startswith("[vm:0] [sidecar] run failed: exit status 1 after ")
    assert len(lines) == 2


# The command leaves a writer behind and exits at once: the writer prints for `seconds` (or
# until killed), its pid first in a file, then its last line; a write that fails is written down
# beside the pid file.
LEAVES_A_WRITER = """
import subprocess, sys
writer = '''
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
deadline = time.monotonic() + float(sys.argv[2])
i = 0
try:
    while time.monotonic() < deadline:
        print(f"background {i}", flush=True)
        i += 1
        time.sleep(0.1)
    print("background: last line", flush=True)
except BrokenPipeError as exc:
    open(sys.argv[1] + ".broken", "w").write(repr(exc))
'''
subprocess.Popen([sys.executable, "-c", writer, sys.argv[1], sys.argv[2]])
print("the command exits", flush=True)
"""


def background_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("background")]


def test_a_background_writer_runs_to_its_end(ingest: RunningIngest, tmp_path: Path) -> None:
    """It writes for 7 s after the command exited, past the 5 s a share of the drain gave it:
    every line is passed through and reaches /logs, in order, and none of its writes fails."""
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "20", "--",
                    *python_child(LEAVES_A_WRITER), str(tmp_path / "pid"), "7"],
                   env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert done.stdout.endswith(b"background: last line\n")  # passed through, as by tee
    written = background_lines(done.stdout.decode())
    assert written[:-1] == [f"background {i}" for i in range(len(written) - 1)]
    text = ingest.log_text()
    assert background_lines(text) == written
    assert text.index("the command exits") < text.index("background 0")
    assert not (tmp_path / "pid.broken").exists()
    assert b"still held open" not in done.stderr
    assert [r["event"] for r in ingest.records("lifecycle")] == [
        "starting", "running", "succeeded"]


def test_a_writer_past_the_drain_is_named_and_left_alone(ingest: RunningIngest,
                                                         tmp_path: Path) -> None:
    """It is forwarded until the drain's end is near (it was cut after a quarter of it), then
    named, with its command, in the last line; nothing of ours kills it."""
    env = platform_env(ingest, tmp_path / "state")
    pid_file = tmp_path / "pid"
    try:
        done = sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "8", "--",
                        *python_child(LEAVES_A_WRITER), str(pid_file), "60"],
                       env, tmp_path / "sc")
        pid = int(pid_file.read_text())
        assert done.status == 0, done.stderr
        said = re.compile(rf"the command's output is still held open by 1 process \(PID {pid} "
                          r"python[^)]*\) \d+s after the command exited, at the end of the "
                          r"drain \(--drain-timeout\); it was forwarded until now, what they "
                          r"write from now on is not\n")
        assert said.search(done.stderr.decode())
        text = ingest.log_text()
        last = text.splitlines(keepends=True)[-1]
        assert last.startswith("[sidecar] ") and said.fullmatch(last.removeprefix("[sidecar] "))
        forwarded = background_lines(text)
        assert forwarded == [f"background {i}" for i in range(len(forwarded))]
        assert len(forwarded) > 30  # of the ~70 written in the 7 s it was given
        os.kill(pid, 0)  # alive
        assert [r["event"] for r in ingest.records("lifecycle")] == [
            "starting", "running", "succeeded"]
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
