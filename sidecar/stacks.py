"""Where every process of the command is, read from outside with py-spy (docs/stalls.md).

At a stall, at a SIGTERM to a quiet run, and on demand (`sidecar stacks`, the status endpoint's
/stacks), each process of the command is dumped by its own `py-spy dump --json` subprocess, all
at once so that the ranks are seen at about the same instant, each with a timeout after which it
is killed and the process is said to be out of reach: nothing here waits on the event loop, and
the trainer is paused for milliseconds a dump (py-spy stops its threads while it reads them).
What they show is grouped by where each process is, its rank read from its environment:

    [sidecar] stacks of 3 processes of the command at the stall, by where they are (full dumps:
    /stacks/last on the status endpoint, <state>/stacks/...json):
    [sidecar]   rank 0: all_reduce [c10d::Work::wait] <- main (trainer.py:17)
    [sidecar]   rank 1: load_shard (trainer.py:8)
    [sidecar]   last output by rank: rank 1 at 20:41:03 (quiet first), rank 0 at 20:41:40

py-spy, not pystack: one static binary (no interpreter to start, 20-30 ms a Python-only dump
against pystack's 100 ms), a JSON document a dump that needs no text parsing, `--native` for the
C++ frame a collective waits in; pystack reads free-threaded 3.13t targets better. Where py-spy is
missing, or ptrace is refused, one line says so and the stall line stays what it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.log import log
from sidecar.stall import ranges
from sidecar.threads import off_loop

if TYPE_CHECKING:
    from sidecar.shares import Rule

# a dump with --native reads libtorch's symbols first: seconds on a loaded machine
DUMP_TIMEOUT_S = 10.0
# at a SIGTERM the platform's grace period runs: Python frames only, and the signal goes on after
SIGNAL_BUDGET_S = 1.0
KEPT_DUMPS = 10  # full dumps kept in the state folder, the oldest removed
STACKS_FOLDER = "stacks"
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
# the permission errors py-spy prints when ptrace or process_vm_readv is refused
_REFUSED = re.compile(r"Permission denied|Operation not permitted|EPERM|os error 1\b|"
                      r"os error 13\b")
_NOT_PYTHON = re.compile(r"Failed to find python version|Failed to find a python interpreter")
_GONE = re.compile(r"No such process|Check that the process is running|os error 3\b")
# frames of libraries and of the interpreter around the one that says where a rank waits
_PLUMBING = re.compile(r"^(?:0x[0-9a-f]+|pybind11::|_?_?pthread_|std::|__GI_|_PyEval|"
                       r"PyObject_|_PyObject|cfunction|method_vectorcall|clock_nanosleep|"
                       r"syscall|poll|epoll_wait|select|futex)")
_SYSTEM_LIBS = ("libc.so", "libpthread", "libstdc++", "ld-linux", "libpython")
# `[rank3]:` (PyTorch's own prefix), `[default3]:` (torchrun --tee), at a line's start; the rest
# of the line is kept, since two ranks' writes on one pipe interleave there: unbuffered, Python
# writes a print's text and its newline apart, so `[rank0]: step 1[rank1]: step 1\n\n` is one
# line of two ranks
RANK_PREFIX = re.compile(rb"(?:^|\n)\[([A-Za-z_]*?)(\d{1,5})\]:([^\n]*)")


def find_tool() -> str | None:
    """py-spy beside the interpreter (a virtual environment's bin) or on PATH; None: absent."""
    # not shutil.which: a daemon does not load shutil for one lookup (tests/test_footprint.py)
    for folder in [str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(":")]:
        candidate = Path(folder or ".") / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


class Process:
    """One process of the command and what its dump said (no dataclass: a daemon generates no
    methods at its start, tests/test_footprint.py)."""

    __slots__ = ("env", "error", "name", "native", "pid", "ppid", "threads")

    def __init__(self, pid: int, ppid: int, name: str, env: dict[str, str] | None = None) -> None:
        self.pid, self.ppid, self.name = pid, ppid, name
        self.env = env or {}
        self.threads: list[dict[str, Any]] = []
        self.error = ""  # why it has no stack: not Python, gone, refused, timed out
        self.native = False

    @property
    def rank(self) -> int | None:
        value = self.env.get("RANK")
        return int(value) if value is not None and value.isdigit() else None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "ppid": self.ppid, "name": self.name, "rank": self.rank,
                "environment": self.env, "native": self.native, "error": self.error,
                "threads": self.threads}


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(ppid, name, state) from /proc/PID/stat; None when it is gone."""
    try:
        text = _read(f"/proc/{pid}/stat").decode("utf-8", "replace")
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    state, ppid = text[text.rindex(")") + 2:].split()[:2]
    return int(ppid), name, state


def _environment(pid: int) -> dict[str, str]:
    """The rank variables of its initial environment (execve's; later changes do not show)."""
    try:
        raw = _read(f"/proc/{pid}/environ")
    except OSError:
        return {}
    found = {}
    for entry in raw.split(b"\0"):
        key, _, value = entry.partition(b"=")
        name = key.decode("ascii", "replace")
        if name in RANK_VARS:
            found[name] = value.decode("utf-8", "replace")
    return found


def processes_of(root_pid: int) -> list[Process]:
    """The command's process and its descendants, parents first (blocking: /proc reads)."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is not None:
            info[int(entry)] = stat[:2]
            children.setdefault(stat[0], []).append(int(entry))
    if root_pid not in info:
        return []
    found, queue = [], [root_pid]
    while queue:
        pid = queue.pop(0)
        ppid, name = info[pid]
        found.append(Process(pid, ppid, name, _environment(pid)))
        queue.extend(sorted(children.get(pid, ())))
    return found


def ranked_processes() -> list[Process]:
    """`watch`: the visible processes a launcher gave a RANK, and their descendants."""
    own = os.getpid()
    roots = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        stat = _stat(int(entry))
        # our own py-spy runs carry our environment, a node's RANK among it
        if stat is not None and stat[0] != own and "RANK" in _environment(int(entry)):
            roots.append(int(entry))
    seen: set[int] = set()
    found = []
    for root in sorted(roots):
        for process in processes_of(root):
            if process.pid not in seen:
                seen.add(process.pid)
                found.append(process)
    return found


def _dump_one(tool: str, process: Process, native: bool, timeout_s: float) -> None:
    """One `py-spy dump` (blocking, on a thread): its threads, or why there are none. A target
    left stopped by a dump cut short is continued."""
    before = _stat(process.pid)
    argv = [tool, "dump", "--pid", str(process.pid), "--json", *(("--native",) if native else ())]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        process.error = f"py-spy took more than {timeout_s:g} s: abandoned"
        _continue_if_stopped(process.pid, before)
        return
    except OSError as exc:
        process.error = f"py-spy cannot run: {exc.strerror or exc}"
        return
    try:
        process.threads = json.loads(done.stdout) if done.stdout.strip() else []
        process.native = native
    except ValueError:
        process.threads = []
    if not process.threads:
        process.error = why_failed(done.stderr.decode("utf-8", "replace"))
    _continue_if_stopped(process.pid, before)


def _continue_if_stopped(pid: int, before: tuple[int, str, str] | None) -> None:
    after = _stat(pid)
    if after is not None and after[2] in "Tt" and (before is None or before[2] not in "Tt"):
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, signal.SIGCONT)


def why_failed(stderr: str) -> str:
    """Why py-spy read nothing, from what it printed: refused, not Python, gone, or its own
    first line."""
    if _REFUSED.search(stderr):
        return "refused: ptrace is not allowed here"
    if _NOT_PYTHON.search(stderr):
        return "not a Python process"
    if _GONE.search(stderr):
        return "exited meanwhile"
    first = next((line for line in stderr.splitlines() if line.strip()), "no output")
    return f"py-spy: {first.removeprefix('Error: ')[:200]}"


def dump(tool: str, procs: Sequence[Process], *, native: bool, timeout_s: float,
         python_done: Callable[[], None] = lambda: None) -> None:
    """Every process at once, each on its own thread (blocking until all are back or given up),
    with Python frames; then, with `native`, those waiting in torch.distributed again with native
    frames (the collective's C++ frame). Only those: py-spy keeps a torch process stopped while it
    unwinds, seconds while it reads libtorch's symbols (tests/bench/bench_stacks.py), which costs
    a rank that waits for the others nothing, and one still working that much of its step."""
    _in_parallel(procs, lambda process: _dump_one(tool, process, False, timeout_s), timeout_s)
    python_done()
    if not native:
        return
    waiting = [p for p in procs if not p.error and _in_collective(p)]

    def again(process: Process) -> None:
        python_only = process.threads
        _dump_one(tool, process, True, timeout_s)
        if process.error or not process.threads:  # "Failed to merge native and python frames"
            process.threads, process.error, process.native = python_only, "", False

    _in_parallel(waiting, again, timeout_s)


def _in_parallel(procs: Sequence[Process], work: Callable[[Process], None],
                 timeout_s: float) -> None:
    import threading

    workers = [threading.Thread(target=work, args=(p,), daemon=True) for p in procs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout_s + 1)


def _in_collective(process: Process) -> bool:
    """Its main thread's innermost Python frame is torch.distributed's (a collective, a barrier,
    the rendezvous's store)."""
    thread = _main_thread(process)
    frames = [f for f in thread.get("frames", ()) if _is_python(f)] if thread else []
    return bool(frames) and "torch/distributed/" in str(frames[0].get("filename", ""))


class Stacks:
    """One look at the command's processes: the dumps and the summary's lines."""

    __slots__ = ("file", "processes", "reason", "taken_at", "took_s")

    def __init__(self, reason: str, taken_at: float, processes: list[Process],
                 took_s: float) -> None:
        self.reason, self.taken_at, self.processes, self.took_s = (
            reason, taken_at, processes, took_s)
        self.file: Path | None = None

    @property
    def refused(self) -> bool:
        """Every process refused py-spy: ptrace is not allowed here."""
        return bool(self.processes) and all(p.error.startswith("refused")
                                            for p in self.processes)

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "taken_at": self.taken_at, "took_s": self.took_s,
                "refused": refused_line("") if self.refused else "",
                "summary": self.summary(), "processes": [p.to_json() for p in self.processes]}

    def summary(self) -> list[str]:
        """Where each process is, grouped: `ranks 0-6: all_reduce <- step (trainer.py:88)`."""
        groups: dict[str, list[Process]] = {}
        skipped: dict[str, int] = {}
        ranks = {p.pid: p.rank for p in self.processes}
        for process in self.processes:
            if process.error:
                if process.error != "not a Python process":
                    groups.setdefault(f"({process.error})", []).append(process)
                else:
                    skipped[process.error] = skipped.get(process.error, 0) + 1
                continue
            groups.setdefault(where(process), []).append(process)
        lines = [f"{_who(members, ranks)}: {place}" for place, members in
                 sorted(groups.items(), key=lambda item: _order(item[1], ranks))]
        for why, count in skipped.items():
            lines.append(f"{count} process{'es' if count > 1 else ''} {why}, not shown")
        return lines


def refused_line(where_said: str) -> str:
    return (f"[sidecar] stacks {where_said}{' ' if where_said else ''}cannot be taken: ptrace is "
            "not allowed here (py-spy was refused; give the sidecar CAP_SYS_PTRACE, "
            "docs/stalls.md#where-it-cannot-look)")


def _order(members: Sequence[Process], ranks: Mapping[int, int | None]) -> tuple[int, int]:
    """Ranks first, by rank; then their workers; then the processes without one, by PID."""
    main = [p.rank for p in members if p.rank is not None and ranks.get(p.ppid) != p.rank]
    workers = [p.rank for p in members if p.rank is not None and ranks.get(p.ppid) == p.rank]
    if main:
        return 0, min(r for r in main if r is not None)
    if workers:
        return 1, min(r for r in workers if r is not None)
    return 2, min(p.pid for p in members)


def _who(members: Sequence[Process], ranks: Mapping[int, int | None]) -> str:
    """`ranks 0-6`, `rank 7`, `workers of rank 0 (PIDs 12, 13)`, `PID 10 torchrun`."""
    main_ranks, workers, others = [], [], []
    for process in members:
        rank = process.rank
        if rank is not None and ranks.get(process.ppid) == rank:
            workers.append(process)
        elif rank is not None:
            main_ranks.append(rank)
        else:
            others.append(process)
    parts = []
    if main_ranks:
        parts.append(("rank " if len(main_ranks) == 1 else "ranks ") + ranges(sorted(main_ranks)))
    if workers:
        worker_ranks = sorted({p.rank for p in workers if p.rank is not None})
        parts.append(f"worker{'s' if len(workers) > 1 else ''} of rank"
                     f"{'s' if len(worker_ranks) > 1 else ''} {ranges(worker_ranks)} (PID"
                     f"{'s' if len(workers) > 1 else ''} "
                     f"{', '.join(str(p.pid) for p in workers)})")
    parts.extend(f"PID {p.pid} {p.name}" for p in others)
    return "; ".join(parts)


def _is_python(frame: Mapping[str, Any]) -> bool:
    return frame.get("module") is None


def _is_own(frame: Mapping[str, Any]) -> bool:
    """A frame of the trainer's own code: not an installed package's, not the interpreter's."""
    filename = str(frame.get("filename", ""))
    return not ("site-packages" in filename or "dist-packages" in filename
                or re.search(r"/lib/python3\.\d+/", filename))


def _main_thread(process: Process) -> dict[str, Any] | None:
    threads = [t for t in process.threads if any(_is_python(f) for f in t.get("frames", ()))]
    for thread in threads:
        if thread.get("os_thread_id") == process.pid:
            return thread
    return threads[0] if threads else None


def where(process: Process) -> str:
    """Its main thread's place: `all_reduce [c10d::Work::wait] <- main (trainer.py:17)`; the
    innermost frame, the native one it waits in, the trainer's own frame that called it."""
    thread = _main_thread(process)
    if thread is None:
        return "(no Python thread)"
    frames = thread.get("frames", [])
    native = ""
    for frame in frames:
        if _is_python(frame):
            break
        name, lib = str(frame.get("name", "")), str(frame.get("short_filename", ""))
        if not _PLUMBING.match(name) and not lib.startswith(_SYSTEM_LIBS):
            native = f" [{name}]"
            break
    return place_of(frames, native=native)


def place_of(frames: Sequence[Mapping[str, Any]], rule: Rule | None = None,
             native: str = "") -> str:
    """Where a thread whose frames (innermost first) these are is: its innermost Python frame,
    or the one that matches `rule` (shares.py), then the trainer's own frame that called it:
    `all_reduce <- step (trainer.py:17)`; `native`: the C++ frame it waits in, after the name."""
    python = [f for f in frames if _is_python(f)]
    if not python:
        return "(no Python frame)"
    at = 0
    if rule is not None:
        from sidecar.shares import rule_of

        at = next((i for i, f in enumerate(python) if rule_of(f) is rule), 0)
    own = next((f for f in python[at:] if _is_own(f)), None)
    if own is python[at] or own is None:
        return f"{_place(python[at])}{native}"
    return f"{python[at]['name']}{native} <- {_place(own)}"


def _place(frame: Mapping[str, Any]) -> str:
    return f"{frame.get('name')} ({frame.get('short_filename')}:{frame.get('line')})"


class RankClock:
    """When each rank last printed, from `[rankN]:` prefixes in the command's output (cheap: one
    regular expression over each block)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.last: dict[int, float] = {}

    def feed(self, block: bytes) -> None:
        if b"]:" not in block:
            return
        now = self.clock()
        for match in RANK_PREFIX.finditer(block):
            self.last[int(match[2])] = now
            name, rest = match[1], match[3]
            if b"]:" in rest:  # another rank's prefix, of the same form, within the line
                for other in re.finditer(rb"\[" + re.escape(name) + rb"(\d{1,5})\]:", rest):
                    self.last[int(other[1])] = now

    def line(self) -> str:
        """`last output by rank: rank 1 at 20:41:03 (quiet first), rank 0 at 20:41:40`; "" for
        fewer than two ranks."""
        if len(self.last) < 2:
            return ""
        order = sorted(self.last.items(), key=lambda item: item[1])
        said = [f"rank {rank} at {time.strftime('%H:%M:%S', time.gmtime(at))}"
                for rank, at in order]
        said[0] += " (quiet first)"
        return "last output by rank (UTC): " + ", ".join(said)


class StackTaker:
    """Takes the stacks of the command's processes for a run: the tool found once, the processes
    found at each look, the dumps on threads awaited with a deadline, the latest kept for the
    status endpoint and written to the state folder."""

    def __init__(self, pids: Callable[[], Iterable[Process]], run_dir: Path | None,
                 tool: str | None = None) -> None:
        self.pids = pids  # blocking: the processes to look at now
        self.run_dir = run_dir
        self.tool = tool if tool is not None else find_tool()
        self.last: Stacks | None = None
        self._said_missing = False
        self.refused_said = False
        # one look at a time: a second tracer is refused by the kernel (EPERM), so a look asked
        # for while one runs waits for it and shares what it saw
        self._running: asyncio.Future[Stacks | None] | None = None
        # the look under way, once its Python frames are in (its native pass may take seconds)
        self.python_pass: Stacks | None = None

    @property
    def available(self) -> bool:
        return self.tool is not None

    async def take(self, reason: str, *, native: bool = True,
                   timeout_s: float = DUMP_TIMEOUT_S) -> Stacks | None:
        """A look now (or the one under way), or None without py-spy (said once in our log)."""
        running = self._running
        if running is not None and not running.done():
            return await asyncio.shield(running)
        self._running = asyncio.ensure_future(self._take(reason, native, timeout_s))
        return await asyncio.shield(self._running)

    async def _take(self, reason: str, native: bool, timeout_s: float) -> Stacks | None:
        tool = self.tool
        if tool is None:
            if not self._said_missing:
                self._said_missing = True
                log.warning("stacks at a stall are not taken: py-spy is not installed here "
                            "(it comes with `pip install ml-sidecar`; "
                            "docs/stalls.md#where-it-cannot-look)")
            return None
        started, taken_at = time.monotonic(), time.time()

        self.python_pass = None

        def look() -> list[Process]:
            procs = list(self.pids())

            def python_done() -> None:  # in the thread: what a SIGTERM may use meanwhile
                self.python_pass = Stacks(reason, taken_at, procs, time.monotonic() - started)

            dump(tool, procs, native=native, timeout_s=timeout_s, python_done=python_done)
            return procs

        try:
            procs = await off_loop(look, 2 * timeout_s + 2, "stacks")
        except TimeoutError:
            procs = []
            log.warning("stacks: the dumps took more than %.0f s and were abandoned",
                        2 * timeout_s + 2)
        stacks = Stacks(reason, taken_at, procs, time.monotonic() - started)
        run_dir = self.run_dir
        if run_dir is not None and procs:
            try:
                stacks.file = await off_loop(lambda: _keep(run_dir, stacks), 5, "stacks-file")
            except TimeoutError:  # a hung disk: the summary goes out all the same
                log.warning("stacks: writing the full dump to %s took more than 5 s", run_dir)
        if procs:
            self.last = stacks
        return stacks

    def block(self, stacks: Stacks, where_said: str, extra: Sequence[str] = ()) -> list[str]:
        """The lines for /logs: a heading, a line a group, `extra` (the rank clock's line)."""
        if stacks.refused:
            if self.refused_said:
                return []
            self.refused_said = True
            return [refused_line(where_said)]
        if not stacks.processes:  # watch, where no process in view has a RANK
            log.info("stacks %s: no process of the command is in view", where_said)
            return []
        files = f", {stacks.file}" if stacks.file is not None else ""
        count = len(stacks.processes)
        head = (f"[sidecar] stacks of {count} process{'es' if count > 1 else ''} of the command "
                f"{where_said}, by where they are (full dumps: /stacks/last on the status "
                f"endpoint{files}):")
        return [head, *(f"[sidecar]   {line}" for line in [*stacks.summary(), *extra] if line)]


def say(block: Sequence[str]) -> None:
    """A block of stacks in the sidecar's own log too, a record a line: where a terminal or
    `kubectl logs` shows it, beside the stall's WARNING (only /logs had it)."""
    for line in block:
        log.warning("%s", line.removeprefix("[sidecar] "))


def _keep(run_dir: Path, stacks: Stacks) -> Path | None:
    """The full dump to the state folder, the oldest beyond KEPT_DUMPS removed; masked, as
    everything the sidecar writes is (a script's path, a function's or a thread's name, a
    local's value may hold the token)."""
    from sidecar.masking import mask_doc

    folder = run_dir / STACKS_FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(stacks.taken_at))
        path = folder / f"{stamp}-{stacks.reason}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(mask_doc(stacks.to_json()), indent=1))
        tmp.replace(path)
        for old in sorted(folder.glob("*.json"))[:-KEPT_DUMPS]:
            old.unlink(missing_ok=True)
        return path
    except OSError as exc:
        log.warning("stacks: cannot write the full dump to %s (%s)", folder, exc.strerror)
        return None


async def take_with_budget(taker: StackTaker, reason: str, budget_s: float) -> Stacks | None:
    """A Python-only look that is over within `budget_s` whatever happens (a SIGTERM's); while
    a stall's look is still in its native pass, the Python frames it already has."""
    try:
        async with asyncio.timeout(budget_s):
            return await taker.take(reason, native=False, timeout_s=budget_s * 0.8)
    except TimeoutError:
        return taker.python_pass
