"""`sidecar watch` end to end: real files, real rotation, real signals, real loopback HTTP."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from sidecar.delivery.batcher import PACE_S
from sidecar.delivery.logs import MAX_REQUEST_CHARS
from tests.conftest import RUN_ID, Finished, Sidecar, platform_env
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until


def points(ingest: RunningIngest) -> list[dict[str, object]]:
    return [p for r in ingest.records("metrics") for p in r["points"]]


class Watch:
    """A `sidecar watch` process over the files of one test."""

    def __init__(self, ingest: RunningIngest, tmp_path: Path, *args: str, **env: str) -> None:
        self.env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0", **env)
        self.args = ["watch", *args]
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


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir()
    return path


def test_lines_and_points_arrive_and_sigterm_drains(ingest: RunningIngest, tmp_path: Path,
                                                    folder: Path) -> None:
    log, metrics = folder / "train.log", folder / "metrics.jsonl"
    log.write_text("before the sidecar started\n")
    watch = Watch(ingest, tmp_path, "--log", str(log), "--jsonl", str(metrics)).start()
    with metrics.open("a") as fh:
        fh.write('{"step": 7, "loss": 0.25, "acc": {"top1": 0.5}, "note": "x"}\n')
        fh.write('{"partial": 1')  # never sent half-written
    with log.open("a") as fh:
        fh.write("step 7 done\nno newline yet")
    ingest.wait_for(lambda: "step 7 done" in ingest.log_lines() and points(ingest), 10)
    done = watch.stop()
    assert done.status == 0, done.stderr
    assert ingest.log_lines() == ["before the sidecar started", "step 7 done", "no newline yet"]
    assert sorted((p["key"], p["step"], p["value"]) for p in points(ingest)) == [
        ("acc/top1", 7, 0.5), ("loss", 7, 0.25)]


def test_a_large_file_goes_out_in_full_requests(ingest: RunningIngest, tmp_path: Path,
                                                 folder: Path) -> None:
    """The bulk path cuts a file into payloads of about a MiB each: not one such payload and
    then a request of its own for the few lines past the cut."""
    log = folder / "train.log"
    written = [f"line {i:07d} " + "x" * 86 for i in range(60_000)]  # 100 B each, 6 MB
    log.write_text("".join(line + "\n" for line in written))
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    ingest.wait_for(lambda: len(ingest.log_lines()) >= len(written), 30)
    assert watch.stop().status == 0
    assert ingest.log_lines() == written
    assert len(ingest.records("logs")) <= math.ceil(6_000_000 / MAX_REQUEST_CHARS)


def test_a_steady_trickle_costs_about_a_request_a_second_per_route(
        ingest: RunningIngest, tmp_path: Path, folder: Path) -> None:
    """A training run's trickle, each line and each point its own write, was a request per
    point and one per few lines (at 100 lines/s and 10 points/s: 27 requests a second). Now
    each route sends about one a second while output keeps coming (batcher.PACE_S), and every
    line and point arrives once."""
    log, metrics = folder / "train.log", folder / "metrics.jsonl"
    log.touch()
    metrics.touch()
    watch = Watch(ingest, tmp_path, "--log", str(log), "--jsonl", str(metrics)).start()
    lines = [f"step {i:03d} loss 0.{i:03d}" for i in range(60)]
    log_fd, metrics_fd = os.open(log, os.O_WRONLY | os.O_APPEND), os.open(metrics, os.O_WRONLY)
    os.write(metrics_fd, b'{"step": -1, "loss": 1.0}\n')  # the files are followed from here
    ingest.wait_for(lambda: bool(points(ingest)), 15)
    before = {route: len(ingest.records(route)) for route in ("logs", "metrics")}
    began = time.monotonic()
    try:
        for i, line in enumerate(lines):  # 20 lines and 4 points a second for 3 s
            os.write(log_fd, f"{line}\n".encode())
            if i % 5 == 0:
                os.write(metrics_fd, f'{{"step": {i}, "loss": {i / 100}}}\n'.encode())
            time.sleep(0.05)  # the trickle's pace, not a synchronisation
    finally:
        os.close(log_fd)
        os.close(metrics_fd)
    elapsed = time.monotonic() - began
    ingest.wait_for(lambda: len(ingest.log_lines()) >= 60 and len(points(ingest)) >= 13, 15)
    assert watch.stop().status == 0
    assert ingest.log_lines() == lines
    assert sorted(int(str(p["step"])) for p in points(ingest)) == [-1, *range(0, 60, 5)]
    most = elapsed / PACE_S + 3  # the lone first one, the pace, the drain at the stop
    for route in ("logs", "metrics"):
        sent = len(ingest.records(route)) - before[route]
        assert sent <= most, f"{sent} requests to /{route} in {elapsed:.1f} s"


def test_a_file_in_a_folder_that_does_not_exist_yet(ingest: RunningIngest, tmp_path: Path,
                                                    folder: Path) -> None:
    later = folder / "later" / "run"
    watch = Watch(ingest, tmp_path, "--log", str(later / "*.log")).start()
    later.mkdir(parents=True)
    (later / "rank0.log").write_text("appeared\n")
    ingest.wait_for(lambda: ingest.log_lines() == ["appeared"], 10)
    assert watch.stop().status == 0


class Writer:
    """Writes numbered lines to one or several files and remembers what it wrote."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.n = 0

    def write(self, fh: IO[str], count: int, tag: str) -> None:
        for _ in range(count):
            line = f"{tag}-{self.n:06d}"
            self.n += 1
            fh.write(line + "\n")
            self.written.append(line)
        fh.flush()


def assert_same_lines_in_order(written: list[str], received: list[str]) -> None:
    counts = Counter(received)
    assert sorted(received) == sorted(written), (
        f"missing {sorted(set(written) - set(received))[:5]}, "
        f"repeated {[k for k, v in counts.items() if v > 1][:5]}")
    for tag in {line.split("-")[0] for line in written}:
        mine = [line for line in received if line.startswith(tag + "-")]
        assert mine == sorted(mine), f"{tag} out of order"


def test_several_writers_in_one_folder(ingest: RunningIngest, tmp_path: Path,
                                       folder: Path) -> None:
    watch = Watch(ingest, tmp_path, "--log", str(folder / "*.log")).start()
    writer = Writer()
    files = [open(folder / f"rank{r}.log", "a") for r in range(3)]  # noqa: SIM115
    for round_ in range(20):
        for rank, fh in enumerate(files):
            writer.write(fh, 5 + round_ % 3, f"r{rank}")
    writer.write(files[0], 3, "r0")  # the oldest file grows after newer ones appeared
    for fh in files:
        fh.close()
    ingest.wait_for(lambda: len(ingest.log_lines()) >= len(writer.written), 15)
    assert watch.stop().status == 0
    assert_same_lines_in_order(writer.written, ingest.log_lines())


def write_generation(fh: IO[str], writer: Writer, ingest: RunningIngest, tag: str) -> None:
    """Lines of which the sidecar has seen some (so it has the file open) and some not yet."""
    writer.write(fh, 40, tag)
    ingest.wait_for(lambda: any(line.startswith(tag + "-") for line in ingest.log_lines()), 10,
                    f"the sidecar reading {tag}")
    writer.write(fh, 10, tag)


def rotate_by_hand(kind: str, log: Path, fh: IO[str], writer: Writer, ingest: RunningIngest,
                   generation: int) -> IO[str]:
    """Rotate `log` the way `kind` does it; returns the file to go on writing to."""
    if kind == "rename":
        log.rename(log.with_name(f"{log.name}.{generation}"))
        new = open(log, "a")  # noqa: SIM115
        writer.write(fh, 2, "late")  # the old file still gets a write after the new appeared
        fh.close()
        return new
    if kind == "truncate":
        seen = len(writer.written)
        ingest.wait_for(lambda: len(ingest.log_lines()) >= seen, 10, "read before truncation")
        fh.truncate(0)
        fh.seek(0)
        return fh
    if kind == "delete":
        seen = len(writer.written)
        ingest.wait_for(lambda: len(ingest.log_lines()) >= seen, 10, "read before deletion")
        fh.close()
        log.unlink()
        return open(log, "a")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["rename", "truncate", "delete"])
def test_rotation_by_hand_loses_and_repeats_nothing(ingest: RunningIngest, tmp_path: Path,
                                                    folder: Path, kind: str) -> None:
    log = folder / "app.log"
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    writer = Writer()
    fh: IO[str] = open(log, "a")  # noqa: SIM115
    for generation in range(4):
        write_generation(fh, writer, ingest, f"g{generation}")
        fh = rotate_by_hand(kind, log, fh, writer, ingest, generation)
    writer.write(fh, 50, "g9")
    fh.close()
    ingest.wait_for(lambda: len(ingest.log_lines()) >= len(writer.written), 15)
    assert watch.stop().status == 0
    assert_same_lines_in_order(writer.written, ingest.log_lines())


LOGROTATE = shutil.which("logrotate") or "/usr/sbin/logrotate"


@pytest.mark.parametrize("mode", ["create", "copytruncate"])
def test_rotation_by_logrotate(ingest: RunningIngest, tmp_path: Path, folder: Path,
                               mode: str) -> None:
    if not os.path.exists(LOGROTATE):
        pytest.skip("logrotate is not installed (.ci/run installs Debian's)")
    log = folder / "app.log"
    conf = tmp_path / "logrotate.conf"
    conf.write_text(f"{log} {{\n  rotate 10\n  {mode}\n  missingok\n  nocompress\n}}\n")
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    writer = Writer()
    fh: IO[str] = open(log, "a")  # noqa: SIM115
    for generation in range(4):
        write_generation(fh, writer, ingest, f"g{generation}")
        subprocess.run([LOGROTATE, "--force", "--state", str(tmp_path / "lr.state"), str(conf)],
                       check=True)
        if mode == "create":  # the application reopens its log, as after a SIGHUP
            fh.close()
            fh = open(log, "a")  # noqa: SIM115
    writer.write(fh, 40, "g9")
    fh.close()
    ingest.wait_for(lambda: len(ingest.log_lines()) >= len(writer.written), 15)
    assert watch.stop().status == 0
    assert_same_lines_in_order(writer.written, ingest.log_lines())


def test_kubelet_cri_logs_with_partial_lines_and_rotation(ingest: RunningIngest, tmp_path: Path,
                                                          folder: Path) -> None:
    log = folder / "0.log"
    ts = "2026-11-30T10:00:00.123456789Z"
    log.write_text(f"{ts} stdout P first half, \n{ts} stderr F an error\n"
                   f"{ts} stdout F second half\n")
    watch = Watch(ingest, tmp_path, "--log", str(folder / "*.log")).start()
    ingest.wait_for(lambda: len(ingest.log_lines()) == 2, 10)
    log.rename(folder / "0.log.20261130-100001")
    (folder / "0.log").write_text(f"{ts} stdout F after rotation\n")
    ingest.wait_for(lambda: len(ingest.log_lines()) == 3, 10)
    assert watch.stop().status == 0
    assert ingest.log_lines() == ["an error", "first half, second half", "after rotation"]


def test_a_new_file_on_a_reused_inode_is_read_from_its_start(ingest: RunningIngest,
                                                            tmp_path: Path,
                                                            folder: Path) -> None:
    log = folder / "app.log"
    log.write_text("a different file now\n")
    st = log.stat()
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    stale = {"path": str(log), "dev": st.st_dev, "ino": st.st_ino,
             "fingerprint": b"the old file".hex(), "offset": 15, "state": {}}
    (run_dir / "offsets.json").write_text(json.dumps(
        {"version": 1, "files": {f"{st.st_dev}:{st.st_ino}": stale}}))
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    ingest.wait_for(lambda: ingest.log_lines() == ["a different file now"], 10)
    assert watch.stop().status == 0


def test_a_corrupt_checkpoint_is_set_aside_not_a_crash_loop(ingest: RunningIngest,
                                                           tmp_path: Path,
                                                           folder: Path) -> None:
    log = folder / "app.log"
    log.write_text("line\n")
    run_dir = tmp_path / "state" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / "offsets.json").write_bytes(b"\x00garbage{")
    watch = Watch(ingest, tmp_path, "--log", str(log)).start()
    ingest.wait_for(lambda: ingest.log_lines() == ["line"], 10)
    done = watch.stop()
    assert done.status == 0
    assert done.stderr.count(b"offsets.json is malformed") == 1
    assert len(list(run_dir.glob("offsets.json.bad-*"))) == 1
    assert json.loads((run_dir / "offsets.json").read_text())["files"]


def test_bad_input_is_skipped_and_counted_never_fatal(ingest: RunningIngest, tmp_path: Path,
                                                     folder: Path) -> None:
    rng = random.Random(7)
    (folder / "garbage.jsonl").write_bytes(bytes(rng.randrange(256) for _ in range(100_000)))
    (folder / "huge.jsonl").write_bytes(b'{"v": ' + b"1" * (10 << 20) + b"}\n"
                                        b'{"after_huge": 1}\n')
    (folder / "mixed.jsonl").write_bytes(b"not json\n[1,2]\n\xff\xfe\n" + b'{"ok": 2}\n')
    (folder / "bad.log").write_bytes(b"\xff\xfe bad utf-8 \xe2\x82\nfine\n")
    watch = Watch(ingest, tmp_path, "--log", str(folder / "*.log"), "--jsonl",
                  str(folder / "*.jsonl")).start()
    ingest.wait_for(lambda: {"after_huge", "ok"} <= {p["key"] for p in points(ingest)}, 20)
    ingest.wait_for(lambda: "fine" in ingest.log_lines(), 10)
    done = watch.stop()
    assert done.status == 0, done.stderr
    assert ingest.log_lines()[0] == "\ufffd\ufffd bad utf-8 \ufffd"


def test_nan_values_of_a_new_key_every_step_are_named_for_100_keys_then_counted_together(
        ingest: RunningIngest, tmp_path: Path, folder: Path) -> None:
    metrics = folder / "grads.jsonl"
    metrics.write_text("".join(f'{{"step": {i}, "loss": 1.0, "grad/{i}": NaN}}\n'
                               for i in range(300)))
    watch = Watch(ingest, tmp_path, "--jsonl", str(metrics)).start()
    ingest.wait_for(lambda: len(points(ingest)) >= 300, 15)
    done = watch.stop()
    assert done.status == 0
    assert {p["key"] for p in points(ingest)} == {"loss"}
    said = [line for line in done.stderr.decode().splitlines() if "NaN or infinite" in line]
    assert len([line for line in said if "said once per key" in line]) == 100
    assert len([line for line in said if "counted together, not named" in line]) == 1


def test_metric_keys_past_the_limit_are_refused_locally(ingest: RunningIngest, tmp_path: Path,
                                                        folder: Path) -> None:
    metrics = folder / "wide.jsonl"
    with metrics.open("w") as fh:
        for i in range(5000):
            fh.write(json.dumps({"key": f"k{i:05d}", "value": i}) + "\n")
    watch = Watch(ingest, tmp_path, "--jsonl", str(metrics)).start()
    ingest.wait_for(lambda: len(points(ingest)) >= 4096, 15)
    done = watch.stop()
    assert done.status == 0
    keys = {p["key"] for p in points(ingest)}
    assert len(keys) == 4096
    assert max(len(r["points"]) for r in ingest.records("metrics")) <= 2048
    refused = [line for line in done.stderr.decode().splitlines() if "refused" in line]
    assert 1 <= len(refused) < 20  # one ERROR for the keys refused together, not one a key
    assert refused[-1].endswith(f"({5000 - 4096} refused in all; said at most once a minute)")


def test_poison_point_is_dead_lettered_and_the_rest_flows(ingest: RunningIngest,
                                                          tmp_path: Path,
                                                          folder: Path) -> None:
    ingest.add_fault(Fault(route="metrics", reject_if_contains="poison"))
    metrics = folder / "m.jsonl"
    lines = [json.dumps({"key": "loss", "value": i, "step": i}) for i in range(100)]
    lines.insert(50, json.dumps({"key": "poison", "value": 1}))
    metrics.write_text("\n".join(lines) + "\n")
    watch = Watch(ingest, tmp_path, "--jsonl", str(metrics)).start()
    ingest.wait_for(lambda: len(points(ingest)) >= 100, 15)
    assert watch.stop().status == 0
    assert sorted(int(p["step"]) for p in points(ingest)) == list(range(100))  # type: ignore
    dead = (tmp_path / "state" / RUN_ID / "dead-letter.jsonl").read_text().splitlines()
    assert len(dead) == 1 and "poison" in dead[0]


MAX_HEAVY_STEPS = 400_000  # about 100 s of writing: far past any test's end


@pytest.fixture
def heavy_writer(folder: Path) -> Iterator[tuple[Writer, threading.Event, list[str]]]:
    """Appends log lines and JSONL points until told to stop."""
    writer, stop, metric_lines = Writer(), threading.Event(), []

    def run() -> None:
        with open(folder / "app.log", "a") as log, open(folder / "m.jsonl", "a") as jsonl:
            step = 0
            # It writes until told to stop: a writer that ran out before the last kill left
            # nothing new to deliver, and the wait for progress timed out. The cap is a bound.
            while not stop.is_set() and step < MAX_HEAVY_STEPS:
                writer.write(log, 20, "w")
                for _ in range(20):
                    line = json.dumps({"step": step, "loss": step / 7})
                    jsonl.write(line + "\n")
                    metric_lines.append(line)
                    step += 1
                jsonl.flush()
                stop.wait(0.005)  # pacing the writer, not synchronising the test

    thread = threading.Thread(target=run)
    thread.start()
    yield writer, stop, metric_lines
    stop.set()
    thread.join()


def test_sigkill_and_restart_lose_nothing(ingest: RunningIngest, tmp_path: Path, folder: Path,
                                          heavy_writer: tuple[Writer, threading.Event, list[str]]
                                          ) -> None:
    writer, stop, metric_lines = heavy_writer
    watch = Watch(ingest, tmp_path, "--log", str(folder / "app.log"), "--jsonl",
                  str(folder / "m.jsonl"))
    rng = random.Random(11)
    for _ in range(5):
        watch.start()
        target = len(ingest.log_lines()) + rng.randrange(200, 2000)
        wait_until(lambda t=target: len(ingest.log_lines()) >= t, 20, "progress before the kill")
        # Kill at a random moment after that progress, not always the instant a big catch-up
        # batch was accepted (this pause picks the moment; it synchronises nothing).
        time.sleep(rng.uniform(0.05, 0.3))
        watch.stop(signal.SIGKILL)
    stop.set()
    watch.start()
    wait_until(lambda: len(set(ingest.log_lines())) >= len(writer.written)
               and len({p["step"] for p in points(ingest)}) >= len(metric_lines), 30,
               "everything delivered after the last restart")
    assert watch.stop().status == 0
    received = ingest.log_lines()
    assert set(received) == set(writer.written)
    steps = [p["step"] for p in points(ingest) if p["key"] == "loss"]
    assert set(steps) == set(range(len(metric_lines)))
    repeats = len(received) - len(set(received)) + len(steps) - len(set(steps))
    print(f"5 SIGKILLs: {len(writer.written)} lines and {len(metric_lines)} points written, "
          f"{repeats} repeats from unacknowledged tails")
    # Repeats come only from what was acknowledged but not yet checkpointed at a kill (0.1 s).
    assert repeats < (len(writer.written) + len(metric_lines)) // 2


def test_tensorboard_scalars_and_hparams(ingest: RunningIngest, tmp_path: Path,
                                         folder: Path) -> None:
    tensorboardx = pytest.importorskip("tensorboardX")
    logdir = folder / "tb"
    watch = Watch(ingest, tmp_path, "--tensorboard", str(logdir)).start()
    with tensorboardx.SummaryWriter(str(logdir)) as top, \
            tensorboardx.SummaryWriter(str(logdir / "eval")) as sub:
        for step in range(50):
            top.add_scalar("loss", 1.0 / (step + 1), step)
            sub.add_scalar("accuracy", step / 50, step)
        top.add_scalar("broken", float("nan"), 0)
        top.add_hparams({"lr": 0.001, "optimizer": "adam"}, {"hp/metric": 1.0})
    ingest.wait_for(lambda: len(points(ingest)) >= 100 and ingest.records("hparams"), 15)
    assert watch.stop().status == 0
    by_key = Counter(str(p["key"]) for p in points(ingest))
    assert by_key["loss"] == 50 and by_key["eval/accuracy"] == 50
    assert "broken" not in by_key
    params = {k: v for r in ingest.records("hparams") for k, v in r["params"].items()}
    assert params["lr"] == 0.001 and params["optimizer"] == "adam"


def test_poll_mode_follows_without_file_events(ingest: RunningIngest, tmp_path: Path,
                                               folder: Path) -> None:
    log = folder / "nfs.log"
    watch = Watch(ingest, tmp_path, "--log", str(log), "--file-watch", "poll").start()
    writer = Writer()
    with open(log, "a") as fh:
        for tag in ("a", "b", "c"):
            writer.write(fh, 10, tag)
            ingest.wait_for(lambda t=tag: any(x.startswith(t) for x in ingest.log_lines()), 10)
    assert watch.stop().status == 0
    assert ingest.log_lines() == writer.written


def test_a_stall_line_is_never_spliced_into_a_followed_files_open_line(
        ingest: RunningIngest, tmp_path: Path, folder: Path) -> None:
    """watch's stall lines go between the followed files' lines, as run's do: a line left open
    (sent in part once quiet) is ended first, and its rest starts a line of its own."""
    log = folder / "train.log"
    log.write_text("epoch 1\nDownloading shard 3/8: ")
    watch = Watch(ingest, tmp_path, "--log", str(log), "--stall-after", "2").start()
    ingest.wait_for(lambda: "Downloading shard 3/8: " in "".join(
        c for r in ingest.records("logs") for c in r["chunks"]), 20)
    ingest.wait_for(lambda: any("output resumed" in line for line in ingest.log_lines()), 20)
    with log.open("a") as fh:
        fh.write("done\n")
    ingest.wait_for(lambda: "done" in ingest.log_lines(), 10)
    finished = watch.stop()
    assert finished.status == 0, finished.stderr
    lines = ingest.log_lines()
    assert [line for line in lines if "[sidecar]" in line and not line.startswith(
        "[sidecar] ")] == [], lines
    assert lines.index("Downloading shard 3/8: ") < lines.index("done"), lines
    resumed = next(line for line in lines if "output resumed" in line)
    assert lines.index("Downloading shard 3/8: ") < lines.index(resumed), lines


def test_a_rejected_token_is_said_at_the_stop_and_the_drain_not_waited_out(
        ingest: RunningIngest, tmp_path: Path, folder: Path) -> None:
    ingest.add_fault(Fault(status=401))
    log = folder / "train.log"
    log.write_text("epoch 1\n")
    watch = Watch(ingest, tmp_path, "--log", str(log), SIDECAR_DRAIN_TIMEOUT="30").start()
    wait_until(lambda: ingest.stats.routes["logs"].rejected.get(401, 0) >= 1, 20,
               "the ingest refused the output")
    stopped_at = time.monotonic()
    done = watch.stop()
    took_s = time.monotonic() - stopped_at
    assert done.status == 0, done.stderr
    assert took_s < 15, f"waited out the drain: {took_s:.1f} s"
    [kept] = [line for line in done.stderr.decode().splitlines()
              if "no payload of this run was accepted" in line]
    assert "every answer was HTTP 401/403" in kept and "`sidecar replay`" in kept
