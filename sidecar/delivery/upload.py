"""Checkpoints uploaded through the ingest's signed URLs, then registered with the object-store
URI the ingest answered (docs/checkpoints.md#uploads): where a local path outlives nothing (a
container), a checkpoint nothing else copies to a bucket reaches the platform this way.

A checkpoint's files are held (staged) the moment it is submitted, complete, whatever is
uploaded before it: hard links into the run's folder, so that a rotation deleting the checkpoint
takes nothing from the upload; open descriptors where the state folder is on another
filesystem, as many as the open-files limit leaves. Then one checkpoint at a time, in the order
they completed, each file is sent, at most FILES_IN_FLIGHT at once, under one bandwidth cap
(delivery/put.py): ask `artifact/upload-url` for it (the asks in flight widening from one while
they are answered: aio.py's Window), send it to the URL answered, ask again when that URL
expired. What each file's send was answered is appended to a ledger in the run's folder
(delivery/ledger.py) before anything else happens, so a restart
resumes with the files not yet stored, and the checkpoint's one `/artifact` goes (through the
strict, journaled sender of delivery/artifacts.py) only once every file is stored. A refusal for
good (a 4xx of `upload-url`, a signature the store refuses) dead-letters the checkpoint with the
reason, in one ERROR line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode

from sidecar.aio import Window, cancel, wait_set
from sidecar.delivery.client import (
    ROUTES,
    IngestClient,
    json_body,
    parse_retry_after,
    retried,
)
from sidecar.delivery.deadletter import dead_letter
from sidecar.delivery.ledger import JsonLedger
from sidecar.delivery.put import PutAnswer, RateLimit, SignedUrl, Stopped, put_file
from sidecar.log import Throttle, format_duration, log
from sidecar.supervise import supervise
from sidecar.threads import in_background

LEDGER = "uploads.ledger"
STAGED = "staged"  # the run's folder's subfolder of hard links, one folder a checkpoint
ROUTE = "artifact/upload-url"
PUT = "artifact/put"  # the store's PUT: its retries' policy, a row of the routes' table
NAME_PREFIX = "checkpoints"  # the object names asked for: checkpoints/<path under the folder>
FILES_IN_FLIGHT = 4
# `upload-url` asks in flight at most: a checkpoint's first ask goes alone, and each answered at
# once lets one more go beside it, while any failed attempt (a 429, a 5xx, a reset) puts it back
# to one: a sidecar far from the ingest is not held to one file a round trip (3,001 small
# files took 138 s), and a signer a fleet throttles still sees one request a sidecar
ASKS_IN_FLIGHT = 8
# descriptors a checkpoint's held files leave free of the soft RLIMIT_NOFILE, for the rest of
# the sidecar (its connections, its files, the PUTs' own opens)
FD_RESERVE = 128
PUT_IDLE_TIMEOUT_S = 60.0  # a store that takes nothing, nor answers, for this long: retried
PROGRESS_EVERY_S = 10.0
# A checkpoint's first ask waits a random part of this: sidecars of a sweep saving at the same
# step would otherwise all ask in one second (bench_fleet_upload.py); never at the drain.
START_SPREAD_S = 10.0
RATE_SEEN_S = 5.0  # an upload's rate is trusted once it went on this long
HOLD_WAIT_S = 10.0  # at the close, for a checkpoint's files still being held
MAX_FRESH_URLS = 5  # expired URLs in a row for one file: then it is a refusal (a clock far off)
# Where hard links cannot be made: another filesystem, one that has none, a link limit.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(Exception):
    """A checkpoint that cannot be uploaded, for good: the reason, the status, what was asked."""

    def __init__(self, reason: str, status: int | None = None, asked: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.asked = asked


class Checkpoint(NamedTuple):
    """A complete checkpoint handed to `Uploads.submit`."""

    local: str  # its absolute local path
    fingerprint: str
    name: str  # its path under its --checkpoints folder, `/`-separated
    files: tuple[str, ...]  # relative to `local`; empty for a checkpoint that is one file
    body: dict[str, Any]  # the /artifact body but its path


class _File:
    __slots__ = ("fd", "mode", "path", "sent", "size", "stored")

    def __init__(self, size: int, mode: str) -> None:
        self.size = size
        self.mode = mode  # link (staged), fd (held open), path (read where it lies)
        self.fd: int | None = None
        self.stored = ""  # the object's URI, once the store took it
        self.sent = [0]  # bytes sent of the current attempt (progress, from its thread)


class _Job:
    """One checkpoint's upload."""

    def __init__(self, ident: str, cp: Checkpoint) -> None:
        self.id = ident
        self.cp = cp
        self.files: dict[str, _File] = {}
        # its files being held (staged) from the moment it is submitted, whatever is uploaded
        # before it; None once held, or for one an earlier start held
        self.holding: asyncio.Future[None] | None = None
        self.unheld: Refused | None = None  # why its files could not be held
        self.state = "uploading"  # uploading, registered, refused
        self.started = time.monotonic()
        self.sent_before = 0  # bytes stored by earlier starts (not this one's rate)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())

    def rate(self, now: float) -> float:
        """Bytes a second this start has sent of it."""
        return max(self.sent - self.sent_before, 0) / max(now - self.started, 1e-3)

    @property
    def sent(self) -> int:
        return sum(f.size if f.stored else f.sent[0] for f in self.files.values())


def _shown(path: str) -> str:
    """A path as a log line may hold it: with escapes where a character would split it."""
    return path if path.isprintable() else ascii(path)


def _ident(local: str, fingerprint: str) -> str:
    key = f"{local}\0{fingerprint}".encode("utf-8", "surrogateescape")
    return hashlib.blake2b(key, digest_size=10).hexdigest()


class Uploads:
    """Every checkpoint of one run uploaded through signed URLs, then registered."""

    def __init__(self, run_dir: Path, run_id: str, client: IngestClient,
                 register: Callable[[str, str, dict[str, Any]], None],
                 registered: Callable[[str, str], bool], rate_bytes_per_s: int) -> None:
        """`register(local, fingerprint, body)`: the /artifact registration (journaled);
        `registered(local, fingerprint)`: whether it was made already (by an earlier start)."""
        self.run_dir = run_dir
        self.run_id = run_id
        self.client = client
        self._register = register
        self._registered = registered
        self.limit = RateLimit(rate_bytes_per_s)
        self.jobs: dict[str, _Job] = {}
        self.bytes_uploaded = 0
        self.files_uploaded = 0
        self.refused = 0
        self.opened = asyncio.Event()
        self.idle = asyncio.Event()
        self._queue: list[_Job] = []
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(FILES_IN_FLIGHT)
        # upload-url requests in flight, from one (ASKS_IN_FLIGHT): sidecars saving at the same
        # moment asked the ingest for sidecars x files URLs in one instant
        # (bench_fleet_upload.py), and a throttled sidecar waits with one request
        self._asks = Window(ASKS_IN_FLIGHT)
        self.ledger = JsonLedger(run_dir / LEDGER)
        self._fds = threading.Lock()  # one stager at a time counts the descriptors left
        self._draining = asyncio.Event()  # the spread is not waited out once set
        self._throttle = Throttle()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = supervise("uploads", self._run)

    def known(self, local: str, fingerprint: str) -> bool:
        """Whether this checkpoint is (or was) uploaded, or refused: not to be handed on again."""
        return _ident(local, fingerprint) in self.jobs

    @property
    def pending(self) -> int:
        """Checkpoints not yet uploaded (nor refused)."""
        return sum(1 for job in self.jobs.values() if job.state == "uploading")

    def submit(self, cp: Checkpoint) -> None:
        """Queue a complete checkpoint; its files are held (staged) at once, in a thread,
        whatever is uploaded before it. Never blocks."""
        ident = _ident(cp.local, cp.fingerprint)
        if ident in self.jobs:
            return
        job = self.jobs[ident] = _Job(ident, cp)
        job.holding = asyncio.ensure_future(self._hold(job))
        self._queue.append(job)
        self.idle.clear()
        self._wake.set()

    def hurry(self) -> None:
        """The stop has begun: every upload goes now, none waits out the start spread."""
        self._draining.set()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every upload is done; False when `timeout_s` ran out (what is left is
        resumed by the next start with this state folder)."""
        self.hurry()
        if self._task is None or not self.pending:
            return True
        self._say_what_will_not_fit(timeout_s)
        return await wait_set(self.idle, timeout_s)

    def _say_what_will_not_fit(self, timeout_s: float) -> None:
        """At the stop: the uploads left that cannot end within the drain at the rate seen
        (or the cap), said at once with how long they need, while the operator can still give
        the next stop a longer grace."""
        jobs = [job for job in self.jobs.values() if job.state == "uploading"]
        left = sum(max(job.size - job.sent, 0) for job in jobs)
        now = time.monotonic()
        # a rate seen over a few seconds: the first moments of an upload (its spread wait,
        # its first asks) say nothing of it
        seen = [job.rate(now) for job in jobs if now - job.started >= RATE_SEEN_S]
        rate = max(seen, default=0.0)
        if self.limit.bytes_per_s > 0:
            rate = min(rate, self.limit.bytes_per_s) if rate > 0 else self.limit.bytes_per_s
        if rate <= 0 or left / rate <= timeout_s:
            return
        log.warning("--checkpoints: %d checkpoint upload(s) need about %s more (%d bytes left "
                    "at %.1f MB/s), past the %.1f s the drain has left (--drain-timeout): what is "
                    "not sent by then is resumed by the next start with this state folder; "
                    "to finish it at a stop, give --drain-timeout and the pod's grace period "
                    "(terminationGracePeriodSeconds) more than that", len(jobs),
                    format_duration(left / rate), left, rate / 1e6, timeout_s,
                    extra={"source": "checkpoints", "option": "--drain-timeout"})

    async def close(self) -> None:
        await cancel(self._task)
        holding = [job.holding for job in self.jobs.values() if job.holding is not None]
        if holding:  # a thread still staging would open descriptors after they are closed
            await asyncio.wait(holding, timeout=HOLD_WAIT_S)
        for job in self.jobs.values():
            _close_fds(job)
        if self.pending:
            log.warning("--checkpoints: %d checkpoint upload(s) not finished; the next start "
                        "with this state folder resumes them with the files not yet stored",
                        self.pending, extra={"source": "checkpoints"})

    def progress(self) -> list[dict[str, Any]]:
        """Each upload under way: bytes sent of how many, the rate of this start, the ETA."""
        shown = []
        now = time.monotonic()
        for job in self.jobs.values():
            if job.state != "uploading":
                continue
            sent, size = job.sent, job.size
            rate = job.rate(now)
            shown.append({"path": job.cp.local, "bytes_sent": sent, "bytes": size,
                          "files_stored": sum(1 for f in job.files.values() if f.stored),
                          "files": len(job.files), "rate_bytes_per_s": round(rate),
                          "eta_s": round((size - sent) / rate, 1) if rate > 0 else None})
        return shown

    # -- the task -----------------------------------------------------------------------------

    async def _run(self) -> None:
        if not self.opened.is_set():
            for job in await asyncio.to_thread(self._open):
                self._queue.append(job)
            self.opened.set()
        while True:
            if not self._queue:
                self.idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            job = self._queue[0]
            try:
                await self._upload(job)
            except Refused as refused:
                await self._refuse(job, refused)
            self._queue.pop(0)

    async def _hold(self, job: _Job) -> None:
        try:
            await asyncio.to_thread(self._stage, job)
        except Refused as refused:
            job.unheld = refused
        except Exception as exc:  # a fault of ours refuses this checkpoint, not every later one
            job.unheld = Refused(f"its files could not be held ({exc.__class__.__name__}: "
                                 f"{exc})")  # said in the refusal's one ERROR line

    async def _upload(self, job: _Job) -> None:
        if job.holding is not None:  # submitted by this start: held since, or being held now
            await job.holding
            job.holding = None
        if job.unheld is not None:
            raise job.unheld
        missing = [rel for rel, f in job.files.items() if not f.stored]
        if missing:
            await wait_set(self._draining, start_wait_s())
            progress = asyncio.create_task(self._say_progress(job))
            try:
                async with asyncio.TaskGroup() as group:
                    for rel in missing:
                        group.create_task(self._upload_file(job, rel))
            except* Refused as refusals:  # the first refusal stops the checkpoint's others
                raise _first(refusals) from None
            finally:
                progress.cancel()
        uri = _checkpoint_uri(job)
        self._register(job.cp.local, job.cp.fingerprint, {**job.cp.body, "path": uri})
        await self.ledger.append({"op": "registered", "id": job.id})
        job.state = "registered"
        log.info("--checkpoints: %s uploaded (%d file(s), %d bytes) to %s; registering it",
                 _shown(job.cp.local), len(job.files), job.size, uri,
                 extra={"source": "checkpoints", "path": _shown(job.cp.local)})
        await asyncio.to_thread(self._unstage, job)

    async def _say_progress(self, job: _Job) -> None:
        """The terminal's progress line: every PROGRESS_EVERY_S while the upload goes on."""
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            shown = next((p for p in self.progress() if p["path"] == job.cp.local), None)
            if shown is None:
                return
            eta = "unknown" if shown["eta_s"] is None else f"{shown['eta_s']:.0f} s"
            log.info("--checkpoints: uploading %s: %d%% (%d of %d bytes, %d of %d files), "
                     "%.1f MB/s, %s left", _shown(job.cp.local),
                     100 * shown["bytes_sent"] // max(shown["bytes"], 1), shown["bytes_sent"],
                     shown["bytes"], shown["files_stored"], shown["files"],
                     shown["rate_bytes_per_s"] / 1e6, eta, extra={"source": "checkpoints"})

    async def _upload_file(self, job: _Job, rel: str) -> None:
        file = job.files[rel]
        name = _object_name(job.cp, rel)
        query = urlencode({"run_id": self.run_id, "name": name, "size_bytes": file.size},
                          quote_via=quote, safe="/")
        fresh = 0
        signed: tuple[SignedUrl, str] | None = None

        async def attempt() -> PutAnswer:
            """Ask for a URL where none is held (a URL is used until the store says it expired:
            a store that throttles a fleet's uploads is not answered with as many requests to
            the ingest), and send the file to it."""
            nonlocal fresh, signed
            while True:
                if signed is None:
                    async with self._asks:
                        signed = await self._ask(query)
                async with self._slots:
                    answer = await self._put(job, rel, file, signed[0])
                if not (answer.expired and fresh < MAX_FRESH_URLS):
                    return answer
                fresh += 1
                signed = None
                log.debug("--checkpoints: the URL for %s expired; asking for another", name,
                          extra={"source": "checkpoints"})

        def failed(answer: PutAnswer) -> None:
            if self._throttle.admit("put") is not None:
                log.warning("--checkpoints: sending %s failed (%s); it is retried with backoff",
                            _shown(name), answer.reason or f"HTTP {answer.status}",
                            extra={"source": "checkpoints"})

        answer = await retried(
            ROUTES[PUT], await attempt(), attempt, retryable=_put_retryable,
            told_s=lambda a: parse_retry_after(a.retry_after) if a.throttled else None,
            sleep=_pause, on_retry=failed)
        if answer.redirected:
            raise Refused(f"the object store answered the PUT of {_shown(name)} with HTTP "
                          f"{answer.status}, a redirect, which is never followed and stores "
                          "nothing: the signed URL must name the object itself",
                          answer.status, query)
        if not answer.stored:
            raise Refused(f"the object store refused {_shown(name)}: HTTP {answer.status}: "
                          f"{answer.reason or 'no reason given'}", answer.status, query)
        assert signed is not None  # a file stored was sent to a URL
        file.stored = signed[1]
        self.bytes_uploaded += file.size
        self.files_uploaded += 1
        await self.ledger.append({"op": "stored", "id": job.id, "rel": rel, "path": file.stored,
                            "etag": answer.etag})

    async def _ask(self, query: str) -> tuple[SignedUrl, str]:
        """The signed URL for one file and the object's URI; Refused on a 4xx."""
        def failed_attempt() -> bool:
            self._asks.narrow()
            return False  # the route's policy goes on retrying

        answer = await self.client.deliver(ROUTE, b"", give_up=failed_attempt, query=query)
        if answer.ok:
            self._asks.widen()
        else:  # the route retries what may pass: this is final
            raise Refused(f"the ingest refused {ROUTES[ROUTE].path}: HTTP {answer.status}: "
                          f"{answer.reason or 'no reason given'}", answer.status, query)
        try:
            return _target(answer.body)
        except ValueError as exc:
            raise Refused(f"the ingest's answer to {ROUTES[ROUTE].path} is unusable ({exc})",
                          answer.status, query) from None

    async def _put(self, job: _Job, rel: str, file: _File, target: SignedUrl) -> PutAnswer:
        stop = threading.Event()
        file.sent[0] = 0
        try:
            # at the lowest CPU priority: sending is the bulk of an upload's CPU, and it
            # must never take a core the trainer wants
            return await in_background(
                lambda: self._put_blocking(job, rel, file, target, stop), "upload")
        except asyncio.CancelledError:
            stop.set()  # the thread ends within one chunk
            raise
        finally:
            if not file.stored:
                file.sent[0] = 0

    def _put_blocking(self, job: _Job, rel: str, file: _File, target: SignedUrl,
                      stop: threading.Event) -> PutAnswer:
        fd, owned = self._source(job, rel, file)
        try:
            return put_file(target, fd, file.size, self.limit, stop, PUT_IDLE_TIMEOUT_S,
                            file.sent)
        except Stopped:
            return PutAnswer(0, "", "stopped")
        finally:
            if owned:
                os.close(fd)

    def _source(self, job: _Job, rel: str, file: _File) -> tuple[int, bool]:
        """A descriptor to read the file from, and whether the caller closes it; Refused when
        the file is gone."""
        if file.mode == "fd" and file.fd is not None:
            return file.fd, False
        path = (self._staged(job) / _staged_name(job, rel) if file.mode == "link"
                else Path(job.cp.local) / rel if rel else Path(job.cp.local))
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise Refused(f"{str(path)!a} cannot be read any more ({exc.strerror}): "
                          + ("its staged link was removed" if file.mode == "link" else
                             "it was deleted, and the descriptors holding it did not outlive "
                             "the sidecar's restart")) from None
        if os.fstat(fd).st_size < file.size:
            os.close(fd)
            raise Refused(f"{str(path)!a} was cut short after it completed (rewritten "
                          "in place)")
        return fd, True

    async def _refuse(self, job: _Job, refused: Refused) -> None:
        self.refused += 1
        job.state = "refused"
        letter = json_body({"run_id": self.run_id, "path": job.cp.local, "asked": refused.asked,
                            "reason": refused.reason})
        kept = await asyncio.to_thread(dead_letter, self.run_dir, ROUTE, refused.status, letter)
        await self.ledger.append({"op": "refused", "id": job.id, "why": refused.reason})
        log.error("--checkpoints: %s is not uploaded nor registered: %s; %s",
                  _shown(job.cp.local), refused.reason,
                  f"kept in {kept}" if kept else "not kept",
                  extra={"source": "checkpoints", "path": _shown(job.cp.local)})
        await asyncio.to_thread(self._unstage, job)

    # -- staging ------------------------------------------------------------------------------

    def _staged(self, job: _Job) -> Path:
        return self.run_dir / STAGED / job.id

    def _stage(self, job: _Job) -> None:
        """Blocking: hold every file of the checkpoint (a hard link, else a descriptor while
        the open-files limit leaves one, else its path alone), then write its ledger record.
        Refused when a file is gone already or is not a regular file; only regular files are
        ever opened. One checkpoint at a time: the descriptors left are counted for it."""
        with self._fds:
            self._stage_files(job)
        self.ledger.append_blocking({
            "op": "checkpoint", "id": job.id, "local": job.cp.local,
            "fingerprint": job.cp.fingerprint, "name": job.cp.name, "body": job.cp.body,
            "files": {rel: [f.size, f.mode] for rel, f in job.files.items()}})

    def _stage_files(self, job: _Job) -> None:
        cp = job.cp
        folder = self._staged(job)
        can_link = True
        fds_left = 0  # descriptors this checkpoint may still hold, once links cannot be made
        try:
            for rel in cp.files or ("",):
                source = os.path.join(cp.local, rel) if rel else cp.local
                try:
                    st = os.lstat(source)
                except FileNotFoundError:
                    raise Refused(f"{_shown(source)} was deleted before it could be held for the "
                                  "upload") from None
                if not stat.S_ISREG(st.st_mode):
                    raise Refused(f"{_shown(source)} is not a regular file")
                if can_link:
                    target = folder / _staged_name(job, rel)
                    try:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with contextlib.suppress(FileNotFoundError):
                            target.unlink()
                        os.link(source, target, follow_symlinks=False)
                        job.files[rel] = _File(st.st_size, "link")
                        continue
                    except OSError as exc:
                        if exc.errno == errno.ENOENT:
                            raise Refused(f"{_shown(source)} was deleted before it could be "
                                          "held for the upload") from None
                        if exc.errno not in _NO_LINK:
                            raise
                        can_link = False
                        fds_left = descriptors_left()
                        log.info("--checkpoints: the state folder cannot hold hard links to %s "
                                 "(%s): its files are held open until uploaded, which a "
                                 "restart of the sidecar does not keep", _shown(cp.local),
                                 exc.strerror, extra={"source": "checkpoints"})
                file = job.files[rel] = _File(st.st_size, "fd")
                if fds_left > 0:
                    try:
                        file.fd = os.open(source, _OPEN_FLAGS)
                        fds_left -= 1
                        continue
                    except FileNotFoundError:
                        raise Refused(f"{_shown(source)} was deleted before it could be held "
                                      "for the upload") from None
                    except OSError as exc:
                        if exc.errno not in (errno.EMFILE, errno.ENFILE):
                            raise
                        fds_left = 0  # another part of the process took what was left
                file.mode = "path"  # read where it lies when it is sent
        except OSError as exc:
            _close_fds(job)
            raise Refused(f"{_shown(cp.local)} cannot be held for the upload "
                          f"({exc.strerror or exc})") from None
        except Refused:
            _close_fds(job)
            raise
        unheld = sum(1 for f in job.files.values() if f.mode == "path")
        if unheld:
            import resource

            log.warning("--checkpoints: %d of the %d files of %s are not held (the open-files "
                        "limit, ulimit -n %d, leaves no more descriptors): they are read where "
                        "they lie when sent, so a rotation that deletes the checkpoint before "
                        "then refuses it; raise the limit, or put the state folder on the "
                        "checkpoints' filesystem, where files are held as hard links",
                        unheld, len(job.files), _shown(cp.local),
                        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                        extra={"source": "checkpoints", "path": _shown(cp.local)})

    def _unstage(self, job: _Job) -> None:
        import shutil  # not at start-up: it costs more than it answers (test_footprint)

        _close_fds(job)
        shutil.rmtree(self._staged(job), ignore_errors=True)

    def _open(self) -> list[_Job]:
        """Blocking: the ledger read back; returns the uploads to resume, in their order."""
        for record in self.ledger.read():
            try:
                self._replay(record)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line torn by a crash, or not ours
        resumed = []
        for job in self.jobs.values():
            if job.state != "uploading":
                continue
            if all(f.stored for f in job.files.values()) and self._registered(
                    job.cp.local, job.cp.fingerprint):
                job.state = "registered"  # a crash came between the two records
                continue
            for file in job.files.values():
                file.mode = "path" if file.mode == "fd" else file.mode
            job.sent_before = job.sent
            resumed.append(job)
        if resumed:
            log.info("--checkpoints: resuming %d checkpoint upload(s) left by an earlier start",
                     len(resumed), extra={"source": "checkpoints"})
        return resumed

    def _replay(self, record: dict[str, Any]) -> None:
        op = record["op"]
        if op == "checkpoint":
            cp = Checkpoint(str(record["local"]), str(record["fingerprint"]),
                            str(record["name"]), tuple(r for r in record["files"] if r),
                            dict(record["body"]))
            job = self.jobs[record["id"]] = _Job(str(record["id"]), cp)
            for rel, (size, mode) in record["files"].items():
                job.files[rel] = _File(int(size), str(mode))
            return
        job = self.jobs[record["id"]]
        if op == "stored":
            job.files[record["rel"]].stored = str(record["path"])
        elif op == "registered":
            job.state = "registered"
        elif op == "refused":
            job.state = "refused"


def descriptors_left() -> int:
    """Descriptors the soft RLIMIT_NOFILE leaves for held files, FD_RESERVE kept back for the
    rest of the sidecar."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = soft // 2  # no /proc: assume half is taken
    return max(soft - in_use - FD_RESERVE, 0)


def start_wait_s() -> float:
    """How long a checkpoint's first ask waits: a random part of START_SPREAD_S."""
    import random  # only once a checkpoint is uploaded: a watch that uploads nothing loads less

    return random.uniform(0, START_SPREAD_S)


def _first(group: BaseExceptionGroup[Refused]) -> Refused:
    leaf = group.exceptions[0]
    return leaf if isinstance(leaf, Refused) else _first(leaf)


def _close_fds(job: _Job) -> None:
    for file in job.files.values():
        if file.fd is not None:
            with contextlib.suppress(OSError):
                os.close(file.fd)
            file.fd = None


def _staged_name(job: _Job, rel: str) -> str:
    return rel or os.path.basename(job.cp.local)


def _put_retryable(answer: PutAnswer) -> bool:
    """A PUT not stored is tried again, but a redirect, or a 4xx that is not the store asking
    us to slow down: those the store will answer again."""
    return not answer.stored and not answer.redirected and not (
        400 <= answer.status < 500 and not answer.throttled)


async def _pause(seconds: float, told: bool) -> None:
    """Between PUT attempts: the whole wait, told by a Retry-After or not."""
    await asyncio.sleep(seconds)


def _object_name(cp: Checkpoint, rel: str) -> str:
    return "/".join(p for p in (NAME_PREFIX, cp.name, rel) if p)


def _target(body: bytes) -> tuple[SignedUrl, str]:
    """The URL, method, headers and object URI of an `upload-url` answer; ValueError why not."""
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    url, path = doc.get("url"), doc.get("path")
    method, headers = doc.get("method", "PUT"), doc.get("headers") or {}
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError("no http(s) url")
    if not isinstance(path, str) or not path:
        raise ValueError("no path")
    if not isinstance(method, str) or not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ValueError("a method or headers that are not text")
    return SignedUrl(url, method.upper(), headers), path


def _checkpoint_uri(job: _Job) -> str:
    """A checkpoint's object-store URI: a file's own; a folder's, its files' common prefix
    (each answered path ends with the name asked for)."""
    if not job.cp.files:
        return job.files[""].stored
    prefixes = {f.stored[:-len(rel) - 1] if f.stored.endswith("/" + rel) else
                os.path.dirname(f.stored) for rel, f in job.files.items()}
    if len(prefixes) == 1:
        return prefixes.pop()
    split = [p.split("/") for p in sorted(prefixes)]
    common = 0
    for parts in zip(*split, strict=False):
        if len(set(parts)) > 1:
            break
        common += 1
    return "/".join(split[0][:common])

