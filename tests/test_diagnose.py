"""`sidecar run` says why a run failed: real children, real signals, real HTTP over loopback."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.diagnose import diagnose
from sidecar.node import Node
from sidecar.sources.console.signatures import Scanner
from sidecar.sources.telemetry.cgroup import OomKill, own_memory_cgroups
from sidecar.sources.telemetry.gpus import choose_gpus
from sidecar.sources.telemetry.nvml.xid import XidEvent
from tests.conftest import RUN_ID, Sidecar, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until
from tests.test_hardware import TWO_GPUS, stub_dir  # noqa: F401 (stub_dir: a fixture)

OOM_TRACEBACK = r'''
import sys
for i in range(10000):
    print(f"step {i} loss {1 / (i + 1):.4f}")
sys.stdout.flush()
sys.stderr.write("""Traceback (most recent call last):
  File "/work/train.py", line 88, in <module>
    loss.backward()
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 525, in backward
    torch.autograd.backward(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
capacity of 79.10 GiB of which 1.06 GiB is free. Of the allocated memory 75.21 GiB is allocated \
by PyTorch, and 1.29 GiB is reserved by PyTorch but unallocated.
""")
sys.exit(1)
'''

# torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp's watchdog and handleException lines, as a
# PyTorch 2.x rank logs them before the watchdog aborts the process (SIGABRT).
NCCL_WATCHDOG = r'''
import os, sys
sys.stderr.write(
    "[rank3]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 3] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=4187, OpType=ALLREDUCE, NumelIn=262144, "
    "NumelOut=262144, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.\n"
    "[rank3]:[E1218 20:27:21.427113201 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 3] Exception "
    "(either an error or timeout) detected by watchdog at work: 4187, last enqueued NCCL work: "
    "4187, last completed NCCL work: 4186.\n"
    "[rank3]:[E1218 20:27:21.427201044 ProcessGroupNCCL.cpp:577] [Rank 3] Some NCCL operations "
    "have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU "
    "operations might run on corrupted/incomplete data.\n"
    "terminate called after throwing an instance of 'c10::DistBackendError'\n")
sys.stderr.flush()
os.abort()
'''

SEGFAULT = "import ctypes; print('loading batch', flush=True); ctypes.string_at(0)"

VALUE_ERROR = r'''
def main():
    raise ValueError("learning rate must be positive, got -0.1")
print("configuring", flush=True)
main()
'''


def summary(ingest: RunningIngest) -> str:
    lines = [line for line in ingest.log_text().splitlines() if "[sidecar] run failed" in line]
    assert len(lines) == 1, lines
    return lines[0]


def run(ingest: RunningIngest, tmp_path: Path, command: list[str], *args: str) -> int:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", *args, "--", *command], env,
                   tmp_path / "sc")
    assert [r["event"] for r in ingest.records("lifecycle")][-1] == "failed"
    assert "run failed: exit status" in done.stderr.decode()  # the same facts in our own log
    return done.status


def test_cuda_oom_traceback(ingest: RunningIngest, tmp_path: Path) -> None:
    assert run(ingest, tmp_path, python_child(OOM_TRACEBACK)) == 1
    line = summary(ingest)
    assert line.startswith("[sidecar] run failed: exit status 1 after ")
    assert ('likely cause: CUDA out of memory (stderr: "torch.OutOfMemoryError: CUDA out of '
            'memory. Tried to allocate 2.00 GiB.') in line
    assert line.endswith(' ..."))') or line.endswith('")')
    assert ingest.log_text().rstrip("\n").endswith(line)  # the last line before the end event


@pytest.mark.parametrize("shell", [
    'exec 2>&1; exec "$0" "$@"',  # the command's stderr on its stdout
    'set -o pipefail; "$0" "$@" 2>&1 | cat'])  # or through a pipe (`| tee` alike)
def test_a_traceback_on_stdout_is_named(ingest: RunningIngest, tmp_path: Path,
                                        shell: str) -> None:
    assert run(ingest, tmp_path, ["bash", "-c", shell, *python_child(OOM_TRACEBACK)]) == 1
    assert ('likely cause: CUDA out of memory (stdout: "torch.OutOfMemoryError: CUDA out of '
            'memory. Tried to allocate 2.00 GiB.') in summary(ingest)


def test_stderr_is_quoted_before_stdout() -> None:
    scanner = Scanner()
    scanner.feed("stdout", b"RuntimeError: CUDA error: out of memory\n")
    scanner.feed("stderr", b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n")
    scanner.feed("stdout", b"RuntimeError: CUDA error: out of memory, again\n")
    failure = diagnose(1, 5.0, scanner, Node("n0", 0))
    assert (failure.signature, failure.stream) == ("cuda_oom", "stderr")
    assert failure.quote == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    assert scanner.counts["cuda_oom"] == 3


def test_the_last_line_on_stdout_when_stderr_has_none() -> None:
    scanner = Scanner()
    scanner.feed("stdout", b"loading\nconfig.yaml: no such key 'lr'\n")
    failure = diagnose(2, 1.0, scanner, Node("n0", 0))
    assert (failure.cause, failure.quote) == ("the last line on stdout",
                                              "config.yaml: no such key 'lr'")


def test_nccl_watchdog_timeout_then_sigabrt(ingest: RunningIngest, tmp_path: Path) -> None:
    assert run(ingest, tmp_path, python_child(NCCL_WATCHDOG)) == 134
    line = summary(ingest)
    assert "exit status 134" in line
    assert 'likely cause: NCCL watchdog timeout (stderr: "[rank3]:[E1218' in line


def test_segfault(ingest: RunningIngest, tmp_path: Path) -> None:
    assert run(ingest, tmp_path, python_child(SEGFAULT)) == 139
    assert "likely cause: segmentation fault (SIGSEGV)" in summary(ingest)


def test_plain_value_error(ingest: RunningIngest, tmp_path: Path) -> None:
    assert run(ingest, tmp_path, python_child(VALUE_ERROR)) == 1
    assert ('likely cause: Python exception ValueError (stderr: "ValueError: learning rate '
            'must be positive, got -0.1")') in summary(ingest)


def test_a_good_run_has_no_summary(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child("print('CUDA out of memory, said in jest')")],
                   env, tmp_path / "sc")
    assert done.status == 0
    assert "[sidecar]" not in ingest.log_text()


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup below this process's own with a 64 MiB limit, where the machine lets us."""
    roots = own_memory_cgroups()
    if not roots:
        pytest.skip("no memory cgroup is visible to this process")
    folder = roots[0] / f"sidecar-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
        limit = "memory.max" if (folder / "memory.max").exists() else "memory.limit_in_bytes"
        (folder / limit).write_text(str(64 << 20))
    except OSError as exc:
        if folder.exists():
            folder.rmdir()
        pytest.skip(f"cannot create a memory-limited cgroup below {roots[0]}: {exc.strerror}")
    try:
        yield folder
    finally:
        wait_until(lambda: not (folder / "cgroup.procs").read_text().strip(), 10,
                   "the cgroup emptied")
        folder.rmdir()


def test_host_oom_kill_in_a_memory_limited_cgroup(ingest: RunningIngest, tmp_path: Path,
                                                  memory_cgroup: Path) -> None:
    hog = "x = []\nwhile True: x.append(bytearray(16 << 20))"
    command = ["sh", "-c", f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$0" "$@"',
               *python_child(hog)]
    assert run(ingest, tmp_path, command) == 137
    line = summary(ingest)
    assert ("likely cause: host out of memory: the kernel's OOM killer (cgroup memory limit "
            "64.0 MiB)") in line
    assert str(memory_cgroup) in line


def test_sigkill_from_outside_is_not_called_an_oom_kill(ingest: RunningIngest,
                                                        tmp_path: Path) -> None:
    assert run(ingest, tmp_path, python_child("import os; os.kill(os.getpid(), 9)")) == 137
    assert "likely cause: killed by SIGKILL from outside" in summary(ingest)


WARNS_THEN_WAIT = r'''
import os, sys, time
for i in range(3):
    print(f"gpu-node-07:4187:4251 [{i}] NCCL WARN NET/IB : Got async event : port error",
          flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
sys.exit(3)
'''


def get(address: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as answer:
        return str(answer.read().decode())


def test_signature_counts_live_and_the_failure_in_status_and_metrics(
        ingest: RunningIngest, tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_STATUS_ADDR="127.0.0.1:0")
    proc = Sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "60", "--",
                    *python_child(WARNS_THEN_WAIT), str(go)], env, tmp_path / "sc")
    addr_file = tmp_path / "state" / RUN_ID / "status-addr"
    wait_until(addr_file.exists, 20, "the status endpoint is up")
    address = addr_file.read_text().strip()
    wait_until(lambda: json.loads(get(address, "/status"))["signatures"]["nccl_warn"] == 3, 20,
               "three NCCL warnings counted while the command runs")
    assert 'sidecar_signature_seen_total{signature="nccl_warn"} 3.0' in get(address, "/metrics")
    ingest.add_fault(Fault(route="lifecycle", status=503))  # hold the drain open at the end event
    go.touch()
    wait_until(lambda: "[sidecar] run failed" in ingest.log_text(), 20, "the summary arrives")
    failure = json.loads(get(address, "/status"))["failure"]
    assert (failure["exit_status"], failure["signature"]) == (3, "nccl_warn")
    metrics = get(address, "/metrics")
    assert 'sidecar_run_failure_info{cause="NCCL error"' in metrics
    assert 'exit_status="3"' in metrics
    ingest.clear_faults()
    assert proc.wait(60).status == 3
    assert [r["event"] for r in ingest.records("lifecycle")][-1] == "failed"


def test_multi_node_summary_names_node_and_rank(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state", NODE_RANK="2", NNODES="4")
    done = sidecar(["run", "--node-name", "gpu-node-07", "--hardware-interval", "0", "--",
                    *python_child(VALUE_ERROR)], env, tmp_path / "sc")
    assert done.status == 1
    assert summary(ingest).startswith("[sidecar] run failed on node gpu-node-07 (rank 2): exit "
                                      "status 1 after ")


WAITS_THEN_CUDA_ERROR = r'''
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
sys.stderr.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
sys.exit(1)
'''


def test_an_xid_the_sampler_saw_is_named_before_the_cuda_error_it_caused(
        ingest: RunningIngest, tmp_path: Path, stub_dir: Path) -> None:  # noqa: F811
    script = tmp_path / "nvml-script.txt"
    script.write_text("".join(f"{k} {v}\n" for k, v in TWO_GPUS.items()))
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state", NVML_STUB_SCRIPT=str(script),
                       LD_LIBRARY_PATH=str(stub_dir))
    proc = Sidecar(["run", "--hardware-interval", "1", "--",
                    *python_child(WAITS_THEN_CUDA_ERROR), str(go)], env, tmp_path / "sc")

    def xid_posted() -> bool:
        return any(p["key"] == "gpu/0/xid_code" for r in ingest.records("hardware")
                   for p in r["points"])

    def its_log() -> str:
        return (tmp_path / "sc" / "stderr").read_text()[-4000:]

    try:
        wait_until(xid_posted, 30, "the sampler posted the XID", its_log)
    finally:
        # the command exits either way: a failure leaves no sidecar running behind the test
        go.touch()
    assert proc.wait(60).status == 1
    assert ('likely cause: GPU XID 79 on GPU 0 (nvml: "GPU 0 reported XID 79")'
            in summary(ingest))


@pytest.mark.parametrize("variable", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"])
def test_the_runners_gpu_choice_never_reaches_the_sidecar_a_test_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str) -> None:
    """With CUDA_VISIBLE_DEVICES="" on the runner the XID test's sidecar chose none of the
    stand-in's GPUs ("selects none of this node's 2 GPUs") and its XID never came: a test's
    sidecar sees every GPU the stand-in shows unless the test names the job's."""
    monkeypatch.setenv(variable, "")
    env = platform_env("http://127.0.0.1:9/api/ingest", tmp_path / "state")
    assert choose_gpus("", env, env, watching=False).filter is None


def scanned(*lines: bytes) -> Scanner:
    scanner = Scanner()
    scanner.feed("stderr", b"".join(line + b"\n" for line in lines))
    return scanner


NODE = Node("gpu-node-07", 0)
OOM = b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
WATCHDOG = (b"[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4187, "
            b"OpType=ALLREDUCE) ran for 600081 milliseconds before timing out.")
KILL = OomKill(Path("/sys/fs/cgroup/job"), 1, 64 << 30)


@pytest.mark.parametrize(("status", "lines", "kills", "xids", "signature"), [
    (137, (OOM,), (KILL,), (), "host_oom_kill"),  # the kernel's kill explains the SIGKILL
    (137, (), (), (), "signal"),  # a SIGKILL with no kill counted came from outside
    (1, (OOM,), (KILL,), (), "cuda_oom"),  # a kill elsewhere in the tree, not of this exit
    (1, (OOM, WATCHDOG), (), (XidEvent(0, 79, 0.0),), "cuda_oom"),
    (134, (WATCHDOG,), (), (XidEvent(0, 79, 0.0),), "xid"),  # the GPU fell off the bus first
    (134, (WATCHDOG, b"ValueError: x"), (), (), "nccl_watchdog_timeout"),
    (139, (b"Traceback (most recent call last):", b"ValueError: x"), (), (), "signal"),
    (1, (b"Traceback (most recent call last):", b"ValueError: x"), (), (), "python_exception"),
    (1, (b"loading shards", b"Killed: bad config"), (), (), "stderr"),
    (2, (), (), (), "unknown"),
])
def test_the_cause_is_the_strongest_evidence(status: int, lines: tuple[bytes, ...],
                                             kills: tuple[OomKill, ...],
                                             xids: tuple[XidEvent, ...], signature: str) -> None:
    failure = diagnose(status, 8000.0, scanned(*lines), NODE, kills, xids)
    assert failure.signature == signature
    assert failure.line().startswith(f"[sidecar] run failed: exit status {status} after 2h13m; "
                                     "likely cause: ")


def test_the_oom_kill_names_the_limit() -> None:
    failure = diagnose(137, 61.0, scanned(), NODE, (KILL,))
    assert failure.line() == ("[sidecar] run failed: exit status 137 after 1m1s; likely cause: "
                              "host out of memory: the kernel's OOM killer (cgroup memory limit "
                              "64.0 GiB) (cgroup: \"/sys/fs/cgroup/job: oom_kill +1\")")


def test_the_failure_document_keeps_its_keys_and_their_order() -> None:
    """/status's `failure`, as `dataclasses.asdict` made it."""
    node = Node("gpu-07", rank=2, nodes=4)
    doc = diagnose(137, 61.0, scanned(), node, (KILL,)).to_json()
    assert json.dumps(doc) == json.dumps({
        "exit_status": 137, "duration_s": 61.0,
        "cause": "host out of memory: the kernel's OOM killer (cgroup memory limit 64.0 GiB)",
        "signature": "host_oom_kill", "stream": "cgroup",
        "quote": "/sys/fs/cgroup/job: oom_kill +1", "node": "gpu-07", "rank": 2,
        "multi_node": True})
