"""A hung job's stacks, taken from outside: real torch.distributed (gloo, two ranks), rank 1 held in
a function of its own while rank 0 waits for it in all_reduce (docs/stalls.md)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.stacks import RankClock, find_tool
from sidecar.stall import StallWatch
from tests.conftest import RUN_ID, SIDECAR, Sidecar, platform_env
from tests.ingest_server import RunningIngest, wait_until

# Two ranks as a launcher starts them: RANK and LOCAL_RANK in each one's environment.
LAUNCH = r'''
import os, socket, subprocess, sys
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ranks = [subprocess.Popen([sys.executable, *sys.argv[1:]], env=dict(
    os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
    MASTER_PORT=str(port))) for r in range(2)]
sys.exit(max(p.wait() for p in ranks))
'''

# A heartbeat until the process group is up: the import and the rendezvous are no stall.
HANG = r'''
import os, sys, threading, time
up = threading.Event()
threading.Thread(target=lambda: [print("starting", flush=True) for _ in iter(
    lambda: up.wait(0.5), True)], daemon=True).start()
import torch
import torch.distributed as dist


def rank_one_is_elsewhere(release):
    while not os.path.exists(release):
        time.sleep(0.05)


dist.init_process_group("gloo")
up.set()
rank = dist.get_rank()
print(f"[rank{rank}]: step 1", flush=True)
if rank == 1:
    rank_one_is_elsewhere(sys.argv[1])
total = torch.ones(1)
dist.all_reduce(total)
print(f"[rank{rank}]: done {total.item():g}", flush=True)
dist.destroy_process_group()
'''

pytestmark = pytest.mark.skipif(find_tool() is None, reason="py-spy is not installed")

RANK0 = re.compile(r"^\[sidecar\]   rank 0: all_reduce( \[[^]]+\])? <- <module> \(hang\.py:\d+\)$")
RANK1 = re.compile(r"^\[sidecar\]   rank 1: rank_one_is_elsewhere \(hang\.py:\d+\)$")


def block(lines: list[str], heading: str) -> list[str]:
    """The lines of the stacks block whose heading contains `heading`."""
    for i, line in enumerate(lines):
        if line.startswith("[sidecar] stacks of") and heading in line:
            end = i + 1
            while end < len(lines) and lines[end].startswith("[sidecar]   "):
                end += 1
            return lines[i:end]
    return []


@pytest.fixture
def hung(ingest: RunningIngest, tmp_path: Path) -> Iterator[tuple[Sidecar, Path]]:
    """The two ranks under `sidecar run`, and the file that releases rank 1. Released and
    stopped at the end whatever the test found: ranks left waiting would outlive the suite."""
    (tmp_path / "hang.py").write_text(HANG)
    release = tmp_path / "release"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_STATUS_ADDR="127.0.0.1:0",
                       SIDECAR_HARDWARE_INTERVAL="0")
    proc = Sidecar(["run", "--stall-after", "3", "--", sys.executable, "-c", LAUNCH,
                    str(tmp_path / "hang.py"), str(release)], env, tmp_path / "sc")
    try:
        yield proc, release
    finally:
        release.touch()
        if proc.proc.poll() is None:
            proc.proc.terminate()
            try:
                proc.proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.proc.kill()


def test_at_a_stall_one_block_names_each_rank_where_it_is_and_the_run_goes_on(
        ingest: RunningIngest, tmp_path: Path, hung: tuple[Sidecar, Path]) -> None:
    proc, release = hung
    wait_until(lambda: block(ingest.log_lines(), "at the stall"), 60, "the stacks block")
    lines = block(ingest.log_lines(), "at the stall")
    assert "3 processes" in lines[0] and "/stacks/last" in lines[0], lines
    assert any(RANK0.match(line) for line in lines), lines
    assert any(RANK1.match(line) for line in lines), lines
    assert any(re.match(r"\[sidecar\]   PID \d+ python[\d.]*: .*\(<string>:\d+\)$", line)
               for line in lines), lines  # the launcher, without a rank
    assert any(re.search(r"last output by rank \(UTC\): rank \d at [\d:]+ \(quiet first\), "
                         r"rank \d at", line) for line in lines), lines
    all_lines = ingest.log_lines()
    assert all_lines.index(lines[0]) > next(
        i for i, line in enumerate(all_lines) if "no output and no new metric step" in line)
    # the full dump in the state folder
    dumps = list((tmp_path / "state" / RUN_ID / "stacks").glob("*-stall.json"))
    assert len(dumps) == 1
    doc = json.loads(dumps[0].read_text())
    assert sorted(p["rank"] for p in doc["processes"] if p["rank"] is not None) == [0, 1]

    # on demand, through the status endpoint
    env = platform_env(ingest, tmp_path / "state")
    asked = subprocess.run([*SIDECAR, "stacks", "--full"], env=env, capture_output=True,
                           timeout=60, check=False)
    out = asked.stdout.decode()
    assert asked.returncode == 0, asked.stderr.decode()
    assert re.search(r"^  rank 0: all_reduce", out, re.M), out
    assert re.search(r"^  rank 1: rank_one_is_elsewhere \(hang\.py:\d+\)$", out, re.M), out
    assert "    rank_one_is_elsewhere (hang.py:" in out  # --full: the frames

    # the run was neither slowed nor killed: released, it finishes
    release.touch()
    done = proc.wait(60)
    assert done.status == 0, done.stderr.decode()
    # the block in the sidecar's own stderr too, where a terminal or `kubectl logs` shows it,
    # naming the dump file, after the stall's WARNING
    said = [line.split(" WARNING ", 1)[1] for line in done.stderr.decode().splitlines()
            if " WARNING " in line]
    [heading] = [i for i, line in enumerate(said) if line.startswith("stacks of 3 processes")]
    assert str(dumps[0]) in said[heading]
    assert any(RANK0.match("[sidecar] " + line) for line in said[heading:]), said
    assert any(RANK1.match("[sidecar] " + line) for line in said[heading:]), said
    assert heading > next(i for i, line in enumerate(said) if "no output and no new" in line)
    # both ranks' last lines, wherever a chunk put them (two processes write the one pipe)
    wait_until(lambda: all(done_line in "\n".join(ingest.log_lines())
                           for done_line in ("[rank0]: done 2", "[rank1]: done 2")),
               10, "both ranks' last lines")
    assert len([line for line in ingest.log_lines() if line.startswith("[sidecar] stacks of")]) == 1


def test_a_sigterm_to_a_stalled_run_takes_the_stacks_first_and_the_summary_names_them(
        ingest: RunningIngest, hung: tuple[Sidecar, Path]) -> None:
    proc, _ = hung
    # at once: the stall's own look may still be under way (its native pass takes seconds)
    wait_until(lambda: any("no output and no new metric step" in line
                           for line in ingest.log_lines()), 60, "the stall")
    proc.proc.send_signal(signal.SIGTERM)
    done = proc.wait(60)
    assert done.status == 128 + signal.SIGTERM or done.status != 0
    lines = ingest.log_lines()
    sigterm = block(lines, "at SIGTERM")
    assert sigterm, lines
    assert any(RANK0.match(line) for line in sigterm), sigterm
    assert any(RANK1.match(line) for line in sigterm), sigterm
    summary = next(line for line in lines if line.startswith("[sidecar] run failed"))
    assert "stalled for" in summary and "at SIGTERM: " in summary, summary
    assert re.search(r"rank 1: rank_one_is_elsewhere \(hang\.py:\d+\)", summary), summary
    assert lines.index(sigterm[0]) < lines.index(summary)
    assert b"taking the command's stacks first" in done.stderr


def test_without_py_spy_the_stall_line_is_todays(ingest: RunningIngest, tmp_path: Path) -> None:
    """An image without the tool: the stall is said as before, one line in our log says why
    there are no stacks, and nothing else changes."""
    # an interpreter of this environment's packages without py-spy beside it, nor on PATH
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (venv / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).resolve().parent}\n")
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                       PATH="/usr/bin:/bin")
    env["PYTHONPATH"] = f"{env.get('PYTHONPATH', '')}:{site}"
    script = "import time; print('x', flush=True); time.sleep(4); print('y', flush=True)"
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "sidecar", "run", "--stall-after",
                           "1", "--", sys.executable, "-c", script], env=env,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()
    lines = ingest.log_lines()
    assert any("no output and no new metric step" in line for line in lines), lines
    assert not any(line.startswith("[sidecar] stacks") for line in lines)
    assert b"py-spy is not installed here" in done.stderr


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("gaps", "said_after"), [
    ((), 1800.0),  # no cadence yet: the old default
    ((2.0, 2.0, 2.0), 120.0),  # a step every 2 s: 2 minutes, well under NCCL's 10
    ((2.0, 60.0, 2.0), 180.0),  # a checkpoint took a minute once: 3 x that
    ((3600.0,), 3 * 3600.0),  # a print an hour: three hours
])
def test_the_default_is_the_runs_own_cadence(gaps: tuple[float, ...], said_after: float) -> None:
    said: list[str] = []
    clock = Clock()
    watch = StallWatch(None, said.append, lambda: "no GPU", clock)
    clock.now += 500  # the start-up before the first output is no cadence
    watch.activity()
    for gap in gaps:
        clock.now += gap
        watch.activity()
    assert watch.threshold_s == said_after
    clock.now += said_after - 1
    watch.check()
    assert said == []
    clock.now += 1
    watch.check()
    assert len(said) == 1
    explicit = StallWatch(30, said.append, lambda: "no GPU", clock)
    clock.now += 1
    explicit.activity()
    clock.now += 3600
    explicit.activity()
    assert explicit.threshold_s == 30  # --stall-after wins


def test_rank_clock_reads_torchrun_and_pytorch_prefixes() -> None:
    clock = Clock()
    ranks = RankClock(clock)
    ranks.feed(b"[rank0]: step 1\n[rank1]: step 1\n")
    clock.now += 5
    ranks.feed(b"[default0]: step 2\nno prefix [rank7]: here\n")
    assert ranks.last == {0: 1005.0, 1: 1000.0}
    assert ranks.line().startswith("last output by rank (UTC): rank 1 at ")
    assert "(quiet first), rank 0 at" in ranks.line()


def test_rank_clock_reads_two_ranks_whose_writes_interleave_on_one_line() -> None:
    """Unbuffered, Python writes a print's text and its newline apart: two ranks on one pipe
    give `[rank0]: step 1[rank1]: step 1\n\n` (seen under load). The second rank is read, and
    a prefix-like text of another form in a rank's line (`loss[3]:`) is not a rank."""
    clock = Clock()
    ranks = RankClock(clock)
    ranks.feed(b"starting\n[rank0]: step 1[rank1]: step 1\n\n[rank2]: loss[3]: 0.5\n")
    assert ranks.last == {0: 1000.0, 1: 1000.0, 2: 1000.0}
    ranks.feed(b"[default4]: a[default5]: b\n")
    assert set(ranks.last) == {0, 1, 2, 4, 5}


SLEEPER = r'''
import sys, time


def waiting_for_data():
    print("ready", flush=True)
    time.sleep(120)


waiting_for_data()
'''


def test_watch_reads_the_ranked_processes_it_can_see(ingest: RunningIngest,
                                                     tmp_path: Path) -> None:
    """`watch` has no command: it looks at the processes a launcher gave a RANK. Where ptrace is
    refused (a sibling under Yama 1, without CAP_SYS_PTRACE) one line says so instead."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.5}\n')
    rank = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE,
                            env={**os.environ, "RANK": "0"})
    try:
        assert rank.stdout is not None
        rank.stdout.readline()
        env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
        proc = Sidecar(["watch", "--jsonl", str(metrics), "--stall-after", "1"], env,
                       tmp_path / "watch")

        def said() -> list[str]:
            lines = ingest.log_lines()
            return [line for line in lines if re.match(
                r"\[sidecar\]   rank 0: waiting_for_data \(<string>:\d+\)$", line)
                or "cannot be taken: ptrace is not allowed here" in line]

        wait_until(said, 60, "the stacks block, or why it cannot be had")
        proc.proc.terminate()
        assert proc.wait(30).status == 0
    finally:
        rank.kill()
        rank.wait()


def frame(name: str, filename: str, line: int = 1, module: str | None = None) -> dict[str, object]:
    """A frame as py-spy's JSON has it (`module`: a native frame's library)."""
    short = (filename.split("site-packages/")[-1] if "site-packages/" in filename
             else filename.rsplit("/", 1)[-1])
    return {"name": name, "filename": filename, "short_filename": short, "line": line,
            "module": module}


def thread(pid: int, *frames: dict[str, object]) -> dict[str, object]:
    return {"os_thread_id": pid, "active": False, "frames": list(frames)}


SITE = "/venv/lib/python3.11/site-packages/"


def test_the_summary_groups_ranks_by_where_they_are_and_names_workers_by_their_parent() -> None:
    from sidecar.stacks import Process, Stacks

    procs = [Process(100, 1, "python", {})]
    procs[0].threads = [thread(100, frame("_poll", "/usr/lib/python3.11/subprocess.py", 9),
                               frame("main", "launch.py", 5))]
    for rank in range(8):
        process = Process(200 + rank, 100, "python", {"RANK": str(rank)})
        if rank == 7:
            inner = [frame("_next_data", SITE + "torch/utils/data/dataloader.py", 1524)]
        else:
            inner = [frame("clock_nanosleep", "/lib/libc.so.6", 0, "/lib/libc.so.6"),
                     frame("c10d::Work::wait", "libtorch_cpu.so", 0, "/x/libtorch_cpu.so"),
                     frame("all_reduce", SITE + "torch/distributed/distributed_c10d.py", 3252),
                     frame("wrapper", SITE + "torch/distributed/c10d_logger.py", 83)]
        process.threads = [thread(200 + rank, *inner, frame("step", "train.py", 88))]
        procs.append(process)
    worker = Process(300, 200, "pt_data_worker", {"RANK": "0"})
    worker.threads = [thread(300, frame("get", "/usr/lib/python3.11/queue.py", 180),
                             frame("_worker_loop", SITE + "torch/utils/data/_utils/worker.py"))]
    shell = Process(400, 100, "bash", {})
    shell.error = "not a Python process"
    gone = Process(401, 100, "python", {"RANK": "9"})
    gone.error = "exited meanwhile"
    stacks = Stacks("stall", 0.0, [*procs, worker, shell, gone], 0.1)
    assert stacks.summary() == [
        "ranks 0-6: all_reduce [c10d::Work::wait] <- step (train.py:88)",
        "rank 7: _next_data <- step (train.py:88)",
        "rank 9: (exited meanwhile)",
        "worker of rank 0 (PID 300): get (queue.py:180)",  # no frame of the trainer's own
        "PID 100 python: _poll <- main (launch.py:5)",
        "1 process not a Python process, not shown",
    ]


def fake_tool(tmp_path: Path, body: str) -> str:
    tool = tmp_path / "py-spy"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return str(tool)


async def test_a_dump_that_takes_too_long_is_abandoned_and_a_refusal_is_said_once(
        tmp_path: Path) -> None:
    import time as clock

    from sidecar.stacks import Process, StackTaker

    hung = StackTaker(lambda: [Process(os.getpid(), 1, "python", {"RANK": "0"})], None,
                      tool=fake_tool(tmp_path, "exec sleep 30"))
    started = clock.monotonic()
    taken = await hung.take("stall", timeout_s=0.5)
    assert taken is not None and clock.monotonic() - started < 10
    assert taken.processes[0].error == "py-spy took more than 0.5 s: abandoned"
    refusing = StackTaker(lambda: [Process(os.getpid(), 1, "python", {"RANK": "0"})], None,
                          tool=fake_tool(tmp_path, "echo 'Error: Permission denied (os error "
                                         "13)' >&2; exit 1"))
    first = await refusing.take("stall", timeout_s=5)
    assert first is not None
    assert refusing.block(first, "at the stall") == [
        "[sidecar] stacks at the stall cannot be taken: ptrace is not allowed here (py-spy was "
        "refused; give the sidecar CAP_SYS_PTRACE, docs/stalls.md#where-it-cannot-look)"]
    second = await refusing.take("stall", timeout_s=5)
    assert second is not None and refusing.block(second, "at the stall") == []  # once
    assert second.to_json()["refused"].startswith("[sidecar] stacks cannot be taken")


def test_a_dump_kept_in_the_state_folder_holds_no_secret(tmp_path: Path) -> None:
    """A trainer whose function is named after the token (or whose script's path holds it):
    the real py-spy's dump, kept in the run's folder, shows it masked."""
    from sidecar.masking import secrets
    from sidecar.stacks import Process, StackTaker

    token = "tokSecretValue0123456789"
    secrets.add(token)
    script = tmp_path / f"train_{token}.py"
    script.write_text(f"import time\ndef step_{token}():\n    time.sleep(60)\n"
                      "print('ready', flush=True)\nstep_" + token + "()\n")
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        taker = StackTaker(lambda: [Process(child.pid, os.getpid(), "python", {"RANK": "0"})],
                           tmp_path / "run")
        taken = asyncio.run(taker.take("stall", timeout_s=20))
    finally:
        child.kill()
        child.wait()
    assert taken is not None and taken.file is not None, taken
    kept = taken.file.read_text()
    assert "step_***" in kept and "train_***" in kept
    assert token not in kept


def test_a_sigterm_under_torchrun_is_named_as_sigterm_whatever_torchrun_prints(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Real gloo ranks under the real torchrun, stalled, then SIGTERM to `sidecar run`:
    torchrun turns the signal into its own SignalException traceback on the way out. The
    summary says `killed by SIGTERM` and the stall before it (it said `Python exception
    ...SignalException`), and the shutdown's output is not taken for the run resuming."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed")
    (tmp_path / "hang.py").write_text(HANG)
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                       PATH=f"{torchrun.parent}:{os.defpath}")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = Sidecar(["run", "--stall-after", "3", "--", str(torchrun), "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(port),
                    str(tmp_path / "hang.py"),
                    str(tmp_path / "never")], env, tmp_path / "sc")
    try:
        wait_until(lambda: any("no output and no new metric step" in line
                               for line in ingest.log_lines()), 90, "the stall")
        proc.proc.send_signal(signal.SIGTERM)
        done = proc.wait(90)
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
    assert done.status != 0
    lines = ingest.log_lines()
    summary = next(line for line in lines if line.startswith("[sidecar] run failed"))
    assert "likely cause: killed by SIGTERM; stalled for " in summary, summary
    assert not any("output resumed" in line for line in lines), lines
    assert b"output resumed" not in done.stderr
