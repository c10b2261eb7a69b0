"""`--checkpoints`: real writers (torch.save, safetensors, HF Trainer and save_pretrained,
Lightning, torch.distributed.checkpoint, DeepSpeed's and Megatron's layouts) in child processes,
a real `sidecar watch` beside them, the checking ingest (`sidecar receive`) receiving /artifact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RUN_ID, SIDECAR, Finished, Sidecar, platform_env
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until

BUCKET = "s3://bucket/run/ckpt"
WRITER_TIMEOUT_S = 120.0
# `sidecar` judging a checkpoint after 0.5 s of quiet rather than 2 s: what these tests prove
# rests on markers and structure, each writer held mid-save until the sidecar has judged it.
QUICK_QUIET = (sys.executable, "-c", "import sys; import sidecar.sources.files.checkpoints as c; "
               "c.QUIET_S = 0.5; from sidecar.cli import main; sys.exit(main())")


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", QUICK_QUIET)


def artifacts(ingest: RunningIngest) -> list[dict[str, Any]]:
    return ingest.records("artifact")


def paths(ingest: RunningIngest) -> Counter[str]:
    return Counter(str(a["path"]) for a in artifacts(ingest))


class Watch:
    """`sidecar watch --checkpoints DIR`, DIR mapped to BUCKET unless told otherwise."""

    def __init__(self, ingest: RunningIngest, tmp_path: Path, folder: Path, *args: str,
                 mapped: bool = True, **env: str) -> None:
        mapping = ("--artifact-uri", f"{folder}={BUCKET}") if mapped else ()
        self.env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                                **env)
        self.args = ["watch", "--checkpoints", str(folder), *mapping, *args]
        self.tmp_path = tmp_path
        self.runs = 0
        self.proc: Sidecar | None = None
        self.preexec_fn: Callable[[], object] | None = None  # run in the child before exec

    def start(self) -> Watch:
        self.runs += 1
        self.proc = Sidecar(self.args, self.env, self.tmp_path / f"watch{self.runs}",
                            preexec_fn=self.preexec_fn)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> Finished:
        assert self.proc is not None
        self.proc.proc.send_signal(sig)
        return self.proc.wait(60)

    def stderr(self) -> str:
        return (self.tmp_path / f"watch{self.runs}" / "stderr").read_text()


def write(code: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Run a writer script in a child process, to completion."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=WRITER_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def under(folder: Path, *names: str) -> list[str]:
    return sorted(f"{BUCKET}/{name}" for name in names)


# -- torch.save and safetensors -----------------------------------------------------------------

SLOW_WRITERS = """
import os, sys, time, torch
from safetensors.torch import save_file
from pathlib import Path

folder, go = Path(sys.argv[1]), Path(sys.argv[2])
torch.save({"w": torch.zeros(64)}, folder / "step_100.pt")
save_file({"w": torch.ones(64)}, str(folder / "weights-200.safetensors"))
# Slowed on purpose mid-save: half of each file, then a pause far past the quiet time.
whole_pt = folder / "scratch.bin"
torch.save({"w": torch.zeros(4096)}, whole_pt)
data = whole_pt.read_bytes()
whole_pt.unlink()
save_file({"w": torch.ones(4096)}, str(folder / "scratch.st"))
tensors = (folder / "scratch.st").read_bytes()
(folder / "scratch.st").unlink()
with open(folder / "step_300.pt", "wb") as pt, open(folder / "model-300.safetensors", "wb") as st:
    pt.write(data[: len(data) // 2]); pt.flush()
    st.write(tensors[: len(tensors) // 2]); st.flush()
    go.write_text("half")
    while go.read_text() != "finish":
        time.sleep(0.05)
    pt.write(data[len(data) // 2:])
    st.write(tensors[len(tensors) // 2:])
# A checkpoint deleted before it was complete (rotation) is never registered.
with open(folder / "step_400.pt", "wb") as fh:
    fh.write(data[:100])
time.sleep(0.2)
os.unlink(folder / "step_400.pt")
os.symlink("step_300.pt", folder / "latest.pt")  # an alias, not a checkpoint
"""


def test_torch_save_and_safetensors_each_once_and_never_half_written(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    go = tmp_path / "go"
    go.write_text("")
    watch = Watch(ingest, tmp_path, folder, "--log-level", "debug").start()
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITERS, str(folder), str(go)])
    try:
        ingest.wait_for(lambda: len(artifacts(ingest)) >= 2 and go.read_text() == "half", 60)
        # Half-written files, unchanged for longer than the quiet time: judged, not registered.
        wait_until(lambda: all(f"{folder / name} is not complete" in watch.stderr()
                               for name in ("step_300.pt", "model-300.safetensors")), 20)
        assert sorted(paths(ingest)) == under(folder, "step_100.pt", "weights-200.safetensors")
        go.write_text("finish")
        assert writer.wait(WRITER_TIMEOUT_S) == 0
    finally:
        writer.kill()
    ingest.wait_for(lambda: len(artifacts(ingest)) >= 4, 30)
    done = watch.stop()
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter(under(folder, "step_100.pt", "weights-200.safetensors",
                                          "step_300.pt", "model-300.safetensors"))
    by_path = {a["path"]: a for a in artifacts(ingest)}
    first = by_path[f"{BUCKET}/step_100.pt"]
    assert first["kind"] == "checkpoint" and first["format"] == "pt" and first["step"] == 100
    assert first["size_bytes"] == (folder / "step_100.pt").stat().st_size
    assert first["run_id"] == RUN_ID
    assert by_path[f"{BUCKET}/model-300.safetensors"]["format"] == "safetensors"
    assert by_path[f"{BUCKET}/model-300.safetensors"]["step"] == 300


# -- HF Trainer and save_pretrained ---------------------------------------------------------------

HF_WRITER = """
import sys, time, torch
from pathlib import Path
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

root, go = Path(sys.argv[1]), Path(sys.argv[2])

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        ids = torch.tensor([(i + j) % 32 for j in range(8)])
        return {"input_ids": ids, "labels": ids}

def trainer(steps):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32,
                                       n_positions=16, eos_token_id=0, bos_token_id=0))
    args = TrainingArguments(output_dir=str(root / "out"), max_steps=steps, save_steps=1,
                             save_total_limit=2, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_steps=100)
    return Trainer(model=model, args=args, train_dataset=Data())

trainer(4).train()  # checkpoint-1 and -2 are rotated away as -3 and -4 are saved
go.write_text("trained")
while go.read_text() != "resume":
    time.sleep(0.05)
trainer(4).train(resume_from_checkpoint=str(root / "out" / "checkpoint-3"))  # -4 rewritten
model = trainer(1).model
model.save_pretrained(root / "export", max_shard_size="4KB")
model.save_pretrained(root / "merged")
"""


def test_hf_trainer_rotation_resume_and_save_pretrained(ingest: RunningIngest,
                                                        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    go = tmp_path / "go"
    go.write_text("")
    watch = Watch(ingest, tmp_path, root).start()
    writer = subprocess.Popen([sys.executable, "-c", HF_WRITER, str(root), str(go)],
                              stderr=subprocess.DEVNULL)
    first = under(root, "out/checkpoint-3", "out/checkpoint-4")
    try:
        wait_until(lambda: go.read_text() == "trained", WRITER_TIMEOUT_S)
        ingest.wait_for(lambda: sorted(paths(ingest)) == first, 30)
        go.write_text("resume")
        assert writer.wait(WRITER_TIMEOUT_S) == 0
    finally:
        writer.kill()
    ingest.wait_for(lambda: len(artifacts(ingest)) >= 5, 30)
    done = watch.stop()
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter({f"{BUCKET}/out/checkpoint-3": 1,
                                     f"{BUCKET}/out/checkpoint-4": 2,  # rewritten after resume
                                     f"{BUCKET}/export": 1, f"{BUCKET}/merged": 1})
    by_path = {a["path"]: a for a in artifacts(ingest)}
    four = by_path[f"{BUCKET}/out/checkpoint-4"]
    assert (four["kind"], four["format"], four["step"]) == ("checkpoint", "hf-trainer", 4)
    assert four["size_bytes"] == sum(
        f.stat().st_size for f in (root / "out" / "checkpoint-4").iterdir())
    export = by_path[f"{BUCKET}/export"]
    assert (export["kind"], export["format"]) == ("hf_export", "hf") and "step" not in export
    assert len(list((root / "export").glob("model-*.safetensors"))) > 1  # sharded
    assert by_path[f"{BUCKET}/merged"]["kind"] == "merged_model"


def _await_line(watch: Watch, *needles: str, timeout: float = 30.0) -> None:
    wait_until(lambda: all(n in watch.stderr() for n in needles), timeout,
               f"the sidecar's messages to say {needles}", watch.stderr)


# -- torch.distributed.checkpoint, 2 processes ----------------------------------------------------

DCP_WRITER = """
import sys, time, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from pathlib import Path

class Slow(dcp.FileSystemWriter):
    def write_data(self, plan, planner):  # rank 1 holds its shard until told to go on
        if dist.get_rank() == 1:
            go = Path(sys.argv[3])
            while go.read_text() != "go":
                time.sleep(0.05)
        return super().write_data(plan, planner)

def main(rank, folder, init):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    state = {f"rank{rank}": torch.full((256,), float(rank))}  # each rank's own tensor
    path = str(Path(folder) / "step-10")
    dcp.save(state, storage_writer=Slow(path), checkpoint_id=path)
    dist.destroy_process_group()

if __name__ == "__main__":
    # forked, not spawned: the ranks need not import torch again
    mp.start_processes(main, args=(sys.argv[1], sys.argv[2]), nprocs=2, start_method="fork")
"""


def test_distributed_checkpoint_from_two_processes_once_after_metadata(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    go = tmp_path / "go"
    go.write_text("")
    script = tmp_path / "dcp_writer.py"
    script.write_text(DCP_WRITER)
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
    writer = subprocess.Popen([sys.executable, str(script), str(root), str(tmp_path / "init"),
                               str(go)], stderr=subprocess.DEVNULL)
    try:
        # rank 0's shard is written, rank 1's held back: no .metadata, nothing registered
        _await_line(watch, f"{root / 'step-10'} is not complete: no .metadata yet")
        assert artifacts(ingest) == []
        go.write_text("go")
        assert writer.wait(WRITER_TIMEOUT_S) == 0
    finally:
        writer.kill()
    ingest.wait_for(lambda: artifacts(ingest), 30)
    done = watch.stop()
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter([f"{BUCKET}/step-10"])
    (record,) = artifacts(ingest)
    assert (record["format"], record["step"], record["kind"]) == ("distcp", 10, "checkpoint")
    assert sorted(p.name for p in (root / "step-10").iterdir())[0] == ".metadata"
    assert len(list((root / "step-10").glob("*.distcp"))) == 2


# -- Lightning ModelCheckpoint --------------------------------------------------------------------

LIGHTNING_WRITER = """
import sys, torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)),
                                   batch_size=2)
for folder, save_last in ((sys.argv[1], True), (sys.argv[2], "link")):
    saver = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=2,
                            save_last=save_last)
    L.Trainer(max_steps=4, callbacks=[saver], logger=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu").fit(Tiny(), data)
"""


def test_lightning_checkpoints_once_and_last_ckpt_is_an_alias(ingest: RunningIngest, quick: None,
                                                              tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    watch = Watch(ingest, tmp_path, root).start()
    write(LIGHTNING_WRITER, str(root / "copy"), str(root / "link"))
    assert not (root / "copy" / "last.ckpt").is_symlink()  # save_last=True: a second save
    assert (root / "link" / "last.ckpt").is_symlink()
    expected = under(root, *(f"{kind}/epoch=0-step={step}.ckpt" for kind in ("copy", "link")
                             for step in (2, 4)))
    ingest.wait_for(lambda: sorted(paths(ingest)) == expected, 30)
    done = watch.stop()  # the drain looks once more: last.ckpt would be registered by now
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter(expected)
    assert sorted((a["format"], a["step"]) for a in artifacts(ingest)) == [
        ("lightning-ckpt", 2), ("lightning-ckpt", 2), ("lightning-ckpt", 4),
        ("lightning-ckpt", 4)]


# -- DeepSpeed's and Megatron's layouts, written in their order ------------------------------------

LAYOUT_WRITER = """
import sys, time, torch
from pathlib import Path

root, go = Path(sys.argv[1]), Path(sys.argv[2])

def wait(word):
    while go.read_text() != word:
        time.sleep(0.05)

# DeepSpeed save_checkpoint: rank 0's model states, every rank's optimizer shard, then rank 0
# writes `latest` before the barrier; here rank 1 is slow: its shard is half written.
ds = root / "deepspeed" / "global_step20"
ds.mkdir(parents=True)
torch.save({"module": torch.zeros(64)}, ds / "mp_rank_00_model_states.pt")
torch.save({"optim": torch.zeros(64)}, ds / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
torch.save({"optim": torch.ones(1024)}, ds / "whole")
whole = (ds / "whole").read_bytes()
(ds / "whole").unlink()
shard = ds / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
with open(shard, "wb") as fh:
    fh.write(whole[: len(whole) // 2]); fh.flush()
    (root / "deepspeed" / "latest").write_text("global_step20")
    go.write_text("deepspeed-half")
    wait("deepspeed-finish")
    fh.write(whole[len(whole) // 2:])

# Megatron (torch_dist): the DCP files, then metadata.json, then the tracker written in place.
mg = root / "megatron"
it = mg / "iter_0000030"
it.mkdir(parents=True)
for rank in (0, 1):
    torch.save({"w": torch.zeros(16)}, it / f"__{rank}_0.distcp")
torch.save({}, it / "common.pt")
(it / ".metadata").write_bytes(b"metadata")
(it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
go.write_text("megatron-no-tracker")
wait("megatron-finish")
(mg / "latest_checkpointed_iteration.txt").write_text("30")
"""


def test_deepspeed_and_megatron_layouts_wait_for_every_rank_and_the_tracker(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    go = tmp_path / "go"
    go.write_text("")
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
    writer = subprocess.Popen([sys.executable, "-c", LAYOUT_WRITER, str(root), str(go)])
    try:
        wait_until(lambda: go.read_text() == "deepspeed-half", WRITER_TIMEOUT_S)
        _await_line(watch, f"{root / 'deepspeed' / 'global_step20'} is not complete: "
                    "zero_pp_rank_1_mp_rank_00_optim_states.pt: no zip end record")
        assert artifacts(ingest) == []  # `latest` names it, a rank is still writing
        go.write_text("deepspeed-finish")
        ingest.wait_for(lambda: len(artifacts(ingest)) == 1, 30)
        wait_until(lambda: go.read_text() == "megatron-no-tracker", WRITER_TIMEOUT_S)
        _await_line(watch, f"{root / 'megatron' / 'iter_0000030'} is not complete: "
                    "no latest_checkpointed_iteration.txt yet")
        go.write_text("megatron-finish")
        assert writer.wait(WRITER_TIMEOUT_S) == 0
    finally:
        writer.kill()
    ingest.wait_for(lambda: len(artifacts(ingest)) == 2, 30)
    done = watch.stop()
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter(under(root, "deepspeed/global_step20",
                                          "megatron/iter_0000030"))
    assert sorted((a["format"], a["step"]) for a in artifacts(ingest)) == [
        ("deepspeed", 20), ("megatron", 30)]


# -- exactly once across a SIGKILL, at least once across an outage ---------------------------------

def save_files(folder: Path, *steps: int) -> None:
    """torch.save's format (a zip, its end record last) without torch's import time, written
    under a temporary name and renamed in, as a writer that stages its files does."""
    import zipfile

    for step in steps:
        staged = folder / f".step_{step}.pt.tmp"
        with zipfile.ZipFile(staged, "w") as archive:
            archive.writestr("archive/data.pkl", b"\x80\x02}q\x00." * 8)
        staged.rename(folder / f"step_{step}.pt")


def _rejected(ingest: RunningIngest, status: int) -> int:
    return ingest.stats.routes["artifact"].rejected.get(status, 0)


def test_sigkill_before_the_acknowledgement_then_restart_registers_once(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    ingest.add_fault(Fault(route="artifact", status=503))
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
    save_files(root, 5)
    ingest.wait_for(lambda: _rejected(ingest, 503) >= 1, 30)  # journaled, not acknowledged
    assert watch.stop(signal.SIGKILL).status == -signal.SIGKILL
    ingest.clear_faults()
    watch.start()
    ingest.wait_for(lambda: artifacts(ingest), 30)
    _await_line(watch, f"{root / 'step_5.pt'} was registered already")
    assert watch.stop().status == 0
    watch.start()  # acknowledged: a third start neither posts nor judges it new
    _await_line(watch, f"{root / 'step_5.pt'} was registered already")
    assert watch.stop().status == 0
    assert paths(ingest) == Counter([f"{BUCKET}/step_5.pt"])


def test_replay_delivers_a_registration_a_killed_sidecar_left(ingest: RunningIngest, quick: None,
                                                              tmp_path: Path) -> None:
    from tests.conftest import sidecar

    root = tmp_path / "ckpt"
    root.mkdir()
    ingest.add_fault(Fault(route="artifact", status=503))
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
    save_files(root, 5)
    ingest.wait_for(lambda: _rejected(ingest, 503) >= 1, 30)
    assert watch.stop(signal.SIGKILL).status == -signal.SIGKILL
    ingest.clear_faults()
    done = sidecar(["replay"], watch.env, tmp_path / "replay")
    assert done.status == 0, done.stderr
    assert b"1/1 payloads delivered" in done.stderr
    assert paths(ingest) == Counter([f"{BUCKET}/step_5.pt"])
    watch.start()  # and the next start knows it was registered
    _await_line(watch, f"{root / 'step_5.pt'} was registered already")
    assert watch.stop().status == 0
    assert paths(ingest) == Counter([f"{BUCKET}/step_5.pt"])


def test_a_registration_made_during_an_outage_is_journaled_at_once(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    ingest.add_fault(Fault(route="artifact", status=503))
    watch = Watch(ingest, tmp_path, root).start()
    save_files(root, 5)
    ingest.wait_for(lambda: _rejected(ingest, 503) >= 1, 30)  # its head is being retried
    save_files(root, 6)
    journal = tmp_path / "state" / RUN_ID / "artifact.journal"
    wait_until(lambda: journal.exists() and b"step_6.pt" in journal.read_bytes(), 20,
               "the second registration journaled while the first is retried")
    assert watch.stop(signal.SIGKILL).status == -signal.SIGKILL
    ingest.clear_faults()
    watch.start()
    ingest.wait_for(lambda: len(artifacts(ingest)) == 2, 30)
    assert watch.stop().status == 0
    assert paths(ingest) == Counter(under(root, "step_5.pt", "step_6.pt"))


def test_an_ingest_answering_503_then_registered_once(ingest: RunningIngest, quick: None,
                                                     tmp_path: Path) -> None:
    # A few seconds of 503s rather than a minute: the backoff doubles to at most 30 s, so a
    # longer outage only spaces the attempts further apart.
    root = tmp_path / "ckpt"
    root.mkdir()
    ingest.add_fault(Fault(route="artifact", status=503))
    watch = Watch(ingest, tmp_path, root).start()
    save_files(root, 5, 6)
    ingest.wait_for(lambda: _rejected(ingest, 503) >= 3, 30)
    assert artifacts(ingest) == []
    ingest.clear_faults()
    ingest.wait_for(lambda: len(artifacts(ingest)) == 2, 30)
    assert watch.stop().status == 0
    assert paths(ingest) == Counter(under(root, "step_5.pt", "step_6.pt"))


def test_a_4xx_is_dead_lettered_with_the_reason_and_later_ones_go_on(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    ingest.add_fault(Fault(route="artifact", reject_if_contains="step_5.pt"))
    watch = Watch(ingest, tmp_path, root).start()
    save_files(root, 5, 6)
    ingest.wait_for(lambda: len(artifacts(ingest)) == 1, 30)
    done = watch.stop()
    assert done.status == 0
    assert paths(ingest) == Counter(under(root, "step_6.pt"))
    (dead,) = [json.loads(line) for line in
               (tmp_path / "state" / RUN_ID).rglob("dead-letter.jsonl").__next__().read_text()
               .splitlines()]
    assert dead["route"] == "artifact" and dead["status"] == 400
    assert "step_5.pt" in dead["body"]
    assert "/artifact: HTTP 400" in done.stderr.decode()


def test_a_413_for_one_registration_is_dead_lettered_too_never_dropped_unsaid(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    ingest.add_fault(Fault(route="artifact", status=413, times=1))
    watch = Watch(ingest, tmp_path, root).start()
    save_files(root, 5)
    ingest.wait_for(lambda: _rejected(ingest, 413) == 1, 30)
    save_files(root, 6)
    ingest.wait_for(lambda: len(artifacts(ingest)) == 1, 30)
    done = watch.stop()
    assert done.status == 0
    assert paths(ingest) == Counter(under(root, "step_6.pt"))
    (dead,) = [json.loads(line) for line in
               next((tmp_path / "state" / RUN_ID).rglob("dead-letter.jsonl")).read_text()
               .splitlines()]
    assert dead["status"] == 413 and "step_5.pt" in dead["body"]


# -- paths the platform can use ----------------------------------------------------------------

def test_in_a_container_a_mapped_folder_is_posted_an_unmapped_one_not_and_status_says_so(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    mapped, unmapped = tmp_path / "mapped", tmp_path / "local"
    mapped.mkdir()
    unmapped.mkdir()
    (mapped / "partial.safetensors").write_bytes(b"\x10\0\0\0")  # a writer that died
    watch = Watch(ingest, tmp_path, mapped, "--checkpoints", str(unmapped),
                  "--checkpoint-upload", "never",
                  KUBERNETES_SERVICE_HOST="10.0.0.1", SIDECAR_STATUS_ADDR="127.0.0.1:0").start()
    save_files(mapped, 5)
    save_files(unmapped, 7, 8)
    ingest.wait_for(lambda: artifacts(ingest), 30)
    addr_file = tmp_path / "state" / RUN_ID / "status-addr"
    wait_until(addr_file.exists, 20, "the watch wrote its status address")
    address = addr_file.read_text().strip()

    def status() -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{address}/status", timeout=10) as answer:
            doc: dict[str, Any] = json.load(answer)
        return doc

    def folders() -> dict[str, dict[str, Any]]:
        return {c["folder"]: c for c in status()["checkpoints"]}

    wait_until(lambda: len(folders()[str(unmapped)]["skipped"]) == 2
               and folders()[str(mapped)]["waiting"], 30, "both folders judged", watch.stderr)
    shown = folders()
    assert shown[str(mapped)]["registered"] == [str(mapped / "step_5.pt")]
    assert shown[str(mapped)]["waiting"] == [
        [str(mapped / "partial.safetensors"), "shorter than a safetensors header"]]
    assert all("--artifact-uri" in why for _, why in shown[str(unmapped)]["skipped"])
    assert shown[str(unmapped)]["not_posted"] == 2
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    assert f'sidecar_checkpoints{{folder="{mapped}",state="registered"}} 1.0' in metrics
    assert f'sidecar_checkpoints_not_posted_total{{folder="{unmapped}"}} 2.0' in metrics
    table = subprocess.run([*SIDECAR, "status", "--once", "--status-addr", address],
                           capture_output=True, text=True, timeout=30,
                           env={**watch.env, "COLUMNS": "400"})
    assert f"CHECKPOINTS {unmapped}: 0 registered, 0 waiting, 2 skipped" in table.stdout
    assert "not posted (no --artifact-uri in a container)" in table.stdout
    done = watch.stop()
    assert done.status == 0
    assert paths(ingest) == Counter([f"{BUCKET}/step_5.pt"])
    warnings = [line for line in done.stderr.decode().splitlines()
                if "WARNING" in line and "--artifact-uri" in line]
    assert len(warnings) == 1 and str(unmapped) in warnings[0], warnings  # one per folder


def test_on_bare_metal_an_unmapped_path_is_posted_as_it_is(tmp_path: Path) -> None:
    from sidecar.sources.files.checkpoints import ArtifactPaths, container_signal

    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "cgroup").write_text("0::/user.slice/session-4.scope\n")
    assert container_signal({}, tmp_path) == ""
    paths = ArtifactPaths([("/mnt/ckpt", "s3://b/run")], container_signal({}, tmp_path))
    assert paths.resolve("/scratch/run/step_5.pt") == "/scratch/run/step_5.pt"
    assert paths.resolve("/mnt/ckpt/step_5.pt") == "s3://b/run/step_5.pt"
    assert paths.resolve("/mnt/ckpt2/step_5.pt") == "/mnt/ckpt2/step_5.pt"  # not a prefix
    (tmp_path / "proc" / "1" / "cgroup").write_text("0::/kubepods/burstable/pod1/abc\n")
    assert container_signal({}, tmp_path) == "the cgroup names kubepods"
    assert ArtifactPaths([], "x").resolve("/scratch/run/step_5.pt") is None
    assert container_signal({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, tmp_path)
    (tmp_path / ".dockerenv").touch()
    assert container_signal({}, tmp_path) == "/.dockerenv exists"


# -- options and `sidecar check` ---------------------------------------------------------------

def test_check_says_what_each_folder_matches_and_whether_it_would_be_posted(
        tmp_path: Path) -> None:
    from tests.conftest import clean_environ, sidecar

    root = tmp_path / "ckpt"
    (root / "checkpoint-5").mkdir(parents=True)
    (root / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    (root / "checkpoint-6").mkdir()
    save_files(root, 7)
    (root / "last.ckpt").symlink_to("step_7.pt")
    env = {**clean_environ(), "STARFORGE_ENABLED": "0", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    done = sidecar(["check", "--json", "--checkpoint-upload", "never", "--checkpoints",
                    str(root), "--checkpoints", str(tmp_path / "later")], env, tmp_path / "check")
    assert done.status == 0, done.stderr
    steps = [s for s in json.loads(done.stdout)["steps"] if s["name"] == "checkpoints"]
    first, later = ({**s, **s["details"]} for s in steps)
    assert first["status"] == "warn" and "NOT POSTED" in first["message"]
    assert "--artifact-uri" in first["message"]
    assert "2 hf-trainer (checkpoint), 1 pt (checkpoint)" in first["message"]
    assert first["waiting"] == ["checkpoint-6: no trainer_state.json yet"]
    assert first["aliases"] == 1 and first["complete"] == 2
    assert later["status"] == "warn" and "does not exist yet" in later["message"]
    mapped = sidecar(["check", "--checkpoints", str(root), "--artifact-uri",
                      f"{root}={BUCKET}"], env, tmp_path / "check2")
    assert f"posted as {BUCKET}/..." in mapped.stdout.decode(), mapped.stdout
    uploaded = sidecar(["check", "--checkpoints", str(root)], env, tmp_path / "check3")
    assert "uploaded through the ingest's signed URLs (--checkpoint-upload auto, in a " \
           "container)" in uploaded.stdout.decode(), uploaded.stdout


def test_options_from_variables_and_the_file_and_a_bad_mapping_named(tmp_path: Path) -> None:
    import argparse

    from sidecar.config import resolve
    from sidecar.exits import ConfigError

    args = argparse.Namespace()
    environ = {"STARFORGE_ENABLED": "0", "SIDECAR_CHECKPOINTS": "/a:/b",
               "SIDECAR_ARTIFACT_URI": "/a=s3://x/a,/b=gs://y/b"}
    cfg = resolve(args, "watch", environ)
    assert cfg.checkpoints == ("/a", "/b")
    assert cfg.artifact_uri == ("/a=s3://x/a", "/b=gs://y/b")
    toml = tmp_path / "sidecar.toml"
    toml.write_text('checkpoints = ["/c"]\nartifact-uri = ["/c=s3://z/c"]\n')
    cfg = resolve(argparse.Namespace(config=str(toml)), "run", {"STARFORGE_ENABLED": "0"})
    assert (cfg.checkpoints, cfg.artifact_uri) == (("/c",), ("/c=s3://z/c",))
    with pytest.raises(ConfigError, match=r"--artifact-uri='/c=bucket/c'.*not a URI"):
        resolve(argparse.Namespace(artifact_uri=["/c=bucket/c"]), "run",
                {"STARFORGE_ENABLED": "0"})
    with pytest.raises(ConfigError, match=r"SIDECAR_ARTIFACT_URI='s3://x'.*LOCAL=URI"):
        resolve(args, "run", {"STARFORGE_ENABLED": "0", "SIDECAR_ARTIFACT_URI": "s3://x"})


def test_run_registers_the_checkpoint_its_command_saved_just_before_it_exited(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    from tests.conftest import python_child, sidecar

    root = tmp_path / "ckpt"
    root.mkdir()
    child = python_child(
        "import sys, zipfile\n"
        f"with zipfile.ZipFile({str(root / 'final.pt')!r}, 'w') as z:\n"
        "    z.writestr('archive/data.pkl', b'x' * 64)\n")
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--checkpoints", str(root), "--artifact-uri", f"{root}={BUCKET}",
                    "--", *child], env, tmp_path / "run")
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter([f"{BUCKET}/final.pt"])
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running",
                                                                 "succeeded"]


def test_on_a_multi_node_run_only_node_rank_0_registers(ingest: RunningIngest, quick: None,
                                                        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    watch = Watch(ingest, tmp_path, root, NODE_RANK="1", NNODES="2").start()
    save_files(root, 5)
    _await_line(watch, f"{root / 'step_5.pt'} is complete and not registered here: this is "
                "node rank 1")
    assert watch.stop().status == 0
    assert artifacts(ingest) == []


async def test_a_run_without_checkpoints_has_no_registration_to_wait_for(tmp_path: Path) -> None:
    from sidecar.delivery.artifacts import Artifacts
    from sidecar.delivery.client import IngestClient

    client = IngestClient("http://127.0.0.1:9/api/ingest", (), lambda: "tok")
    artifacts = Artifacts(tmp_path, RUN_ID, client)  # never started: nothing journaled
    assert await artifacts.drain(0.0)  # a shutdown is not held up for the drain timeout
    assert artifacts.pending == 0


# -- the writers' rules, one by one --------------------------------------------------------------

def test_names_a_writer_uses_while_saving_are_never_checkpoints() -> None:
    from sidecar.sources.files.checkpoint_formats import is_alias_name, work_in_progress

    for name in ("tmp-checkpoint-500", "model.safetensors.tmpa1b2c3", ".metadata.tmp",
                 "step_5.pt.part", "x.partial", "x.incomplete", "model.pt~", ".hidden.pt",
                 "run--step=5-last-unfinished"):
        assert work_in_progress(name), name
    for name in ("checkpoint-500", "step_5.pt", "epoch=0-step=2.ckpt", "global_step20"):
        assert not work_in_progress(name), name
    assert is_alias_name("last.ckpt") and is_alias_name("last-v1.ckpt")
    assert not is_alias_name("epoch=0-step=2.ckpt")
    nemo = frozenset({"gpt--val_loss=1.2-step=90", "gpt--val_loss=1.1-step=90-last"})
    assert is_alias_name("gpt--val_loss=1.1-step=90-last", nemo)  # the same step twice
    assert not is_alias_name("gpt--val_loss=1.1-step=95-last", nemo)  # the only copy of 95


def test_steps_come_from_the_names_writers_give() -> None:
    from sidecar.sources.files.checkpoint_formats import step_in_name

    assert [step_in_name(n) for n in (
        "checkpoint-500", "global_step20", "global_step_30", "iter_0000040", "epoch=1-step=50",
        "step-60", "model_70", "ckpt-80", "checkpoint_3", "final", "megatron_gpt--val_loss=1.2"
        "-step=90-consumed_samples=100.0")] == [500, 20, 30, 40, 50, 60, 70, 80, None, None, 90]


def test_nemo_waits_for_its_unfinished_marker_and_a_nemo_file_for_its_tar_end(
        tmp_path: Path) -> None:
    import io
    import tarfile

    from sidecar.sources.files.checkpoint_formats import Shape, assess, folder_shape

    run = tmp_path / "gpt--step=90-last"
    (run / "weights").mkdir(parents=True)
    (run / "context").mkdir()
    save_files(run / "weights", 1)
    (run / "weights" / "step_1.pt").rename(run / "weights" / "common.pt")
    shape = folder_shape(run.name, frozenset(), frozenset({"weights", "context"}))
    assert shape == Shape("nemo", "checkpoint", 90)
    marker = tmp_path / (run.name + "-unfinished")
    marker.touch()
    assert assess(shape, run, ("weights/common.pt",)).why == f"{marker.name} is still there"
    marker.unlink()
    assert assess(shape, run, ("weights/common.pt",)).complete
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("model_config.yaml"), io.BytesIO(b""))
    whole = buffer.getvalue()
    nemo = tmp_path / "model.nemo"
    nemo.write_bytes(whole[:1024])
    assert not assess(Shape("nemo", "checkpoint", None), nemo, ()).complete
    nemo.write_bytes(whole)
    assert assess(Shape("nemo", "checkpoint", None), nemo, ()).complete


def test_the_shards_of_an_export_are_never_checkpoints_of_their_own(tmp_path: Path) -> None:
    from sidecar.sources.files.checkpoints import checkpoints_in

    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    shard = len(header).to_bytes(8, "little") + header + bytes(4)
    (export / "model-00001-of-00002.safetensors").write_bytes(shard)  # the second not yet
    found, _ = checkpoints_in(str(tmp_path))
    assert [(c.path, c.shape.format, c.assessment.why) for c in found] == [
        (str(export), "hf", "shards without their index yet")]
    (export / "model-00002-of-00002.safetensors").write_bytes(shard)
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    ((c,), _) = checkpoints_in(str(tmp_path))
    assert c.assessment.complete and c.shape.kind == "hf_export"


def test_a_checkpoint_judged_incomplete_is_not_looked_at_again_until_something_changes(
        tmp_path: Path) -> None:
    import time

    from sidecar.sources.files import checkpoints as c
    from sidecar.sources.files.checkpoint_formats import Shape

    watcher = c.CheckpointWatcher([str(tmp_path)], lambda found: None, lambda p, f: False,
                                  c.ArtifactPaths([], ""))
    entry = watcher.entries["x"] = c.Candidate("x", str(tmp_path), Shape("pt", "checkpoint", 1))
    entry.seen_at = time.monotonic() - 10 * c.QUIET_S  # settled long ago
    entry.why = "no zip end record yet (still being written)"  # judged: a writer that died
    assert watcher._next_look_in() == c.REMOTE_LOOK_S  # no inotify here: the interval
    entry.why = "changing"  # its files changed since it was judged: judged at the next look
    assert watcher._next_look_in() == c.MIN_LOOK_S


def test_a_checkpoint_folder_judged_empty_is_registered_as_soon_as_its_save_ends(
        ingest: RunningIngest, quick: None, tmp_path: Path) -> None:
    # A trainer that creates checkpoint-7/ and gathers its state for a while before writing:
    # the folder is watched from the first look, so its files are seen as they arrive, not at
    # the next walk made without events (a minute on).
    root = tmp_path / "ckpt"
    (root / "checkpoint-7").mkdir(parents=True)
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
    _await_line(watch, f"{root / 'checkpoint-7'} is not complete: no trainer_state.json yet")
    save_files(root / "checkpoint-7", 7)
    (root / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7}')
    ingest.wait_for(lambda: artifacts(ingest), 15)
    assert watch.stop().status == 0
    assert paths(ingest) == Counter([f"{BUCKET}/checkpoint-7"])


def test_a_nemo_distributed_ckpt_folder_waits_for_its_marker_to_go(tmp_path: Path) -> None:
    from sidecar.sources.files.checkpoint_formats import assess, folder_shape

    ckpt = tmp_path / "megatron_gpt--step=40-last.ckpt"
    ckpt.mkdir()
    for name in (".metadata", "__0_0.distcp", "metadata.json"):
        (ckpt / name).write_text("{}")
    shape = folder_shape(ckpt.name, frozenset({".metadata", "__0_0.distcp", "metadata.json"}),
                         frozenset())
    assert shape is not None and (shape.format, shape.step) == ("lightning-distcp", 40)
    marker = tmp_path / "megatron_gpt--step=40-last-unfinished"  # NeMo drops the .ckpt
    marker.touch()
    files = (".metadata", "__0_0.distcp", "metadata.json")
    assert assess(shape, ckpt, files).why == f"{marker.name} is still there"
    marker.unlink()
    assert assess(shape, ckpt, files).complete


def test_a_deepspeed_tag_of_the_callers_own_is_one_checkpoint_not_a_pile_of_files() -> None:
    from sidecar.sources.files.checkpoint_formats import Shape, folder_shape

    names = frozenset({"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"})
    assert folder_shape("step-500", names, frozenset()) == Shape("deepspeed", "checkpoint", 500)
    assert folder_shape("best", names, frozenset()) == Shape("deepspeed", "checkpoint", None)


def test_a_deepspeed_tag_latest_has_moved_past_is_complete_one_newer_waits(
        tmp_path: Path) -> None:
    import time

    from sidecar.sources.files.checkpoint_formats import Shape, assess

    shape = Shape("deepspeed", "checkpoint", None)
    older, newer = tmp_path / "warmup", tmp_path / "best"
    for tag in (older, newer):
        tag.mkdir()
        save_files(tag, 1)
        (tag / "step_1.pt").rename(tag / "mp_rank_00_model_states.pt")
    files = ("mp_rank_00_model_states.pt",)
    (tmp_path / "latest").write_text("warmup")  # rank 0 is done with warmup; best has begun
    os.utime(tmp_path / "latest", ns=(time.time_ns() - 10**9, time.time_ns() - 10**9))
    assert assess(shape, newer, files).why == "latest does not name it yet"
    assert assess(shape, older, files).complete
    (tmp_path / "latest").write_text("best")  # written after every file of both
    assert assess(shape, newer, files).complete and assess(shape, older, files).complete


# A checkpoint still being written when the sidecar is told to stop keeps its drain busy to the
# deadline: here its drain is made to take all of it, as a save that never settles would. Files
# are polled once a minute, so what the log gains before the stop is read by the drain alone.
BUSY_CHECKPOINT_DRAIN = (
    sys.executable, "-c",
    "import asyncio, sys, time; import sidecar.sources.files.checkpoints as c\n"
    "import sidecar.sources.files.follow as f; f.POLL_S = 60.0\n"
    "async def drain(self, deadline):\n"
    "    await asyncio.sleep(max(deadline - time.monotonic(), 0))\n"
    "c.CheckpointWatcher.drain = drain\n"
    "from sidecar.cli import main; sys.exit(main())")


def test_a_checkpoint_busy_at_the_stop_leaves_the_files_their_drain(
        ingest: RunningIngest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last lines of a followed log, written as the stop comes, are read and delivered
    while the checkpoints are still being judged, not after."""
    monkeypatch.setattr("tests.conftest.SIDECAR", BUSY_CHECKPOINT_DRAIN)
    root, log = tmp_path / "ckpt", tmp_path / "train.log"
    root.mkdir()
    save_files(root, 1)
    log.write_text("first\n")
    watch = Watch(ingest, tmp_path, root, "--log", str(log), "--drain-timeout", "4",
                  SIDECAR_FILE_WATCH="poll").start()
    wait_until(lambda: bool(artifacts(ingest)) and "first\n" in "".join(
        c for r in ingest.records("logs") for c in r["chunks"]), timeout=30)
    with log.open("a") as out:
        out.writelines(f"last {n}\n" for n in range(200))
    assert watch.stop().status == 0
    text = "".join(c for r in ingest.records("logs") for c in r["chunks"])
    assert text.count("last ") == 200, text[-300:]


def test_a_slow_artifact_route_is_given_the_whole_drain(ingest: RunningIngest, quick: None,
                                                        tmp_path: Path) -> None:
    """30 checkpoints saved just before the exit, /artifact answering in 0.6 s: all 30 are
    registered within a 30 s drain (the wrapper left at half of it, a dozen short)."""
    from tests.conftest import python_child, sidecar

    root = tmp_path / "ckpt"
    root.mkdir()
    child = python_child(
        "import zipfile\n"
        "for step in range(30):\n"
        f"    with zipfile.ZipFile(f'{root}/step_{{step}}.pt', 'w') as z:\n"
        "        z.writestr('archive/data.pkl', b'x' * 64)\n")
    ingest.add_fault(Fault(route="artifact", slow_answer_s=0.6))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--drain-timeout", "30", "--checkpoints", str(root),
                    "--artifact-uri", f"{root}={BUCKET}", "--", *child], env, tmp_path / "run",
                   timeout=90)
    assert done.status == 0, done.stderr
    assert paths(ingest) == Counter(f"{BUCKET}/step_{step}.pt" for step in range(30))
