"""`--checkpoints`: real writers (torch.save, safetensors, HF Trainer and save_pretrained,
Lightning, torch.distributed.checkpoint, DeepSpeed's and Megatron's layouts) in child processes,
a real `sidecar watch` beside them, the contract-checking ingest receiving /artifact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sidecar.commands.receive import Fault
from tests.conftest import RUN_ID, Finished, Sidecar, platform_env
from tests.ingest_server import RunningIngest, wait_until

BUCKET = "s3://bucket/run/ckpt"
WRITER_TIMEOUT_S = 120.0


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

    def start(self) -> Watch:
        self.runs += 1
        self.proc = Sidecar(self.args, self.env, self.tmp_path / f"watch{self.runs}")
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
        ingest: RunningIngest, tmp_path: Path) -> None:
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
