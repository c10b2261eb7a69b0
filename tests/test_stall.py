"""--stall-after: a quiet trainer is said to be stalled once, and to have resumed once."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from sidecar.stall import StallWatch, gpu_summary
from tests.conftest import RUN_ID, Sidecar, platform_env, python_child
from tests.ingest_server import RunningIngest, wait_until

# Prints, goes quiet for at least 5 s (until the test has seen the stall), prints again, then
# waits for the test to have seen the resume.
QUIET_THEN_PRINTS = r'''
import os, sys, time
print("epoch 1 done", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 5 or not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("epoch 2 done", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
'''

STALLED = re.compile(r"\[sidecar\] no output and no new metric step for (\d+)s; no GPU$")
RESUMED = re.compile(r"\[sidecar\] output resumed after (\d+)s$")


def stalled_gauge(address: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return float(re.search(r"^sidecar_trainer_stalled_seconds (\S+)$", text, re.M)[1])  # type: ignore[index]


def test_stall_after_2(ingest: RunningIngest, tmp_path: Path) -> None:
    resume, finish = tmp_path / "resume", tmp_path / "finish"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_STATUS_ADDR="127.0.0.1:0")
    proc = Sidecar(["run", "--stall-after", "2", "--hardware-interval", "0", "--",
                    *python_child(QUIET_THEN_PRINTS), str(resume), str(finish)], env,
                   tmp_path / "sc")
    addr_file = tmp_path / "state" / RUN_ID / "status-addr"
    wait_until(addr_file.exists, 20, "the status endpoint is up")
    address = addr_file.read_text().strip()
    wait_until(lambda: any(STALLED.match(line) for line in ingest.log_lines()), 20,
               "the stall is said")
    assert stalled_gauge(address) >= 2.0
    resume.touch()
    wait_until(lambda: any(RESUMED.match(line) for line in ingest.log_lines()), 20,
               "the resume is said")
    assert stalled_gauge(address) == 0.0
    finish.touch()
    done = proc.wait(30)
    assert done.status == 0  # a stall is never a failure
    lines = ingest.log_lines()
    stalls = [line for line in lines if STALLED.match(line)]
    resumes = [line for line in lines if RESUMED.match(line)]
    assert len(stalls) == 1 and len(resumes) == 1, lines
    assert lines.index(stalls[0]) < lines.index(resumes[0]) < lines.index("epoch 2 done")
    assert int(RESUMED.match(resumes[0])[1]) >= 4  # type: ignore[index]  # 5 s, in whole s
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running",
                                                                  "succeeded"]
    assert b"WARNING" in done.stderr and b"no output and no new metric step" in done.stderr


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stall_watch_says_each_once_and_zero_turns_it_off() -> None:
    said: list[str] = []
    clock = Clock()
    watch = StallWatch(1800, said.append, lambda: "no GPU", clock)
    clock.now += 1799
    watch.check()
    assert said == []
    clock.now += 1
    watch.check()
    clock.now += 600
    watch.check()
    assert said == ["[sidecar] no output and no new metric step for 30m0s; no GPU"]
    assert watch.stalled_s == 2400
    clock.now += 72
    watch.activity()
    watch.activity()
    assert said[1:] == ["[sidecar] output resumed after 41m12s"]
    assert watch.stalled_s == 0
    off = StallWatch(0, said.append, lambda: "no GPU", clock)
    clock.now += 1e6
    off.check()
    assert len(said) == 2


def test_stall_watch_says_when_to_look_next() -> None:
    """watch sleeps until a stall could be due instead of ticking four times a second."""
    clock = Clock()
    watch = StallWatch(1800, lambda line: None, lambda: "no GPU", clock)
    clock.now += 600
    assert watch.due_in_s() == 1200
    watch.activity()  # activity moves the moment on
    assert watch.due_in_s() == 1800
    clock.now += 1800
    assert watch.due_in_s() == 0
    watch.check()
    assert watch.stalled and watch.due_in_s() is None  # said once: nothing to look for
    assert StallWatch(0, lambda line: None, lambda: "no GPU", clock).due_in_s() is None


def test_gpu_summary_from_the_samplers_gauges() -> None:
    gauges = {f"gpu/{i}/utilization_percent": 100.0 for i in range(8)}
    gauges.update({f"gpu/{i}/sm_active_percent": 2.0 for i in range(8)})
    gauges["gpu/0/memory_used_bytes"] = 1e9
    assert gpu_summary(gauges) == "GPUs 0-7: 100 % utilisation, 2 % SM activity"
    assert gpu_summary({"gpu/0/utilization_percent": 40.0, "gpu/2/utilization_percent": 60.0,
                        "gpu/3/utilization_percent": 50.0}) == "GPUs 0,2-3: 50 % utilisation"
    assert gpu_summary({"cpu/utilization_percent": 5.0}) == "no GPU"


def test_watch_a_new_metric_step_ends_a_stall_and_a_repeated_step_does_not(
        ingest: RunningIngest, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.5}\n')
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    proc = Sidecar(["watch", "--jsonl", str(metrics), "--stall-after", "2"], env,
                   tmp_path / "watch")

    def points() -> int:
        return sum(len(r["points"]) for r in ingest.records("metrics"))

    wait_until(lambda: any(STALLED.match(line) for line in ingest.log_lines()), 20,
               "the stall is said")
    with metrics.open("a") as fh:
        fh.write('{"step": 1, "loss": 0.4}\n')  # the same step again: no progress
    wait_until(lambda: points() == 2, 20, "the repeated step's point arrived")
    assert not any(RESUMED.match(line) for line in ingest.log_lines())
    with metrics.open("a") as fh:
        fh.write('{"step": 2, "loss": 0.3}\n')
    wait_until(lambda: any(RESUMED.match(line) for line in ingest.log_lines()), 20,
               "the resume is said")
    proc.proc.terminate()
    assert proc.wait(30).status == 0
    assert len([line for line in ingest.log_lines() if STALLED.match(line)]) == 1
