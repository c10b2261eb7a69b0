"""--time-window: where each rank's time goes, read from outside (docs/time.md).

Every window, each local rank's process is sampled by one `py-spy record --nonblocking` for the
window's length: py-spy reads the rank's memory at a low rate and never stops it, so the trainer
pays nothing but the memory bandwidth of a few hundred reads. Each sample of the rank's main
thread is placed in a category by its frames (shares.py), and the window's shares go to
/hardware, one gauge a rank and category with the samples they rest on:

    rank/5/time/collective/ratio 0.03  rank/5/time/compute/ratio 0.97  rank/5/time/samples_count 300

The rate is SAMPLES_PER_WINDOW over the window, between MIN_RATE_HZ and MAX_RATE_HZ: 5 a second
at the default 60-s window, 300 samples whose shares are known to about +-3 points; one record a
window and rank costs about 0.25 % of a core (tests/bench/bench_timeshare.py).

A verdict is said, once, when it holds for two windows in a row, and its end once when it stops
holding (verdicts.py says which and at what threshold). py-spy records without ptrace's stop,
but the kernel asks for the same permission: where ptrace is refused, or py-spy is missing, or a
rank is not Python, it is said once, as the stacks are, and the rest goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sidecar.log import log
from sidecar.shares import CATEGORIES, COMPUTE, deciding
from sidecar.stacks import Process, place_of, why_failed
from sidecar.statefile import read_state
from sidecar.supervise import fault_point
from sidecar.threads import off_loop

SAMPLES_PER_WINDOW = 300  # a share of p known to +-sqrt(p(1-p)/300): 3 points at p = 0.5
MIN_RATE_HZ = 5
MAX_RATE_HZ = 20  # a short window samples faster, up to about 1 % of a core a rank
# a record that outlives its window this much is killed: py-spy is stuck, not the rank
RECORD_GRACE_S = 15.0
PROFILE_RATE_HZ = 50  # `sidecar profile`: a few seconds asked for, each sample worth more
UNSEEN_LOOKS = 3  # looks in a row without a rank, before that is said
HOT_PLACES = 3  # the hottest places of a category kept for `sidecar profile`
_CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def rate_for(window_s: float) -> int:
    """Samples a second for a window: SAMPLES_PER_WINDOW over it, within the bounds."""
    return max(MIN_RATE_HZ, min(MAX_RATE_HZ, math.ceil(SAMPLES_PER_WINDOW / window_s)))


class Tally:
    """One process's samples over one look: by category, and by place within each."""

    __slots__ = ("counts", "error", "pid", "places", "rank", "workers")

    def __init__(self, rank: int, pid: int) -> None:
        self.rank, self.pid = rank, pid
        self.counts: Counter[str] = Counter()
        self.places: dict[str, Counter[str]] = {category: Counter() for category in CATEGORIES}
        self.error = ""  # why there are no samples: refused, not Python, gone, py-spy failed
        # where its data-loader workers' main threads were (with --subprocesses): place -> count
        self.workers: Counter[str] = Counter()

    @property
    def samples(self) -> int:
        return sum(self.counts.values())

    def share(self, category: str) -> float:
        total = self.samples
        return self.counts[category] / total if total else 0.0

    def add(self, frames: list[dict[str, Any]], count: int) -> None:
        """One stack of the main thread (innermost first), seen `count` times."""
        rule = deciding(frames)
        category = rule.category if rule is not None else COMPUTE
        self.counts[category] += count
        self.places[category][place_of(frames, rule)] += count

    def to_json(self) -> dict[str, Any]:
        total = self.samples
        return {"rank": self.rank, "pid": self.pid, "samples": total, "error": self.error,
                "shares": {c: self.share(c) for c in CATEGORIES},
                "hottest": {c: [[place, n / total] for place, n in
                                self.places[c].most_common(HOT_PLACES)]
                            for c in CATEGORIES if total and self.counts[c]},
                "workers": [[place, n / max(1, sum(self.workers.values()))]
                            for place, n in self.workers.most_common(HOT_PLACES)]}


def parse_raw(text: str, tally: Tally) -> None:
    """py-spy's raw (folded) output into `tally`: the main thread's stacks (its OS thread id is
    the process's PID) into the categories, a child process's into its workers.

    A line is the stack outermost first, `;`-separated, then a space and how many samples had
    it (the `process` parts only with --subprocesses, a child's after its parent's):

        process 12:"python trainer.py";thread (12): MainThread;<module>
        (sidecar/examples/trainer.py:11);step (sidecar/examples/trainer.py:4) 5
    """
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        parts = stack.split(";")
        processes = 0
        while processes < len(parts) and parts[processes].startswith("process "):
            processes += 1
        if processes == len(parts) or not parts[processes].startswith("thread ("):
            continue
        # `thread (12): MainThread`, or `thread (12)` where py-spy could not read its name
        thread = parts[processes].removeprefix("thread (").partition(")")[0]
        frames = [_frame(part) for part in reversed(parts[processes + 1:])]
        if processes > 1:  # a child of the rank: a data-loader worker, its main thread's
            child = parts[processes - 1].removeprefix("process ").partition(":")[0]
            if thread == child:
                tally.workers[place_of(frames, None)] += int(count_text)
        elif thread == str(tally.pid):
            tally.add(frames, int(count_text))


def _frame(part: str) -> dict[str, Any]:
    """`step (sidecar/examples/trainer.py:4)` as py-spy's JSON names a frame."""
    name, _, where = part.rpartition(" (")
    filename, _, line = where.removesuffix(")").rpartition(":")
    if not name:  # no place: a frame py-spy could not name
        name, filename, line = part, "", ""
    return {"name": name, "filename": filename, "short_filename": _short(filename),
            "line": int(line) if line.isdigit() else 0, "module": None}


def _short(filename: str) -> str:
    """The path from a package's folder down, as py-spy's short_filename is."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rpartition(marker)[2]
    return filename.rpartition("/")[2]


def ranks_of(processes: Iterable[Process]) -> list[tuple[int, Process, list[int]]]:
    """The local ranks to sample now, of the processes the run looks after: (rank, its trainer
    process, that one's children's PIDs, the data-loader workers), by rank.

    A rank starts where RANK does: at a process with RANK whose parent has none (or another
    one); a run without RANK is rank 0, started at the command. Its trainer is the first Python
    process from there down that is no launcher: a rank may begin with a shell or a wrapper
    (`srun bash -c ...`, `timeout`, `train.sh`) that carries RANK to the Python beneath. A rank
    with no Python process is kept as it is, for py-spy to say so."""
    procs = list(processes)
    by_pid = {p.pid: p for p in procs}
    children: dict[int, list[Process]] = {}
    for process in procs:
        children.setdefault(process.ppid, []).append(process)
    starts = [p for p in procs if p.rank is not None
              and (p.ppid not in by_pid or by_pid[p.ppid].rank != p.rank)]
    if not starts:
        starts = [p for p in procs if p.ppid not in by_pid][:1]
    found: dict[int, tuple[int, Process, list[int]]] = {}
    for start in starts:
        trainer = _first_python(start, children)
        if trainer is None and start.rank is None:
            continue  # a command without a Python process: nothing to sample
        trainer = trainer or start
        rank = start.rank or 0
        found.setdefault(rank, (rank, trainer,
                                [p.pid for p in children.get(trainer.pid, ())]))
    return [found[rank] for rank in sorted(found)]


def _first_python(start: Process, children: Mapping[int, list[Process]]) -> Process | None:
    """The first Python process that is no launcher, from `start` down, breadth first, within
    its rank (a child with another RANK begins a rank of its own)."""
    queue = [start]
    while queue:
        process = queue.pop(0)
        if _is_python(process.pid):
            return process
        queue += [c for c in children.get(process.pid, ()) if c.rank == start.rank]
    return None


# launchers written in Python: their processes start the ranks and are none of them
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate",
             "deepspeed", "lightning")


def _is_python(pid: int) -> bool:
    """A Python process that is not a launcher: a trainer without RANK."""
    try:
        if not Path(os.readlink(f"/proc/{pid}/exe")).name.startswith("python"):
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return False
    return not any(Path(arg).name in LAUNCHERS for arg in argv[1:3])


def cpu_seconds(pids: Iterable[int]) -> float:
    """The user and system CPU the processes have used, from /proc (a gone one counts 0)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                text = fh.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) * _CLOCK_TICK_S
    return total


class ShareWindow:
    """One window's tallies, by rank, and what the ranks' workers did meanwhile."""

    __slots__ = ("ended_at", "length_s", "rate_hz", "tallies", "workers")

    def __init__(self, length_s: float, rate_hz: int, ended_at: float,
                 tallies: Mapping[int, Tally], workers: Mapping[int, tuple[int, float]]) -> None:
        self.length_s, self.rate_hz, self.ended_at = length_s, rate_hz, ended_at
        self.tallies = dict(tallies)
        self.workers = dict(workers)  # rank -> (how many, cores they used on average)

    @property
    def sampled(self) -> dict[int, Tally]:
        """The ranks with samples."""
        return {rank: t for rank, t in self.tallies.items() if t.samples}

    def points(self) -> list[dict[str, Any]]:
        """The /hardware points: each sampled rank's shares and its samples count."""
        from sidecar.records import iso_ts

        ts = iso_ts(self.ended_at)
        points = []
        for rank, tally in sorted(self.sampled.items()):
            points += [{"key": f"rank/{rank}/time/{category}/ratio",
                        "value": tally.share(category), "ts": ts} for category in CATEGORIES]
            points.append({"key": f"rank/{rank}/time/samples_count", "value": tally.samples,
                           "ts": ts})
        return points

    def to_json(self) -> dict[str, Any]:
        return {"window_s": self.length_s, "rate_hz": self.rate_hz, "ended_at": self.ended_at,
                "ranks": [dict(tally.to_json(), workers_count=self.workers.get(rank, (0, 0))[0],
                               workers_cores=self.workers.get(rank, (0, 0.0))[1])
                          for rank, tally in sorted(self.tallies.items())]}


async def sample_ranks(tool: str, ranks: Sequence[tuple[int, Process, list[int]]],
                       seconds: int, rate_hz: int, folder: Path, *,
                       workers: Container[int] = ()) -> ShareWindow:
    """Every rank sampled at once for `seconds`, each by its own py-spy record; the ranks in
    `workers` with their children too."""

    def workers_cpu() -> dict[int, float]:  # /proc reads: off the loop
        return {rank: cpu_seconds(children) for rank, _, children in ranks}

    before = await off_loop(workers_cpu, 5, "time-cpu")
    started = time.monotonic()
    tallies = await asyncio.gather(*(_record_one(tool, rank, process, seconds, rate_hz, folder,
                                                 rank in workers)
                                     for rank, process, _ in ranks))
    took_s = max(time.monotonic() - started, 1e-3)
    after = await off_loop(workers_cpu, 5, "time-cpu")
    used = {rank: (len(children), max(0.0, after[rank] - before[rank]) / took_s)
            for rank, _, children in ranks}
    return ShareWindow(seconds, rate_hz, time.time(), {t.rank: t for t in tallies}, used)


async def _record_one(tool: str, rank: int, process: Process, seconds: int, rate_hz: int,
                      folder: Path, workers: bool) -> Tally:
    tally = Tally(rank, process.pid)
    output = folder / f"rank-{rank}-{process.pid}.txt"
    argv = [tool, "record", "--pid", str(process.pid), "--duration", str(seconds),
            "--rate", str(rate_hz), "--format", "raw", "--output", str(output), "--idle",
            "--threads", "--nonblocking", "--full-filenames", *(("--subprocesses",)
                                                                 if workers else ())]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        tally.error = f"py-spy cannot run: {exc.strerror or exc}"
        return tally
    with contextlib.suppress(OSError):  # CPU the trainer does not use
        os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    assert proc.stderr is not None
    try:
        # its stderr's end, not its exit status: as PID 1 the child watcher may reap it first
        async with asyncio.timeout(seconds + RECORD_GRACE_S):
            stderr = await proc.stderr.read()
    except TimeoutError:
        _kill(proc)
        stderr = b""
        tally.error = f"py-spy took more than {seconds + RECORD_GRACE_S:g} s: abandoned"
    except asyncio.CancelledError:  # the run ends: no record outlives it
        _kill(proc)
        raise
    with contextlib.suppress(TimeoutError, ChildProcessError):
        async with asyncio.timeout(2):
            await proc.wait()
    try:  # read as every file of the state folder is: never through a link, never blocking
        raw = await off_loop(lambda: read_state(output), 5, "time-read")
    except (OSError, TimeoutError):
        raw = None
    text = raw.decode("utf-8", "replace") if raw else ""
    with contextlib.suppress(OSError):
        output.unlink()
    parse_raw(text, tally)
    if not tally.samples and not tally.error:
        tally.error = why_failed(stderr.decode("utf-8", "replace"))
    return tally


def scratch_folder(prefix: str) -> Path:
    """A new folder of ours alone for py-spy's output files (not tempfile: it loads shutil and
    random, which a daemon does not need otherwise, tests/test_footprint.py)."""
    folder = Path(os.environ.get("TMPDIR") or "/tmp") / f"{prefix}-{os.urandom(6).hex()}"
    folder.mkdir(mode=0o700)
    return folder


def remove_folder(folder: Path) -> None:
    """The folder and the files py-spy left in it."""
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            path.unlink(missing_ok=True)
        folder.rmdir()


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


class TimeSampler:
    """The always-on sampling of one run: a window after another, each one's shares emitted
    to /hardware and judged (verdicts.py), the latest kept for /status."""

    def __init__(self, window_s: int, processes: Callable[[], Iterable[Process]],
                 emit_points: Callable[[list[dict[str, Any]]], None],
                 judge: Callable[[ShareWindow], None], said: Callable[[], list[str]],
                 tool: str | None,
                 starving: Callable[[ShareWindow], set[int]] = lambda window: set(),
                 folder: Path | None = None) -> None:
        """`folder`: where py-spy writes each window's output (the run's state folder's
        `time`), else a folder of ours in the temporary directory."""
        self.window_s = window_s
        self.rate_hz = rate_for(window_s)
        self.processes = processes  # blocking: the run's processes now
        self.emit_points = emit_points
        self.judge = judge  # each window's verdicts judged and said (verdicts.py)
        self.said = said  # the verdicts said and holding, for /status
        # the ranks of a window whose workers the next one samples too: those waiting for data
        self.starving = starving
        self.tool = tool
        self.latest: ShareWindow | None = None
        self.cannot = ""  # why nothing can be sampled, once said
        self._said: set[str] = set()  # the reasons said, once each
        self._folder: Path | None = folder
        self._unseen = 0  # looks in a row that found no rank
        self._own_folder = folder is None  # made here, and removed at the end

    async def run(self) -> None:
        """Window after window until cancelled; a window with no rank in view waits one."""
        if self.tool is None:
            self._say_once("py-spy is not installed here")
            return
        while True:
            fault_point()
            ranks = await off_loop(lambda: ranks_of(self.processes()), 10, "time-ranks")
            if not ranks:
                # said once it lasts: a launcher starts its ranks late, and a command that
                # exits leaves none
                self._unseen += 1
                if self._unseen == UNSEEN_LOOKS and self.latest is None:
                    self._say_once("no process of the command is in view", level="info")
                await asyncio.sleep(self.window_s)
                continue
            self._unseen = 0
            workers = self.starving(self.latest) if self.latest is not None else set()
            try:
                folder = self._dir()
            except OSError as exc:
                self._say_once(f"no folder can be made for py-spy's output ({exc})")
                return
            window = await sample_ranks(self.tool, ranks, self.window_s, self.rate_hz, folder,
                                        workers=workers)
            self._say_errors(window)
            if not window.sampled:
                await asyncio.sleep(min(self.window_s, 5))  # a rank that just exited, or none
                continue
            self.latest = window
            if not any(t.error for t in window.tallies.values()):
                self.cannot = ""
            self.emit_points(window.points())
            self.judge(window)

    def to_json(self) -> dict[str, Any]:
        """What /status shows: the latest window, the verdicts said and holding, or why there
        is nothing to show."""
        return {"window_s": self.window_s, "rate_hz": self.rate_hz, "cannot": self.cannot,
                "verdicts": self.said(),
                "latest": self.latest.to_json() if self.latest is not None else None}

    def _dir(self) -> Path:
        if self._folder is not None and not self._own_folder:
            self._folder.mkdir(parents=True, exist_ok=True)
        elif self._folder is None or not self._folder.is_dir():
            self._folder = scratch_folder("sidecar-time")
        return self._folder

    def close(self) -> None:
        if self._folder is not None:
            remove_folder(self._folder)
            if self._own_folder:
                self._folder = None

    def _say_errors(self, window: ShareWindow) -> None:
        """Why a rank has no samples, once a reason (a rank that exited says nothing)."""
        for rank, tally in sorted(window.tallies.items()):
            if tally.error and tally.error != "exited meanwhile":
                self._say_once(tally.error, rank=rank)

    def _say_once(self, why: str, rank: int | None = None, level: str = "warning") -> None:
        key = why.split(":")[0]
        if key in self._said:
            return
        self._said.add(key)
        who = f" of rank {rank}" if rank is not None else ""
        self.cannot = why
        getattr(log, level)("where the time%s goes is not sampled: %s "
                            "(docs/time.md#where-it-cannot-look); the rest goes on", who,
                            why + ("; give the sidecar CAP_SYS_PTRACE" if "refused" in why
                                   else ""))


async def profile(tool: str | None, processes: Callable[[], Iterable[Process]],
                  seconds: int) -> dict[str, Any] | str:
    """`sidecar profile`: every rank and its workers sampled for `seconds` at PROFILE_RATE_HZ;
    the window's document, or why there is none."""
    if tool is None:
        return ("the ranks cannot be sampled: py-spy is not installed here "
                "(docs/time.md#where-it-cannot-look)")
    ranks = await off_loop(lambda: ranks_of(processes()), 10, "profile-ranks")
    if not ranks:
        return "no process of the command is in view: nothing to sample"
    try:
        folder = scratch_folder("sidecar-profile")
    except OSError as exc:
        return f"no folder can be made for py-spy's output in the temporary directory ({exc})"
    try:
        window = await sample_ranks(tool, ranks, seconds, PROFILE_RATE_HZ, folder,
                                    workers={rank for rank, _, _ in ranks})
    finally:
        remove_folder(folder)
    return window.to_json()
