"""Every file read back from the state dir is checked before it is trusted (issue 13, cause 3):
a malformed one is moved aside with one WARNING and the run carries on as if it were absent
(docs/ingest.md#at-least-once: nothing lost, repeats allowed). Never a crash, never a silent
stop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.delivery.journal import frame
from sidecar.sources.files import offsets as offsets_module
from sidecar.sources.files.offsets import parse_offsets
from sidecar.statefile import Malformed, load_checked
from tests.conftest import RUN_ID, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest

POINTS = 50


def jsonl_file(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"key": "loss", "step": s, "value": s / 4}) + "\n"
                            for s in range(POINTS)))
    return path


def mark_of(path: Path, **fields: object) -> dict[str, object]:
    """offsets.json holding one mark for `path`, at its real device and inode, with `fields`."""
    st = os.stat(path)
    mark = {"path": str(path), "dev": st.st_dev, "ino": st.st_ino,
            "fingerprint": path.read_bytes()[:256].hex(), "offset": 0, "state": {}, **fields}
    return {"version": 1, "files": {f"{st.st_dev}:{st.st_ino}": mark}}


Prepare = Callable[[Path, Path], None]  # (the run's state folder, the JSONL file)


def offsets(doc: Callable[[Path], object]) -> Prepare:
    return lambda run_dir, jsonl: (run_dir / "offsets.json").write_text(json.dumps(doc(jsonl)))


def put(relative: str, data: bytes) -> Prepare:
    def prepare(run_dir: Path, jsonl: Path) -> None:
        path = run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return prepare


def fifo(relative: str) -> Prepare:
    def prepare(run_dir: Path, jsonl: Path) -> None:
        path = run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    return prepare


CASES: list[tuple[str, Prepare, str]] = [
    ('offsets.json {"files": null}', offsets(lambda f: {"version": 1, "files": None}),
     "offsets.json"),
    ('offsets.json {"files": []}', offsets(lambda f: {"version": 1, "files": []}),
     "offsets.json"),
    ("a mark with a non-hex fingerprint", offsets(lambda f: mark_of(f, fingerprint="zz-not-hex")),
     "offsets.json"),
    ("a mark with a string offset", offsets(lambda f: mark_of(f, offset="12")), "offsets.json"),
    ('a mark with "state": null', offsets(lambda f: mark_of(f, state=None)), "offsets.json"),
    ("a stray backup.seg in the hardware spool", put("spool/hardware/backup.seg", b"x" * 64),
     "backup.seg"),
    ("a spool cursor that is not two numbers", put("spool/hardware/cursor", b"seven"), "cursor"),
    ("a FIFO as a spool segment", fifo("spool/hardware/00000000.seg"), "00000000.seg"),
    ("a lifecycle journal count that is not a number", put("lifecycle.journal.acked", b"-x"),
     "lifecycle.journal.acked"),
]


@pytest.mark.parametrize(("prepare", "named"), [(p, n) for _, p, n in CASES],
                         ids=[c[0] for c in CASES])
def test_a_malformed_state_file_is_set_aside_and_the_run_delivers_everything(
        ingest: RunningIngest, tmp_path: Path, prepare: Prepare, named: str) -> None:
    jsonl = jsonl_file(tmp_path)
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    prepare(run_dir, jsonl)
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--jsonl", str(jsonl), "--", *python_child("print('trained')")], env,
                   tmp_path / "out")
    err = done.stderr.decode()
    assert done.status == 0 and done.stdout == b"trained\n", err
    assert "Traceback" not in err and " ERROR " not in err, err
    warnings = [line for line in err.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and named in warnings[0], err
    assert list(run_dir.rglob(f"{Path(named).name}.bad-*")), sorted(run_dir.rglob("*"))
    steps = {p["step"] for r in ingest.records("metrics") for p in r["points"]}
    assert steps == set(range(POINTS))
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running",
                                                                 "succeeded"]


@pytest.mark.parametrize("record", [b"not json", b'{"event": "running"}', b"[1, 2]",
                                    b'{"run_id": "another-run", "event": "failed", "ts": "x"}'])
def test_a_journal_record_that_is_no_event_of_this_run_is_skipped_never_posted(
        ingest: RunningIngest, tmp_path: Path, record: bytes) -> None:
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    good = json.dumps({"run_id": RUN_ID, "event": "starting",
                       "ts": "2026-12-01T08:00:00+00:00"}).encode()
    (run_dir / "lifecycle.journal").write_bytes(frame(record) + frame(good))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--", *python_child("pass")], env, tmp_path / "out")
    err = done.stderr.decode()
    assert done.status == 0 and "Traceback" not in err, err
    assert err.count("not lifecycle events of run") == 1, err
    events = [(r["event"], r["ts"]) for r in ingest.records("lifecycle")]
    assert events[0] == ("starting", "2026-12-01T08:00:00+00:00")  # the earlier start's, kept
    assert [e for e, _ in events[1:]] == ["running", "succeeded"]  # `starting` is recorded once


@pytest.mark.parametrize("kind", ["directory", "FIFO", "symbolic link"])
@pytest.mark.parametrize("name", ["lifecycle.journal", "lifecycle.journal.acked",
                                  "logs-tail.journal", "lock"])
def test_what_is_no_file_in_the_state_folder_is_set_aside_and_the_command_runs_at_once(
        ingest: RunningIngest, tmp_path: Path, name: str, kind: str) -> None:
    """A journal as a directory gave a traceback and the command never started; as a FIFO the
    wrapper waited for a writer for good, before the spawn; a link is never written through."""
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the sidecar's\n")
    if kind == "directory":
        (run_dir / name).mkdir()
    elif kind == "FIFO":
        os.mkfifo(run_dir / name)
    else:
        (run_dir / name).symlink_to(outside)
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--", *python_child("print('trained')")], env, tmp_path / "out",
                   timeout=20)
    err = done.stderr.decode()
    assert done.status == 0 and done.stdout == b"trained\n", err
    assert "Traceback" not in err and " ERROR " not in err, err
    warnings = [line for line in err.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and f"{name} is malformed (a {kind} " in warnings[0], err
    assert list(run_dir.glob(f"{name}.bad-*")), sorted(run_dir.iterdir())
    assert outside.read_bytes() == b"not the sidecar's\n"
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running",
                                                                 "succeeded"]


def test_a_link_at_the_dead_letter_file_is_set_aside_and_the_letter_kept_inside(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """dead-letter.jsonl was opened for appending as any file: a symbolic link there was
    followed, and the refused payload (225 B) written wherever it pointed."""
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text(json.dumps({"key": "poison", "step": 0, "value": 1.0}) + "\n")
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "letters.jsonl"
    outside.parent.mkdir()
    (run_dir / "dead-letter.jsonl").symlink_to(outside)
    ingest.add_fault(Fault(route="metrics", reject_if_contains="poison"))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--jsonl", str(jsonl), "--", *python_child("print('trained')")], env,
                   tmp_path / "out")
    err = done.stderr.decode()
    assert done.status == 0 and "Traceback" not in err, err
    assert not outside.exists(), outside.read_text()
    assert list(outside.parent.iterdir()) == []
    [aside] = run_dir.glob("dead-letter.jsonl.bad-*")
    assert aside.is_symlink()
    assert "dead-letter.jsonl is malformed (a symbolic link " in err, err
    letter = run_dir / "dead-letter.jsonl"
    assert letter.is_file() and not letter.is_symlink()
    [kept] = [json.loads(line) for line in letter.read_text().splitlines()]
    assert kept["route"] == "metrics" and kept["status"] == 400 and "poison" in kept["body"]


def test_a_spooled_payload_that_is_not_json_is_skipped(ingest: RunningIngest,
                                                       tmp_path: Path) -> None:
    spool = tmp_path / "state" / RUN_ID / "spool" / "hardware"
    spool.mkdir(parents=True)
    sample = {"run_id": RUN_ID, "node": "n", "points": [
        {"key": "cpu/utilization_percent", "value": 5.0, "ts": "2026-12-01T08:00:00+00:00"}]}
    (spool / "00000000.seg").write_bytes(frame(b"\xff not json") + frame(json.dumps(sample)
                                                                          .encode()))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--", *python_child("pass")], env, tmp_path / "out")
    err = done.stderr.decode()
    assert done.status == 0 and "Traceback" not in err, err
    assert "not JSON objects; skipped" in err
    assert sample in ingest.records("hardware")


# -- the loader itself ---------------------------------------------------------------------------

def test_an_absent_file_is_none_and_nothing_is_said(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    assert load_checked(tmp_path / "offsets.json", parse_offsets) is None
    assert not caplog.records


@pytest.mark.parametrize("data", [b"", b"\x00garbage{", b"[]", b'{"files": 3}',
                                  b'{"files": {"1:2": {"path": "p"}}}',
                                  b'{"files": {"1:2": {"path": "p", "dev": 1, "ino": 2, '
                                  b'"fingerprint": "ab", "offset": -1, "state": {}}}}',
                                  b'{"files": {"1:2": {"path": "p", "dev": true, "ino": 2, '
                                  b'"fingerprint": "ab", "offset": 0, "state": {}}}}'])
def test_malformed_offsets_are_moved_aside_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data: bytes) -> None:
    path = tmp_path / "offsets.json"
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        assert load_checked(path, parse_offsets) is None
    assert not path.exists()
    assert [p.read_bytes() for p in tmp_path.glob("offsets.json.bad-*")] == [data]
    assert len(caplog.records) == 1 and "malformed" in caplog.records[0].getMessage()


def test_well_formed_offsets_load_and_unknown_fields_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "offsets.json"
    path.write_text(json.dumps({"version": 2, "files": {"1:2": {
        "path": "p", "dev": 1, "ino": 2, "fingerprint": "00ff", "offset": 7,
        "state": {"line": 3}, "added_later": 1}}}))
    marks = load_checked(path, parse_offsets)
    assert marks is not None and marks["1:2"].offset == 7 and marks["1:2"].state == {"line": 3}


def test_a_parser_refusal_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(Malformed, match="'offset' is '12', not a whole number"):
        parse_offsets(json.dumps({"files": {"1:2": {
            "path": "p", "dev": 1, "ino": 2, "fingerprint": "00", "offset": "12",
            "state": {}}}}).encode())


def test_a_malformed_status_address_file_is_set_aside(tmp_path: Path) -> None:
    from sidecar.commands.status import find_addresses

    folder = tmp_path / RUN_ID
    folder.mkdir()
    (folder / "status-addr").write_text("127.0.0.1:notaport\n")
    assert find_addresses(tmp_path, "off") == ["127.0.0.1:9620"]
    assert list(folder.glob("status-addr.bad-*"))


# -- replay: what the run's files hold past their committed offsets ------------------------------

def test_replay_delivers_the_points_a_timed_out_drain_left_in_the_files(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Replay printed `6/6 payloads delivered`, exit 0, having sent no metric at all."""
    jsonl = jsonl_file(tmp_path)
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                       SIDECAR_DRAIN_TIMEOUT="1")
    ingest.add_fault(Fault(route="metrics", status=503))
    done = sidecar(["run", "--jsonl", str(jsonl), "--", *python_child("pass")], env,
                   tmp_path / "run")
    assert done.status == 0, done.stderr.decode()
    assert not ingest.records("metrics")  # the drain timed out with every point unacknowledged
    ingest.clear_faults()
    replayed = sidecar(["replay"], env, tmp_path / "replay")
    err = replayed.stderr.decode()
    assert replayed.status == 0, err
    steps = {p["step"] for r in ingest.records("metrics") for p in r["points"]}
    assert steps == set(range(POINTS))
    assert f"replay: {POINTS} metric points read again" in err
    again = sidecar(["replay"], env, tmp_path / "replay2")
    assert again.status == 0 and "replay: 0 metric points" in again.stderr.decode()


def test_replay_names_a_file_it_cannot_read_again(ingest: RunningIngest, tmp_path: Path) -> None:
    jsonl = jsonl_file(tmp_path)
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / "offsets.json").write_text(json.dumps(mark_of(jsonl, offset=10)))
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    replayed = sidecar(["replay"], env, tmp_path / "replay")
    err = replayed.stderr.decode()
    assert replayed.status == 1, err
    assert str(jsonl) in err and "--jsonl" in err and "Traceback" not in err


def test_sidecar_status_finds_the_address_in_a_per_node_folder(tmp_path: Path) -> None:
    """The default state dir has a folder per run id and per node
    (docs/commands.md#the-state-folder)."""
    from sidecar.commands.status import find_addresses

    folder = tmp_path / RUN_ID / "gpu-node-7"
    folder.mkdir(parents=True)
    (folder / "status-addr").write_text("127.0.0.1:45678\n")
    assert find_addresses(tmp_path, "off")[0] == "127.0.0.1:45678"


async def test_offsets_are_written_at_most_ten_times_a_second_and_the_last_always(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file read at full speed is acknowledged every few milliseconds: each write of the
    offsets (two fsyncs) is spaced, the latest mark still reaches the disk at stop."""
    writes: list[bytes] = []
    real_write = offsets_module.write_atomic

    def counting(path: Path, data: bytes) -> None:
        writes.append(data)
        real_write(path, data)

    monkeypatch.setattr(offsets_module, "write_atomic", counting)
    marks = offsets_module.Offsets(tmp_path / "offsets.json")
    marks.start()
    began = asyncio.get_running_loop().time()
    for offset in range(1, 101):  # 100 acknowledgements in about half a second
        marks.set(offsets_module.Mark("/f", 1, 2, "ab", offset))
        await asyncio.sleep(0.005)  # the acknowledgements' pace, not a synchronisation
    await marks.stop()
    elapsed = asyncio.get_running_loop().time() - began
    # At most ten a second over however long a loaded machine took, plus the first and the
    # last at stop; and far fewer than one per acknowledgement.
    assert 2 <= len(writes) <= 10 * elapsed + 2
    assert json.loads(writes[-1])["files"]["1:2"]["offset"] == 100


async def test_a_save_cancelled_mid_write_never_lands_after_a_newer_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() cancels the saver, whose write goes on in its thread; the final save's write of
    newer offsets overtook it and was then replaced by it, and a restart read again what had
    been delivered (801 lines of a rotated log, once in five runs)."""
    real_write = offsets_module.write_atomic
    old_started, newer_written = threading.Event(), threading.Event()
    finished: list[int] = []

    def slow_old_write(path: Path, data: bytes) -> None:
        offset = json.loads(data)["files"]["1:2"]["offset"]
        if offset == 1:
            old_started.set()
            newer_written.wait(1.0)  # the old write lasts until the newer one is done, or 1 s
        real_write(path, data)
        if offset == 2:
            newer_written.set()
        finished.append(offset)

    monkeypatch.setattr(offsets_module, "write_atomic", slow_old_write)
    marks = offsets_module.Offsets(tmp_path / "offsets.json")
    marks.set(offsets_module.Mark("/f", 1, 2, "ab", 1))
    first = asyncio.ensure_future(marks.save())
    assert await asyncio.to_thread(old_started.wait, 5.0), "the first write never began"
    first.cancel()
    marks.set(offsets_module.Mark("/f", 1, 2, "ab", 2))
    assert await marks.save()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while len(finished) < 2:  # the cancelled save's thread, too, has written
        assert loop.time() < deadline, f"writes finished: {finished}"
        await asyncio.sleep(0.01)
    assert finished == [1, 2]
    assert json.loads((tmp_path / "offsets.json").read_text())["files"]["1:2"]["offset"] == 2
