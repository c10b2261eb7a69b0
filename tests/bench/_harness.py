"""What the benchmarks share: the receiver process, the sidecar's environment, CPU and memory
readings of a process, py-spy profiling, and the result rows `run_all.py` prints as a table."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN_ID = "bench-run"
TOKEN = "sf_9c1e4b7a2d6f08e35b17c4a9e2d0f6b3"  # random-looking, as a real one is
SIDECAR = [sys.executable, "-m", "sidecar"]  # started in a scratch folder, never in the
#   checkout: `-m` puts the working folder first on sys.path, which would hide PYTHONPATH (the
#   way to benchmark a modified copy: PYTHONPATH=/tmp/copy python tests/bench/run_all.py)
_extra_options: dict[str, str] = {}  # --set NAME=VALUE: SIDECAR_NAME for every sidecar started


# -- results --------------------------------------------------------------------------------------

@dataclass
class Row:
    """One line of the table: a figure, the baseline it is compared with, and the target."""

    bench: str
    figure: str
    value: float
    unit: str
    baseline: float | None = None  # the same figure of the baseline, measured in the same run
    baseline_name: str = ""
    ratio: float | None = None  # value / baseline
    target: str = ""  # as the issue states it, e.g. ">= 0.5x floor"
    passed: bool | None = None  # None: informational, no target


def ratio_row(bench: str, figure: str, value: float, baseline: float, unit: str,
              baseline_name: str, op: str, limit: float) -> Row:
    """A row whose target is `value / baseline` `op` (>= or <=) `limit`."""
    ratio = value / baseline if baseline else float("inf")
    passed = ratio >= limit if op == ">=" else ratio <= limit
    return Row(bench, figure, value, unit, baseline, baseline_name, ratio,
               f"{op} {limit:g}x {baseline_name}", passed)


def limit_row(bench: str, figure: str, value: float, unit: str, op: str, limit: float) -> Row:
    """A row whose target is an absolute limit: `value` `op` (<, <=, >=) `limit`."""
    passed = {"<": value < limit, "<=": value <= limit, ">=": value >= limit}[op]
    return Row(bench, figure, value, unit, target=f"{op} {limit:g} {unit}", passed=passed)


def info_row(bench: str, figure: str, value: float, unit: str, baseline: float | None = None,
             baseline_name: str = "") -> Row:
    ratio = value / baseline if baseline else None
    return Row(bench, figure, value, unit, baseline, baseline_name, ratio)


def bench_arguments(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes."""
    options = argparse.ArgumentParser(description=description)
    options.add_argument("--quick", action="store_true", help="smaller sizes, shorter runs")
    options.add_argument("--json", type=Path, help="also write the result rows here")
    options.add_argument("--profile", type=Path, metavar="DIR",
                         help="record the sidecar with py-spy into DIR (figures then skewed)")
    options.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                         help="an option for every sidecar started, as SIDECAR_NAME (to try "
                         "settings: --set file-watch=poll)")
    return options


def parse(options: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line; remember --set for sidecar_env."""
    args = options.parse_args()
    for setting in args.set:
        name, _, value = setting.partition("=")
        _extra_options[name.replace("-", "_")] = value
    return args


def finish(rows: list[Row], json_path: Path | None) -> None:
    """Print the rows; write them as JSON for run_all.py when asked."""
    print_table(rows)
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(r) for r in rows]))


def print_table(rows: list[Row]) -> None:
    header = ("benchmark", "figure", "value", "baseline (same run)", "ratio", "target", "result")
    table = [header]
    for r in rows:
        baseline = f"{_num(r.baseline)} {r.unit} ({r.baseline_name})" if r.baseline else ""
        table.append((r.bench, r.figure, f"{_num(r.value)} {r.unit}", baseline,
                      f"{r.ratio:.2f}x" if r.ratio is not None else "", r.target,
                      {True: "pass", False: "FAIL", None: ""}[r.passed]))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * width for width in widths))


def _num(value: float | None) -> str:
    if value is None:
        return ""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


# -- the receiver ---------------------------------------------------------------------------------

class Receiver:
    """The bare ingest (_receiver.py) in its own process."""

    def __init__(self, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_receiver.py"), mode],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.proc.kill()
            raise RuntimeError(f"the receiver did not start: {line!r}")
        self.port = int(line.split()[1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.endpoint = self.base + "/api/ingest"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + "/_stats", timeout=10) as answer:
            stats: dict[str, Any] = json.load(answer)
        return stats

    def delays(self) -> dict[str, list[float]]:
        with urllib.request.urlopen(self.base + "/_delays", timeout=30) as answer:
            delays: dict[str, list[float]] = json.load(answer)
        return delays

    def wait_for(self, done: Callable[[dict[str, Any]], bool], timeout_s: float,
                 poll_s: float = 0.02) -> dict[str, Any]:
        """Poll the counters until `done` holds; returns the last counters either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if done(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(poll_s)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@contextmanager
def receiver(mode: str = "count") -> Iterator[Receiver]:
    r = Receiver(mode)
    try:
        yield r
    finally:
        r.close()


# -- the sidecar ----------------------------------------------------------------------------------

def sidecar_env(endpoint: str, state_dir: Path, token: str = TOKEN,
                **options: str) -> dict[str, str]:
    """The environment of a sidecar reporting to `endpoint` with `token`: platform variables, a
    fresh state dir, no status endpoint, no hardware sampling unless `options` says otherwise."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SIDECAR_", "STARFORGE_", "TUNEPLANE_"))}
    env.update(STARFORGE_ENABLED="1", STARFORGE_ENDPOINT=endpoint, STARFORGE_RUN_ID=RUN_ID,
               STARFORGE_TOKEN=token, SIDECAR_STATE_DIR=str(state_dir),
               SIDECAR_HARDWARE_INTERVAL="0", SIDECAR_STATUS_ADDR="off")
    env.update({"SIDECAR_" + k.upper(): v for k, v in {**options, **_extra_options}.items()})
    return env


def fluent_bit() -> Path | None:
    """The Fluent Bit anchor (shared/anchors/fluent-bit/fluent-bit) in the first `shared/`
    beside the checkout or above it, as a clone with shared/ next to it has; None if none."""
    for folder in REPO.parents:
        binary = folder / "shared" / "anchors" / "fluent-bit" / "fluent-bit"
        if binary.is_file():
            return binary
    return None


def start_sidecar(args: list[str], env: dict[str, str], work: Path) -> subprocess.Popen[bytes]:
    """`sidecar ARGS` in the scratch folder `work`, its messages to work/sidecar.log."""
    with (work / "sidecar.log").open("ab") as messages:
        return subprocess.Popen([*SIDECAR, *args], env=env, cwd=work, stderr=messages)


def show_warnings(work: Path, limit: int = 5) -> None:
    """Print the sidecar's WARNING and ERROR messages (a few), from work/sidecar.log."""
    try:
        lines = (work / "sidecar.log").read_text(errors="replace").splitlines()
    except OSError:
        return
    bad = [line for line in lines if " WARNING " in line or " ERROR " in line]
    for line in bad[:limit]:
        print(f"    sidecar said: {line[:300]}")
    if len(bad) > limit:
        print(f"    ... and {len(bad) - limit} more warnings")


def wait_until_posted(rec: Receiver, route: str, timeout_s: float = 30.0) -> None:
    """Until the receiver saw `route` (the environment snapshot marks a started sidecar)."""
    stats = rec.wait_for(lambda s: s["routes"].get(route, 0) > 0, timeout_s, poll_s=0.05)
    if not stats["routes"].get(route):
        raise RuntimeError(f"the sidecar posted no {route} within {timeout_s:.0f} s")


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU time of the process (all its threads), not of its children."""
    times = proc.cpu_times()
    return float(times.user + times.system)


def wait_quiet(proc: psutil.Process, quiet_s: float = 0.5, timeout_s: float = 20.0) -> None:
    """Until the process used under 2 % of a core for `quiet_s` (its start-up work is over)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = cpu_seconds(proc)
        time.sleep(quiet_s)
        if cpu_seconds(proc) - before < 0.02 * quiet_s:
            return


def stop(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# -- profiling ------------------------------------------------------------------------------------

def _py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from `py-spy dump` ({} without py-spy)."""
    try:
        dump = subprocess.run([_py_spy(), "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m[1], 0): m[2] for m in re.finditer(r'Thread (\S+) \(\w+\): "([^"]*)"', dump)}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of the process, by native id, from the scheduler's own
    nanosecond account (/proc/PID/task/TID/schedstat). The tick-sampled user and system times
    of psutil are too coarse for an idle process: a thread woken by a timer is running at the
    very tick that charges it, and so is charged whole ticks for microseconds of work."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return times


class Profiler:
    """py-spy record attached to a running process; `stop` writes the profile."""

    def __init__(self, pid: int, out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        command = [_py_spy(), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                   "--threads", "--output", str(out)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.out = out
        time.sleep(0.5)  # py-spy attaches

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        print(f"profile written to {self.out}")


@contextmanager
def profiled(pid: int, profile_dir: Path | None, name: str) -> Iterator[None]:
    """py-spy on `pid` for the duration of the block when `profile_dir` is given."""
    if profile_dir is None:
        yield
        return
    profiler = Profiler(pid, profile_dir / f"{name}.txt")
    try:
        yield
    finally:
        profiler.stop()
