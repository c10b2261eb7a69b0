"""Fault injection over real loopback HTTP (issue 5, "Show"): whatever the ingest or the
connection to it does, every metric point and lifecycle event written reaches the ingest, the
wrapped command's exit status is its own, and the command is never held up.

Each case runs `sidecar run --jsonl FILE -- TRAINER`. The trainer appends JSONL points to FILE
at a fixed pace (20 ticks a second), prints a 10 kB log line a tick (enough to fill the 1 MiB
pipe in 5 s were the sidecar to stop reading it), and stamps its own timing: how
long its work took and its slowest tick, compared with a run without faults (`baseline`). FILE
starts with a backlog of points, so that the first requests carry full batches of 2,048. A
fault sits either in the ingest (`tests.faulty_ingest.Fault`) or in the connection
(tests/tcp_proxy.py). Every case checks, through `check`:

- the set of points at the ingest equals the set written; repeats are counted, printed and
  bounded (none where no request can be stored without being answered);
- the lifecycle arrived complete and in order (`starting`, `running`, the end event), each
  event repeated at most once;
- the exit status is the trainer's, and the trainer was never slowed down.

Scaled to keep the file near three minutes on two cores:
- refusing connections "for a minute": 8 s, measured in the trainer's own progress;
- flapping every two seconds: as stated, while the trainer runs (8 s);
- answers slower than the timeout: the routes' 30 s timeout (sidecar/delivery/client.py ROUTES) is
  shortened to 1.5 s by a launcher, and the proxy holds every third answer 2.5 s;
- 401 "until the token file is rotated": until the sidecar said so and 2 s of training passed;
- the full disk: a 1 MiB tmpfs as the state dir, full for 3 s of training;
- ten SIGKILLs as stated, each after 0 to 3,000 more points reached the ingest.
Shutdown gets 40 s (--drain-timeout) rather than 20, so that a backoff grown during a fault
still ends inside it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any

import psutil
import pytest

from sidecar.delivery.spool import Spool, SpoolFull
from sidecar.records import MAX_POINTS_PER_REQUEST
from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, running_ingest, wait_until
from tests.tcp_proxy import RunningProxy, running_proxy

TICKS_PER_S = 20
TRAINER = r"""
import json, os, sys, time
path, rate, seconds, code, first, poison, hold = sys.argv[1:8]
rate, seconds, code, first, poison = float(rate), float(seconds), int(code), int(first), int(poison)
TICKS = __TICKS_PER_S__
per_tick = max(int(rate / TICKS), 1)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
start = time.monotonic()
worst = 0.0
step = first
for tick in range(int(seconds * TICKS)):
    began = time.monotonic()
    lines = []
    for _ in range(per_tick):
        lines.append(json.dumps({"key": "loss", "step": step, "value": step / 7}))
        if step == poison:
            lines.append(json.dumps({"key": "poison", "step": step, "value": 1}))
        step += 1
    os.write(fd, ("\n".join(lines) + "\n").encode())
    print(f"tick {tick} step {step} " + "x" * 10000, flush=True)
    worst = max(worst, time.monotonic() - began)
    pause = start + (tick + 1) / TICKS - time.monotonic()
    if pause > 0:
        time.sleep(pause)
stamp = f"trainer took {time.monotonic() - start:.3f} worst {worst:.3f}"
with open(path + ".stamp", "w") as fh:
    fh.write(stamp)
print(stamp, flush=True)
while hold and not os.path.exists(hold):
    time.sleep(0.02)
sys.exit(code)
""".replace("__TICKS_PER_S__", str(TICKS_PER_S))

# Runs the sidecar with every route's timeout shortened (FAULTS_ROUTE_TIMEOUT_S), so that an
# answer slower than the timeout takes seconds rather than the production 30 s.
LAUNCHER = """
import os, sys
from sidecar.delivery import client as ingest
timeout_s = float(os.environ["FAULTS_ROUTE_TIMEOUT_S"])
for name, policy in list(ingest.ROUTES.items()):
    ingest.ROUTES[name] = policy._replace(timeout_s=timeout_s)
from sidecar.cli import main
sys.exit(main())
"""

DRAIN_TIMEOUT_S = "40"
Point = tuple[str, int, float]


@dataclass(frozen=True)
class Plan:
    """What the trainer of one case does."""

    rate: float = 1000.0  # points a second
    seconds: float = 5.0
    code: int = 0  # its exit status
    backlog: int = 3000  # points already in the file when the sidecar starts
    poison_step: int = -1  # a step after which a "poison" point is written too
    hold: Path | None = None  # once done, wait for this file before exiting

    @property
    def points(self) -> int:
        """How many points the file holds once the trainer is done."""
        per_tick = max(int(self.rate / TICKS_PER_S), 1)
        return (self.backlog + int(self.seconds * TICKS_PER_S) * per_tick
                + (self.poison_step >= 0))

    @property
    def end_event(self) -> str:
        return "succeeded" if self.code == 0 else "failed"


@dataclass
class Outcome:
    """What one `sidecar run` of a plan left behind."""

    status: int
    stdout: str
    stderr: str
    took_s: float  # the trainer's own time for its work
    worst_s: float  # its slowest tick
    written: list[Point]
    received: list[Point]
    events: list[str]  # lifecycle events, each counted once, in the order they first arrived
    event_repeats: int

    @property
    def repeats(self) -> int:
        return len(self.received) - len(set(self.received))


@dataclass(frozen=True)
class Baseline:
    """The trainer's timing under a sidecar without faults."""

    overrun_s: float  # took - planned seconds
    worst_s: float


# -- running a case ------------------------------------------------------------------------------

def metrics_file(work: Path) -> Path:
    return work / "metrics.jsonl"


def start_run(endpoint: str, work: Path, plan: Plan, *args: str, name: str = "sidecar",
              **env: str) -> Sidecar:
    """`sidecar run --jsonl FILE -- TRAINER` for `plan`, reporting to `endpoint`; FILE and the
    state dir are in `work`, the sidecar's output in `work / name`."""
    path = metrics_file(work)
    if plan.backlog and not path.exists():
        path.write_text("".join(json.dumps({"key": "loss", "step": s, "value": s / 7}) + "\n"
                                for s in range(plan.backlog)))
    options = {"SIDECAR_HARDWARE_INTERVAL": "0", "SIDECAR_DRAIN_TIMEOUT": DRAIN_TIMEOUT_S, **env}
    environ = platform_env(endpoint, work / "state", **options)
    trainer = [*python_child(TRAINER), str(path), str(plan.rate), str(plan.seconds),
               str(plan.code), str(plan.backlog), str(plan.poison_step),
               str(plan.hold or "")]
    return Sidecar(["run", "--jsonl", str(path), *args, "--", *trainer], environ, work / name)


def finish(run: Sidecar, ingest: RunningIngest, work: Path) -> Outcome:
    """Wait for the run to end and gather what the trainer wrote and the ingest received."""
    done = run.wait(120)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    stamp = re.search(r"trainer took (\S+) worst (\S+)", stamp_file(work).read_text()
                      if stamp_file(work).exists() else "")
    assert stamp is not None, f"the trainer did not finish: {stderr[-3000:]}"
    assert stamp[0] in stdout  # passed through to the sidecar's own stdout
    first: dict[tuple[str, str], None] = {}
    records = ingest.records("lifecycle")
    for record in records:
        first.setdefault((record["event"], record["ts"]), None)
    return Outcome(done.status, stdout, stderr, float(stamp[1]), float(stamp[2]),
                   written_points(metrics_file(work)), received_points(ingest),
                   [event for event, _ in first], len(records) - len(first))


def written_points(path: Path) -> list[Point]:
    points = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        points.append((doc["key"], doc["step"], doc["value"]))
    return points


def received_points(ingest: RunningIngest) -> list[Point]:
    return [(p["key"], p["step"], p["value"]) for r in ingest.records("metrics")
            for p in r["points"]]


def written_lines(work: Path) -> int:
    with suppress(FileNotFoundError):
        return metrics_file(work).read_bytes().count(b"\n")
    return 0


def accepted_points(ingest: RunningIngest) -> int:
    return ingest.stats.routes["metrics"].items


def stamp_file(work: Path) -> Path:
    return work / "metrics.jsonl.stamp"


def trainer_done(work: Path) -> bool:
    return stamp_file(work).exists()


def check(out: Outcome, plan: Plan, baseline: Baseline, *, max_repeats: int,
          expected: set[Point] | None = None, max_event_repeats: int | None = None) -> None:
    """The invariants of every case (module docstring)."""
    assert out.status == plan.code, out.stderr[-3000:]
    assert len(out.written) == plan.points
    want = set(out.written) if expected is None else expected
    got = set(out.received)
    assert got == want, (f"{len(want - got)} points missing (first {sorted(want - got)[:3]}), "
                         f"{len(got - want)} unexpected (first {sorted(got - want)[:3]}); "
                         f"sidecar said: {out.stderr[-2000:]}")
    print(f"{len(out.written)} points written, {out.repeats} repeated at the ingest; "
          f"lifecycle repeats {out.event_repeats}; trainer took {out.took_s:.2f} s for "
          f"{plan.seconds:g} s of work, slowest tick {out.worst_s * 1000:.0f} ms")
    assert out.repeats <= max_repeats, f"{out.repeats} repeats, at most {max_repeats} expected"
    assert out.events == ["starting", "running", plan.end_event], out.stderr[-3000:]
    # An event is repeated only when an attempt the ingest stored went unanswered; by default at
    # most once an event, else as many times as the case lets answers go missing.
    assert out.event_repeats <= (len(out.events) if max_event_repeats is None
                                 else max_event_repeats)
    assert out.took_s <= plan.seconds + baseline.overrun_s + 1.0 + 0.1 * plan.seconds
    assert out.worst_s <= baseline.worst_s + 0.5


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """The trainer under a sidecar and an ingest without faults."""
    work = tmp_path_factory.mktemp("baseline")
    plan = Plan(seconds=3)
    with running_ingest(work / "received", token=TOKEN, run_id=RUN_ID) as ingest:
        out = finish(start_run(ingest.base_url, work, plan), ingest, work)
    assert out.status == 0 and set(out.received) == set(out.written), out.stderr
    return Baseline(out.took_s - plan.seconds, out.worst_s)


@pytest.fixture
def proxy(ingest: RunningIngest) -> Iterator[RunningProxy]:
    with running_proxy(ingest.base_url, seed=3) as running:
        yield running


def point_batches(exchanges: int) -> int:
    """The most points `exchanges` requests stored but never answered can repeat."""
    return exchanges * MAX_POINTS_PER_REQUEST


# -- the connection ------------------------------------------------------------------------------

def test_refused_connections_for_a_while_then_back(ingest: RunningIngest, proxy: RunningProxy,
                                                   tmp_path: Path, baseline: Baseline) -> None:
    plan = Plan(seconds=12)
    run = start_run(proxy.base_url, tmp_path, plan)
    wait_until(lambda: accepted_points(ingest) >= plan.backlog, 20, "delivery before the outage")
    proxy.refuse()
    refused_at = written_lines(tmp_path)
    wait_until(lambda: written_lines(tmp_path) >= refused_at + 8 * plan.rate, 30,
               "8 s of training during the outage")
    held_back = written_lines(tmp_path) - accepted_points(ingest)
    proxy.accept()
    out = finish(run, ingest, tmp_path)
    assert held_back >= 4 * plan.rate  # the outage was real
    check(out, plan, baseline, max_repeats=point_batches(proxy.stats.resets))


def test_flapping_every_two_seconds(ingest: RunningIngest, proxy: RunningProxy, tmp_path: Path,
                                    baseline: Baseline) -> None:
    plan = Plan(seconds=8)
    run = start_run(proxy.base_url, tmp_path, plan)
    wait_until(lambda: accepted_points(ingest) >= plan.backlog, 20, "delivery before flapping")
    proxy.flap(2.0)
    wait_until(lambda: trainer_done(tmp_path), 30, "the trainer finished")
    proxy.clear()
    out = finish(run, ingest, tmp_path)
    assert proxy.stats.resets >= 1
    check(out, plan, baseline, max_repeats=point_batches(proxy.stats.resets))


def test_thirty_percent_of_answers_5xx(ingest: RunningIngest, proxy: RunningProxy,
                                       tmp_path: Path, baseline: Baseline) -> None:
    proxy.fail(0.3)
    plan = Plan()
    out = finish(start_run(proxy.base_url, tmp_path, plan), ingest, tmp_path)
    failed = [e for e in proxy.exchanges() if e.fate == "failed"]
    assert any(e.path.endswith("/metrics") for e in failed)
    print(f"{len(failed)} of {proxy.stats.requests} requests answered 5xx by the proxy")
    check(out, plan, baseline, max_repeats=0)  # a failed request never reached the ingest


def test_answers_slower_than_the_timeout(ingest: RunningIngest, proxy: RunningProxy,
                                         tmp_path: Path, baseline: Baseline,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", (sys.executable, "-c", LAUNCHER))
    proxy.delay_answers(every=3, delay_s=2.5)
    plan = Plan()
    run = start_run(proxy.base_url, tmp_path, plan, FAULTS_ROUTE_TIMEOUT_S="1.5")
    out = finish(run, ingest, tmp_path)
    delayed = [e for e in proxy.exchanges() if e.fate == "delayed"]
    assert any(e.path.endswith("/metrics") for e in delayed)
    assert out.repeats >= 1  # the ingest stored what the sidecar gave up waiting for
    delayed_events = sum(e.path.endswith("/lifecycle") for e in delayed)
    check(out, plan, baseline, max_repeats=point_batches(len(delayed)),
          max_event_repeats=max(delayed_events, len(out.events)))


def test_connections_reset_in_the_middle_of_a_request_body(ingest: RunningIngest,
                                                           proxy: RunningProxy, tmp_path: Path,
                                                           baseline: Baseline) -> None:
    proxy.cut_bodies(every=2, after_bytes=1024)
    plan = Plan()
    out = finish(start_run(proxy.base_url, tmp_path, plan), ingest, tmp_path)
    cut = [e for e in proxy.exchanges() if e.fate == "cut"]
    assert any(e.path.endswith("/metrics") and e.body_bytes > 2048 for e in cut)
    assert ingest.stats.routes["metrics"].accepted >= 1
    check(out, plan, baseline, max_repeats=0)  # a cut body is never stored


# -- the ingest's answers ------------------------------------------------------------------------

def test_a_429_storm_with_retry_after(ingest: RunningIngest, proxy: RunningProxy,
                                      tmp_path: Path, baseline: Baseline) -> None:
    """Retry-After in seconds (429 on /metrics) and as an HTTP date (503 on /lifecycle)."""
    until = float(int(time.time()) + 4)
    ingest.add_fault(Fault(route="lifecycle", status=503, retry_after=formatdate(until,
                                                                                 usegmt=True),
                           times=1))
    ingest.add_fault(Fault(route="metrics", status=429, retry_after="1", times=5))
    plan = Plan(seconds=6)
    out = finish(start_run(proxy.base_url, tmp_path, plan), ingest, tmp_path)
    exchanges = proxy.exchanges()
    waits: dict[str, list[tuple[float, float]]] = {"/metrics": [], "/lifecycle": []}
    for i, told in enumerate(exchanges):
        route = next((r for r in waits if told.path.endswith(r)), None)
        if route is None or told.status not in (429, 503) or told.answered_at is None:
            continue
        again = next(e for e in exchanges[i + 1:] if e.path == told.path)
        waits[route].append((told.answered_at, again.sent_at))
    assert len(waits["/metrics"]) == 5 and len(waits["/lifecycle"]) == 1
    for answered, retried in waits["/metrics"]:
        assert 0.9 <= retried - answered <= 3.0
    assert until - 0.1 <= waits["/lifecycle"][0][1] <= until + 2.0
    check(out, plan, baseline, max_repeats=0)


def test_413_on_batches_above_a_size(ingest: RunningIngest, tmp_path: Path,
                                     baseline: Baseline) -> None:
    ingest.add_fault(Fault(route="metrics", too_large_above=300))
    plan = Plan()
    out = finish(start_run(ingest.base_url, tmp_path, plan), ingest, tmp_path)
    assert ingest.stats.routes["metrics"].rejected.get(413, 0) >= 3
    assert max(len(r["points"]) for r in ingest.records("metrics")) <= 300
    assert not (tmp_path / "state" / RUN_ID / "dead-letter.jsonl").exists()
    check(out, plan, baseline, max_repeats=0)


def test_401_until_the_token_file_is_rotated(ingest: RunningIngest, tmp_path: Path,
                                             baseline: Baseline) -> None:
    token_file = tmp_path / "token"
    stale = "stale-token-0123456789"
    token_file.write_text(stale + "\n")
    plan = Plan(seconds=8)
    run = start_run(ingest.base_url, tmp_path, plan, "--token-file", str(token_file))
    stderr = tmp_path / "sidecar" / "stderr"
    wait_until(lambda: b"rejected the token" in stderr.read_bytes(), 20, "the sidecar said so")
    wait_until(lambda: written_lines(tmp_path) >= plan.backlog + 2 * plan.rate, 20,
               "2 s of training with a rejected token")
    assert accepted_points(ingest) == 0 and ingest.stats.routes["metrics"].rejected.get(401)
    rotated = tmp_path / "token.new"
    rotated.write_text(TOKEN + "\n")
    rotated.replace(token_file)  # as a Secret's update lands: a new file, swapped in
    out = finish(run, ingest, tmp_path)
    check(out, plan, baseline, max_repeats=0)
    said = [line for line in out.stderr.splitlines() if "rejected the token" in line]
    per_route = Counter(line.split(": HTTP")[0].rsplit(" ", 1)[-1] for line in said)
    assert per_route and max(per_route.values()) == 1, said  # one ERROR a minute per route
    assert TOKEN not in out.stderr and stale not in out.stderr


def test_a_poison_payload_while_good_ones_flow_past(ingest: RunningIngest, tmp_path: Path,
                                                    baseline: Baseline) -> None:
    ingest.add_fault(Fault(route="metrics", reject_if_contains="poison"))
    plan = Plan(poison_step=4000)
    out = finish(start_run(ingest.base_url, tmp_path, plan), ingest, tmp_path)
    poison = ("poison", 4000, 1)
    check(out, plan, baseline, max_repeats=0, expected=set(out.written) - {poison})
    dead = [json.loads(line) for line in
            (tmp_path / "state" / RUN_ID / "dead-letter.jsonl").read_text().splitlines()]
    assert [(d["route"], d["status"]) for d in dead] == [("metrics", 400)]
    assert [(p["key"], p["step"]) for p in json.loads(dead[0]["body"])["points"]] == [
        ("poison", 4000)]


# -- the state dir's disk filling up -------------------------------------------------------------

TMPFS_BYTES = 1 << 20
FULL_DISK_WORDS = re.compile(r"no space left|enospc|disk (is )?full|full disk", re.IGNORECASE)


@contextmanager
def small_tmpfs(path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs at `path` (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the full-disk cases needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(mount: Path) -> Path:
    """Write a file until the disk says ENOSPC; deleting it frees the space again."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(64 << 10))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def committed_offset(run_dir: Path) -> int:
    with suppress(FileNotFoundError, ValueError, KeyError):
        files = json.loads((run_dir / "offsets.json").read_text())["files"]
        return max((int(mark["offset"]) for mark in files.values()), default=0)
    return 0


def complaints(stderr: str) -> list[str]:
    """The sidecar's WARNING and ERROR lines about a full disk."""
    return [line for line in stderr.splitlines()
            if (" WARNING " in line or " ERROR " in line) and FULL_DISK_WORDS.search(line)]


@dataclass
class FullDiskRun:
    plan: Plan
    out: Outcome
    delivered_while_full: int
    recovered: bool  # offsets were committed again after the space came back, during the run


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullDiskRun]:
    """One run whose state dir fills up for 3 s of training, then gets its space back."""
    work = tmp_path_factory.mktemp("full-disk")
    plan = Plan(seconds=9)
    run_dir = work / "state" / RUN_ID
    with small_tmpfs(work / "state"), \
            running_ingest(work / "received", token=TOKEN, run_id=RUN_ID) as ingest:
        run = start_run(ingest.base_url, work, plan)
        wait_until(lambda: committed_offset(run_dir) > 0 and accepted_points(ingest) >=
                   plan.backlog, 20, "offsets committed before the disk fills")
        filler = fill(work / "state")
        full_at = written_lines(work)
        before = accepted_points(ingest)
        wait_until(lambda: written_lines(work) >= full_at + 3 * plan.rate, 20,
                   "3 s of training on a full disk")
        delivered = accepted_points(ingest) - before
        stale = committed_offset(run_dir)
        filler.unlink()
        with suppress(AssertionError):
            wait_until(lambda: committed_offset(run_dir) > stale or trainer_done(work), 10)
        recovered = committed_offset(run_dir) > stale and not trainer_done(work)
        yield FullDiskRun(plan, finish(run, ingest, work), delivered, recovered)


def test_full_state_disk_keeps_the_trainer_going_and_loses_nothing(
        full_disk_run: FullDiskRun, baseline: Baseline) -> None:
    run = full_disk_run
    assert run.delivered_while_full > 0
    check(run.out, run.plan, baseline, max_repeats=0)


def test_full_state_disk_is_said_once_and_recovered_from(full_disk_run: FullDiskRun) -> None:
    said = complaints(full_disk_run.out.stderr)
    assert len(said) == 1 and full_disk_run.recovered, (
        f"said {said}; offsets committed again once the space came back: "
        f"{full_disk_run.recovered}")


def test_full_state_disk_at_start_still_runs_the_trainer(ingest: RunningIngest,
                                                         tmp_path: Path) -> None:
    plan = Plan(seconds=1, code=5, backlog=0)
    with small_tmpfs(tmp_path / "state"):
        (tmp_path / "state" / RUN_ID).mkdir()
        fill(tmp_path / "state")
        out = finish(start_run(ingest.base_url, tmp_path, plan), ingest, tmp_path)
    assert out.status == 5
    assert out.events == ["starting", "running", "failed"]
    assert len(complaints(out.stderr)) == 1, out.stderr


def journal(run_dir: Path) -> tuple[list[tuple[str, str]], int]:
    """The lifecycle journal's intact records as (event, ts), and how many are acknowledged."""
    path = run_dir / "lifecycle.journal"
    data = path.read_bytes() if path.exists() else b""
    records = [json.loads(payload) for _, payload in frames(data)]
    acked = run_dir / "lifecycle.journal.acked"
    count = int(acked.read_text().strip() or 0) if acked.exists() else 0
    return [(r["event"], r["ts"]) for r in records], count


def test_full_state_disk_when_the_trainer_ends(ingest: RunningIngest, tmp_path: Path) -> None:
    hold = tmp_path / "exit-now"
    plan = Plan(seconds=1, code=4, backlog=0, hold=hold)
    with small_tmpfs(tmp_path / "state"):
        run = start_run(ingest.base_url, tmp_path, plan, SIDECAR_DRAIN_TIMEOUT="8")
        wait_until(lambda: trainer_done(tmp_path) and accepted_points(ingest) >= 1000, 20,
                   "the trainer's points delivered")
        filler = fill(tmp_path / "state")
        hold.touch()
        stderr = tmp_path / "sidecar" / "stderr"
        wait_until(lambda: "failed" in [r["event"] for r in ingest.records("lifecycle")]
                   or bool(complaints(stderr.read_text())), 20, "the end event or a word")
        filler.unlink()
        out = finish(run, ingest, tmp_path)
        records, acked = journal(tmp_path / "state" / RUN_ID)
    assert out.status == 4
    assert out.events == ["starting", "running", "failed"]
    assert "not yet delivered" not in out.stderr
    # The end event's acknowledgement is written once the disk has room again before the
    # sidecar exits; if the disk is still full at its exit, the next start posts the event
    # again (a repeat, never a loss).
    assert len(records) == 3 and acked >= 2


def test_a_spool_append_cut_short_by_a_full_disk_leaves_the_spool_intact(tmp_path: Path) -> None:
    """The spool of a document route on a disk that fills in the middle of an append (a
    segment's last page has room for part of the record only)."""
    def record(n: int, pad: int = 0) -> bytes:
        return json.dumps({"n": n, "pad": "x" * pad}).encode()

    with small_tmpfs(tmp_path / "state") as mount:
        queue = Spool(mount / "spool")
        queue.open()
        queue.append([record(0)])
        filler = fill(mount)
        with pytest.raises(SpoolFull):
            queue.append([record(1, pad=10_000)])
        filler.unlink()
        queue.append([record(2)])
        assert queue.peek(10) == [record(0), record(2)]
        reopened = Spool(mount / "spool")
        reopened.open()
        assert reopened.peek(10) == [record(0), record(2)]


# -- SIGKILL under load --------------------------------------------------------------------------

_FRAME = struct.Struct("<II")  # length, crc32: the framing of journal.py and spool.py


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """The intact records of a journal or spool segment: (offset, payload), up to a torn one."""
    out, pos = [], 0
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        payload = data[pos + _FRAME.size:pos + _FRAME.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        out.append((pos, payload))
        pos += _FRAME.size + length
    return out


def spooled(folder: Path) -> list[dict[str, Any]]:
    """The payloads waiting in a route's spool (from its cursor on), as the next start sees
    them."""
    segments = sorted(folder.glob("*.seg"))
    cursor = folder / "cursor"
    first, offset = ((int(x) for x in cursor.read_text().split()) if cursor.exists()
                     else (int(segments[0].stem) if segments else 0, 0))
    waiting = []
    for segment in segments:
        number = int(segment.stem)
        if number < first:
            continue
        for pos, payload in frames(segment.read_bytes()):
            if number > first or pos >= offset:
                waiting.append(json.loads(payload))
    return waiting


def tear_spool_tail(folder: Path) -> bool:
    """Cut the last segment of a spool in the middle of its last record, as a crash during an
    append would; False when there is no record to cut."""
    segments = sorted(folder.glob("*.seg"))
    if not segments:
        return False
    records = frames(segments[-1].read_bytes())
    if not records:
        return False
    pos, payload = records[-1]
    os.truncate(segments[-1], pos + _FRAME.size + len(payload) // 2)
    return True


def kill_abruptly(run: Sidecar) -> None:
    """SIGKILL the sidecar now, and the trainer it wrapped (a dead wrapper's trainer would go on
    writing on its own). SIGSTOP first, so that no trainer can be spawned between listing the
    sidecar's children and the kill."""
    sidecar = psutil.Process(run.proc.pid)
    sidecar.send_signal(signal.SIGSTOP)
    children = sidecar.children(recursive=True)
    sidecar.kill()
    for child in children:
        with suppress(psutil.NoSuchProcess):
            child.kill()
    assert run.wait(30).status == -signal.SIGKILL

    def gone(process: psutil.Process) -> bool:
        try:
            return process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(gone(child) for child in children), 10, "the trainer killed")


def test_sigkill_at_random_moments_with_a_torn_spool_tail(ingest: RunningIngest,
                                                          tmp_path: Path, baseline: Baseline,
                                                          fast_sampling: None) -> None:
    """Ten SIGKILLs under load (2,000 points a second), each once 0 to 3,000 more points
    reached the ingest; every start follows the same file with the same state dir. /hardware
    is refused (503) meanwhile and sampled every 50 ms, so its spool fills; every third restart
    finds the spool's last segment cut in the middle of a record. A last start without faults
    must then deliver every point, every lifecycle event of every start in the order it was
    journaled (each once: the later starts go on from the first's), and every intact spooled
    sample."""
    ingest.add_fault(Fault(route="hardware", status=503))
    run_dir = tmp_path / "state" / RUN_ID
    spool = run_dir / "spool" / "hardware"
    options = {"SIDECAR_HARDWARE_INTERVAL": "0.05"}
    rng = random.Random(5)
    journaled: list[int] = []  # journal records after each start
    tears = 0
    for start in range(10):
        more = 0 if rng.random() < 0.2 else rng.randrange(200, 3000)
        target = accepted_points(ingest) + more
        plan = Plan(rate=2000, seconds=60, backlog=written_lines(tmp_path))
        run = start_run(ingest.base_url, tmp_path, plan, name=f"start{start}", **options)

        def killable(target: int = target, first: bool = start == 0) -> bool:
            return accepted_points(ingest) >= target and (not first or any(spool.glob("*.seg")))

        wait_until(killable, 30, f"start {start}: {more} more points delivered")
        kill_abruptly(run)
        journaled.append(len(journal(run_dir)[0]))
        if start % 3 == 2:
            tears += tear_spool_tail(spool)
    assert tears >= 1
    ingest.clear_faults()
    waiting = spooled(spool)
    assert waiting

    last = Plan(rate=2000, seconds=1, backlog=written_lines(tmp_path))
    out = finish(start_run(ingest.base_url, tmp_path, last, name="last", **options), ingest,
                 tmp_path)
    assert out.status == 0, out.stderr[-3000:]
    assert out.worst_s <= baseline.worst_s + 0.5
    missing = set(out.written) - set(out.received)
    assert not missing, f"{len(missing)} points lost, first {sorted(missing)[:3]}"
    assert set(out.received) == set(out.written)
    assert out.repeats <= 10 * 3 * MAX_POINTS_PER_REQUEST
    records, acked = journal(run_dir)
    assert acked == len(records)
    # Each start after the first goes on from the `starting` and `running` it journaled: the
    # lifecycle is recorded once, whatever the restarts, and ends with the last start's end.
    assert journaled == [2] * 10, journaled
    assert [event for event, _ in records] == ["starting", "running", "succeeded"]
    arrived: dict[tuple[str, str], None] = {}
    for record in ingest.records("lifecycle"):
        arrived.setdefault((record["event"], record["ts"]), None)
    assert list(arrived) == records  # all present, in the order they were journaled
    delivered = {json.dumps(doc, sort_keys=True) for doc in ingest.records("hardware")}
    assert {json.dumps(doc, sort_keys=True) for doc in waiting} <= delivered
    said = [(tmp_path / f"start{i}" / "stderr").read_text().count("torn tail")
            for i in range(10)]
    assert sum(said) + out.stderr.count("torn tail") >= 1
    print(f"10 SIGKILLs: {len(out.written)} points written, {out.repeats} repeated; "
          f"{len(records)} lifecycle events; {len(waiting)} spooled samples delivered after "
          f"{tears} torn tails")


# -- every supervised task raising once (issue 13) -----------------------------------------------

FAULTED_TASKS = {"ticker", "follow", "offsets", "deliver-metrics", "logs-shipper", "hardware",
                 "deliver-hardware", "lifecycle", "hparams"}


def test_every_supervised_task_raising_once_loses_nothing(ingest: RunningIngest, tmp_path: Path,
                                                          baseline: Baseline) -> None:
    """Each long-lived task raises once, at a random moment of the first 3 s, in a run with
    every source on: each is restarted and said once, nothing is lost, the trainer never
    notices."""
    log_file = tmp_path / "train.log"
    log_file.write_text("".join(f"log line {i}\n" for i in range(200)))
    scalars = write_scalars(tmp_path / "tb" / "run1", 300)
    hparams = tmp_path / "hparams.json"
    hparams.write_text(json.dumps({"lr": 0.1, "model": {"depth": 12}}))
    plan = Plan(seconds=5)
    run = start_run(ingest.base_url, tmp_path, plan, "--log", str(log_file), "--tensorboard",
                    str(tmp_path / "tb"), "--hparams", str(hparams),
                    SIDECAR_HARDWARE_INTERVAL="1", SIDECAR_STATUS_ADDR="127.0.0.1:0",
                    _SIDECAR_TEST_FAULTS="3")
    out = finish(run, ingest, tmp_path)
    failed = re.findall(r"ERROR task (\S+) failed \(InjectedFault", out.stderr)
    assert set(failed) >= FAULTED_TASKS, out.stderr[-3000:]
    assert len(failed) == len(set(failed))  # once each, and said once
    assert not [line for line in out.stderr.splitlines()
                if " ERROR " in line and "InjectedFault" not in line], out.stderr[-3000:]
    from_tensorboard = {point for point in out.received if point[0].startswith("run1/")}
    assert {(key, step) for key, step, _ in from_tensorboard} == scalars
    check(out, plan, baseline, max_repeats=point_batches(len(failed)),
          expected=set(out.written) | from_tensorboard)
    forwarded = "".join(chunk for r in ingest.records("logs") for chunk in r["chunks"])
    assert all(f"log line {i}\n" in forwarded for i in range(200))
    assert sum(r.get("params", {}).get("lr") == 0.1 for r in ingest.records("hparams")) >= 1
    assert ingest.records("hardware") and ingest.records("environment")


def write_scalars(logdir: Path, steps: int) -> set[tuple[str, int]]:
    """TensorBoard scalars written by the `tensorboard` package's own writer; the points the
    sidecar should make of them."""
    writer_module = pytest.importorskip("tensorboard.summary.writer.event_file_writer")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    logdir.mkdir(parents=True)
    writer = writer_module.EventFileWriter(str(logdir))
    for step in range(steps):
        writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(
            value=[Summary.Value(tag="acc", simple_value=step / steps)])))
    writer.close()
    return {("run1/acc", step) for step in range(steps)}
