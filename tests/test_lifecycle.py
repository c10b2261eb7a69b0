"""The lifecycle is a state machine, enforced where events are recorded: `starting` once,
`running` once, then one end event, nothing after it; one process writes a run's journal. Each
case through the real `sidecar` process, its real child and the checking ingest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.delivery.journal import frame
from sidecar.delivery.lifecycle import refusal
from tests.conftest import RUN_ID, Sidecar, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until


@pytest.mark.parametrize(("recorded", "event", "refused"), [
    ((), "starting", False), ((), "running", False), ((), "failed", False),
    (("starting",), "running", False), (("starting", "running"), "succeeded", False),
    (("starting",), "failed", False),
    (("starting", "running"), "running", False),  # a repeat: nothing to record, no refusal
    (("running",), "starting", True),
    (("starting", "failed"), "running", True), (("running", "failed"), "succeeded", True),
    (("starting", "running", "succeeded"), "succeeded", False)])
def test_each_stage_once_in_order_and_nothing_after_the_end(recorded: tuple[str, ...],
                                                           event: str, refused: bool) -> None:
    assert (refusal(recorded, event) is not None) is refused


# The command exits at once; a process it left behind (its output not the command's, so that
# nothing holds the wrapper) hands `running` over once it has, and writes down what it was told.
LATE_MARKER = """
import os, subprocess, sys
late = '''
import os, subprocess, sys, time
while os.getppid() == PARENT:
    time.sleep(0.01)
told = subprocess.run([sys.executable, "-m", "sidecar", "lifecycle", "running"],
                      capture_output=True)
with open(sys.argv[1] + ".tmp", "wb") as fh:
    fh.write(b"%d " % told.returncode + told.stderr)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
'''.replace("PARENT", str(os.getpid()))
subprocess.Popen([sys.executable, "-c", late, sys.argv[1]], stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
sys.exit(1)
"""


def test_a_marker_handed_over_after_the_command_exited_is_refused(ingest: RunningIngest,
                                                                  tmp_path: Path) -> None:
    """`running` reached the ingest after `failed`: a billing start after the end."""
    ingest.add_fault(Fault(route="lifecycle", status=503, retry_after="1"))  # so the wrapper
    env = platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="30")  # is still in
    told = tmp_path / "told"  # its drain when the marker comes
    run = Sidecar(["run", "--running-when", "marker", "--", *python_child(LATE_MARKER),
                   str(told)], env, tmp_path / "sc")
    wait_until(told.exists, 30, "the late marker was handed over")
    ingest.clear_faults()
    done = run.wait()
    assert done.status == 1, done.stderr
    answer = told.read_bytes()
    assert answer.startswith(b"1 ") and b"refused: the command has exited" in answer, answer
    assert ingest.events() == ["starting", "failed"]
    assert b"`sidecar lifecycle running` refused: the command has exited" in done.stderr


WAITS = """
import os, sys, time
print("training", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
"""


def test_a_standalone_lifecycle_beside_a_run_is_refused_naming_it_and_replay_repeats_nothing(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Without SIDECAR_WRAPPER_SOCKET, `sidecar lifecycle succeeded` beside a live wrapper of
    the same run appended to its journal, each process wrote its own acknowledged count, and
    `succeeded` reached the ingest twice (and again from `replay`)."""
    env = platform_env(ingest, tmp_path / "state")
    go = tmp_path / "go"
    run = Sidecar(["run", "--", *python_child(WAITS), str(go)], env, tmp_path / "run")
    try:
        ingest.wait_for(lambda: ingest.events() == ["starting", "running"], 20)
        beside = sidecar(["lifecycle", "succeeded"], env, tmp_path / "beside")
    finally:
        go.touch()
    done = run.wait()
    assert done.status == 0, done.stderr
    err = beside.stderr.decode()
    assert beside.status == 2, err
    assert f"PID {run.proc.pid}" in err and "Traceback" not in err, err
    replayed = sidecar(["replay"], env, tmp_path / "replay")
    assert replayed.status == 0, replayed.stderr
    assert ingest.events() == ["starting", "running", "succeeded"]
    after = sidecar(["lifecycle", "failed"], env, tmp_path / "after")  # the run has ended
    assert after.status == 1 and b"refused: the run has ended" in after.stderr, after.stderr
    again = sidecar(["lifecycle", "succeeded"], env, tmp_path / "again")  # a repeat: nothing to do
    assert again.status == 0, again.stderr
    assert ingest.events() == ["starting", "running", "succeeded"]


def test_a_run_whose_journal_holds_its_end_runs_the_command_and_posts_nothing_more(
        ingest: RunningIngest, tmp_path: Path) -> None:
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    earlier = [{"run_id": RUN_ID, "event": e, "ts": f"2026-12-01T08:00:0{n}+00:00"}
               for n, e in enumerate(("starting", "running", "failed"))]
    (run_dir / "lifecycle.journal").write_bytes(b"".join(frame(json.dumps(e).encode())
                                                         for e in earlier))
    (run_dir / "lifecycle.journal.acked").write_text("3")
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--", *python_child("print('trained')")], env, tmp_path / "sc")
    err = done.stderr.decode()
    assert done.status == 0 and done.stdout == b"trained\n", err
    assert ingest.events() == []
    assert "already holds the end of run" in err and "Traceback" not in err, err


# Connects to the wrapper's hand-off socket 300 times, each time leaving before the answer;
# then hands `running` over as it should.
LEAVES = r"""
import json, os, socket, struct, subprocess, sys
name = os.environ["SIDECAR_WRAPPER_SOCKET"].partition("#")[0]
for _ in range(300):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect("\0" + name[1:])
        sock.sendall(json.dumps({"event": "running", "secret": "wrong"}).encode() + b"\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
print("marked", subprocess.call([sys.executable, "-m", "sidecar", "lifecycle", "running"]))
"""


def test_hand_off_clients_that_leave_before_their_answer_cost_a_line_at_most(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Each printed asyncio's raw traceback: 300 of them, 2,700 lines of stderr."""
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--running-when", "marker", "--", *python_child(LEAVES)], env,
                   tmp_path / "sc")
    err = done.stderr.decode()
    assert done.status == 0 and done.stdout == b"marked 0\n", err
    assert "Traceback" not in err and "Unhandled exception" not in err, err[:2000]
    assert err.count("went away before its answer") <= 2, err
    assert all(" sidecar " in line for line in err.splitlines()), err  # each line one of ours
    assert ingest.events() == ["starting", "running", "succeeded"]


def test_a_short_run_against_an_ingest_that_restarts_posts_its_whole_lifecycle(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """The ingest refuses connections (a pod of it restarting) while a 1 s command runs and
    exits 0: the exit waits it out, says so at once with how long, and every event arrives,
    in order (the wrapper used to leave at once, keeping them for a `replay` that a pod's
    state folder does not live to see)."""
    ingest.stop_listening()
    run = Sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "30", "--",
                   *python_child("import time\nprint('hi', flush=True)\ntime.sleep(1)\n"
                                 "print('bye')\n")],
                  platform_env(ingest, tmp_path / "state"), tmp_path / "sc")
    stderr = tmp_path / "sc" / "stderr"
    try:
        wait_until(lambda: b"waiting up to" in stderr.read_bytes(), 30,
                   "the wait said at the exit")
    finally:
        ingest.start_listening()
    done = run.wait(60)
    assert done.status == 0, done.stderr
    [waits] = [line for line in done.stderr.decode().splitlines() if "waiting up to" in line]
    assert "more (--drain-timeout 30s from the exit) for the ingest to take what is left " \
        "(failing now: " in waits
    assert "no payload of this run was accepted" not in done.stderr.decode()
    assert ingest.events() == ["starting", "running", "succeeded"]
    assert "bye" in "".join(c for body in ingest.records("logs") for c in body["chunks"])
