"""Where each rank's time goes, read from outside (docs/time.md): real torch.distributed ranks
(gloo) under the real torchrun, balanced, then one of them three times slower, then balanced
again; a DataLoader whose workers cannot keep up; `sidecar profile` on a running job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.stacks import Process, find_tool, processes_of
from sidecar.timeshare import ShareWindow, Tally, TimeSampler, parse_raw, ranks_of
from sidecar.verdicts import Verdicts
from tests.conftest import SIDECAR, Sidecar, platform_env
from tests.ingest_server import RunningIngest, wait_until

needs_py_spy = pytest.mark.skipif(find_tool() is None, reason="py-spy is not installed")

# Each rank computes, then all-reduces; rank 1 computes three times longer while the file `slow`
# exists. The compute sleeps, as a host waiting for its GPU does: three ranks busy on two cores
# would make whichever the scheduler served least a straggler too, and the test one of load.
STEPS = r'''
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
slow, stop = sys.argv[1], sys.argv[2]
total = torch.ones(1)


def compute(seconds):
    time.sleep(seconds)


step = 0
while not os.path.exists(stop):
    compute(0.06 if rank == 1 and os.path.exists(slow) else 0.02)
    dist.all_reduce(total)
    step += 1
    if step % 100 == 0:
        print(f"[rank{rank}]: step {step}", flush=True)
dist.destroy_process_group()
'''

WINDOW_S = 2


def hardware_shares(ingest: RunningIngest) -> list[dict[int, dict[str, float]]]:
    """Each window's shares as /hardware got them: rank -> category -> ratio, in order."""
    windows: list[dict[int, dict[str, float]]] = []
    for body in ingest.records("hardware"):
        by_rank: dict[int, dict[str, float]] = {}
        for point in body["points"]:
            parts = point["key"].split("/")
            if parts[0] == "rank" and parts[2] == "time":
                by_rank.setdefault(int(parts[1]), {})[parts[3]] = point["value"]
        if by_rank:
            windows.append(by_rank)
    return windows


def verdicts(ingest: RunningIngest) -> list[str]:
    return [line for line in ingest.log_lines()
            if line.startswith("[sidecar] ") and ("straggler" in line or "input-bound" in line)]


@pytest.fixture
def torchrun() -> Path:
    path = Path(sys.executable).parent / "torchrun"
    if not path.exists():
        pytest.skip("torchrun is not installed")
    return path


@pytest.fixture
def ranks(ingest: RunningIngest, tmp_path: Path, torchrun: Path) -> Iterator[Sidecar]:
    """Three gloo ranks under torchrun under `sidecar run --time-window 2`; stopped at the end
    whatever the test found."""
    (tmp_path / "steps.py").write_text(STEPS)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                       PATH=f"{torchrun.parent}:{os.defpath}", OMP_NUM_THREADS="1")
    proc = Sidecar(["run", "--time-window", str(WINDOW_S), "--", str(torchrun),
                    "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port",
                    str(port), str(tmp_path / "steps.py"), str(tmp_path / "slow"),
                    str(tmp_path / "stop")], env, tmp_path / "sc")
    try:
        yield proc
    finally:
        (tmp_path / "stop").touch()
        if proc.proc.poll() is None:
            try:
                proc.proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.proc.kill()


@needs_py_spy
def test_the_straggler_is_named_once_while_it_lasts_and_a_balanced_run_gets_no_verdict(
        ingest: RunningIngest, tmp_path: Path, ranks: Sidecar) -> None:
    balanced = 6
    wait_until(lambda: len(hardware_shares(ingest)) >= balanced, 120,
               f"{balanced} windows of the three ranks' shares")
    assert verdicts(ingest) == []
    first = hardware_shares(ingest)[0]
    assert sorted(first) == [0, 1, 2]
    for shares in first.values():  # the four sum to 1, with the samples they rest on
        assert sum(v for k, v in shares.items() if k != "samples_count") == pytest.approx(1)
        assert shares["samples_count"] >= 20

    (tmp_path / "slow").touch()
    before = len(hardware_shares(ingest))
    wait_until(lambda: verdicts(ingest), 8 * WINDOW_S + 10, "the straggler named")
    said = verdicts(ingest)
    assert len(said) == 1
    assert said[0].startswith("[sidecar] rank 1 is the straggler: ranks 0, 2 wait for it in "
                              "all_reduce "), said
    # the windows since: rank 1 waits little, the others much
    slow_windows = hardware_shares(ingest)[before + 1:]
    assert slow_windows
    for shares in slow_windows:
        assert shares[1]["collective"] < 0.2, slow_windows
        assert min(shares[0]["collective"], shares[2]["collective"]) > 0.4, slow_windows

    (tmp_path / "slow").unlink()
    wait_until(lambda: any("no rank is the straggler any more" in line
                           for line in ingest.log_lines()), 8 * WINDOW_S + 10,
               "the straggler's end said")
    assert len(verdicts(ingest)) == 2  # said once, and its end once


# One process whose DataLoader workers take 50 ms an item; the step takes 5 ms.
STARVED = r'''
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        time.sleep(0.05)
        return torch.ones(4)


def step(batch):
    end = time.perf_counter() + 0.005
    while time.perf_counter() < end:
        pass


if __name__ == "__main__":
    for batch in DataLoader(Slow(), batch_size=1, num_workers=2):
        step(batch)
        if os.path.exists(sys.argv[1]):
            break
'''


@needs_py_spy
def test_a_starving_data_loader_is_said_input_bound_and_profile_shows_its_workers(
        ingest: RunningIngest, tmp_path: Path) -> None:
    (tmp_path / "starved.py").write_text(STARVED)
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                       SIDECAR_STATUS_ADDR="127.0.0.1:0", OMP_NUM_THREADS="1")
    proc = Sidecar(["run", "--time-window", str(WINDOW_S), "--", sys.executable,
                    str(tmp_path / "starved.py"), str(tmp_path / "stop")], env, tmp_path / "sc")
    try:
        wait_until(lambda: verdicts(ingest), 60, "input-bound said")
        said = verdicts(ingest)
        assert said[0].startswith("[sidecar] rank 0 is input-bound: the main thread waits for "
                                  "its next batch in "), said
        assert "its 2 data-loader worker processes use " in said[0], said
        # the workers are sampled once the rank waits for them: what they do is said too
        assert "their main threads most in Slow.__getitem__ (starved.py:" in said[0], said
        # the first window holds the import of torch: compute
        assert hardware_shares(ingest)[-1][0]["data"] > 0.5, hardware_shares(ingest)

        status_env = {k: v for k, v in env.items() if k != "SIDECAR_STATUS_ADDR"}
        shown = subprocess.run([*SIDECAR, "status", "--once", "--state-dir",
                                str(tmp_path / "state")], env=status_env,
                               capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        assert "TIME" in shown.stdout and "input-bound" in shown.stdout, shown.stdout

        profiled = subprocess.run([*SIDECAR, "profile", "--seconds", "2", "--state-dir",
                                   str(tmp_path / "state")], env=status_env,
                                  capture_output=True, text=True, timeout=60)
        assert profiled.returncode == 0, profiled.stderr
        out = profiled.stdout
        assert "rank 0" in out and "data" in out, out
        assert "__getitem__" in out, out  # the workers' hottest frame: the dataset's item
        doc: dict[str, Any] = json.loads(subprocess.run(
            [*SIDECAR, "profile", "--seconds", "1", "--json", "--state-dir",
             str(tmp_path / "state")], env=status_env, capture_output=True, text=True,
            timeout=60).stdout)
        assert doc["ranks"][0]["shares"]["data"] > 0.5, doc
    finally:
        (tmp_path / "stop").touch()
        done = proc.wait(60)
    assert done.status == 0, done.stderr


# -- the verdicts, judged on windows made by hand --------------------------------------------

def tally(rank: int, samples: int = 300, **shares: float) -> Tally:
    """A rank's window: `shares` of its samples in those categories, the rest compute."""
    made = Tally(rank, 1000 + rank)
    left = samples
    for category, share in shares.items():
        count = round(share * samples)
        made.counts[category] += count
        made.places[category][f"{'all_reduce' if category == 'collective' else category} <- "
                              "step (trainer.py:9)"] += count
        left -= count
    made.counts["compute"] += left
    made.places["compute"]["step (trainer.py:9)"] += left
    return made


def window(*tallies: Tally, workers: dict[int, tuple[int, float]] | None = None) -> ShareWindow:
    return ShareWindow(60, 5, 0.0, {t.rank: t for t in tallies}, workers or {})


def judged(windows: list[ShareWindow], multi_node: bool = False) -> list[str]:
    said: list[str] = []
    judge = Verdicts(said.append, "gpu-07", multi_node, lambda: "GPUs 0-7: 97 % utilisation")
    for each in windows:
        judge(each)
    return said


def test_a_straggler_is_said_after_two_windows_once_and_its_end_once() -> None:
    slow = window(tally(0, collective=0.41), tally(1, collective=0.45), tally(2, collective=0.4),
                  tally(3, collective=0.38), tally(4, collective=0.44),
                  tally(5, collective=0.03), tally(6, collective=0.42),
                  tally(7, collective=0.39))
    balanced = window(*(tally(r, collective=0.1) for r in range(8)))
    assert judged([slow]) == []  # one window is one slow batch
    said = judged([slow, slow, slow, balanced])
    assert said == [
        "[sidecar] rank 5 is the straggler: ranks 0-4, 6-7 wait for it in all_reduce 41 % of "
        "their time, rank 5 waits 3 %; GPUs 0-7: 97 % utilisation",
        "[sidecar] no rank is the straggler any more: the ranks wait for each other alike"]
    # another rank takes its place: its end, then the new one once it held two windows
    other = window(*(tally(r, collective=0.02 if r == 2 else 0.4) for r in range(8)))
    said = judged([slow, slow, other, other])
    assert [line.split(":")[0] for line in said] == [
        "[sidecar] rank 5 is the straggler", "[sidecar] rank 5 is no longer the straggler",
        "[sidecar] rank 2 is the straggler"]


@pytest.mark.parametrize("shares", [
    (0.30, 0.33, 0.28),  # balanced ranks, each waiting for the others alike
    (0.51, 0.46, 0.85),  # a noisy window of three busy ranks sharing two cores
    (0.12, 0.01, 0.15),  # one rank waits least, but nobody waits much
    (0.40, 0.25, 0.45),  # a rank that waits less, not a third as much
])
def test_balanced_or_noisy_ranks_get_no_verdict(shares: tuple[float, ...]) -> None:
    each = window(*(tally(r, collective=s) for r, s in enumerate(shares)))
    assert judged([each] * 4) == []


def test_every_local_rank_waiting_names_another_node_only_on_a_multi_node_run() -> None:
    waiting = window(*(tally(r, collective=0.5 + (r - 8) / 100) for r in range(8, 12)))
    assert judged([waiting] * 3) == []  # one node: nothing to say where the slow one is
    said = judged([waiting] * 3, multi_node=True)
    assert len(said) == 1
    assert said[0].startswith("[sidecar] every rank on this node (gpu-07: ranks 8-11) waits in "
                              "collectives (all_reduce) 50-53 % of its time: the rank they wait "
                              "for is on another node"), said


def test_input_bound_names_the_workers_cpu_or_their_absence() -> None:
    starved = window(tally(0, data=0.64), workers={0: (4, 3.9)})
    assert Verdicts.starving(starved) == {0}  # the next window samples its workers
    starved.tallies[0].workers.update({"decode (dataset.py:30)": 90, "get (queue.py:180)": 10})
    said = judged([starved, starved])
    assert said == ["[sidecar] rank 0 is input-bound: the main thread waits for its next batch "
                    "in data 64 % of its time; its 4 data-loader worker processes use 3.9 cores "
                    "of CPU, their main threads most in decode (dataset.py:30) (90 %); GPUs 0-7: "
                    "97 % utilisation"]
    inline = window(tally(0, data=0.3))
    assert "it loads its batches in its main process (no worker process)" in \
        judged([inline, inline])[0]
    assert judged([window(tally(0, data=0.15))] * 3) == []  # below 20 %: not said


def test_checkpoint_saves_are_judged_over_the_last_ten_windows() -> None:
    quiet = window(tally(0), tally(1))
    saving = window(tally(0, checkpoint=0.9), tally(1, checkpoint=0.9))
    # a save of most of a window, every tenth window: 9 % of the time, not said
    assert judged([saving, *[quiet] * 9, saving, *[quiet] * 9]) == []
    # every fourth window: 18-27 % of the last ten, said once ten are in and it held two
    said = judged([saving, *[quiet] * 3] * 3)
    assert said == ["[sidecar] checkpoint saves took 18 % of the time of ranks 0-1 over the "
                    "last 600 s (in checkpoint)"]


def test_a_window_with_too_few_samples_is_not_judged() -> None:
    few = window(tally(0, samples=10, collective=0.6), tally(1, samples=10))
    assert judged([few] * 4) == []


def test_py_spys_raw_output_is_read_by_thread_and_process() -> None:
    made = Tally(0, 12)
    parse_raw(
        'process 12:"python trainer.py";thread (12): MainThread;<module> (/w/trainer.py:11);'
        'all_reduce (/v/site-packages/torch/distributed/distributed_c10d.py:2501) 7\n'
        'process 12:"python trainer.py";thread (12): MainThread;<module> (/w/trainer.py:11);'
        'step (/w/trainer.py:4) 3\n'
        'process 12:"python trainer.py";thread (13): Thread-1 (beat);beat (/w/trainer.py:2) 10\n'
        # a thread whose name py-spy could not read (a process that is not its child)
        'thread (12);<module> (/w/trainer.py:11);step (/w/trainer.py:4) 2\n'
        'process 12:"python trainer.py";process 14:"python trainer.py";thread (14): MainThread;'
        '__getitem__ (/w/data.py:5) 4\n'
        'process 12:"python trainer.py";process 14:"python trainer.py";thread (15): Thread-2;'
        'wait (/usr/lib/python3.11/threading.py:327) 4\n'
        'a line py-spy never writes\n', made)
    assert made.counts == {"collective": 7, "compute": 5}  # the main thread's only
    assert made.places["collective"] == {"all_reduce <- <module> (trainer.py:11)": 7}
    assert made.workers == {"__getitem__ (data.py:5)": 4}  # a worker's main thread only


def fake_tool(tmp_path: Path, body: str) -> str:
    tool = tmp_path / "py-spy"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return str(tool)


async def sample_until_said(tool: str | None, caplog: pytest.LogCaptureFixture,
                            windows: int = 3) -> tuple[TimeSampler, list[str]]:
    """A sampler of this process (rank 0) run for `windows` looks, and what it said."""
    caplog.set_level(logging.INFO, logger="sidecar")
    me = [Process(os.getpid(), os.getppid(), "python", {"RANK": "0"})]
    emitted: list[list[dict[str, Any]]] = []
    looks = 0

    def processes() -> list[Process]:
        nonlocal looks
        looks += 1
        return me

    sampler = TimeSampler(2, processes, emitted.append, lambda window: None, list, tool)
    task = asyncio.ensure_future(sampler.run())
    try:
        async with asyncio.timeout(30):
            while looks <= windows and not task.done():
                await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sampler.close()
    assert emitted == []
    return sampler, [r.getMessage() for r in caplog.records if "is not sampled" in r.getMessage()]


async def test_where_it_cannot_look_it_says_so_once_and_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    refused = fake_tool(tmp_path, "echo 'Error: Failed to get process executable name. Check "
                                  "that the process is running.' >&2\necho 'Caused by: "
                                  "Permission denied (os error 13)' >&2; exit 1")
    sampler, said = await sample_until_said(refused, caplog)
    assert said == ["where the time of rank 0 goes is not sampled: refused: ptrace is not "
                    "allowed here; give the sidecar CAP_SYS_PTRACE "
                    "(docs/time.md#where-it-cannot-look); the rest goes on"]
    assert sampler.to_json()["cannot"] == "refused: ptrace is not allowed here"
    caplog.clear()
    _, said = await sample_until_said(None, caplog, windows=0)
    assert said == ["where the time goes is not sampled: py-spy is not installed here "
                    "(docs/time.md#where-it-cannot-look); the rest goes on"]


# A rank a launcher started beside the sidecar: RANK in its environment, its step a busy loop.
RANKED = r'''
import time
def step():
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        pass
while True:
    step()
    time.sleep(0.01)
'''


@needs_py_spy
def test_watch_samples_the_ranks_it_sees_with_nothing_else_to_follow(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """`watch` with --hardware-interval 0 and no file: the ranks' time is reason enough."""
    rank = subprocess.Popen([sys.executable, "-c", RANKED], env=dict(os.environ, RANK="3"))
    env = platform_env(ingest, tmp_path / "state")
    proc = Sidecar(["watch", "--hardware-interval", "0", "--time-window", str(WINDOW_S)], env,
                   tmp_path / "sc")
    try:
        wait_until(lambda: bool(hardware_shares(ingest)), 30, "rank 3's shares")
    finally:
        proc.proc.terminate()
        done = proc.wait(30)
        rank.kill()
        rank.wait()
    assert done.status == 0, done.stderr
    shares = hardware_shares(ingest)[0]
    assert list(shares) == [3] and shares[3]["compute"] > 0.2, shares


def test_a_rank_that_begins_with_a_shell_is_read_at_its_python(tmp_path: Path) -> None:
    """`srun bash -c 'python train.py'`, `timeout`, a train.sh: RANK is on the shell, and the
    trainer is the Python beneath it; its own children are its workers."""
    (tmp_path / "ranked.py").write_text(RANKED)
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} {tmp_path / 'ranked.py'}; true"],
                             env=dict(os.environ, RANK="5"))
    try:
        found: list[tuple[int, Process, list[int]]] = []

        def the_python_is_there() -> bool:
            found[:] = ranks_of(processes_of(shell.pid))
            return bool(found) and found[0][1].pid != shell.pid

        wait_until(the_python_is_there, 10, "the shell's Python")
        ((rank, trainer, workers),) = found
        assert rank == 5 and trainer.ppid == shell.pid and workers == []
    finally:
        shell.kill()
        subprocess.run(["pkill", "-f", str(tmp_path / "ranked.py")], check=False)
        shell.wait()


async def test_no_rank_in_view_is_said_only_once_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    """A launcher starts its ranks late and a command that exits leaves none: neither is said;
    a `watch` that never sees a rank (no shared process namespace) is, once."""
    caplog.set_level(logging.INFO, logger="sidecar")
    looks = 0

    def processes() -> list[Process]:
        nonlocal looks
        looks += 1
        return []

    sampler = TimeSampler(2, processes, lambda points: None, lambda window: None, list,
                          "py-spy")
    sampler.window_s = 0.05  # type: ignore[assignment]  # looks in quick succession
    task = asyncio.ensure_future(sampler.run())

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "in view" in r.getMessage()]

    try:
        async with asyncio.timeout(10):
            while looks < 2:
                await asyncio.sleep(0.01)
            assert said() == []  # two looks: a launcher still starting its ranks
            while looks < 6:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert len(said()) == 1, said()
