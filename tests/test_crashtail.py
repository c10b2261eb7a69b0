"""The crash tail: the traceback that explains a crash reaches /logs exactly once, before the end
event, through an ingest blip at the moment of the crash and through a SIGKILL of the sidecar."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import pytest

from sidecar.delivery.client import IngestClient
from sidecar.delivery.crashtail import JOURNAL_NAME, TAIL_BYTES, CrashTail, new_tails
from sidecar.delivery.journal import Journal
from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until

TRACEBACK = """Traceback (most recent call last):
  File "/work/train.py", line 88, in <module>
    loss.backward()
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 525, in backward
    torch.autograd.backward(
  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 267, in backward
    _engine_run_backward(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
capacity of 79.10 GiB of which 1.06 GiB is free.
"""

# 10,000 lines, then (once the test has armed the fault) the traceback, and exit 1.
CRASHING = f"""
import os, sys, time
for i in range(10000):
    print(f"step {{i:05d}} loss 0.4132")
sys.stdout.flush()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
sys.stderr.write({TRACEBACK!r})
sys.exit(1)
"""


def log_lines(records: list[dict[str, object]]) -> list[str]:
    return "".join(c for r in records for c in r["chunks"]).splitlines()  # type: ignore[attr-defined]


def logs_before_end_event(ingest: RunningIngest) -> list[dict[str, object]]:
    """The /logs bodies the ingest accepted before the end event."""
    arrivals = ingest.stats.arrivals
    lifecycle = [i for i, route in enumerate(arrivals) if route == "lifecycle"]
    events = [r["event"] for r in ingest.records("lifecycle")]
    end = lifecycle[events.index("failed")]
    return ingest.records("logs")[:arrivals[:end].count("logs")]


def assert_tail_once_before_the_end_event(ingest: RunningIngest) -> None:
    everything = log_lines(ingest.records("logs"))
    for line in TRACEBACK.splitlines():
        assert everything.count(line) == 1, line
    before = log_lines(logs_before_end_event(ingest))
    assert before[-len(TRACEBACK.splitlines()) - 1:-1] == TRACEBACK.splitlines()
    assert before[-1].startswith("[sidecar] run failed: exit status 1 after ")
    assert "likely cause: CUDA out of memory" in before[-1]
    assert all(everything.count(f"step {i:05d} loss 0.4132") <= 1 for i in range(0, 10000, 97))


def start_crashing(ingest: RunningIngest, tmp_path: Path, drain_timeout: str) -> tuple[Sidecar,
                                                                                      Path]:
    """The crashing child under `sidecar run`, its 10,000 lines delivered, and the go file."""
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state")
    proc = Sidecar(["run", "--hardware-interval", "0", "--drain-timeout", drain_timeout, "--",
                    *python_child(CRASHING), str(go)], env, tmp_path / "sc")
    wait_until(lambda: "step 09999 loss 0.4132" in log_lines(ingest.records("logs")), 30,
               "the 10,000 lines arrived")
    return proc, go


def test_a_503_from_the_traceback_on_for_5_s(ingest: RunningIngest, tmp_path: Path) -> None:
    proc, go = start_crashing(ingest, tmp_path, "20")
    ingest.add_fault(Fault(route="logs", status=503))
    heal = threading.Timer(5.0, ingest.clear_faults)  # the blip's length, not a wait
    heal.start()
    try:
        go.touch()
        done = proc.wait(60)
    finally:
        heal.cancel()
    assert done.status == 1
    assert ingest.stats.routes["logs"].rejected  # the blip really hit the traceback
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running", "failed"]
    assert_tail_once_before_the_end_event(ingest)
    assert not (tmp_path / "state" / RUN_ID / JOURNAL_NAME).exists()  # delivered: forgotten


@pytest.mark.parametrize("then", ["replay", "next start"])
def test_sigkilled_during_the_drain(ingest: RunningIngest, tmp_path: Path, then: str) -> None:
    proc, go = start_crashing(ingest, tmp_path, "60")
    ingest.add_fault(Fault(route="logs", status=503))
    go.touch()
    journal = tmp_path / "state" / RUN_ID / JOURNAL_NAME
    # The file is there before its record is written: wait for the record itself, whose last
    # words are the failure summary (a kill before it is written can only lose the tail).
    wait_until(lambda: journal.exists() and b"run failed" in journal.read_bytes(), 30,
               "the crash tail is journaled")
    proc.proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running"]
    ingest.clear_faults()
    env = platform_env(ingest, tmp_path / "state")
    if then == "replay":
        assert sidecar(["replay"], env, tmp_path / "replay").status == 0
    else:  # the run's end is in its journal: nothing is recorded after it
        assert sidecar(["run", "--hardware-interval", "0", "--", "true"], env,
                       tmp_path / "next").status == 0
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running", "failed"]
    assert_tail_once_before_the_end_event(ingest)
    delivered = len(ingest.records("logs"))
    assert sidecar(["replay"], env, tmp_path / "again").status == 0  # never twice
    assert len(ingest.records("logs")) == delivered


def test_a_journal_record_that_is_no_crash_tail_is_skipped_never_posted(
        ingest: RunningIngest, tmp_path: Path) -> None:
    run_dir = tmp_path / "state" / RUN_ID
    journal = Journal(run_dir / JOURNAL_NAME)
    journal.open()
    for body in (b"not json", json.dumps({"run_id": "another-run", "chunks": ["x\n"]}).encode(),
                 json.dumps({"run_id": RUN_ID, "chunks": "no list"}).encode(),
                 json.dumps({"run_id": RUN_ID, "chunks": ["the last words\n"],
                             "eof": False}).encode()):
        journal.append(body)
    done = sidecar(["replay"], platform_env(ingest, tmp_path / "state"), tmp_path / "replay")
    assert done.status == 0, done.stderr
    assert [r["chunks"] for r in ingest.records("logs")] == [["the last words\n"]]
    assert b"3 record(s) are not /logs bodies of run" in done.stderr


ALTERNATING = """
import sys, time
time.sleep(1.0)  # past the sidecar's start-up, which the order of the first writes is not about
for i in range(40):
    stream = sys.stdout if i % 2 == 0 else sys.stderr
    stream.write(f"write {i:03d} on {stream.name[1:-1]}\\n")
    stream.flush()
    time.sleep(0.005)
"""


def test_the_last_output_keeps_the_order_it_was_written_in_across_streams(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Writes alternating on stdout and stderr 5 ms apart, the last of them not acknowledged at
    the exit (the ingest answers slowly): the last output merges both streams in the order they
    were written, not one stream's after the other's."""
    ingest.add_fault(Fault(route="logs", slow_answer_s=1.0))
    done = sidecar(["run", "--", *python_child(ALTERNATING)],
                   platform_env(ingest, tmp_path / "state"), tmp_path / "sc")
    assert done.status == 0, done.stderr
    bodies = [body["chunks"] for body in ingest.records("logs")]
    lines = "".join(c for chunks in bodies for c in chunks).splitlines()
    assert lines == [f"write {i:03d} on {('stdout', 'stderr')[i % 2]}" for i in range(40)]
    last = "".join(bodies[-1])  # the last output, taken at the exit: both streams in it
    assert len(bodies) >= 2 and "on stdout" in last and "on stderr" in last, bodies


async def test_a_dead_letter_the_state_dir_refuses_does_not_end_the_delivery(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """The crash tail kept a refused body in the dead-letter file with no OSError guard: when
    the file could not be written (here a folder stands in its place), `deliver` raised, the
    drain lost the rest of the last output, and the earlier start's sender was restarted on the
    same body again and again. Now the refusal is said, the body left, and the next one goes."""
    ingest.add_fault(Fault(route="logs", reject_if_contains="poison"))
    run_dir = tmp_path / "state" / RUN_ID
    await asyncio.to_thread((run_dir / "dead-letter.jsonl").mkdir, parents=True)
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    crash_tail = CrashTail(run_dir, RUN_ID, client)
    try:
        await crash_tail.open()
        await crash_tail.add(["poison\n"])
        await crash_tail.add(["the last words\n"])
        assert await crash_tail.deliver(time.monotonic() + 10.0)
    finally:
        await client.close()
    assert [r["chunks"] for r in ingest.records("logs")] == [["the last words\n"]]
    assert crash_tail.pending == 0
    assert not (run_dir / JOURNAL_NAME).exists()  # both acknowledged, the journal cleared


def test_a_503_until_late_in_the_drain_still_puts_the_tail_before_the_end(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """/logs answers 503 for 16 s of a 30 s drain: the traceback goes when it is back, and
    `failed` after it (the end event went out once half the drain was spent, the tail never)."""
    proc, go = start_crashing(ingest, tmp_path, "30")
    ingest.add_fault(Fault(route="logs", status=503))
    heal = threading.Timer(16.0, ingest.clear_faults)  # the outage's length, not a wait
    heal.start()
    try:
        go.touch()
        done = proc.wait(90)
    finally:
        heal.cancel()
    assert done.status == 1
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running", "failed"]
    assert_tail_once_before_the_end_event(ingest)


def test_with_logs_down_for_good_the_tail_is_journaled_before_the_end_and_replayed(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """/logs never answers: the tail is journaled before `failed` is posted (a broken /logs
    never costs the lifecycle), and replay sends the tail, once, after nothing else."""
    proc, go = start_crashing(ingest, tmp_path, "6")
    ingest.add_fault(Fault(route="logs", status=503))
    go.touch()
    done = proc.wait(60)
    assert done.status == 1
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running", "failed"]
    journal = tmp_path / "state" / RUN_ID / JOURNAL_NAME
    assert b"run failed" in journal.read_bytes()
    said = done.stderr.decode()
    assert said.index("the command's last output is not yet delivered to /logs; kept in") < (
        said.index("lifecycle: failed accepted by the ingest"))
    ingest.clear_faults()
    before = len(ingest.stats.arrivals)
    assert sidecar(["replay"], platform_env(ingest, tmp_path / "state"),
                   tmp_path / "replay").status == 0
    assert ingest.stats.arrivals[before:] == ["logs"]
    everything = log_lines(ingest.records("logs"))
    for line in TRACEBACK.splitlines():
        assert everything.count(line) == 1, line


# 3 s of output, much faster than a slow /logs takes it, then a last line and an exception.
FLOOD_THEN_CRASH = """
import time
end = time.monotonic() + 3.0
i = 0
while time.monotonic() < end:
    for _ in range(100):
        print(f"flood {i:07d} " + "x" * 60)
        i += 1
    time.sleep(0.005)
print("the last line before the crash", flush=True)
raise RuntimeError("the crash at the end")
"""


def test_at_a_failed_exit_the_crash_tail_goes_before_the_older_output_a_slow_logs_holds(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """/logs answers 2 s late while the command floods for 3 s and dies of an exception: the
    last line and the traceback arrive first in the drain, before the older output still queued
    then; that follows as the budget allows, between two lines of ours that say so, and the
    failure summary still ends the log before `failed`."""
    ingest.add_fault(Fault(route="logs", latency_s=2.0))
    done = sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "12", "--",
                    *python_child(FLOOD_THEN_CRASH)],
                   platform_env(ingest, tmp_path / "state"), tmp_path / "sc")
    assert done.status == 1, done.stderr
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running", "failed"]
    bodies = ["".join(body["chunks"]) for body in logs_before_end_event(ingest)]
    tail_at = next(i for i, text in enumerate(bodies) if "RuntimeError: the crash" in text)
    tail = bodies[tail_at].splitlines()
    assert tail[0].startswith("[sidecar] the command's last output goes first: "), tail[0]
    assert "the last line before the crash" in tail
    assert tail[-1].startswith("[sidecar] run failed: exit status 1 after ")
    assert "RuntimeError" in tail[-1]
    # what followed it: older lines only, then ours that close it and the summary again
    after = "".join(bodies[tail_at + 1:]).splitlines()
    assert after[-2].startswith("[sidecar] end of the output written before the command's "
                                "last output above: "), after[-2:]
    assert after[-1] == tail[-1]
    first_in_tail = min(int(line.split()[1]) for line in tail if line.startswith("flood "))
    older = [int(line.split()[1]) for line in after if line.startswith("flood ")]
    assert older, "some of the older output followed the tail within the 12 s drain"
    assert max(older) < first_in_tail
    floods = [line for line in "".join(bodies).splitlines() if line.startswith("flood ")]
    assert len(floods) == len(set(floods))  # none of them twice


def test_the_crash_tail_starts_at_a_line_where_the_window_cuts_one() -> None:
    """Older text may be sent after the crash tail, with a line of ours between them: a line
    the 64 KiB window's edge cut would arrive in two parts around it."""
    tail = new_tails(1)[0]
    lines = "".join(f"line {i:05d} " + "x" * 201 + "\n" for i in range(1000))
    tail.add(lines)
    ((_, start),) = tail.window()
    assert start > 0 and lines[start - 1] == "\n"
    assert len(lines) - start > TAIL_BYTES - 213  # no more than one line short of it
