"""Where each rank's time goes, read from outside (docs/time.md): real torch.distributed ranks
(gloo) under the real torchrun, balanced, then one of them three times slower, then balanced
again; a DataLoader whose workers cannot keep up; `sidecar profile` on a running job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.stacks import find_tool
from tests.conftest import SIDECAR, Sidecar, platform_env
from tests.ingest_server import RunningIngest, wait_until

pytestmark = pytest.mark.skipif(find_tool() is None, reason="py-spy is not installed")

# Each rank computes (a busy loop, as a CPU-bound step is) then all-reduces; rank 1 computes
# three times longer while the file `slow` exists. Each step's time goes to steps-<rank>.
STEPS = r'''
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
slow, stop = sys.argv[1], sys.argv[2]
total = torch.ones(1)


def compute(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


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
