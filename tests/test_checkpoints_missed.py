"""No checkpoint missed in silence: a real `sidecar watch`/`run` beside writers that save as new
users do (torch.save into checkpoint-N/, a folder made after the sidecar started, a FIFO where
a checkpoint belongs, a Hydra folder), the checking ingest receiving /artifact."""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import RUN_ID, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest, wait_until
from tests.test_checkpoints import BUCKET, QUICK_QUIET, Watch, artifacts, paths


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", QUICK_QUIET)


def torch_save(path: Path, payload: bytes = b"\x80\x02}q\x00.") -> None:
    """torch.save's format (a zip, its end record last), written in place as torch.save does."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", payload * 8)


def test_torch_save_files_in_checkpoint_n_folders_are_registered_despite_rotation(
        ingest: RunningIngest, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    watch = Watch(ingest, tmp_path, root).start()
    for step in (5, 10, 15):
        folder = root / f"checkpoint-{step}"
        folder.mkdir()
        torch_save(folder / "model.pt")
        torch_save(folder / "optimizer.pt")
        ingest.wait_for(lambda s=step: f"{BUCKET}/checkpoint-{s}" in paths(ingest), 30,
                        f"checkpoint-{step} registered")
        if step == 15:  # keep the last 2
            shutil.rmtree(root / "checkpoint-5")
    done = watch.stop()
    assert done.status == 0
    by_path = {a["path"]: a for a in artifacts(ingest)}
    assert sorted(by_path) == [f"{BUCKET}/checkpoint-{s}" for s in (10, 15, 5)]
    assert {a["format"] for a in by_path.values()} == {"pt"}
    assert by_path[f"{BUCKET}/checkpoint-10"]["step"] == 10
    assert "deleted before it was complete" not in done.stderr.decode()


def test_a_checkpoints_folder_made_after_the_start_is_found_within_a_second(
        ingest: RunningIngest, tmp_path: Path) -> None:
    root = tmp_path / "emptydir" / "out" / "ckpt"
    (tmp_path / "emptydir").mkdir()
    watch = Watch(ingest, tmp_path, root).start()
    wait_until(lambda: "does not exist yet" in watch.stderr(), 30, "said at start",
               watch.stderr)
    root.mkdir(parents=True)
    torch_save(root / "step_1.pt")
    made = time.monotonic()
    # a minute on today's main (the walk without events); here, its parent's events and a
    # look every second while it is missing, then the quiet time
    ingest.wait_for(lambda: artifacts(ingest), 20, "registered")
    assert time.monotonic() - made < 20
    done = watch.stop()
    assert done.status == 0
    assert "the folder exists now" in done.stderr.decode()
    assert paths(ingest) == {f"{BUCKET}/step_1.pt": 1}


def test_a_fifo_named_like_a_checkpoint_never_blocks_and_the_exit_names_what_was_left(
        ingest: RunningIngest, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "global_step3").mkdir(parents=True)
    os.mkfifo(root / "step_2.pt")
    os.mkfifo(root / "global_step3" / "mp_rank_00_model_states.pt")
    torch_save(root / "step_1.pt")
    (root / "step_9.pt").write_bytes(b"PK\x03\x04 half of a save")
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--checkpoints", str(root), "--artifact-uri", f"{root}={BUCKET}",
                    "--", *python_child("pass")], env, tmp_path / "run", timeout=60)
    assert done.status == 0, done.stderr
    assert paths(ingest) == {f"{BUCKET}/step_1.pt": 1}
    said = done.stderr.decode()
    assert f"{root / 'step_9.pt'} was not registered: no zip end record yet" in said, said


def test_a_hydra_folder_maps_and_names_are_percent_encoded_or_refused(
        ingest: RunningIngest, tmp_path: Path) -> None:
    root = tmp_path / "outputs" / "lr=0.1,bs=8"
    root.mkdir(parents=True)
    torch_save(root / "step 1#a?b%20.pt")
    torch_save(root / "epoch=0-step=2.pt")
    torch_save(root / "step_3\nx.pt")
    watch = Watch(ingest, tmp_path, root, mapped=False)
    watch.args += ["--artifact-uri", f"{root}=s3://bucket/run=1"]
    watch.start()
    ingest.wait_for(lambda: len(artifacts(ingest)) >= 2, 30, "two registered")
    wait_until(lambda: "which no URI can carry" in watch.stderr(), 30, "the newline refused",
               watch.stderr)
    done = watch.stop()
    assert done.status == 0
    assert sorted(paths(ingest)) == ["s3://bucket/run=1/epoch=0-step=2.pt",
                                     "s3://bucket/run=1/step%201%23a%3Fb%2520.pt"]
    refused = [line for line in done.stderr.decode().splitlines() if "no URI can" in line]
    assert "step_3\\nx.pt" in refused[0]  # escaped: the newline does not split the line


def test_a_rewritten_last_pt_is_registered_again_only_when_something_tells_them_apart(
        ingest: RunningIngest, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    watch = Watch(ingest, tmp_path, root).start()
    torch_save(root / "last.pt")
    ingest.wait_for(lambda: artifacts(ingest), 30, "registered")
    for _ in range(2):  # saved over again, the same size: nothing tells the two apart
        saved_at = (root / "last.pt").stat().st_mtime_ns
        wait_until(lambda t=saved_at: time.time_ns() > t + 10_000_000, 5,
                   "the clock past the last save's modification time")
        torch_save(root / "last.pt")
        wait_until(lambda n=_: watch.stderr().count("rewritten with the same step") > n, 30,
                   "the rewrite judged", watch.stderr)
    torch_save(root / "last.pt", b"\x80\x02}q\x01(." * 3)  # another size: another checkpoint
    ingest.wait_for(lambda: len(artifacts(ingest)) >= 2, 30, "the bigger one registered")
    assert watch.stop().status == 0
    sizes = [a["size_bytes"] for a in artifacts(ingest)]
    assert len(sizes) == 2 and sizes[0] != sizes[1]


def test_an_export_whose_tokenizer_lands_after_its_weights_is_registered_once_whole(
        ingest: RunningIngest, tmp_path: Path) -> None:
    import json
    import struct

    root = tmp_path / "ckpt"
    export = root / "final-model"
    export.mkdir(parents=True)
    watch = Watch(ingest, tmp_path, root).start()
    header = json.dumps({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (export / "config.json").write_text('{"model_type": "demo"}')
    (export / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"abcd")
    time.sleep(1.5)  # the Trainer's save_model: the tokenizer seconds after the weights
    (export / "tokenizer.json").write_text('{"version": "1.0"}')
    ingest.wait_for(lambda: artifacts(ingest), 30, "registered")
    done = watch.stop()
    assert done.status == 0
    (registered,) = artifacts(ingest)
    assert registered["size_bytes"] == sum(f.stat().st_size for f in export.iterdir())


def test_a_legacy_pickle_still_open_for_writing_is_never_complete_however_long_it_pauses(
        ingest: RunningIngest, tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    root.mkdir()
    go = tmp_path / "go"
    go.write_text("")
    # torch.save(..., _use_new_zipfile_serialization=False): a pickle, nothing to check at its
    # end; half of it written, then a pause far past the quiet time
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "with open(sys.argv[1], 'wb') as fh:\n"
        "    fh.write(b'\\x80\\x02\\x8a\\nl\\xfc\\x9cF\\xf9 j\\xa8P\\x19.' + b'x' * 500_000)\n"
        "    fh.flush()\n"
        "    while open(sys.argv[2]).read() != 'finish':\n"
        "        time.sleep(0.05)\n"
        "    fh.write(b'y' * 500_000)\n"), str(root / "step_1.pth"), str(go)])
    try:
        watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
        wait_until(lambda: "still open for writing by process" in watch.stderr(), 30,
                   "judged while its writer holds it", watch.stderr)
        assert not artifacts(ingest)
        go.write_text("finish")
        assert writer.wait(30) == 0
    finally:
        writer.kill()
    ingest.wait_for(lambda: artifacts(ingest), 30, "registered once closed")
    assert watch.stop().status == 0
    (registered,) = artifacts(ingest)
    assert registered["size_bytes"] == (root / "step_1.pth").stat().st_size


@pytest.fixture(scope="module")
def legacy_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """torch.save(..., _use_new_zipfile_serialization=False), by torch itself in a child: a
    small save of every kind of storage, and one of 1.2 MB."""
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("legacy")
    subprocess.run([sys.executable, "-c", (
        "import sys, torch\n"
        "small = {'h': torch.zeros(4, dtype=torch.float16), 'l': torch.arange(3),\n"
        "         'view': torch.ones(2, 2)[0], 'b': torch.ones(3, dtype=torch.bool),\n"
        "         'c': torch.ones(2, dtype=torch.complex64), 'empty': torch.empty(0),\n"
        "         'u': torch.UntypedStorage(5), 'layer': torch.nn.Linear(2, 1), 'lr': [0.1, 'a']}\n"
        "torch.save(small, sys.argv[1] + '/small.pt', _use_new_zipfile_serialization=False)\n"
        "big = {'w': torch.arange(300_000, dtype=torch.float32), 'step': 7}\n"
        "torch.save(big, sys.argv[1] + '/big.pt', _use_new_zipfile_serialization=False)\n"),
        str(folder)], check=True, timeout=120)
    return {name: (folder / f"{name}.pt").read_bytes() for name in ("small", "big")}


def test_a_legacy_pickle_cut_anywhere_is_not_complete_and_whole_it_is(
        legacy_saves: dict[str, bytes], tmp_path: Path) -> None:
    from sidecar.sources.files.checkpoint_formats import zip_complete

    path = tmp_path / "step_1.pt"
    for name, whole in legacy_saves.items():
        path.write_bytes(whole)
        assert zip_complete(path) == "", name
        cuts = range(1, len(whole)) if name == "small" else range(1, len(whole), 4099)
        judged_whole = [n for n in cuts if path.write_bytes(whole[:n]) and not zip_complete(path)]
        assert judged_whole == [], name
    # not laid out as a legacy torch save: judged as before, by its quiet time and its writers
    path.write_bytes(b"\x80\x04not a pickle torch wrote")
    assert zip_complete(path) == ""


def test_a_legacy_pickle_written_in_two_halves_is_registered_once_and_only_whole(
        ingest: RunningIngest, tmp_path: Path, legacy_saves: dict[str, bytes]) -> None:
    whole = legacy_saves["big"]
    root = tmp_path / "ckpt"
    root.mkdir()
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug").start()
    path = root / "step_7.pt"
    # closed between the halves: no writer holds it, and its quiet time passes
    path.write_bytes(whole[:len(whole) // 2])
    wait_until(lambda: "step_7.pt is not complete" in watch.stderr() or artifacts(ingest), 30,
               "the first half judged", watch.stderr)
    assert not artifacts(ingest), "registered half-written"
    assert "cut short at" in watch.stderr()
    with path.open("ab") as fh:
        fh.write(whole[len(whole) // 2:])
    ingest.wait_for(lambda: artifacts(ingest), 30, "registered once whole")
    assert watch.stop().status == 0
    (registered,) = artifacts(ingest)
    assert registered["size_bytes"] == len(whole)


def test_a_legacy_pickle_cut_a_third_of_the_way_is_never_registered_and_named_at_the_exit(
        ingest: RunningIngest, tmp_path: Path, legacy_saves: dict[str, bytes]) -> None:
    whole = legacy_saves["big"]
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step_7.pt").write_bytes(whole[:len(whole) // 3])  # the save killed and left
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--checkpoints", str(root), "--artifact-uri", f"{root}={BUCKET}",
                    "--", *python_child("pass")], env, tmp_path / "run", timeout=60)
    assert done.status == 0, done.stderr
    assert not artifacts(ingest)
    said = done.stderr.decode()
    assert f"{root / 'step_7.pt'} was not registered: cut short at {len(whole) // 3} bytes" \
        in said, said


def test_a_walk_stops_at_its_time_limit_and_says_it_did_not_see_everything(
        tmp_path: Path) -> None:
    from sidecar.sources.files.checkpoints import look_over

    for step in range(3):
        (tmp_path / f"run{step}").mkdir()
        torch_save(tmp_path / f"run{step}" / f"step_{step}.pt")
    assert look_over(str(tmp_path))[3] is True and len(look_over(str(tmp_path))[0]) == 3
    looks, _, _, whole = look_over(str(tmp_path), limit_s=0.0)
    assert whole is False and looks == []


def test_a_local_folder_holding_the_separators_maps_from_a_variable_too() -> None:
    import argparse

    from sidecar.config import resolve

    environ = {"STARFORGE_ENABLED": "0",
               "SIDECAR_ARTIFACT_URI": "/o/lr=0.1,bs=8/ck=s3://b/r,/d=gs://c/a,b"}
    cfg = resolve(argparse.Namespace(), "watch", environ)
    assert cfg.artifact_uri == ("/o/lr=0.1,bs=8/ck=s3://b/r", "/d=gs://c/a,b")


def test_status_names_a_candidate_deleted_before_it_was_complete_and_why(
        ingest: RunningIngest, tmp_path: Path) -> None:
    import json
    import subprocess
    import urllib.request

    from tests.conftest import SIDECAR

    root = tmp_path / "ckpt"
    root.mkdir()
    watch = Watch(ingest, tmp_path, root, "--log-level", "debug",
                  SIDECAR_STATUS_ADDR="127.0.0.1:0").start()
    (root / "step_9.pt").write_bytes(b"PK\x03\x04 half of a save")
    wait_until(lambda: "step_9.pt is not complete" in watch.stderr(), 30, "judged",
               watch.stderr)
    (root / "step_9.pt").unlink()
    wait_until(lambda: "was deleted before it was complete" in watch.stderr(), 30, "seen gone",
               watch.stderr)
    address = (tmp_path / "state" / RUN_ID / "status-addr").read_text().strip()
    with urllib.request.urlopen(f"http://{address}/status", timeout=10) as answer:
        (folder,) = json.load(answer)["checkpoints"]
    assert folder["deleted"] == [[str(root / "step_9.pt"), "deleted before it was complete "
                                  "(no zip end record yet (still being written))"]]
    table = subprocess.run([*SIDECAR, "status", "--once", "--status-addr", address],
                           capture_output=True, text=True, timeout=30,
                           env={**watch.env, "COLUMNS": "400"})
    assert f"deleted {root / 'step_9.pt'}: deleted before it was complete" in table.stdout
    done = watch.stop()
    assert f"{root / 'step_9.pt'} was not registered: deleted before" in done.stderr.decode()
