"""The trainer's process tree from /proc: a table of parents kept from sample to sample, and
each process read from its one stat file."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import NamedTuple

from sidecar.sources.telemetry import procfs

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ProcessReading(NamedTuple):
    """One process of the trainer's tree."""

    pid: int
    started_s: float  # wall-clock creation time: tells a new process from a reused pid
    cpu_s: float
    rss_bytes: int
    threads: int
    open_files: int | None


class ParentTable:
    """Every process's parent, kept from sample to sample, to find a process's descendants
    without reading the stat file of every process on the machine each time (psutil's
    children(recursive=True) does: 4 ms of a 10 ms sample on a machine of 170 processes).
    A pid's parent is read when the pid first appears, and the parents of the tree's own
    processes every time (an orphan is re-parented). /proc is listed again only when a process
    was created since the last look (the newest pid of /proc/loadavg moved on): otherwise no
    process can have joined the tree, and the tree's own are all there is to read. Set
    operations on a listing find what appeared and what went: Python touches only those.

    The tree's stat files are kept open (`procfs.ProcFile`) and their lines handed on in
    `stat_lines`, so that a process's reading needs no second read. An exited process's file
    fails its next read and is dropped: a new process given the same pid is opened anew."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._loadavg = procfs.ProcFile(f"{proc}/loadavg")
        self._parents: dict[str, tuple[int, int]] = {}  # /proc entry -> (pid, its parent)
        self._other: set[str] = set()  # /proc's entries that are not processes
        self._tree: set[str] = set()  # the root and its descendants at the last look
        self._files: dict[str, procfs.ProcFile] = {}  # their stat files
        self._looked: tuple[int, int] | None = None  # (newest pid, root) at the last look
        self.stat_lines: dict[int, bytes] = {}  # the stat line of each of them, this look

    def descendants(self, root: int) -> list[int] | None:
        """`root`'s descendants, parents before children; None where /proc cannot be listed."""
        newest = self._newest_pid()
        listed = newest is None or (newest, root) != self._looked
        if listed:
            try:
                self._learn(set(os.listdir(self._proc)))
            except OSError:
                return None
        self._looked = None if newest is None else (newest, root)
        parents = self._parents
        lines: dict[int, bytes] = {}
        for name in self._tree | {str(root)}:
            line = self._tree_stat(name)
            parent = None if line is None else _parent_of(line)
            if line is None or parent is None:  # it has just exited
                parents.pop(name, None)
            else:
                parents[name] = (int(name), parent)
                lines[int(name)] = line
        # with no process created, the tree can only have lost some: its own are all to look at
        candidates = parents.values() if listed else sorted(parents[str(p)] for p in lines)
        children: dict[int, list[int]] = collections.defaultdict(list)
        for pid, parent in candidates:
            children[parent].append(pid)
        found: list[int] = []
        stack = [root]
        while stack:
            below = children.get(stack.pop(), ())
            found.extend(below)
            stack.extend(below)
        self._tree = {str(pid) for pid in [root, *found]}
        for name in self._files.keys() - self._tree:
            self._files.pop(name).close()
        self.stat_lines = lines
        return found

    def _learn(self, listed: set[str]) -> None:
        """Forget the processes gone from the listing; read the parents of those new in it."""
        parents = self._parents
        for gone in parents.keys() - listed:
            del parents[gone]
        for name in listed - parents.keys() - self._other:
            if not name.isdigit():
                self._other.add(name)
                continue
            try:
                parent = _parent_of(_read_stat(f"{self._proc}/{name}/stat"))
            except OSError:  # it has just exited
                continue
            if parent is not None:
                parents[name] = (int(name), parent)

    def _tree_stat(self, name: str) -> bytes | None:
        """The stat line of the tree's process `name`, from its kept file; None once gone."""
        file = self._files.get(name)
        if file is None:
            file = self._files[name] = procfs.ProcFile(f"{self._proc}/{name}/stat")
        try:
            return file.read()
        except OSError:
            del self._files[name]
            return None

    def _newest_pid(self) -> int | None:
        """The pid most recently handed out (the last field of /proc/loadavg), None unreadable."""
        try:
            return int(self._loadavg.read().split()[-1])
        except (OSError, ValueError, IndexError):
            return None


def _parent_of(stat_line: bytes) -> int | None:
    """The parent pid in a /proc/PID/stat line (after the command name, which may hold spaces
    and parentheses: the last `)` ends it); None where the line is not one."""
    try:
        return int(stat_line[stat_line.rindex(b")") + 2:].split(b" ", 2)[1])
    except (ValueError, IndexError):
        return None


def _read_stat(path: str) -> bytes:
    """A /proc/PID/stat line in one read (it is under a page), without a Python file object."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def proc_reading(pid: int, boot_s: float, stat_line: bytes | None) -> ProcessReading | None:
    """One process from /proc/PID/stat (times, threads, start, RSS) and its fd folder, as
    psutil reads them but from one file: psutil's oneshot took 0.34 ms a process. `boot_s` is
    the boot time psutil adds (btime of /proc/stat), read once for the whole tree, not once a
    process; `stat_line` the stat line where it was just read. None once the process is gone."""
    try:
        if stat_line is None:
            stat_line = _read_stat(f"/proc/{pid}/stat")
        # after "pid (comm) ": state ppid ... utime(14) stime(15) ... num_threads(20)
        # itrealvalue starttime(22) vsize rss(24), counted from 1 with pid as field 1
        fields = stat_line[stat_line.rindex(b")") + 2:].split()
        utime, stime = int(fields[11]), int(fields[12])
        threads, started, rss_pages = int(fields[17]), int(fields[19]), int(fields[21])
    except (OSError, ValueError, IndexError):
        return None
    return ProcessReading(pid=pid, started_s=boot_s + started / CLOCK_TICKS,
                          cpu_s=(utime + stime) / CLOCK_TICKS, rss_bytes=rss_pages * _PAGE_BYTES,
                          threads=threads, open_files=_open_files(pid))


def _open_files(pid: int) -> int | None:
    """How many files the process has open, as psutil's num_fds() counts its fd folder's
    entries: the folder's size says it since Linux 6.2, in one stat instead of a listing of
    every descriptor (0 before: then listed). None where the folder cannot be read."""
    folder = f"/proc/{pid}/fd"
    try:
        return os.stat(folder).st_size or len(os.listdir(folder))
    except OSError:
        return None
