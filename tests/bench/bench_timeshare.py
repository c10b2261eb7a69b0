"""Benchmark (not a test): what the always-on time sampling (--time-window) costs a CPU-bound
trainer.

    python tests/bench/bench_timeshare.py [--quick] [--seconds 130] [--repeat 1] [--windows 60,10]

A stand-in trainer (_steps_trainer.py: torch matmuls on one thread and a little pure Python, a
step of about 2 ms, each step's duration taken with time.perf_counter) runs for --seconds under
the real `sidecar run --time-window W -- python _steps_trainer.py ...`, reporting to the
project's own local ingest (`sidecar receive`, a process of its own, a fresh one each run) with
the platform variables the other benchmarks set (no hardware sampling, no status endpoint). Each
window of W the sidecar runs one `py-spy record --nonblocking --idle --threads --rate R
--duration W` on the trainer (timeshare.py's `_record_one`, at nice 19; R = rate_for(W): 5 Hz at
the default 60 s, 20 Hz, the most, at 10 s). The runs: W = 60 and 10 (sampling on) and W = 0
(sampling off, the baseline), each with the same ingest set-up, the order reversed every other
round of --repeat.

Figures, per sampled window against the off runs of the same benchmark:
- the trainer's median step (the target), p99 and mean, over every timed step of the runs, and
  the median of the steps' own CPU time (time.thread_time on the trainer's thread): a cost the
  sampling put on the trainer itself shows in both; the machine's other work, which makes the
  trainer wait for a core, in the durations alone;
- the py-spy records' CPU (user + system) per rank as a share of one core, read from the very
  processes the sidecar spawns (not from a copy of their command line run by the benchmark: the
  same moments, nice level and target). The kernel adds an exited child's user and system time,
  what wait4 returns, to its parent's cutime and cstime once the parent reaps it, so the
  sidecar's own /proc/PID/stat (psutil's children_user + children_system), read every 0.2 s
  beside a listing of its py-spy children, holds every finished record's CPU from its start to
  its exit; counted from the reading before the first record ended (so not the sidecar's only
  other child here, its probe of the command's Python at the start, `python -c "import sys,
  json, platform; ..."`, printed apart), to the last reading before the trainer's end; the
  record still running then adds the last value of its own /proc/PID/stat seen. That sum over
  the wall time from the sidecar's start to the trainer's end is the figure (one rank here); the
  CPU of one whole window's record is printed beside it, and the records' own last /proc values
  as a check (they miss each one's last 0.2 s). With sampling off, no py-spy must be spawned.
- the sidecar's own CPU (user + system, its threads, not its children) over the trainer's timed
  span, on against off: what spawning a record each window, parsing its output and posting the
  shares adds.
Each sampled run must have posted its windows' shares to /hardware (`rank/0/time/...`), the
count is printed.

Targets: median step <= 1.02x the off runs' at every window; py-spy <= 1 % of a core per rank at
the default window (60 s). --quick: --time-window 10 against 0, 25-s runs, 2 rounds (about 2
minutes); its py-spy figure is informational.
"""

from __future__ import annotations

import array
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from _harness import (
    HERE,
    REPO,
    RUN_ID,
    SIDECAR,
    TOKEN,
    Row,
    bench_arguments,
    finish,
    info_row,
    limit_row,
    parse,
    profiled,
    ratio_row,
    show_warnings,
    sidecar_env,
    stop,
)

sys.path.insert(0, str(REPO))
from sidecar.stacks import find_tool
from sidecar.timeshare import cpu_seconds, rate_for

BENCH = "time sampling"
DEFAULT_WINDOW_S = 60  # --time-window's default (sidecar/options.py)
STEP_LIMIT = 1.02  # median step with sampling on <= 1.02x off
PY_SPY_LIMIT_PCT = 1.0  # % of a core per rank, at the default window
POLL_S = 0.2
READY_TIMEOUT_S = 20.0


@dataclass
class Run:
    """One `sidecar run`: the trainer's steps and what the sampling used meanwhile."""

    window_s: int
    steps: list[float]  # seconds
    steps_cpu: list[float]  # each step's CPU time on the trainer's main thread
    span_s: float  # the trainer's timed span
    sidecar_cpu_s: float  # over the span, its own threads
    py_spy_cpu_s: float  # every record's, from the sidecar's start to the trainer's end
    wall_s: float  # from the sidecar's start to the trainer's end
    records_done: int  # records that exited (reaped) before the trainer's end
    reaped_cpu_s: float  # their CPU, from the sidecar's cutime + cstime
    polled_done_cpu_s: float  # the same records' last /proc value seen (a check)
    others_cpu_s: float  # the sidecar's other children's (its start-up probe)
    records: int  # py-spy children seen in all
    windows: int = 0  # share windows posted to /hardware
    samples: list[int] = field(default_factory=list)  # samples_count of each


# -- the ingest -----------------------------------------------------------------------------------

@contextmanager
def ingest(work: Path) -> Iterator[str]:
    """`sidecar receive` on a free port, storing into work/received; yields its endpoint."""
    ready = work / "ingest-url"
    with (work / "receive.log").open("ab") as messages:
        proc = subprocess.Popen([*SIDECAR, "receive", "--port", "0", "--dir",
                                 str(work / "received"), "--ready-file", str(ready), "--quiet",
                                 "--token", TOKEN, "--run-id", RUN_ID],
                                cwd=work, stdout=subprocess.DEVNULL, stderr=messages)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("sidecar receive did not start: "
                                   + (work / "receive.log").read_text(errors="replace")[-500:])
            time.sleep(0.05)
        yield ready.read_text().strip()
    finally:
        stop(proc)


def shares_posted(work: Path) -> list[int]:
    """The samples_count of every window the ingest stored (rank 0's)."""
    counts = []
    try:
        lines = (work / "received" / "hardware.jsonl").read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        for point in json.loads(line).get("points", []):
            if point.get("key") == "rank/0/time/samples_count":
                counts.append(int(point["value"]))
    return counts


# -- one run --------------------------------------------------------------------------------------

def _children_cpu(proc: psutil.Process) -> float:
    """The user + system CPU of the children the process has reaped (its cutime + cstime)."""
    times = proc.cpu_times()
    return float(times.children_user + times.children_system)


@dataclass
class Tick:
    """One reading: the sidecar's own CPU, its reaped children's before and after the listing of
    its children, and the py-spy children the listing found."""

    when: float
    own_s: float
    reaped_before_s: float
    reaped_after_s: float
    py_spy: frozenset[int]


class Watcher(threading.Thread):
    """Every POLL_S, a Tick; and the last CPU seen of each py-spy child."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.ticks: list[Tick] = []
        self.records: dict[int, list[float]] = {}  # pid -> [first seen, last seen, CPU]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                before = _children_cpu(self.proc)
                now = time.monotonic()
                children = self.proc.children()
            except psutil.Error:
                return
            seen = set()
            for child in children:
                try:
                    if child.name() != "py-spy":
                        continue
                except psutil.Error:
                    continue
                seen.add(child.pid)
                record = self.records.setdefault(child.pid, [now, now, 0.0])
                record[1], record[2] = now, max(record[2], cpu_seconds([child.pid]))
            try:
                times = self.proc.cpu_times()
            except psutil.Error:
                return
            self.ticks.append(Tick(now, times.user + times.system, before,
                                   times.children_user + times.children_system,
                                   frozenset(seen)))
            self.done.wait(POLL_S)

    def at(self, when: float) -> Tick:
        """The last reading taken at or before `when`."""
        earlier = [tick for tick in self.ticks if tick.when <= when]
        return earlier[-1] if earlier else self.ticks[0]

    def py_spy_reaped(self, last: Tick) -> tuple[int, float, float]:
        """The records that exited by `last`: how many, their CPU from the sidecar's cutime +
        cstime, and the other children's before them (the sidecar's probe of the command's
        Python at its start: `python -c "import sys, json, platform; ..."`).

        The reaped CPU is counted from the reading before the listing in which the first record
        to exit was last seen alive (nothing of a record in it, the start-up probe long done) to
        the reading after `last`'s listing (every record missing from it reaped, or a zombie
        yet: then listed still)."""
        done = [r for r in self.records.values() if r[1] < last.when]
        if not done:
            return 0, 0.0, last.reaped_after_s
        first_gone = min(r[1] for r in done)
        base = next(tick for tick in self.ticks if tick.when == first_gone)
        return len(done), last.reaped_after_s - base.reaped_before_s, base.reaped_before_s


def measure(window_s: int, seconds: float, profile: Path | None, label: str) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-timeshare-") as scratch:
        work = Path(scratch)
        out = work / "steps"
        with ingest(work) as endpoint:
            env = sidecar_env(endpoint, work / "state")
            started = time.monotonic()
            with (work / "sidecar.log").open("ab") as messages:
                proc = subprocess.Popen(
                    [*SIDECAR, "run", "--time-window", str(window_s), "--", sys.executable,
                     str(HERE / "_steps_trainer.py"), str(out), str(seconds)],
                    env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=messages)
            watcher = Watcher(proc.pid)
            watcher.start()
            with profiled(proc.pid, profile, f"timeshare-{label}"):
                try:
                    status = proc.wait(seconds + 120)
                except subprocess.TimeoutExpired:
                    status = stop(proc)
            watcher.done.set()
            watcher.join()
        if status != 0:
            show_warnings(work)
            raise RuntimeError(f"sidecar run --time-window {window_s} exited {status}")
        raw = array.array("d")
        raw.frombytes(out.read_bytes())
        count = (len(raw) - 2) // 2
        begin, end = raw[0], raw[1]
        steps, steps_cpu = list(raw[2:2 + count]), list(raw[2 + count:])
        samples = shares_posted(work)
    first, last = watcher.at(begin), watcher.at(end)  # the trainer not yet reaped at `last`
    done, reaped, others = watcher.py_spy_reaped(last)
    running = [r for pid, r in watcher.records.items() if pid in last.py_spy]
    run = Run(window_s, steps, steps_cpu, end - begin, last.own_s - first.own_s,
              reaped + sum(r[2] for r in running), end - started, done, reaped,
              sum(r[2] for pid, r in watcher.records.items()
                  if r[1] < last.when), others, len(watcher.records), len(samples), samples)
    if window_s > 0 and not samples:
        show_warnings(work)
    return run


def describe(run: Run) -> str:
    steps = sorted(run.steps)
    name = f"--time-window {run.window_s}" if run.window_s else "sampling off"
    line = (f"{name:18} {len(steps):7,d} steps, median {statistics.median(steps) * 1e3:.3f} ms, "
            f"p99 {percentile(steps, 0.99) * 1e3:.3f} ms, own CPU "
            f"{statistics.median(run.steps_cpu) * 1e3:.3f} ms; sidecar "
            f"{100 * run.sidecar_cpu_s / run.span_s:.3f} % of a core; ")
    if run.window_s == 0:
        return line + (f"{run.records} py-spy records; the other children's CPU "
                       f"{run.others_cpu_s:.3f} s")
    per_record = run.reaped_cpu_s / run.records_done if run.records_done else float("nan")
    return line + (f"py-spy {100 * run.py_spy_cpu_s / run.wall_s:.3f} % of a core over "
                   f"{run.wall_s:.0f} s, {run.records_done} records done at "
                   f"{per_record * 1e3:.0f} ms CPU each (polled {run.polled_done_cpu_s:.3f} s "
                   f"of {run.reaped_cpu_s:.3f} s reaped; the other children's "
                   f"{run.others_cpu_s:.3f} s); "
                   f"{run.windows} windows posted, samples {run.samples}")


def percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


# -- the table ------------------------------------------------------------------------------------

def rows_for(window_s: int, on: list[Run], off: list[Run], checked: bool) -> list[Row]:
    steps_on = sorted(s for run in on for s in run.steps)
    steps_off = sorted(s for run in off for s in run.steps)
    rate = rate_for(window_s)
    what = f"--time-window {window_s} ({rate} Hz)"
    median_on, median_off = statistics.median(steps_on) * 1e3, statistics.median(steps_off) * 1e3
    py_spy_pct = 100 * sum(r.py_spy_cpu_s for r in on) / sum(r.wall_s for r in on)
    done = sum(r.records_done for r in on)
    own_on = 100 * sum(r.sidecar_cpu_s for r in on) / sum(r.span_s for r in on)
    own_off = 100 * sum(r.sidecar_cpu_s for r in off) / sum(r.span_s for r in off)
    rows = [
        ratio_row(BENCH, f"median step, {what}", median_on, median_off, "ms", "off", "<=",
                  STEP_LIMIT),
        info_row(BENCH, f"p99 step, {what}", percentile(steps_on, 0.99) * 1e3, "ms",
                 percentile(steps_off, 0.99) * 1e3, "off"),
        info_row(BENCH, f"mean step, {what}", statistics.fmean(steps_on) * 1e3, "ms",
                 statistics.fmean(steps_off) * 1e3, "off"),
        info_row(BENCH, f"median step's own CPU (thread_time), {what}",
                 statistics.median(s for run in on for s in run.steps_cpu) * 1e3, "ms",
                 statistics.median(s for run in off for s in run.steps_cpu) * 1e3, "off"),
        (limit_row(BENCH, f"py-spy CPU per rank, {what}", py_spy_pct, "% core", "<=",
                   PY_SPY_LIMIT_PCT) if checked else
         info_row(BENCH, f"py-spy CPU per rank, {what}", py_spy_pct, "% core")),
        info_row(BENCH, f"py-spy CPU of a whole window's record, {what}",
                 1e3 * sum(r.reaped_cpu_s for r in on) / done if done else float("nan"), "ms"),
        info_row(BENCH, f"sidecar's own CPU, {what}", own_on, "% core", own_off, "off"),
        limit_row(BENCH, f"share windows posted to /hardware, {what}",
                  sum(r.windows for r in on), "windows", ">=", max(1, len(on))),
    ]
    return rows


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--seconds", type=float, default=None,
                         help="each run's timed steps (default 130: two 60-s windows; 25 "
                         "with --quick)")
    options.add_argument("--repeat", type=int, default=None,
                         help="rounds of every run, the order reversed every other round "
                         "(default 1; 2 with --quick)")
    options.add_argument("--windows", default=None,
                         help="the sampled windows, comma-separated (default 60,10; 10 with "
                         "--quick); each is measured against --time-window 0")
    args = parse(options)
    if find_tool() is None:
        print("py-spy is not installed: nothing to measure")
        sys.exit(1)
    seconds = args.seconds or (25.0 if args.quick else 130.0)
    repeat = args.repeat or (2 if args.quick else 1)
    windows = [int(w) for w in (args.windows or ("10" if args.quick else "60,10")).split(",")]
    if any(w <= 0 for w in windows):
        options.error("--windows: each sampled window is a positive number of seconds")
    runs: dict[int, list[Run]] = {w: [] for w in [*windows, 0]}
    for round_ in range(repeat):
        order = [*windows, 0]
        for window_s in order if round_ % 2 == 0 else order[::-1]:
            run = measure(window_s, seconds, args.profile, f"{window_s}-{round_}")
            runs[window_s].append(run)
            print(describe(run), flush=True)
    rows: list[Row] = []
    for window_s in windows:
        rows += rows_for(window_s, runs[window_s], runs[0], window_s == DEFAULT_WINDOW_S)
    rows.append(limit_row(BENCH, "py-spy records spawned, sampling off",
                          sum(r.records for r in runs[0]), "records", "<=", 0))
    print(f"(the machine: {os.cpu_count()} CPUs, shared with other work while measured; "
          f"{seconds:g}-s runs, {repeat} round(s))")
    finish(rows, args.json)
    missed = [r.figure for r in rows if r.passed is False]
    print(f"goal: median step <= {STEP_LIMIT:g}x off at every window"
          + (f", py-spy <= {PY_SPY_LIMIT_PCT:g} % of a core per rank at --time-window "
             f"{DEFAULT_WINDOW_S}" if DEFAULT_WINDOW_S in windows else "")
          + (": PASS" if not missed else ": FAIL (" + "; ".join(missed) + ")"))


if __name__ == "__main__":
    main()
