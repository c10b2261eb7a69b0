"""The local status endpoint: /healthz, /readyz, /metrics (Prometheus) and /status (JSON).

It serves what a `snapshot()` callable returns at request time, so the daemon's live objects stay
the only source of truth; nothing here counts anything itself. The endpoint listens on loopback by
default (docs/commands.md#the-status-endpoint); a busy default port gives way to an ephemeral one of
the same interface with one WARNING, never failing the run, and the address actually bound is
written to `<run_dir>/status-addr` for `sidecar status`. Nothing secret is in any answer: the
snapshot has no token, and every answer is masked besides.

The server is h11's HTTP/1.1 framing over asyncio streams (aiohttp's server side cost 2 MB and a
share of the start-up, issue 17): keep-alive and pipelining, HEAD, 405 for other methods; a
request that is malformed (400) or too large (431) is answered and its connection closed; a
client is given a bounded time to send each request and to take each answer; `close` ends every
open connection.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import h11

from sidecar import __version__
from sidecar.delivery.client import RouteStats
from sidecar.log import log
from sidecar.masking import mask, mask_doc
from sidecar.observe.address import DEFAULT_STATUS_ADDR, parse_host_port
from sidecar.observe.address import STATUS_ADDR_FILE as ADDR_FILE
from sidecar.statefile import read_state, write_atomic
from sidecar.supervise import SUPERVISOR

_FALLBACK_HOSTS = {4: "127.0.0.1", 6: "::1"}


class RouteSnapshot(NamedTuple):
    """One ingest route's counters at one moment."""

    route: str
    requests: int = 0
    accepted: int = 0
    failures: int = 0
    retries: int = 0
    dropped: int = 0  # items given up on (for /logs: chunks of text)
    queue_depth: int = 0  # payloads waiting in memory
    spool_bytes: int = 0  # bytes waiting on disk
    last_success: float | None = None  # epoch seconds of the last 2xx
    last_failure: str = ""  # why the last failed attempt failed, no secret in it
    dropped_chars: int = 0  # characters of the text dropped (/logs)
    latency_counts: tuple[int, ...] = ()  # attempts by duration bucket (LATENCY_BUCKETS_S)
    latency_sum_s: float = 0.0  # the attempts' durations, summed

    @classmethod
    def of(cls, route: str, stats: RouteStats, *, queue_depth: int = 0,
           spool_bytes: int = 0) -> RouteSnapshot:
        """The snapshot of `IngestClient.stats[route]` plus what the route's batcher holds."""
        return cls(route, stats.requests, stats.accepted, stats.failures, stats.retries,
                   stats.dropped, queue_depth, spool_bytes, stats.last_success,
                   stats.last_failure, stats.dropped_chars, tuple(stats.latency_counts),
                   stats.latency_sum_s)


class SourceSnapshot(NamedTuple):
    """One source's counters at one moment (a child stream, a tailed file, a TensorBoard dir)."""

    name: str
    kind: str  # "child", "log", "jsonl", "tensorboard", ...
    bytes_read: int = 0
    lines_read: int = 0  # lines or records
    points: int = 0  # metric points produced
    invalid: int = 0  # NaN/infinite values and JSONL lines giving no point, not sent
    skipped: int = 0  # unparseable lines or corrupt records


class FileSnapshot(NamedTuple):
    """One followed file at one moment."""

    path: str
    kind: str  # "log", "jsonl", "tensorboard"
    offset: int  # bytes read
    size: int  # bytes in the file, as last seen
    lag_bytes: int  # size - offset: what is still to read
    committed: int  # the offset acknowledged by the ingest and saved in offsets.json
    last_read: float | None = None  # epoch seconds of the last read that found data


class MatchSnapshot(NamedTuple):
    """What one pattern of one source option names now ("--jsonl out/*.jsonl": 2 files)."""

    source: str
    files: int
    note: str = ""  # why it names nothing ("the folder out does not exist yet"), else ""


class CheckpointSnapshot(NamedTuple):
    """What one --checkpoints folder holds: each checkpoint registered, waiting (and why) or
    skipped (and why), the aliases passed over, and counts of what was never registered."""

    folder: str
    # complete and handed on (checkpoints.py's "complete"): registered, or uploaded then
    # registered; the key keeps the name /status and the metric's label have always had
    registered: tuple[str, ...] = ()
    waiting: tuple[tuple[str, str], ...] = ()  # (path, why)
    skipped: tuple[tuple[str, str], ...] = ()  # (path, why)
    aliases: int = 0  # last.ckpt, symbolic links: the same checkpoint under another name
    not_posted: int = 0  # unmapped local paths in a container
    deleted_before_complete: int = 0
    note: str = ""  # why the folder shows nothing ("does not exist yet"), else ""
    deleted: tuple[tuple[str, str], ...] = ()  # the latest deleted before complete, and why

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CheckpointSnapshot:
        return cls(str(doc["folder"]), tuple(str(p) for p in doc.get("registered", ())),
                   tuple((str(p), str(w)) for p, w in doc.get("waiting", ())),
                   tuple((str(p), str(w)) for p, w in doc.get("skipped", ())),
                   int(doc.get("aliases", 0)), int(doc.get("not_posted", 0)),
                   int(doc.get("deleted_before_complete", 0)), str(doc.get("note", "")),
                   tuple((str(p), str(w)) for p, w in doc.get("deleted", ())))


class UploadSnapshot(NamedTuple):
    """One checkpoint upload under way: how far, how fast, how long still."""

    path: str
    bytes_sent: int
    bytes: int
    files_stored: int
    files: int
    rate_bytes_per_s: int
    eta_s: float | None


class StatusSnapshot:
    """Everything the status endpoint shows, taken from the daemon's live objects; the fields of
    /status in its order (`to_json`)."""

    __slots__ = ("checkpoints", "failure", "files", "lifecycle_pending", "lifecycle_recorded",
                 "matches",
                 "mode", "node", "offline", "routes", "run_id", "sampler_duration_s",
                 "signatures", "sources", "stalled_s", "started_at", "taken_at",
                 "task_restarts", "time_shares", "upload_totals", "uploads")

    def __init__(self, run_id: str, node: str, mode: str, offline: bool, started_at: float,
                 routes: tuple[RouteSnapshot, ...] = (),
                 sources: tuple[SourceSnapshot, ...] = (),
                 files: tuple[FileSnapshot, ...] = (), matches: tuple[MatchSnapshot, ...] = (),
                 sampler_duration_s: float | None = None,
                 lifecycle_recorded: tuple[str, ...] = (),
                 lifecycle_pending: tuple[str, ...] = (),
                 task_restarts: dict[str, int] | None = None,
                 signatures: dict[str, int] | None = None,
                 failure: dict[str, Any] | None = None, stalled_s: float = 0.0,
                 taken_at: float | None = None,
                 checkpoints: tuple[CheckpointSnapshot, ...] = (),
                 uploads: tuple[UploadSnapshot, ...] = (),
                 upload_totals: dict[str, int] | None = None,
                 time_shares: dict[str, Any] | None = None) -> None:
        self.run_id = run_id
        self.node = node
        self.mode = mode  # "run" or "watch"
        self.offline = offline  # ENABLED=0: nothing is posted
        self.started_at = started_at  # epoch seconds
        self.routes = routes
        self.sources = sources
        self.files = files
        self.matches = matches
        self.sampler_duration_s = sampler_duration_s  # how long the last hardware sample took
        self.lifecycle_recorded = lifecycle_recorded  # events recorded, in order
        self.lifecycle_pending = lifecycle_pending  # events not yet acknowledged
        # supervised tasks that failed, and failure signatures seen so far
        self.task_restarts = {} if task_restarts is None else task_restarts
        self.signatures = {} if signatures is None else signatures
        self.failure = failure  # the failed run's summary (sidecar.diagnose.Failure)
        # how long the trainer has been stalled (--stall-after); 0: it is not
        self.stalled_s = stalled_s
        self.taken_at = time.time() if taken_at is None else taken_at
        self.checkpoints = checkpoints  # one per --checkpoints folder
        self.uploads = uploads  # the checkpoint uploads under way
        # bytes and files uploaded, checkpoints refused, since the start
        self.upload_totals = {} if upload_totals is None else upload_totals
        # --time-window: the latest window's shares by rank, the verdicts holding (timeshare.py)
        self.time_shares = time_shares

    @property
    def ready(self) -> bool:
        """Offline, or the ingest accepted at least one request (configuration is loaded, or
        there would be no snapshot)."""
        return self.offline or any(r.last_success is not None for r in self.routes)

    def to_json(self) -> dict[str, Any]:
        """The /status document: each record an object of its fields in order, and the
        dicts copies (as `dataclasses.asdict` made it)."""
        return {
            "run_id": self.run_id, "node": self.node, "mode": self.mode,
            "offline": self.offline, "started_at": self.started_at,
            "routes": tuple(r._asdict() for r in self.routes),
            "sources": tuple(s._asdict() for s in self.sources),
            "files": tuple(f._asdict() for f in self.files),
            "matches": tuple(m._asdict() for m in self.matches),
            "sampler_duration_s": self.sampler_duration_s,
            "lifecycle_recorded": self.lifecycle_recorded,
            "lifecycle_pending": self.lifecycle_pending,
            "task_restarts": dict(self.task_restarts), "signatures": dict(self.signatures),
            "failure": copy.deepcopy(self.failure), "stalled_s": self.stalled_s,
            "taken_at": self.taken_at, "ready": self.ready, "version": __version__,
            "checkpoints": tuple(c._asdict() for c in self.checkpoints),
            "uploads": tuple(u._asdict() for u in self.uploads),
            "upload_totals": dict(self.upload_totals),
            "time_shares": copy.deepcopy(self.time_shares),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StatusSnapshot:
        """Read a /status document back; ValueError when it is not one."""
        try:
            return cls(
                run_id=str(doc["run_id"]), node=str(doc["node"]), mode=str(doc["mode"]),
                offline=bool(doc["offline"]), started_at=float(doc["started_at"]),
                routes=tuple(RouteSnapshot(**{**r, "latency_counts": tuple(
                    r.get("latency_counts", ()))}) for r in doc.get("routes", ())),
                sources=tuple(SourceSnapshot(**s) for s in doc.get("sources", ())),
                files=tuple(FileSnapshot(**f) for f in doc.get("files", ())),
                matches=tuple(MatchSnapshot(**m) for m in doc.get("matches", ())),
                sampler_duration_s=doc.get("sampler_duration_s"),
                lifecycle_recorded=tuple(doc.get("lifecycle_recorded", ())),
                lifecycle_pending=tuple(doc.get("lifecycle_pending", ())),
                task_restarts={str(k): int(v) for k, v in doc.get("task_restarts", {}).items()},
                signatures={str(k): int(v) for k, v in doc.get("signatures", {}).items()},
                failure=dict(doc["failure"]) if doc.get("failure") else None,
                stalled_s=float(doc.get("stalled_s", 0.0)),
                taken_at=float(doc.get("taken_at", time.time())),
                checkpoints=tuple(CheckpointSnapshot.from_json(c)
                                  for c in doc.get("checkpoints", ())),
                uploads=tuple(UploadSnapshot(**u) for u in doc.get("uploads", ())),
                upload_totals={str(k): int(v) for k, v in doc.get("upload_totals", {}).items()},
                time_shares=dict(doc["time_shares"]) if doc.get("time_shares") else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a sidecar /status document ({exc!r})") from None


class _Prometheus:
    """The /metrics text, rendered by `sidecar.observe.prometheus`, which is imported at the first
    scrape (in a thread: it takes tens of milliseconds)."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        self._snapshot = snapshot
        self._render: Callable[[], bytes] | None = None
        self.content_type = ""

    async def text(self) -> str:
        if self._render is None:
            module = await asyncio.to_thread(importlib.import_module, "sidecar.observe.prometheus")
            self._render, self.content_type = module.exposition(self._snapshot), module.CONTENT_TYPE
        return self._render().decode("utf-8")


# What one client may cost the daemon is bounded: its request line and headers in bytes, the time
# it may take to send a request or to take an answer, and the connections open at once.
MAX_REQUEST_BYTES = 16 * 1024  # a scraper's request line and headers take a few hundred bytes
# the whole next request, from the connection's start or the last answer (above a 60 s scrape
# interval, so that a scraper's connection is reused)
IDLE_TIMEOUT_S = 75.0
WRITE_TIMEOUT_S = 10.0  # for a client to take an answer
MAX_CONNECTIONS = 32  # past it, the connection idle the longest is closed
EVICTED = "closed to make room: the connection idle the longest goes first"
READ_BYTES = 4096
TEXT_PLAIN = "text/plain; charset=utf-8"
JSON = "application/json; charset=utf-8"
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
            431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
            503: b"Service Unavailable"}


class _Answer(NamedTuple):
    """One response, before masking and framing."""

    status: int
    text: str
    content_type: str = TEXT_PLAIN
    headers: tuple[tuple[str, str], ...] = ()
    # masked already, where it has a structure that masking the whole text could break: a
    # number that holds 8 digits of a token would become `***` in the JSON or the exposition
    masked: bool = False


_Handler = Callable[[str], Awaitable[_Answer]]  # the request's query string


Stacks = Callable[[bool], Awaitable[dict[str, Any] | str]]  # a look now, or the last; or why not
Profile = Callable[[int], Awaitable[dict[str, Any] | str]]  # N seconds sampled; or why not
MAX_PROFILE_S = 300


def _routes(snapshot: Callable[[], StatusSnapshot], stacks: Stacks | None = None,
            profile: Profile | None = None) -> dict[str, _Handler]:
    prometheus = _Prometheus(snapshot)

    async def healthz(_query: str) -> _Answer:
        return _Answer(200, "ok\n")

    async def readyz(_query: str) -> _Answer:
        if snapshot().ready:
            return _Answer(200, "ready\n")
        return _Answer(503, "not ready: the ingest has not accepted a request yet\n")

    async def metrics(_query: str) -> _Answer:
        text = await prometheus.text()
        return _Answer(200, _masked_exposition(text), prometheus.content_type, masked=True)

    async def status(_query: str) -> _Answer:
        return _json_answer(snapshot().to_json())

    def stacks_route(fresh: bool) -> _Handler:
        async def answer(_query: str) -> _Answer:
            doc = await stacks(fresh) if stacks is not None else "no stacks in this mode"
            if isinstance(doc, str):
                return _Answer(503, doc + "\n")
            return _json_answer(doc)

        return answer

    async def profile_route(query: str) -> _Answer:
        """/profile?seconds=N: every rank sampled for N seconds (default 10)."""
        from urllib.parse import parse_qs

        given = parse_qs(query).get("seconds", ["10"])[-1]
        if not given.isdigit() or not 1 <= int(given) <= MAX_PROFILE_S:
            return _Answer(400, f"seconds={given!r}: give a whole number of seconds from 1 to "
                           f"{MAX_PROFILE_S}\n")
        doc = await profile(int(given)) if profile is not None else "no profile in this mode"
        if isinstance(doc, str):
            return _Answer(503, doc + "\n")
        return _json_answer(doc)

    return {"/healthz": healthz, "/readyz": readyz, "/metrics": metrics, "/status": status,
            "/stacks": stacks_route(True), "/stacks/last": stacks_route(False),
            "/profile": profile_route}


async def _answer(routes: Mapping[str, _Handler], request: h11.Request) -> _Answer:
    """The answer to `request`; one that raises is a 500, said and counted as a failure of the
    status server (sidecar.supervise), which goes on serving."""
    target, _, query = request.target.partition(b"?")
    path = target.decode("ascii", "replace")
    handler = routes.get(path)
    if handler is None:
        return _Answer(404, f"not found: the status endpoint serves {', '.join(routes)}\n")
    if request.method not in (b"GET", b"HEAD"):
        return _Answer(405, f"method not allowed: {path} answers GET and HEAD\n",
                       headers=(("Allow", "GET, HEAD"),))
    try:
        return await handler(query.decode("ascii", "replace"))
    except Exception as exc:  # a bug in a snapshot or its rendering: never the server's end
        SUPERVISOR.failed("status-server", exc)
        return _Answer(500, f"{path} failed: {exc.__class__.__name__}; the sidecar's log says "
                       "more\n")


def _refusal(exc: h11.RemoteProtocolError) -> _Answer:
    if exc.error_status_hint == 431:
        return _Answer(431, f"request too large: its line and headers may take at most "
                       f"{MAX_REQUEST_BYTES} bytes\n")
    return _Answer(exc.error_status_hint, f"bad request: {str(exc)[:200]}\n")


class _Connections:
    """The endpoint's HTTP/1.1 connections (h11's framing over asyncio streams), each served in
    a task of its own, in turn, until the client closes it, errs, or is idle too long.

    A connection is idle while it waits for its client's next request (from its accept on, and
    again after each answer). At MAX_CONNECTIONS a new one closes the one idle the longest, so
    that idle connections never starve a request: 32 opened and left silent made /healthz
    answer 503 until they timed out, and a liveness probe restart the sidecar. Only when every
    connection is being answered is a new one refused (503)."""

    def __init__(self, routes: Mapping[str, _Handler], idle_timeout_s: float) -> None:
        self._routes = routes
        self._idle_timeout_s = idle_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle: dict[asyncio.Task[None], float] = {}  # -> since when (the loop's clock)
        self._closing: set[asyncio.Task[None]] = set()  # closed to make room, not yet ended

    def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """asyncio.start_server's callback: the task is known from the moment of the accept,
        so that `close` finds every one."""
        loop = asyncio.get_running_loop()
        full = len(self._tasks) - len(self._closing) >= MAX_CONNECTIONS
        if full and self._idle:
            oldest = min(self._idle, key=self._idle.__getitem__)
            del self._idle[oldest]
            self._closing.add(oldest)
            oldest.cancel(EVICTED)
            full = False
        task = loop.create_task(self._serve(reader, writer, refuse=full),
                                name="status-connection")
        self._tasks.add(task)
        if not full:
            self._idle[task] = loop.time()
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._closing.discard(task)
        self._idle.pop(task, None)

    def _waiting(self, idle: bool) -> None:
        """The current connection waits for its client's next request (idle), or is answered."""
        task = asyncio.current_task()
        if task is None or task not in self._tasks or task in self._closing:
            return
        if idle:
            self._idle[task] = asyncio.get_running_loop().time()
        else:
            self._idle.pop(task, None)

    async def close(self) -> None:
        """End every connection now; what was being answered is not finished."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                     refuse: bool) -> None:
        try:
            if refuse:
                await _send(writer, h11.Connection(h11.SERVER), _Answer(
                    503, f"busy: all {MAX_CONNECTIONS} connections are being answered\n"),
                    close=True)
            else:
                await self._converse(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()  # shutting down: nothing more goes out
            raise
        except (ConnectionError, TimeoutError):  # the client left, or does not take its answer
            writer.transport.abort()
        except Exception as exc:  # a bug of ours: this connection ends, the server goes on
            SUPERVISOR.failed("status-server", exc)
            writer.transport.abort()
        finally:
            await _closed(writer)

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        while True:
            self._waiting(True)
            try:
                async with asyncio.timeout(self._idle_timeout_s):
                    request = await _next_request(reader, conn)
                    body_follows = request is not None and not isinstance(conn.next_event(),
                                                                          h11.EndOfMessage)
            except TimeoutError:
                return  # idle, or too slow to send its request: the task and its memory go
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await _send(writer, conn, _refusal(exc), close=True)
                return
            if request is None:
                return  # the client closed the connection
            self._waiting(False)
            answer = await _answer(self._routes, request)
            # A body is never read: the answer closes the connection instead.
            await _send(writer, conn, answer, head=request.method == b"HEAD", close=body_follows)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()


async def _next_request(reader: asyncio.StreamReader, conn: h11.Connection) -> h11.Request | None:
    """The connection's next request; None when the client closed the connection instead."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ_BYTES))
        elif isinstance(event, h11.Request):
            return event
        else:
            return None


def _json_answer(doc: Any) -> _Answer:
    return _Answer(200, json.dumps(mask_doc(doc), ensure_ascii=False), JSON, masked=True)


def _masked_exposition(text: str) -> str:
    """Prometheus' text with its names, labels and comments masked and its values as they are."""
    lines = []
    for line in text.split("\n"):
        head, space, value = line.rpartition(" ")
        if line.startswith("#") or not space:
            lines.append(mask(line))
        else:
            lines.append(mask(head) + space + value)
    return "\n".join(lines)


async def _send(writer: asyncio.StreamWriter, conn: h11.Connection, answer: _Answer, *,
                head: bool = False, close: bool = False) -> None:
    """Frame, mask and write `answer` (only its headers for HEAD); TimeoutError when the client
    does not take it within WRITE_TIMEOUT_S."""
    body = (answer.text if answer.masked else mask(answer.text)).encode("utf-8")
    headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(body))),
               *answer.headers]
    if close:
        headers.append(("Connection", "close"))
    events: list[h11.Event] = [h11.Response(status_code=answer.status, headers=headers,
                                            reason=_REASONS.get(answer.status, b""))]
    if not head:
        events.append(h11.Data(data=body))
    events.append(h11.EndOfMessage())
    writer.write(b"".join(conn.send(event) or b"" for event in events))
    async with asyncio.timeout(WRITE_TIMEOUT_S):
        await writer.drain()


async def _closed(writer: asyncio.StreamWriter) -> None:
    """Close the connection once what was written went out; abort it when the client does not
    take that within WRITE_TIMEOUT_S."""
    writer.close()
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
    except asyncio.CancelledError:  # shutting down: what is left is not sent
        writer.transport.abort()
        raise
    except OSError:  # reset by the client: closed all the same
        pass


class StatusServer:
    """The running status endpoint; `address` is HOST:PORT as actually bound."""

    def __init__(self, listener: asyncio.Server, connections: _Connections,
                 addr_file: Path | None) -> None:
        self._listener = listener
        self._connections = connections
        self.address = _bound(listener)
        self.addr_file = addr_file

    async def close(self) -> None:
        """Stop listening and end every connection; forget the address file if it still names
        this server."""
        self._listener.close()
        await self._connections.close()
        await self._listener.wait_closed()
        if self.addr_file is not None:
            try:
                held = read_state(self.addr_file) or b""  # a FIFO put there cannot block
                if held.decode("utf-8", "replace").strip() == self.address:
                    self.addr_file.unlink()
            except OSError:
                pass


async def start_status_server(addr: str, run_dir: Path | None,
                              snapshot: Callable[[], StatusSnapshot], *,
                              idle_timeout_s: float = IDLE_TIMEOUT_S,
                              stacks: Stacks | None = None,
                              profile: Profile | None = None) -> StatusServer | None:
    """Serve the status endpoint on `addr` (HOST:PORT, or "off" for none); never raises for a
    port that cannot be had. The default address, busy, falls back to an ephemeral port of the
    same interface; an address given explicitly is checked before the start (cli.py), so one
    busy here was taken since: the endpoint is off, rather than somewhere nobody looks."""
    if addr == "off":
        return None
    host, port = parse_host_port(addr, "--status-addr")
    connections = _Connections(_routes(snapshot, stacks, profile), idle_timeout_s)
    try:
        listener = await asyncio.start_server(connections.accept, host, port,
                                              limit=MAX_REQUEST_BYTES)
    except OSError as exc:
        if addr != DEFAULT_STATUS_ADDR:
            log.warning("--status-addr %s: cannot listen there (%s); the status endpoint is off "
                        "for this run", addr, _reason(exc), extra={"option": "--status-addr"})
            return None
        try:
            listener = await asyncio.start_server(connections.accept, host, 0,
                                                  limit=MAX_REQUEST_BYTES)
        except OSError as second:
            log.warning("--status-addr %s: cannot listen there (%s) nor on an ephemeral port of "
                        "%s (%s); the status endpoint is off for this run",
                        addr, _reason(exc), host, _reason(second),
                        extra={"option": "--status-addr"})
            return None
        log.warning("--status-addr %s: cannot listen there (%s); the status endpoint is on %s "
                    "instead", addr, _reason(exc), _bound(listener),
                    extra={"option": "--status-addr"})
    address = _bound(listener)
    addr_file = _write_addr_file(run_dir, address) if run_dir is not None else None
    log.info("status endpoint on http://%s (/status, /metrics, /healthz, /readyz)", address)
    return StatusServer(listener, connections, addr_file)


def format_addr(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bound(listener: asyncio.Server) -> str:
    """The address a client on this node can connect to: a wildcard host becomes loopback."""
    host, port = listener.sockets[0].getsockname()[:2]
    ip = _ip(host)
    if ip is not None and ip.is_unspecified:
        host = _FALLBACK_HOSTS[ip.version]
    return format_addr(str(host), int(port))


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _reason(exc: OSError) -> str:
    return (exc.strerror or exc.__class__.__name__).lower()


def _write_addr_file(run_dir: Path, address: str) -> Path | None:
    """Write `address` to <run_dir>/status-addr atomically; a failure only costs a WARNING."""
    path = run_dir / ADDR_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, f"{address}\n".encode())
    except OSError as exc:
        log.warning("cannot write %s (%s): `sidecar status` will need --status-addr %s",
                    path, _reason(exc), address)
        return None
    return path
