"""Every file read once: content identity across copies and rotation storms, bounded
descriptors, symlink loops, restarts mid-line, and sources that say what they matched."""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import os
import resource
import shutil
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.aio import cancel
from sidecar.records import Ticket
from sidecar.sources.base import Parsed
from sidecar.sources.files import descriptors, discover, follow, scan
from sidecar.sources.files.follow import Follower, Sink
from sidecar.sources.files.jsonl import JsonlParser
from sidecar.sources.files.kinds import BY_NAME
from sidecar.sources.files.logfile import LogFileParser
from sidecar.sources.files.offsets import Mark, Offsets, fingerprint
from sidecar.sources.files.spec import SourceSpec
from tests.conftest import RUN_ID, SIDECAR
from tests.ingest_server import RunningIngest, wait_until
from tests.test_delivery import wait_until as async_wait_until
from tests.test_status import warnings_of_sidecar
from tests.test_watch import LOGROTATE, Watch, Writer, points

CRI_TS = "2026-11-30T10:00:00.123456789Z"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir()
    return path


def repeats_and_losses(written: list[str], received: list[str]) -> tuple[int, int]:
    """(lines received more than once, counted once per extra copy; lines never received)."""
    counts = Counter(received)
    return sum(n - 1 for n in counts.values() if n > 1), len(set(written) - set(counts))


def report(case: str, written: list[str], received: list[str]) -> tuple[int, int]:
    repeated, lost = repeats_and_losses(written, received)
    print(f"{case}: {len(written)} lines written, {len(received)} received, {repeated} repeated, "
          f"{lost} lost")
    return repeated, lost


@contextmanager
def logger_to(handler: logging.Handler) -> Iterator[logging.Logger]:
    """A logger of the 'trainer' writing through `handler` alone, its messages as they are."""
    writer = logging.getLogger(f"trainer.{id(handler)}")
    writer.propagate = False
    writer.addHandler(handler)
    writer.setLevel(logging.INFO)
    try:
        yield writer
    finally:
        writer.removeHandler(handler)
        handler.close()


# -- content identity ----------------------------------------------------------------------------


def test_copytruncate_with_a_glob_matching_the_copy(ingest: RunningIngest, tmp_path: Path,
                                                    folder: Path) -> None:
    log = folder / "app.log"
    watch = Watch(ingest, tmp_path, "--log", str(folder / "app.log*")).start()
    writer = Writer()
    with open(log, "a") as fh:
        writer.write(fh, 1000, "a")
        ingest.wait_for(lambda: len(ingest.log_lines()) >= 1000, 15, "the first 1,000 lines")
        shutil.copyfile(log, folder / "app.log.1")
        fh.truncate(0)
        fh.seek(0)
        writer.write(fh, 500, "b")
    ingest.wait_for(lambda: len(set(ingest.log_lines())) >= 1500, 15)
    assert watch.stop().status == 0
    watch.start()  # the copy, checkpointed as read, is not read again after a restart either
    with open(log, "a") as fh:
        writer.write(fh, 10, "c")
    ingest.wait_for(lambda: len(set(ingest.log_lines())) >= 1510, 15)
    assert watch.stop().status == 0
    assert report("copytruncate + glob", writer.written, ingest.log_lines()) == (0, 0)


def test_logrotate_alternating_create_and_copytruncate(ingest: RunningIngest, tmp_path: Path,
                                                       folder: Path) -> None:
    if not os.path.exists(LOGROTATE):
        pytest.skip("logrotate is not installed (.ci/run installs Debian's)")
    log = folder / "app.log"
    confs = []
    for mode in ("create", "copytruncate"):
        conf = tmp_path / f"{mode}.conf"
        conf.write_text(f"{log} {{\n  rotate 20\n  {mode}\n  missingok\n  nocompress\n}}\n")
        confs.append(conf)
    watch = Watch(ingest, tmp_path, "--log", str(folder / "app.log*")).start()
    written = []
    with logger_to(logging.handlers.WatchedFileHandler(log)) as writer:
        for generation in range(20):
            for i in range(200):
                written.append(f"g{generation:02d}-{i:04d}")
                writer.info(written[-1])
            if generation % 5 == 0:  # now and then the sidecar is seen to keep up
                ingest.wait_for(lambda: written[-1] in ingest.log_lines(), 15)
            subprocess.run([LOGROTATE, "--force", "--state", str(tmp_path / "lr.state"),
                            str(confs[generation % 2])], check=True)
        writer.info("the end")
        written.append("the end")
    ingest.wait_for(lambda: set(written) <= set(ingest.log_lines()), 20)
    assert watch.stop().status == 0
    watch.start()  # 20 rotated files, copies and renamed ones: none read again after a restart
    with log.open("a") as fh:
        fh.write("after the restart\n")
    written.append("after the restart")
    ingest.wait_for(lambda: "after the restart" in ingest.log_lines(), 15)
    assert watch.stop().status == 0
    repeated, lost = report("logrotate create/copytruncate", written, ingest.log_lines())
    assert lost == 0
    assert repeated <= len(written) // 100


def test_rotation_every_20_ms_loses_no_generation(ingest: RunningIngest, tmp_path: Path,
                                                  folder: Path) -> None:
    log = folder / "app.log"
    watch = Watch(ingest, tmp_path, "--log", str(folder / "app.log*")).start()
    line_bytes = len("g000-00\n")
    written = []
    with logger_to(logging.handlers.RotatingFileHandler(log, maxBytes=20 * line_bytes,
                                                        backupCount=200)) as writer:
        for generation in range(100):
            for i in range(20):
                written.append(f"g{generation:03d}-{i:02d}")
                writer.info(written[-1])
            time.sleep(0.02)  # pacing the writer: one rotation every 20 ms
    ingest.wait_for(lambda: set(written) <= set(ingest.log_lines()), 20)
    assert watch.stop().status == 0
    received = ingest.log_lines()
    generations = {line.split("-")[0] for line in written} - {
        line.split("-")[0] for line in received}
    print(f"rotation every 20 ms: {len(generations)} of 100 generations lost")
    assert report("rotation every 20 ms", written, received) == (0, 0)


# -- descriptors and folders ---------------------------------------------------------------------


def event_file_bytes(tmp_path: Path, steps: int) -> bytes:
    tensorboardx = pytest.importorskip("tensorboardX")
    logdir = tmp_path / "template"
    with tensorboardx.SummaryWriter(str(logdir)) as writer:
        for step in range(steps):
            writer.add_scalar("loss", 1.0 / (step + 1), step)
    (path,) = logdir.glob("events.out.tfevents.*")
    return path.read_bytes()


def open_descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def test_3000_event_files_under_a_256_descriptor_limit(ingest: RunningIngest, tmp_path: Path,
                                                       folder: Path) -> None:
    template = event_file_bytes(tmp_path, 3)
    logdir = folder / "tb"
    for i in range(3000):
        run = logdir / f"r{i:04d}"
        run.mkdir(parents=True)
        (run / f"events.out.tfevents.{1790000000 + i}.node").write_bytes(template)
    watch = Watch(ingest, tmp_path, "--tensorboard", str(logdir))
    watch.preexec_fn = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    watch.start()
    assert watch.proc is not None
    pid, most = watch.proc.proc.pid, 0

    def all_points() -> bool:
        nonlocal most
        most = max(most, open_descriptors(pid))
        return len(points(ingest)) >= 9000

    wait_until(all_points, 60, "every point of 3,000 event files", lambda: str(most))
    done = watch.stop()
    print(f"3,000 event files under ulimit -n 256: {len(points(ingest))} points of 9000, "
          f"at most {most} descriptors open")
    assert done.status == 0, done.stderr[-2000:]
    assert b"Too many open files" not in done.stderr
    found = Counter((p["key"], p["step"]) for p in points(ingest))
    assert len(found) == 9000 and max(found.values()) == 1
    assert most <= 256 // 2


def test_a_symlink_loop_is_followed_once(ingest: RunningIngest, tmp_path: Path,
                                         folder: Path) -> None:
    tensorboardx = pytest.importorskip("tensorboardX")
    logdir = folder / "tb"
    with tensorboardx.SummaryWriter(str(logdir)) as writer:
        for step in range(15):
            writer.add_scalar("loss", step / 15, step)
    (logdir / "loop").mkdir()
    (logdir / "loop" / "self").symlink_to("..")
    watch = Watch(ingest, tmp_path, "--tensorboard", str(logdir)).start()
    ingest.wait_for(lambda: len(points(ingest)) >= 15, 15)
    assert watch.stop().status == 0
    keys = Counter(str(p["key"]) for p in points(ingest))
    print(f"symlink loop: {sum(keys.values())} points for 15, keys {sorted(keys)[:3]}")
    assert keys == {"loss": 15}


# -- restarts ------------------------------------------------------------------------------------


def committed_offsets(tmp_path: Path) -> list[int]:
    try:
        doc = json.loads((tmp_path / "state" / RUN_ID / "offsets.json").read_text())
    except (OSError, ValueError):
        return []
    return [mark["offset"] for mark in doc["files"].values()]


def test_a_cri_line_cut_by_sigkill_between_p_and_f(ingest: RunningIngest, tmp_path: Path,
                                                   folder: Path) -> None:
    log = folder / "0.log"
    log.write_text(f"{CRI_TS} stdout F before\n{CRI_TS} stdout P first half, \n")
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    ingest.wait_for(lambda: ingest.log_lines() == ["before"], 10)
    wait_until(lambda: log.stat().st_size in committed_offsets(tmp_path), 10,
               "the P piece committed")
    watch.stop(signal.SIGKILL)
    with log.open("a") as fh:
        fh.write(f"{CRI_TS} stdout F second half\n")
    watch.start()
    ingest.wait_for(lambda: len(ingest.log_lines()) >= 2, 10)
    assert watch.stop().status == 0
    assert ingest.log_lines() == ["before", "first half, second half"]


def test_a_40_byte_file_is_read_once_across_restarts(ingest: RunningIngest, tmp_path: Path,
                                                     folder: Path) -> None:
    log = folder / "job.log"
    first = "job done: loss 0.0123 after 3 s, exit 0\n"
    assert len(first) == 40
    log.write_text(first)
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    ingest.wait_for(lambda: ingest.log_lines() == [first.strip()], 10)
    wait_until(lambda: 40 in committed_offsets(tmp_path), 10, "the short file committed")
    watch.stop(signal.SIGKILL)
    watch.start()
    with log.open("a") as fh:  # grows past the fingerprint's length while read
        fh.write("x" * 300 + "\n")
    ingest.wait_for(lambda: len(ingest.log_lines()) >= 2, 10)
    assert watch.stop().status == 0
    watch.start()
    with log.open("a") as fh:
        fh.write("last\n")
    ingest.wait_for(lambda: len(ingest.log_lines()) >= 3, 10)
    assert watch.stop().status == 0
    assert ingest.log_lines() == [first.strip(), "x" * 300, "last"]


# -- what each source matched ----------------------------------------------------------------------


def get_status(address: str) -> dict[str, Any]:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(f"http://{address}/status", timeout=5) as response:
        doc: dict[str, Any] = json.loads(response.read())
    return doc


def test_each_source_says_what_it_matches(ingest: RunningIngest, tmp_path: Path,
                                          folder: Path) -> None:
    out = folder / "out"
    out.mkdir()
    for name in ("a", "b"):
        (out / f"{name}.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (folder / "empty").mkdir()
    tb_file = folder / "events.out.tfevents.1.node"
    tb_file.write_bytes(b"")
    watch = Watch(ingest, tmp_path, "--jsonl", str(out / "*.jsonl"),
                  "--log", "/nonexistent/dir/train.log", "--log", str(folder / "empty" / "*.log"),
                  "--log", str(folder / "empty"), "--tensorboard", str(tb_file),
                  SIDECAR_STATUS_ADDR="127.0.0.1:0").start()
    addr_file = tmp_path / "state" / RUN_ID / "status-addr"
    wait_until(addr_file.exists, 20, "the status address")
    address = addr_file.read_text().strip()
    ingest.wait_for(lambda: len(points(ingest)) >= 2, 10)
    (out / "c.jsonl").write_text('{"step": 1, "acc": 0.5}\n' * 3)
    ingest.wait_for(lambda: len(points(ingest)) >= 5, 10)

    def listed() -> dict[str, dict[str, Any]]:
        return {f["path"]: f for f in get_status(address)["files"]}

    wait_until(lambda: listed().get(str(out / "c.jsonl"), {}).get("lag_bytes") == 0, 10)
    files = listed()
    assert set(files) == {str(out / f"{n}.jsonl") for n in "abc"}
    c = files[str(out / "c.jsonl")]
    assert c["kind"] == "jsonl" and c["offset"] == c["size"] == 3 * 24 and c["lag_bytes"] == 0
    assert time.time() - 30 < c["last_read"] <= time.time()
    sources = {s["source"]: s for s in get_status(address)["matches"]}
    assert sources[f"--jsonl {out}/*.jsonl"]["files"] == 3
    assert sources["--log /nonexistent/dir/train.log"]["files"] == 0
    shown = subprocess.run([*SIDECAR, "status", "--once", "--status-addr", address],
                           capture_output=True, text=True, timeout=30, check=False,
                           env={**os.environ, "COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line.strip()}
    assert rows[str(out / "c.jsonl")][1:4] == ["jsonl", "72", "72"]
    assert f"--jsonl {out}/*.jsonl" in shown.stdout and "3 files" in shown.stdout
    done = watch.stop()
    assert done.status == 0
    err = done.stderr.decode()
    assert f"INFO --jsonl {out}/*.jsonl: 2 files" in err
    assert f"INFO --jsonl {out}/*.jsonl: 3 files" in err
    assert "--log /nonexistent/dir/train.log: the folder /nonexistent/dir does not exist" in err
    assert f"--log {folder}/empty/*.log: nothing matches yet" in err
    assert f"--log {folder}/empty: is a folder" in err
    assert f"INFO --tensorboard {tb_file}: 1 file" in err


class _Collect(Sink):
    """A sink that takes everything and acknowledges it at once."""

    def __init__(self) -> None:
        self.parsed: list[Parsed] = []

    def has_room(self) -> bool:
        return True

    def deliver(self, parsed: Parsed, ticket: Ticket, kind: str, source: str) -> None:
        self.parsed.append(parsed)
        ticket.seal()


async def test_a_source_matching_nothing_warns_once(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "NOTHING_MATCHED_WARN_S", 0.0)
    pattern = str(tmp_path / "out" / "*.jsonl")
    spec = SourceSpec("jsonl", (pattern,), lambda path, state: JsonlParser.resume(state),
                      option="--jsonl")
    follower = Follower([spec], _Collect(), Offsets(tmp_path / "offsets.json"), mode="poll")
    with warnings_of_sidecar() as warned:
        for _ in range(3):
            await follower.step()
            await asyncio.sleep(0)
    said = [r.getMessage() for r in warned]
    assert said == [f"--jsonl {pattern}: still nothing to read after 0 s (the folder "
                    f"{tmp_path / 'out'} does not exist yet)"]
    follower.close()


class _OneBlockAtATime(_Collect):
    """A sink with room for one block, then none until the test gives it room again."""

    def __init__(self) -> None:
        super().__init__()
        self.room = True

    def has_room(self) -> bool:
        return self.room

    def deliver(self, parsed: Parsed, ticket: Ticket, kind: str, source: str) -> None:
        super().deliver(parsed, ticket, kind, source)
        self.room = False


def _counted_looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The patterns the follower looks for files with, one entry a look (discover.match)."""
    looks: list[str] = []
    match = discover.match
    monkeypatch.setattr(discover, "match",
                        lambda pattern, *rest: looks.append(pattern) or match(pattern, *rest))
    return looks


async def test_room_again_reads_on_without_looking_for_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backlog read a request at a time wakes the follower once a request: each wake reads
    the next block of the files followed, and globs, stats and rotation checks wait for a file
    event or the poll (with a node's hundreds of pod logs, they cost more than the block)."""
    log = tmp_path / "train.log"
    lines = 4 * follow.READ_BYTES // 1024
    log.write_bytes((b"x" * 1023 + b"\n") * lines)  # four blocks
    looks = _counted_looks(monkeypatch)
    spec = SourceSpec("log", (str(log),), lambda path, state: LogFileParser(), option="--log")
    sink = _OneBlockAtATime()
    follower = Follower([spec], sink, Offsets(tmp_path / "offsets.json"))
    task = asyncio.create_task(follower.run())
    try:
        await async_wait_until(lambda: len(sink.parsed) == 1, "the first block was read")
        looked = len(looks)
        for blocks in range(2, 5):
            sink.room = True
            follower.room()
            await async_wait_until(lambda: len(sink.parsed) == blocks,  # noqa: B023
                                   "the next block was read")
        assert len(looks) == looked
        assert sum(parsed.records for parsed in sink.parsed) == lines
        follower.wake()  # a file event: a look
        await async_wait_until(lambda: len(looks) > looked, "the files were looked at")
    finally:
        await cancel(task)
        follower.close()


async def test_a_steady_trickle_is_read_in_gatherings_without_looking_for_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line each 10 ms, each its own write, was an inotify wake-up, a look for files (globs,
    stats, watches) and a read per line: a training run's trickle of 100 lines a second cost
    100 of each. Now a change of content only reads the files followed, and while they keep
    growing a read waits COALESCE_S for company: about ten reads a second, every line once. A
    file beside it that fits no pattern (the trainer's own) costs no look when it grows."""
    log, other = tmp_path / "train.log", tmp_path / "trainer-notes.txt"
    log.write_bytes(b"")
    other.write_bytes(b"")
    looks = _counted_looks(monkeypatch)
    spec = SourceSpec("log", (str(log),), lambda path, state: LogFileParser(), option="--log")
    sink = _Collect()
    follower = Follower([spec], sink, Offsets(tmp_path / "offsets.json"))
    task = asyncio.create_task(follower.run())
    fd, other_fd = os.open(log, os.O_WRONLY | os.O_APPEND), os.open(other, os.O_WRONLY)
    try:
        await async_wait_until(lambda: bool(looks), "the first look")
        looked = len(looks)
        began = time.monotonic()
        for i in range(100):
            os.write(fd, f"line {i:03d}\n".encode())
            os.write(other_fd, b"note\n")
            await asyncio.sleep(0.01)  # the trickle's pace, not a synchronisation
        elapsed = time.monotonic() - began
        await async_wait_until(lambda: sum(p.records for p in sink.parsed) == 100,
                               "every line was read")
        assert "".join(p.text for p in sink.parsed) == "".join(
            f"line {i:03d}\n" for i in range(100))
        assert len(sink.parsed) <= elapsed / follow.COALESCE_S + 3, len(sink.parsed)
        assert len(looks) - looked <= 2  # no look per write: only the content changed
    finally:
        os.close(fd)
        os.close(other_fd)
        await cancel(task)
        follower.close()


class _Paced(_Collect):
    """A sink that sends what it holds each PERIOD_S, as a paced batcher does."""

    PERIOD_S = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.began = time.monotonic()

    def due(self) -> float | None:
        periods = (time.monotonic() - self.began) // self.PERIOD_S + 1
        return self.began + periods * self.PERIOD_S


async def test_a_trickle_is_read_just_before_the_sink_sends(tmp_path: Path) -> None:
    """Reading a trickle ten times a second still woke the sidecar ten times for a request a
    second: the follower now reads just before the sink's next request, so about once per
    request (here one each 0.5 s), every line still once and in order."""
    log = tmp_path / "train.log"
    log.write_bytes(b"")
    spec = SourceSpec("log", (str(log),), lambda path, state: LogFileParser(), option="--log")
    sink = _Paced()
    follower = Follower([spec], sink, Offsets(tmp_path / "offsets.json"))
    task = asyncio.create_task(follower.run())
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        began = time.monotonic()
        for i in range(150):
            os.write(fd, f"line {i:03d}\n".encode())
            await asyncio.sleep(0.01)  # the trickle's pace, not a synchronisation
        elapsed = time.monotonic() - began
        await async_wait_until(lambda: sum(p.records for p in sink.parsed) == 150,
                               "every line was read")
        assert "".join(p.text for p in sink.parsed) == "".join(
            f"line {i:03d}\n" for i in range(150))
        # at most two reads a period: one just before the sink sends, one after a quiet start
        assert len(sink.parsed) <= 2 * elapsed / _Paced.PERIOD_S + 3, len(sink.parsed)
    finally:
        os.close(fd)
        await cancel(task)
        follower.close()


def test_replay_counts_the_event_files_of_a_tensorboard_folder_as_followed(
        tmp_path: Path) -> None:
    from sidecar.commands.replay import _unread
    from sidecar.sources.files.tensorboard import folder_parsers

    event_file = tmp_path / "tb" / "train" / "events.out.tfevents.1.node"
    event_file.parent.mkdir(parents=True)
    event_file.write_bytes(b"x" * 100)
    st = event_file.stat()
    spec = SourceSpec("tensorboard", (str(tmp_path / "tb"),), folder_parsers(tmp_path / "tb"),
                      option="--tensorboard", tree=BY_NAME["tensorboard"].tree)
    marks = {"m": Mark(str(event_file), st.st_dev, st.st_ino, fingerprint(b"x" * 100), 10)}
    pipeline = SimpleNamespace(follower=SimpleNamespace(specs=[spec]),
                               offsets=SimpleNamespace(marks=marks))
    assert _unread(pipeline) == []  # type: ignore[arg-type]


async def test_a_file_closed_while_idle_and_renamed_away_is_read_to_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(descriptors, "IDLE_CLOSE_S", 0.0)
    log = tmp_path / "app.log"
    log.write_text("first\n")
    spec = SourceSpec("log", (str(log),), lambda path, state: LogFileParser.resume(
        state, log_format="plain"), option="--log")
    sink = _Collect()
    follower = Follower([spec], sink, Offsets(tmp_path / "offsets.json"), mode="poll")
    await follower.step()
    await follower.step()  # read to its end and idle: its descriptor is given back
    assert not follower.descriptors.any_idle() and follower.descriptors.open_count == 0
    log.rename(tmp_path / "app.log.1")  # --log app.log does not match the rotated name
    log.write_text("new file\n")
    (tmp_path / "app.log.1").write_text("first\nlate\n")  # the writer has not reopened yet
    await follower.step()
    assert sorted("".join(p.text for p in sink.parsed).splitlines()) == [
        "first", "late", "new file"]
    follower.close()


@pytest.mark.parametrize("patterns", [("app.log*",), ("app.log.1", "app.log")],
                         ids=["one-glob", "the-copy-named-first"])
async def test_a_copy_found_in_the_same_look_as_its_original_is_read_once(
        tmp_path: Path, patterns: tuple[str, ...]) -> None:
    """A writer quicker than the looks: logrotate's create made app.log after the last look,
    and copytruncate copied it to app.log.1 before the next, which found both new. app.log
    had read nothing yet to check the copy against, so the copy was read from its start too:
    a generation repeated (and again after a restart, the copy having no offset). Whatever
    order the patterns name them in, the live file is not the one taken as the copy (its
    next generation would be lost)."""
    log = tmp_path / "app.log"
    spec = SourceSpec("log", tuple(str(tmp_path / p) for p in patterns), lambda path, state: (
        LogFileParser.resume(state, log_format="plain")))
    first = [f"g09-{n:04d}" for n in range(200)]
    log.write_text("".join(f"{line}\n" for line in first))
    shutil.copyfile(log, tmp_path / "app.log.1")  # copytruncate's copy, not truncated yet
    sink = _Collect()
    offsets = Offsets(tmp_path / "offsets.json")
    follower = Follower([spec], sink, offsets, mode="poll")
    await follower.step()  # both files new in one look
    with log.open("r+") as fh:  # the truncation, and the writer's next generation
        fh.truncate(0)
        fh.write("".join(f"g10-{n:04d}\n" for n in range(200)))
    second = [f"g10-{n:04d}" for n in range(200)]
    await follower.step()
    await follower.drain()
    follower.close()
    await offsets.save()
    received = "".join(p.text for p in sink.parsed).splitlines()
    assert repeats_and_losses(first + second, received) == (0, 0)
    restarted = Offsets(tmp_path / "offsets.json")
    restarted.load()
    sink = _Collect()
    follower = Follower([spec], sink, restarted, mode="poll")
    await follower.step()
    await follower.drain()
    follower.close()
    assert "".join(p.text for p in sink.parsed) == ""


HAS_LOGROTATE = os.path.exists(LOGROTATE)
ROTATIONS = ("W0", "Rc", "W1", "Rt", "W2", "Rc", "W3", "Rt", "W4")  # write, create, copytruncate


@pytest.mark.parametrize("lines", [5, 40])  # generations shorter and longer than a fingerprint
async def test_every_moment_of_looking_between_rotations(tmp_path: Path, lines: int) -> None:
    """The follower looks after some of the steps (writes and logrotate runs) and not after the
    others: whichever it sees, each line is read once."""
    if not HAS_LOGROTATE:
        pytest.skip("logrotate is not installed")
    bad = []
    for looks in range(0, 2 ** len(ROTATIONS), 11):
        folder = tmp_path / f"looks{looks}"
        folder.mkdir()
        confs = {}
        for op, mode in (("Rc", "create"), ("Rt", "copytruncate")):
            confs[op] = folder / f"{mode}.conf"
            confs[op].write_text(f"{folder}/app.log {{\n rotate 20\n {mode}\n nocompress\n}}\n")
        spec = SourceSpec("log", (str(folder / "app.log*"),), lambda path, state: (
            LogFileParser.resume(state, log_format="plain")))
        sink = _Collect()
        follower = Follower([spec], sink, Offsets(folder / "offsets.json"), mode="poll")
        written = []
        with logger_to(logging.handlers.WatchedFileHandler(folder / "app.log")) as writer:
            for i, op in enumerate(ROTATIONS):
                if op in confs:
                    await asyncio.to_thread(subprocess.run, [
                        LOGROTATE, "--force", "--state", str(folder / "state"), str(confs[op])],
                        check=True)
                for n in range(lines if op.startswith("W") else 0):
                    written.append(f"{op}-{n:03d}")
                    writer.info(written[-1])
                if looks >> i & 1:
                    await follower.step()
            await follower.step()
            await follower.drain()
        follower.close()
        received = "".join(p.text for p in sink.parsed).splitlines()
        if repeats_and_losses(written, received) != (0, 0):
            bad.append((f"{looks:09b}"[::-1], repeats_and_losses(written, received)))
    assert not bad, f"(looked after step, (repeated, lost)): {bad}"
