"""Following files as they grow (issue: file sources): the loop that looks for the files the
sources name (scan.py), follows each one (tail.py) through rename, rotation and truncation, and
hands what it holds to the sink.

A renamed file that still matches a pattern stays followed under its new name; one renamed out of
every pattern, or deleted, is read to its end through its open descriptor. A truncated file is
read to its old end from a rotated copy when one holds it, then followed again from its start.
A file that holds the content of one followed (identity.py says when) is read only past what was
already read of its original, never again from its start; its offset is committed like any
file's, so a restart does not read it again either. Saved offsets (offsets.py) advance only once
everything before them was acknowledged by the ingest. Open files stay within a budget of
descriptors (descriptors.py).

Changes are noticed through inotify (inotify.py) read by the event loop (no thread, nothing
spent while idle), with a slow safety poll. A change of content only of files open for reading
reads them on without looking for files; while they keep growing, the next read waits COALESCE_S
from the start of the one before, or until just before the sink's next request when it paces
them (a write each 10 ms is read about twice a second, not a hundred times); the first change
after a quiet spell is read at once. Folders on NFS, SMB, FUSE and the like, where events never
arrive, are polled instead, as is everything in `poll` mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from sidecar.aio import wait_set
from sidecar.log import log
from sidecar.records import LOG_BLOCK, Ticket
from sidecar.sources.base import Parsed
from sidecar.sources.files.descriptors import Descriptors
from sidecar.sources.files.identity import (
    END_CHECK_BYTES,
    copy_holding,
    file_id,
    last_bytes,
    original_of,
    same_start,
)
from sidecar.sources.files.inotify import Inotify, filesystem_of, is_remote
from sidecar.sources.files.offsets import FINGERPRINT_BYTES, Mark, Offsets, fingerprint
from sidecar.sources.files.scan import MatchState, Scan
from sidecar.sources.files.spec import SourceSpec
from sidecar.sources.files.tail import FileId, Tail
from sidecar.supervise import fault_point

READ_BYTES = LOG_BLOCK
POLL_S = 0.25  # poll mode: how often files are looked at
SAFETY_POLL_S = 5.0  # event mode: a look even without events (an overflowed event queue)
# event mode (a local filesystem): a read this small of what was just written comes from the page
# cache and is read on the loop, not in a thread
INLINE_READ_BYTES = 64 << 10
READ_LEAD_S = 0.05  # a trickle is read this long before the sink's next request starts
MAX_GATHER_S = 1.0  # and never waits longer than this for it
# a look that found new data and read everything: the next waits this long from its start for
# company, and until just before the sink's next request when it paces them (batcher.PACE_S: about
# one a second), so a trickle is read about twice a second
COALESCE_S = 0.1
QUIET_S = 1.0  # unconsumed bytes this old are offered to the parser's quiet()
RETIRED_GRACE_S = 5.0  # a rotated-away file is read this long after it went quiet
# a file of a kind that gives points, read from its start, that gave none this long after it was
# first followed is said, with why (and so is one that gave none by the end)
NO_POINT_S = 60.0


class SourceStats:
    """Counters of one kind of source, for the status endpoint."""

    __slots__ = ("bytes_read", "files", "invalid", "points", "records", "rotations", "skipped",
                 "truncations")

    def __init__(self) -> None:
        self.files = 0
        self.bytes_read = 0
        self.records = 0
        self.points = 0
        self.skipped = 0
        self.invalid = 0
        self.rotations = 0
        self.truncations = 0


class FileState(NamedTuple):
    """One followed file at one moment, for the status endpoint."""

    path: str
    kind: str
    offset: int  # bytes read
    size: int  # as last seen
    committed: int  # acknowledged and saved in offsets.json
    last_read: float | None  # epoch seconds of the last read that found data

    @property
    def lag_bytes(self) -> int:
        return max(self.size - self.offset, 0)


class Sink:
    """Where parsed output goes; implemented by the daemon's pipeline."""

    def has_room(self) -> bool:
        raise NotImplementedError

    def deliver(self, parsed: Parsed, ticket: Ticket, kind: str, source: str) -> None:
        """`source`: the option and the file it came from, for messages (`--jsonl m.jsonl`)."""
        raise NotImplementedError

    def due(self) -> float | None:
        """When (time.monotonic) the sink next sends what it holds, while it paces its requests;
        None when it sends at once. A trickle is read just before then."""
        return None


class Follower:
    """Follows the files of every spec and hands what they hold to `sink`."""

    def __init__(self, specs: Sequence[SourceSpec], sink: Sink, offsets: Offsets,
                 mode: str = "auto") -> None:
        self.specs = specs
        self.sink = sink
        self.offsets = offsets
        self.mode = mode  # auto (events + safety poll), poll
        self.stats = {spec.kind: SourceStats() for spec in specs}
        self._tails: dict[str, Tail] = {}  # active, by path
        self._ids: dict[FileId, Tail] = {}  # active and retired, by identity
        self._retired: list[Tail] = []
        self._copies: dict[FileId, Tail] = {}  # files holding a tail's content
        self.descriptors = Descriptors(self._open_paths_changed)
        self._waiting: list[tuple[SourceSpec, str]] = []  # new, no descriptor
        self._by_folder: dict[str, list[Tail]] = {}  # live tails, this look
        self._scan = Scan(specs)
        self._wake = asyncio.Event()
        self._look = True  # a file changed since the last look (or none was taken yet)
        self._looked_at = float("-inf")  # when the last look ended: the next is due `interval` on
        self._events: Inotify | None = None
        self._open_paths_cache: set[str] | None = None

    async def run(self) -> None:
        """Follow until cancelled."""
        self._events = self._start_events() if self.mode == "auto" else None
        interval = SAFETY_POLL_S if self._events is not None else POLL_S
        try:
            while True:
                fault_point()
                self._wake.clear()  # before the look: a change during it means another look
                began, before = time.monotonic(), self._bytes_read()
                if self._look or began - self._looked_at >= interval:
                    self._look = False
                    # watched before the look: a file that appears later sends an event, and
                    # none falls between the two
                    if self._events is not None:
                        self._events.watch(self._scan.watch_folders())
                    await self.step()
                    self._looked_at = time.monotonic()
                else:  # only room in the sink: the files followed are read on, none looked for
                    await self._read_followed()
                if self._bytes_read() > before and self._read_all():
                    await self._gather(self._gathered_by(began))
                await wait_set(self._wake, max(self._looked_at + interval - time.monotonic(), 0))
        finally:
            if self._events is not None:
                self._events.close()

    def _gathered_by(self, began: float) -> float:
        """When the next read of a trickle is due, the last one having begun at `began`: just
        before the sink's next request (what is read then goes with it), and no sooner than
        COALESCE_S after the last read."""
        until = began + COALESCE_S
        due = self.sink.due()
        if due is not None:
            until = max(until, min(due - READ_LEAD_S, began + MAX_GATHER_S))
        return until

    async def _gather(self, until: float) -> None:
        """A look found new data and read all of it: let more of the trickle gather until
        `until`, its file events unread meanwhile (they wait in the kernel, and wake the next
        look at once)."""
        if self._events is not None:
            self._events.pause()
        try:
            await asyncio.sleep(max(until - time.monotonic(), 0))
        finally:
            if self._events is not None:
                self._events.resume()

    def _bytes_read(self) -> int:
        return sum(stats.bytes_read for stats in self.stats.values())

    def _read_all(self) -> bool:
        """Whether every file followed was read to its end (no backlog waits for room)."""
        return all(tail.read_offset >= tail.size or tail.fd < 0
                   for tail in [*self._tails.values(), *self._retired])

    def _start_events(self) -> Inotify | None:
        """inotify, unless a followed folder is on a filesystem where it sees nothing."""
        for root in sorted(self._scan.roots()):
            fstype = filesystem_of(Path(root))
            if is_remote(fstype):
                log.info("%s is on %s, where file events do not arrive: polling every %.2f s",
                         root, fstype, POLL_S)
                return None
        try:
            return Inotify(self._file_event)
        except OSError as exc:
            log.info("file events unavailable (%s): polling every %.2f s", exc, POLL_S)
            return None

    def wake(self) -> None:
        """Look at the files now (a file changed)."""
        self._look = True
        self._wake.set()

    def _file_event(self) -> None:
        """A file event: a look when names or folders changed, or a file not open for reading
        changed (a new one, an empty one not followed yet, one closed while idle); when only
        the content of open files changed, they are read on, without looking for files
        (globs, stats, watches)."""
        assert self._events is not None
        structural, modified = self._events.take_changes()
        if structural or any(self._scan.may_follow(path) for path in modified - self._open_paths()):
            self._look = True
        self._wake.set()

    def _open_paths_changed(self) -> None:
        self._open_paths_cache = None

    def _open_paths(self) -> set[str]:
        """The absolute paths of the files open for reading (kept until a look or a close)."""
        if self._open_paths_cache is None:
            self._open_paths_cache = {os.path.abspath(tail.path)
                                      for tail in self._tails.values() if tail.fd >= 0}
        return self._open_paths_cache

    def room(self) -> None:
        """A sink has room again: read on in the files followed. Finding files (globs, stats,
        rotation checks) waits for a file event or the poll, not for every request answered
        while a backlog is read."""
        self._wake.set()

    async def step(self) -> None:
        """One look at every file: discover, detect rotation, read what is new. New files
        waiting for a descriptor get those of files read to their end, round after round."""
        self._open_paths_cache = None
        self._discover()
        while True:
            await self._read_followed()
            if not (self._waiting and self.descriptors.any_idle()):
                break
            waiting, self._waiting = self._waiting, []
            for spec, name in waiting:
                self._open_new(spec, name)
        self._say_silent(final=False)
        self._close_finished()
        self._open_paths_cache = None

    async def _read_followed(self) -> None:
        for tail in [*self._tails.values(), *self._retired]:
            await self._read(tail)

    async def drain(self) -> bool:
        """Read every file towards its end (shutdown), partial lines offered as quiet; True
        once nothing is left unread (call again while False: the sink was full)."""
        self._discover()
        for tail in [*self._tails.values(), *self._retired]:
            await self._read(tail, final=True)
        done = all(tail.read_offset >= tail.size or tail.closed
                   for tail in [*self._tails.values(), *self._retired])
        if done:
            self._say_silent(final=True)
        return done

    def close(self) -> None:
        for tail in [*self._tails.values(), *self._retired]:
            self.descriptors.release(tail)

    def files(self) -> list[FileState]:
        """Every file followed now, for the status endpoint."""
        return [FileState(str(t.path), t.spec.kind, t.read_offset, t.size, t.committed,
                          t.last_read) for t in self._tails.values()]

    def matches(self) -> list[MatchState]:
        """What each pattern of each source names, for the status endpoint."""
        return self._scan.matches()

    def _say_silent(self, final: bool) -> None:
        """Say each file read from its start that gave no point in its first NO_POINT_S, or
        (`final`) by the end, once, with why: an empty chart is never left unexplained."""
        now = time.monotonic()
        for tail in [*self._tails.values(), *self._retired]:
            silence = tail.spec.silence
            if silence is None or tail.points or tail.silence_said or not tail.from_start:
                continue
            if not final and now - tail.opened < NO_POINT_S:
                continue
            tail.silence_said = True
            log.warning("%s %s: no point %s: %s", tail.spec.option, tail.path,
                        "by the end" if final else f"in its first {NO_POINT_S:.0f} s",
                        silence(tail.parser, max(tail.size - tail.consumed, 0)),
                        extra={"source": tail.spec.kind, "path": tail.path})

    # -- discovery and rotation --------------------------------------------------------------

    def _discover(self) -> None:
        found = self._scan.look()
        ids = {file_id(st) for _, st in found.values()}
        self._waiting.clear()
        self._by_folder.clear()
        for tail in [*self._tails.values(), *self._retired]:
            self._by_folder.setdefault(os.path.dirname(tail.path), []).append(tail)
        detached = [self._tails.pop(name) for name in list(self._tails) if name not in found]
        # Files followed already are placed first: a copy is known for one only once its
        # original is in place. Then by name: a file's rotated copies are named after it
        # (app.log.1, app.log-20261207), so of two new ones holding the same content the live
        # one is placed first and the other known as its copy, whatever order the patterns
        # name them in (the live one taken as the copy would not be read on).
        for name, (spec, st) in sorted(found.items(), key=lambda item: (
                file_id(item[1][1]) not in self._ids, item[0])):
            detached += self._place(spec, name, st)
        for key in [key for key in self._copies if key not in ids]:
            self.offsets.forget(*key)
            del self._copies[key]
        for tail in detached:
            if self._tails.get(str(tail.path)) is not tail and not tail.retired:
                self._retire(tail, "it was renamed, replaced or deleted")

    def _place(self, spec: SourceSpec, name: str, st: os.stat_result) -> list[Tail]:
        """Follow the file now at `name`; returns the tails that lost their name to it."""
        key = file_id(st)
        here = self._tails.get(name)
        tail = here if here is not None and here.id == key else self._ids.get(key)
        detached = []
        if here is not None and here is not tail:  # another file took this name (a rotation)
            del self._tails[name]
            detached.append(here)
            self.stats[spec.kind].rotations += 1
        if tail is None:
            if key not in self._copies:
                self._open_new(spec, name)
            return detached
        if tail is not here:  # a followed file under a new name: keep its place
            if self._tails.get(str(tail.path)) is tail:
                del self._tails[str(tail.path)]
            if tail.retired:
                self._retired.remove(tail)
                tail.retired = False
            tail.path = Path(name)
            self._tails[name] = tail
            if tail.committed:  # the place of a copy it moved to is saved from now on
                self.offsets.set(tail.mark(tail.committed, tail.state))
        tail.size = st.st_size
        if st.st_size < tail.read_offset or (tail.fd >= 0 and not same_start(tail)):
            self._truncated(tail)
        return detached

    def _open_new(self, spec: SourceSpec, name: str, fd: int | None = None) -> None:
        """Start following the file at `name`: from its saved offset, past what was read of the
        content it is a copy of (then only its offset is kept), or from its start."""
        if fd is None:
            fd = self.descriptors.open(name)
            if fd is None:
                self._waiting.append((spec, name))
                return
        try:
            st = os.fstat(fd)
            head = os.pread(fd, FINGERPRINT_BYTES, 0)
        except OSError:
            self.descriptors.close(fd)
            return
        key = file_id(st)
        # an empty file may be a copy about to be written: the next look tells
        if key in self._ids or not head:
            self.descriptors.close(fd)
            return
        original = original_of(self._by_folder.get(os.path.dirname(name), ()), name, head, fd,
                               st.st_size)
        if original is not None:
            log.info("%s holds the content of %s: read only past what was read of it", name,
                     original.path)
            self._copies[key] = original
            original.copies.append(Mark(name, *key, fingerprint(head), st.st_size, {},
                                        len(head)))
            self._commit(original)
            self.descriptors.close(fd)
            return
        mark = self.offsets.find(*key)
        offset, state = 0, {}
        if mark is not None and mark.matches(head) and mark.offset <= st.st_size:
            offset, state = mark.offset, mark.state
        log.debug("following %s (%d:%d) from offset %d", name, *key, offset)
        tail = Tail(spec, Path(name), *key, head, spec.make_parser(Path(name), state), offset,
                    offset, state, fd=fd, size=st.st_size, end=last_bytes(fd, offset))
        self._tails[name] = self._ids[key] = tail
        self._by_folder.setdefault(os.path.dirname(name), []).append(tail)
        self.stats[spec.kind].files += 1

    def _truncated(self, tail: Tail) -> None:
        """Truncated (copytruncate, or by hand): read what we missed from a copy of its content
        if one holds it, then follow the file again from its start."""
        self.stats[tail.spec.kind].truncations += 1
        name = str(tail.path)
        del self._tails[name]
        del self._ids[tail.id]
        self.offsets.forget(*tail.id)
        fd, tail.fd = tail.fd, -1
        self._open_paths_cache = None
        if fd >= 0:
            self.descriptors.busy(tail)
        copy = copy_holding(tail)
        tail.retired = True
        self._retired.append(tail)
        if copy is not None:
            log.info("%s was truncated; reading its end from the rotated copy %s", name, copy)
            fd_of_copy = self.descriptors.open(str(copy))
            tail.fd, tail.path = -1 if fd_of_copy is None else fd_of_copy, copy
            with contextlib.suppress(OSError):
                st = os.fstat(tail.fd)
                tail.dev, tail.ino, tail.size = st.st_dev, st.st_ino, st.st_size
                self._ids[tail.id] = tail
                self._copies.pop(tail.id, None)
                tail.copies = [m for m in tail.copies if (m.dev, m.ino) != tail.id]
        else:
            log.info("%s was truncated; following it from its start", name)
            tail.size = tail.read_offset  # nothing more is read of this generation
        self._open_new(tail.spec, name, fd if fd >= 0 else None)

    def _retire(self, tail: Tail, why: str) -> None:
        """Stop looking the file up by name; read it to its end, then close it."""
        log.info("%s: %s; reading the old file to its end", tail.path, why,
                 extra={"source": tail.spec.kind, "path": tail.path})
        tail.retired = True
        tail.last_data = time.monotonic()
        self.descriptors.busy(tail)
        self._retired.append(tail)
        if tail.fd < 0:  # closed while idle: found again by identity if it was only renamed
            tail.size = tail.read_offset
            with contextlib.suppress(OSError):
                for entry in os.scandir(tail.path.parent):
                    if entry.is_file() and file_id(entry.stat()) == tail.id:
                        tail.path, tail.size = Path(entry.path), entry.stat().st_size
                        break

    def _close_finished(self) -> None:
        now = time.monotonic()
        for tail in list(self._retired):
            if not tail.buffer and not tail.pending and now - tail.last_data > RETIRED_GRACE_S:
                self._retired.remove(tail)
                self.descriptors.release(tail)
                tail.closed = True
                if self._ids.get(tail.id) is tail:
                    del self._ids[tail.id]
                    self.offsets.forget(*tail.id)
        self.descriptors.release_idle(now)

    def _reopen(self, tail: Tail) -> bool:
        """Reopen a tail closed while idle, if its name still holds the same file."""
        fd = self.descriptors.open(str(tail.path))
        if fd is None:
            return False
        try:
            same = file_id(os.fstat(fd)) == tail.id
        except OSError:
            same = False
        if not same:  # another file has its name now: the next look sorts that out
            self.descriptors.close(fd)
            return False
        tail.fd = fd
        if not same_start(tail):
            self._truncated(tail)
            return False
        return True

    # -- reading -------------------------------------------------------------------------------

    async def _read(self, tail: Tail, final: bool = False) -> None:
        """Read what is new in `tail` while the sink has room; hand it to the parser."""
        if tail.fd < 0 and tail.size > tail.read_offset and not tail.closed \
                and self.sink.has_room() and not self._reopen(tail):
            return
        while tail.fd >= 0 and self.sink.has_room():
            try:
                tail.size = os.fstat(tail.fd).st_size
            except OSError:
                return
            if tail.size < tail.read_offset:  # truncated: the next look sorts it out
                self._look = True
                self._wake.set()
                return
            # what the buffer holds and the read make whole parse slices: none is cut by a copy
            want = min(tail.size - tail.read_offset, READ_BYTES - len(tail.buffer) % READ_BYTES)
            if want <= 0:
                break
            if want <= INLINE_READ_BYTES and self._events is not None:
                data = os.pread(tail.fd, want, tail.read_offset)  # just written: page cache
            else:
                data = await asyncio.to_thread(os.pread, tail.fd, want, tail.read_offset)
            if not data:
                break
            self.descriptors.busy(tail)
            tail.read_offset += len(data)
            tail.end = (tail.end + data[-END_CHECK_BYTES:])[-END_CHECK_BYTES:]
            tail.last_data, tail.last_read = time.monotonic(), time.time()
            self.stats[tail.spec.kind].bytes_read += len(data)
            tail.buffer += data
            self._parse_buffer(tail, whole=tail.read_offset >= tail.size)
        if self.sink.has_room():
            self._parse_buffer(tail, whole=True)
        if tail.fd >= 0 and not tail.retired and tail.read_offset >= tail.size:
            self.descriptors.caught_up(tail)
        quiet = final or tail.retired or time.monotonic() - tail.last_data >= QUIET_S
        if (tail.buffer or final) and quiet and self.sink.has_room():
            self._parse(tail, tail.parser.quiet(tail.buffer, time.time(), final))

    def _parse_buffer(self, tail: Tail, whole: bool) -> None:
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

    def _parse(self, tail: Tail, parsed: Parsed) -> None:
        if not (parsed.consumed or parsed.skipped or parsed.unusable or parsed.text):
            return
        tail.buffer = tail.buffer[parsed.consumed:]
        stats = self.stats[tail.spec.kind]
        stats.records += parsed.records
        stats.points += len(parsed.points)
        tail.points += len(parsed.points)
        stats.skipped += parsed.skipped
        stats.invalid += sum(parsed.invalid.values()) + parsed.unusable
        entry: list[Any] = [tail.consumed, False, tail.parser.state()]
        tail.pending.append(entry)

        def acknowledged() -> None:
            entry[1] = True
            self._commit(tail)

        ticket = Ticket(acknowledged)
        self.sink.deliver(parsed, ticket, tail.spec.kind, f"{tail.spec.option} {tail.path}")
        ticket.seal()

    def _commit(self, tail: Tail) -> None:
        """Advance the saved offset over the acknowledged prefix of what was read, and over the
        copies of what was read. A retired file keeps no saved offset: its name now belongs to
        another file, or to none."""
        while tail.pending and tail.pending[0][1]:
            tail.committed, _, tail.state = tail.pending.popleft()
            if not tail.retired:
                self.offsets.set(tail.mark(tail.committed, tail.state))
        for copy in [c for c in tail.copies if c.offset <= tail.committed]:
            tail.copies.remove(copy)
            if (copy.dev, copy.ino) in self._copies:
                self.offsets.set(copy)
