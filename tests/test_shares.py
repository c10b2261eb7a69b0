"""Where a rank's time goes, read from real stacks: small real processes (two ranks of a gloo
process group in a collective, DDP, a distributed checkpoint or a DataLoader's epoch; a DataLoader
with a worker; saves into sinks that block; a matmul loop) looked at with the real
`py-spy dump --json --nonblocking`, as a sampler looks, and each look's main thread placed by
sidecar/shares.py. The rules' files and functions are checked against the installed packages, so
that a file or a function a new version renames fails here rather than counting as compute."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.shares import (
    CATEGORIES,
    CHECKPOINT,
    COLLECTIVE,
    COMPUTE,
    DATA,
    RULES,
    Rule,
    category_of,
    deciding,
)
from sidecar.stacks import find_tool, why_failed
from tests.ingest_server import wait_until

PY_SPY = find_tool()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")
LOOKS_AGREE = 3  # looks in a row that find the main thread at the same line: it is blocked there

# Two ranks as a launcher starts them. Rank 1 is the straggler: it sleeps before the call, and
# rank 0 is looked at while it waits for it there; the barrier first has both up and gloo warm.
RANKS = r'''
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
rank = dist.get_rank()
if sys.argv[1] == "all_reduce":
    def call():
        dist.all_reduce(torch.ones(4))
elif sys.argv[1] == "dcp.save":
    import torch.distributed.checkpoint as dcp

    def call():
        dcp.save({"weight": torch.ones(4)}, checkpoint_id=sys.argv[2])
elif sys.argv[1] == "data":
    from torch.utils.data import DataLoader
    from torch.utils.data.datapipes.iter import IterableWrapper

    loader = DataLoader(IterableWrapper(range(4)))

    def call():
        next(iter(loader))
else:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8),
                                                        torch.nn.BatchNorm1d(8)))
    batch = torch.randn(4, 8)
    for _ in range(3):  # past the buckets' rebuild after the first step
        model(batch).sum().backward()
    if sys.argv[1] == "ddp.backward":
        loss = model(batch).sum()

    def call():
        if sys.argv[1] == "ddp.forward":
            model(batch)
        else:
            loss.backward()
if rank == 1:
    time.sleep(60)
print("ready", flush=True)
call()
'''

# The worker's __getitem__ is a slow disk: the main process waits for its first batch.
LOADER = r'''
import time
import torch
from torch.utils.data import DataLoader, Dataset


class SlowDisk(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(60)
        return torch.zeros(2)


batches = iter(DataLoader(SlowDisk(), num_workers=1))
print("ready", flush=True)
next(batches)
'''

# A file object whose write hangs, as on a stalled network filesystem; a first save warms
# torch.save's imports.
TORCH_SAVE = r'''
import io, time
import torch


class HungFile:
    def write(self, data):
        time.sleep(60)
        return len(data)

    def flush(self):
        pass


torch.save(torch.zeros(1), io.BytesIO())
print("ready", flush=True)
torch.save({"weight": torch.zeros(1 << 22)}, HungFile())
'''

# safetensors writes from Rust, to a file it creates and renames: no Python sink to hold it,
# so the loop saves again and again and a look finds it inside save_file or between two calls.
SAFETENSORS = r'''
import sys
import torch
from safetensors.torch import save_file

tensors = {"weight": torch.zeros(1 << 22)}
print("ready", flush=True)
while True:
    save_file(tensors, sys.argv[1])
'''

# config.json a FIFO that nobody reads: save_pretrained blocks opening it, as on a hung mount.
SAVE_PRETRAINED = r'''
import os, sys
import torch
from transformers import PretrainedConfig, PreTrainedModel


class Tiny(PreTrainedModel):
    config_class = PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = torch.nn.Linear(4, 4)
        self.post_init()


model = Tiny(PretrainedConfig())
os.mkfifo(os.path.join(sys.argv[1], "config.json"))
print("ready", flush=True)
model.save_pretrained(sys.argv[1])
'''

COMPUTE_LOOP = r'''
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
print("ready", flush=True)
while True:
    a = torch.tanh(a @ a)
'''


class Subject:
    """A small real process of this interpreter, in a session of its own (a DataLoader's workers
    with it), its output read on a thread; killed at the end, since it blocks by design."""

    def __init__(self, script: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.decode("utf-8", "replace").rstrip("\n"))

    def ready(self, timeout_s: float = 60) -> None:
        """Once it has said `ready`, the line before the call it blocks in."""
        wait_until(lambda: "ready" in self.lines or self.proc.poll() is not None, timeout_s,
                   "the subject's ready", lambda: "\n".join(self.lines[-30:]))
        self._reader.join(0.5 if self.proc.poll() is not None else 0)
        assert "ready" in self.lines, "\n".join(self.lines[-30:])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def subjects() -> Iterator[list[Subject]]:
    started: list[Subject] = []
    yield started
    for subject in started:
        subject.close()


def look(pid: int) -> list[dict[str, Any]] | None:
    """One look at the main thread, as the sampler takes it: Python frames only, the target not
    stopped. None: the look failed (a read torn by the running target); a skip where ptrace is
    refused."""
    assert PY_SPY is not None
    done = subprocess.run([PY_SPY, "dump", "--json", "--nonblocking", "--pid", str(pid)],
                          capture_output=True, timeout=30, check=False)
    threads = json.loads(done.stdout) if done.stdout.strip() else []
    if not threads:
        why = why_failed(done.stderr.decode("utf-8", "replace"))
        if why.startswith("refused"):
            pytest.skip("py-spy cannot attach to a child process here: ptrace is refused "
                        "(the container lacks CAP_SYS_PTRACE, or kernel.yama.ptrace_scope is 3)")
        return None
    main = next((t for t in threads if t.get("os_thread_id") == pid), None)
    return list(main["frames"]) if main is not None else None


def blocked(pid: int, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The main thread's frames once LOOKS_AGREE looks in a row find it at the same place: it
    has reached the call it blocks in (it said `ready` on the line before)."""
    deadline = time.monotonic() + timeout_s
    seen: list[list[tuple[str, str, int]]] = []
    while time.monotonic() < deadline:
        frames = look(pid)
        if frames:
            seen = [*seen[-(LOOKS_AGREE - 1):],
                    [(f["name"], f["filename"], f["line"]) for f in frames]]
            if len(seen) == LOOKS_AGREE and all(place == seen[0] for place in seen):
                return frames
    raise AssertionError(f"the main thread of {pid} did not settle in {timeout_s:g} s: {seen}")


def names(frames: list[dict[str, Any]]) -> list[str]:
    return [str(f["name"]) for f in frames]


def two_ranks(subjects: list[Subject], *args: str) -> Subject:
    """Ranks 0 and 1 of RANKS on loopback; rank 0, once it waits for rank 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        subjects.append(Subject(RANKS, *args, env=env))
    subjects[0].ready()
    return subjects[0]


# -- real stacks --------------------------------------------------------------------------------


@needs_py_spy
def test_a_rank_waiting_in_a_gloo_all_reduce_is_in_a_collective(subjects: list[Subject]) -> None:
    rank0 = two_ranks(subjects, "all_reduce")
    frames = blocked(rank0.proc.pid)
    assert category_of(frames) == COLLECTIVE, names(frames)
    rule = deciding(frames)
    assert rule is not None and rule.file == "torch/distributed/distributed_c10d.py"
    assert frames[0]["name"] == "all_reduce", names(frames)  # the wait's innermost Python frame


@needs_py_spy
def test_a_main_thread_waiting_for_its_dataloader_worker_is_in_data(
        subjects: list[Subject]) -> None:
    subjects.append(Subject(LOADER))
    subjects[0].ready()
    frames = blocked(subjects[0].proc.pid)
    assert category_of(frames) == DATA, names(frames)
    rule = deciding(frames)
    assert rule is not None and rule.file == "torch/utils/data/dataloader.py"
    # the frames inside it are the standard library's queue and selectors, matched by no rule
    assert any(name.endswith("_try_get_data") for name in names(frames)), names(frames)


@needs_py_spy
def test_torch_save_into_a_hung_file_is_a_checkpoint(subjects: list[Subject]) -> None:
    subjects.append(Subject(TORCH_SAVE))
    subjects[0].ready()
    frames = blocked(subjects[0].proc.pid)
    # the innermost frame is the trainer's own file object's write, called from torch's C++
    assert frames[0]["name"].endswith("HungFile.write"), names(frames)
    assert category_of(frames) == CHECKPOINT, names(frames)


@needs_py_spy
def test_safetensors_save_file_is_a_checkpoint(subjects: list[Subject], tmp_path: Path) -> None:
    subjects.append(Subject(SAFETENSORS, str(tmp_path / "model.safetensors")))
    subjects[0].ready()
    inside, between = [], []
    deadline = time.monotonic() + 30
    while len(inside) < LOOKS_AGREE and time.monotonic() < deadline:
        frames = look(subjects[0].proc.pid)
        if frames:
            # only save_file is called in the loop: a look is in it, or at the loop's own line
            (between if len(frames) == 1 else inside).append(frames)
    assert len(inside) == LOOKS_AGREE, (inside, between)
    assert all(category_of(frames) == CHECKPOINT for frames in inside), inside
    assert all("save_file" in names(frames) for frames in inside), inside
    assert all(category_of(frames) == COMPUTE for frames in between), between


@needs_py_spy
def test_save_pretrained_blocked_on_its_config_is_a_checkpoint(
        subjects: list[Subject], tmp_path: Path) -> None:
    """Anywhere under save_pretrained is the save's, here the config's open on a FIFO."""
    subjects.append(Subject(SAVE_PRETRAINED, str(tmp_path)))
    subjects[0].ready()
    frames = blocked(subjects[0].proc.pid)
    assert any(name.endswith("to_json_file") for name in names(frames)), names(frames)
    assert category_of(frames) == CHECKPOINT, names(frames)
    rule = deciding(frames)
    assert rule is not None and rule.file == "transformers/modeling_utils.py", names(frames)


@needs_py_spy
def test_a_matmul_loop_is_compute(subjects: list[Subject]) -> None:
    subjects.append(Subject(COMPUTE_LOOP))
    subjects[0].ready()
    looks = [frames for frames in (look(subjects[0].proc.pid) for _ in range(5)) if frames]
    assert looks
    assert all(category_of(frames) == COMPUTE for frames in looks), looks


@needs_py_spy
def test_a_ddp_forward_waiting_for_a_rank_to_sync_its_buffers_is_in_a_collective(
        subjects: list[Subject]) -> None:
    rank0 = two_ranks(subjects, "ddp.forward")
    frames = blocked(rank0.proc.pid)
    assert category_of(frames) == COLLECTIVE, names(frames)
    rule = deciding(frames)
    assert rule is not None and rule.file == "torch/nn/parallel/distributed.py", names(frames)


@needs_py_spy
def test_a_ddp_backward_waiting_for_a_ranks_gradients_is_compute_to_python_frames(
        subjects: list[Subject]) -> None:
    """What a Python-only look cannot see: the reducer waits for the buckets in C++ (its native
    frame c10d::Reducer::finalize_backward), under the autograd engine's one Python frame."""
    rank0 = two_ranks(subjects, "ddp.backward")
    frames = blocked(rank0.proc.pid)
    assert frames[0]["name"] == "_engine_run_backward", names(frames)
    assert category_of(frames) == COMPUTE, names(frames)


# -- the order: a save or a fetch that waits in a collective is the save's or the fetch's -------


@needs_py_spy
def test_a_distributed_checkpoint_waiting_for_a_rank_is_a_checkpoint(
        subjects: list[Subject], tmp_path: Path) -> None:
    rank0 = two_ranks(subjects, "dcp.save", str(tmp_path / "checkpoint"))
    frames = blocked(rank0.proc.pid)
    # waiting in torch.distributed's gather of the save plan, under dcp.save
    inner = deciding(frames[:1])
    assert inner is not None and inner.category == COLLECTIVE, names(frames)
    assert category_of(frames) == CHECKPOINT, names(frames)


@needs_py_spy
def test_a_dataloader_waiting_for_a_rank_at_an_epochs_start_is_in_data(
        subjects: list[Subject]) -> None:
    rank0 = two_ranks(subjects, "data")
    frames = blocked(rank0.proc.pid)
    # a data pipe's epoch: the DataLoader makes a gloo group of all ranks for its shared seed
    assert any(name == "new_group" for name in names(frames)), names(frames)
    assert category_of(frames) == DATA, names(frames)


# -- the table ----------------------------------------------------------------------------------


def _source(rule: Rule) -> Path | None:
    """The rule's file in the installed package (found without importing it); None: the package
    is not installed here."""
    top = rule.file.split("/", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent / rule.file


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: f"{rule.file}:{rule.functions[0]}")
def test_each_rules_functions_are_in_the_installed_file(rule: Rule) -> None:
    """A file moved or a function renamed in a new version fails here, rather than sending the
    time it stands for to compute."""
    path = _source(rule)
    if path is None:
        pytest.skip(f"{rule.file.split('/', 1)[0]} is not installed here")
    assert path.is_file(), f"{rule.file} is gone from the installed package ({path})"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    defined = {node.name for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    missing = [name for name in rule.functions if name not in defined]
    assert not missing, f"{rule.file} defines no {missing}"


def test_each_row_is_one_of_the_waiting_categories_and_no_frame_is_claimed_twice() -> None:
    assert CATEGORIES[-1] == COMPUTE
    assert all(rule.category in CATEGORIES[:-1] and rule.where for rule in RULES)
    pairs = [(rule.file, name) for rule in RULES for name in rule.functions]
    assert len(pairs) == len(set(pairs))


def frame(name: str, path: str, module: str | None = None) -> dict[str, Any]:
    return {"name": name, "filename": path, "short_filename": path, "line": 1, "module": module}


SITE = "/opt/venv/lib/python3.11/site-packages/"


def test_a_frame_matches_by_its_own_name_and_the_end_of_its_path() -> None:
    """Qualified (3.11 and later) or plain; its file a path under any prefix, but whole path
    components only; a native frame never."""
    c10d = "torch/distributed/distributed_c10d.py"
    assert category_of([frame("all_reduce", SITE + c10d)]) == COLLECTIVE
    assert category_of([frame("_BaseDataLoaderIter.__next__",
                           "/src/pytorch/torch/utils/data/dataloader.py")]) == DATA
    assert category_of([frame("all_reduce", SITE + "mytorch/distributed/distributed_c10d.py")]) \
        == COMPUTE
    assert category_of([frame("all_reduce", SITE + c10d, module=SITE + "torch/lib/libc10d.so")]) \
        == COMPUTE
    assert category_of([]) == COMPUTE
