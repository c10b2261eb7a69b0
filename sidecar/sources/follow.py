"""Following files as they grow: discovery, rotation, truncation, offsets (issue: file sources).

Every matching file is followed on its own through an open descriptor, so a renamed or deleted
file is still read to its end while its successor is read from its start. Files are known by
device, inode and a fingerprint of their first bytes; the offset of a file advances in the
checkpoint only once everything before it was acknowledged by the ingest.

Changes are noticed through inotify read by the event loop (no thread, nothing spent while idle),
with a slow safety poll; folders on NFS, SMB, FUSE and the like, where events never arrive, are
polled instead, as is everything in `poll` mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import stat
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.aio import wait_set
from sidecar.log import log
from sidecar.records import Ticket
from sidecar.sources.base import Parsed, Parser
from sidecar.sources.checkpoints import Checkpoints, Mark
from sidecar.sources.inotify import Inotify, filesystem_of, is_remote
from sidecar.supervise import fault_point

FINGERPRINT_BYTES = 256
READ_BYTES = 1 << 20
POLL_S = 0.25  # poll mode: how often files are looked at
SAFETY_POLL_S = 5.0  # event mode: a look even without events (an overflowed event queue)
QUIET_S = 1.0  # unconsumed bytes this old are offered to the parser's quiet()
RETIRED_GRACE_S = 5.0  # a rotated-away file is read this long after it went quiet


@dataclass(frozen=True)
class SourceSpec:
    """A kind of file to follow: which paths, and how to make a parser for one file."""

    kind: str  # "log", "jsonl", "tensorboard"
    patterns: tuple[str, ...]
    make_parser: Callable[[Path, dict[str, Any]], Parser]  # (path, saved state) -> parser
    parse_bytes: int = READ_BYTES  # bytes handed to the parser at once: the granularity of
    #                                acknowledgement, so of what a crash can repeat


@dataclass
class SourceStats:
    """Counters of one kind of source, for the status endpoint."""

    files: int = 0
    bytes_read: int = 0
    records: int = 0
    points: int = 0
    skipped: int = 0
    invalid: int = 0
    rotations: int = 0
    truncations: int = 0


class Sink:
    """Where parsed output goes; implemented by the daemon's pipeline."""

    def has_room(self) -> bool:
        raise NotImplementedError

    def deliver(self, parsed: Parsed, ticket: Ticket, kind: str) -> None:
        raise NotImplementedError


@dataclass
class _Tail:
    """One file being followed."""

    spec: SourceSpec
    path: Path
    fd: int
    dev: int
    ino: int
    fingerprint: bytes
    parser: Parser
    read_offset: int
    committed: int
    buffer: bytes = b""
    pending: deque[list[Any]] = field(default_factory=deque)  # [end offset, done, state]
    last_data: float = field(default_factory=time.monotonic)
    retired: bool = False
    closed: bool = False

    @property
    def consumed(self) -> int:
        return self.read_offset - len(self.buffer)


@dataclass
class Follower:
    """Follows the files of every spec and hands what they hold to `sink`."""

    specs: Sequence[SourceSpec]
    sink: Sink
    checkpoints: Checkpoints
    mode: str = "auto"  # auto (events + safety poll), poll
    stats: dict[str, SourceStats] = field(default_factory=dict)
    _tails: dict[str, _Tail] = field(default_factory=dict)  # active, by path
    _retired: list[_Tail] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _events: Inotify | None = None

    async def run(self) -> None:
        """Follow until cancelled."""
        for spec in self.specs:
            self.stats.setdefault(spec.kind, SourceStats())
        self._events = self._start_events() if self.mode == "auto" else None
        interval = SAFETY_POLL_S if self._events is not None else POLL_S
        try:
            while True:
                fault_point()
                await self.step()
                if self._events is not None:
                    self._events.watch(_watch_folders(self.specs))
                self._wake.clear()
                await wait_set(self._wake, interval)
        finally:
            if self._events is not None:
                self._events.close()

    def _start_events(self) -> Inotify | None:
        """inotify, unless a followed folder is on a filesystem where it sees nothing."""
        for root in sorted(_watch_roots(spec.patterns for spec in self.specs)):
            fstype = filesystem_of(Path(root))
            if is_remote(fstype):
                log.info("%s is on %s, where file events do not arrive: polling every %.2f s",
                         root, fstype, POLL_S)
                return None
        try:
            return Inotify(self.wake)
        except OSError as exc:
            log.info("file events unavailable (%s): polling every %.2f s", exc, POLL_S)
            return None

    def wake(self) -> None:
        """Look at the files now (a sink has room again, or a file changed)."""
        self._wake.set()

    async def step(self) -> None:
        """One look at every file: discover, detect rotation, read what is new."""
        self._discover()
        for tail in [*self._tails.values(), *self._retired]:
            await self._read(tail)
        self._close_finished()

    async def drain(self) -> bool:
        """Read every file towards its end (shutdown), partial lines offered as quiet; True
        once nothing is left unread (call again while False: the sink was full)."""
        self._discover()
        done = True
        for tail in [*self._tails.values(), *self._retired]:
            await self._read(tail, final=True)
            with contextlib.suppress(OSError):
                done = done and tail.read_offset >= os.fstat(tail.fd).st_size
        return done

    def close(self) -> None:
        for tail in [*self._tails.values(), *self._retired]:
            self._close(tail)

    # -- discovery and rotation --------------------------------------------------------------

    def _discover(self) -> None:
        seen: set[str] = set()
        for spec in self.specs:
            for name in _expand(spec.patterns):
                if name in seen:
                    continue
                seen.add(name)
                try:
                    st = os.stat(name)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    self._look_at(spec, name, st)
        for name in [n for n in self._tails if n not in seen]:
            self._retire(self._tails.pop(name), "it was deleted or renamed")

    def _look_at(self, spec: SourceSpec, name: str, st: os.stat_result) -> None:
        tail = self._tails.get(name)
        if tail is not None and (tail.dev, tail.ino) == (st.st_dev, st.st_ino):
            if st.st_size < tail.read_offset or not self._same_start(tail):
                self._truncated(tail)
            return
        if tail is not None:
            self._retire(tail, "a new file took its name")
            self.stats[spec.kind].rotations += 1
        moved = next((t for t in self._retired if (t.dev, t.ino) == (st.st_dev, st.st_ino)
                      and not t.closed), None)
        if moved is not None:  # a rotated file that still matches a pattern: keep its place
            self._retired.remove(moved)
            moved.retired, moved.path = False, Path(name)
            self._tails[name] = moved
            return
        self._open(spec, name)

    def _open(self, spec: SourceSpec, name: str, fd: int | None = None) -> None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
            st = os.fstat(fd)
            head = os.pread(fd, FINGERPRINT_BYTES, 0)
        except OSError as exc:
            log.warning("cannot open %s: %s", name, exc.strerror)
            return
        mark = self.checkpoints.find(st.st_dev, st.st_ino)
        offset, state = 0, {}
        if mark is not None and head.startswith(bytes.fromhex(mark.fingerprint)) and \
                mark.offset <= st.st_size:
            offset, state = mark.offset, mark.state
        tail = _Tail(spec, Path(name), fd, st.st_dev, st.st_ino, head,
                     spec.make_parser(Path(name), state), offset, offset)
        self._tails[name] = tail
        self.stats[spec.kind].files += 1

    def _same_start(self, tail: _Tail) -> bool:
        """Whether the file still begins with the bytes it began with (copytruncate, reuse)."""
        try:
            head = os.pread(tail.fd, FINGERPRINT_BYTES, 0)
        except OSError:
            return False
        if len(head) > len(tail.fingerprint) and head.startswith(tail.fingerprint):
            tail.fingerprint = head
        return head.startswith(tail.fingerprint)

    def _truncated(self, tail: _Tail) -> None:
        """Truncated (copytruncate, or by hand): read what we missed from a rotated copy if one
        holds it, then follow the file again from its start."""
        self.stats[tail.spec.kind].truncations += 1
        copy = _rotated_copy(tail)
        if copy is not None:
            log.info("%s was truncated; reading its end from the rotated copy %s",
                     tail.path, copy)
        else:
            log.info("%s was truncated; following it from its start", tail.path)
        self._retire(tail, "", copy)
        del self._tails[str(tail.path)]
        self.checkpoints.forget(tail.dev, tail.ino)
        self._open(tail.spec, str(tail.path), os.dup(tail.fd) if copy is None else None)

    def _retire(self, tail: _Tail, why: str, replacement: Path | None = None) -> None:
        """Stop looking the file up by name; read it (or its copy) to the end, then close it."""
        if why:
            log.info("%s: %s; reading the old file to its end", tail.path, why)
        tail.retired = True
        tail.last_data = time.monotonic()
        if replacement is not None:
            with contextlib.suppress(OSError):
                fd = os.open(replacement, os.O_RDONLY | os.O_CLOEXEC)
                os.close(tail.fd)
                tail.fd = fd
        self._retired.append(tail)

    def _close_finished(self) -> None:
        now = time.monotonic()
        for tail in list(self._retired):
            if not tail.buffer and not tail.pending and now - tail.last_data > RETIRED_GRACE_S:
                self._retired.remove(tail)
                self._close(tail)
                self.checkpoints.forget(tail.dev, tail.ino)

    def _close(self, tail: _Tail) -> None:
        if not tail.closed:
            tail.closed = True
            with contextlib.suppress(OSError):
                os.close(tail.fd)

    # -- reading -------------------------------------------------------------------------------

    async def _read(self, tail: _Tail, final: bool = False) -> None:
        """Read what is new in `tail` while the sink has room; hand it to the parser."""
        while self.sink.has_room() and not tail.closed:
            try:
                size = os.fstat(tail.fd).st_size
            except OSError:
                return
            want = min(size - tail.read_offset, READ_BYTES)
            if want <= 0:
                break
            data = await asyncio.to_thread(os.pread, tail.fd, want, tail.read_offset)
            if not data:
                break
            tail.read_offset += len(data)
            tail.last_data = time.monotonic()
            self.stats[tail.spec.kind].bytes_read += len(data)
            tail.buffer += data
            self._parse_buffer(tail, whole=tail.read_offset >= size)
        if self.sink.has_room():
            self._parse_buffer(tail, whole=True)
        quiet = final or tail.retired or time.monotonic() - tail.last_data >= QUIET_S
        if tail.buffer and quiet and self.sink.has_room():
            self._parse(tail, tail.parser.quiet(tail.buffer, time.time()))

    def _parse_buffer(self, tail: _Tail, whole: bool) -> None:
        """Parse the buffer a slice at a time (a slice too short for one record: all of it).
        While more of the file is waiting (not `whole`), a slice shorter than parse_bytes waits
        for the next read: parsed alone it would make a payload of a few lines, and a request
        of its own."""
        while len(tail.buffer) >= (1 if whole else tail.spec.parse_bytes):
            now = time.time()
            parsed = tail.parser.parse(tail.buffer[:tail.spec.parse_bytes], now)
            if not parsed.consumed and len(tail.buffer) > tail.spec.parse_bytes:
                parsed = tail.parser.parse(tail.buffer, now)
            if not parsed.consumed:
                return
            self._parse(tail, parsed)

    def _parse(self, tail: _Tail, parsed: Parsed) -> None:
        if parsed.consumed == 0 and not parsed.skipped:
            return
        tail.buffer = tail.buffer[parsed.consumed:]
        stats = self.stats[tail.spec.kind]
        stats.records += parsed.records
        stats.points += len(parsed.points)
        stats.skipped += parsed.skipped
        stats.invalid += sum(parsed.invalid.values())
        entry: list[Any] = [tail.consumed, False, tail.parser.state()]
        tail.pending.append(entry)

        def acknowledged() -> None:
            entry[1] = True
            self._commit(tail)

        ticket = Ticket(acknowledged)
        self.sink.deliver(parsed, ticket, tail.spec.kind)
        ticket.seal()

    def _commit(self, tail: _Tail) -> None:
        """Advance the checkpoint over the acknowledged prefix of what was read. A retired file
        keeps no checkpoint: its name now belongs to another file, or to none."""
        while tail.pending and tail.pending[0][1]:
            tail.committed, _, state = tail.pending.popleft()
            if not tail.retired:
                self.checkpoints.set(Mark(str(tail.path), tail.dev, tail.ino,
                                          tail.fingerprint.hex(), tail.committed, state))

    # -- events ----------------------------------------------------------------------------------


def _expand(patterns: Iterable[str]) -> list[str]:
    names: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            names.extend(sorted(glob.glob(pattern, recursive=True)))
        else:
            names.append(pattern)
    return names


def _watch_roots(pattern_groups: Iterable[Iterable[str]]) -> set[str]:
    """The folders to watch: each pattern's fixed folder, or its parent while it does not exist
    yet (never higher: a recursive watch of a large tree costs more than polling)."""
    roots: set[str] = set()
    for patterns in pattern_groups:
        for pattern in patterns:
            fixed = Path(pattern).parent
            while glob.has_magic(str(fixed)):
                fixed = fixed.parent
            for candidate in (fixed, fixed.parent):
                if candidate.is_dir() and candidate != candidate.parent:
                    roots.add(str(candidate))
                    break
    return roots


def _watch_folders(specs: Sequence[SourceSpec]) -> list[str]:
    """The folders to watch: each pattern's roots, and every folder below a root whose pattern
    recurses (`**`, TensorBoard run folders), so new files anywhere in them are noticed."""
    folders = []
    for spec in specs:
        for root in sorted(_watch_roots([spec.patterns])):
            folders.append(root)
            if any("**" in pattern for pattern in spec.patterns):
                folders.extend(dirpath for dirpath, _, _ in os.walk(root) if dirpath != root)
    return folders


def _rotated_copy(tail: _Tail) -> Path | None:
    """A sibling that starts like `tail` did and holds at least what was read (copytruncate)."""
    parent = tail.path.parent
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(tail.path.name) or entry.path == str(tail.path):
                continue
            try:
                if entry.stat().st_size < tail.read_offset:
                    continue
                with open(entry.path, "rb") as fh:
                    if fh.read(len(tail.fingerprint)) == tail.fingerprint:
                        return Path(entry.path)
            except OSError:
                continue
    return None
