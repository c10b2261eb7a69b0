"""The local status endpoint: /healthz, /readyz, /metrics (Prometheus) and /status (JSON).

It serves what a `snapshot()` callable returns at request time, so the daemon's live objects stay
the only source of truth; nothing here counts anything itself. The endpoint listens on loopback by
default (CONTRACT 2, --status-addr); a busy port falls back to an ephemeral loopback port with
one WARNING, never failing the run, and the address actually bound is written to
`<run_dir>/status-addr` for `sidecar status`. Nothing secret is in any answer: the snapshot has
no token, and every answer is masked besides.
"""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from sidecar import __version__
from sidecar.config import STATUS_ADDR_FILE as ADDR_FILE
from sidecar.config import parse_host_port
from sidecar.delivery.client import RouteStats
from sidecar.log import log, mask
from sidecar.supervise import SUPERVISOR

_FALLBACK_HOSTS = {4: "127.0.0.1", 6: "::1"}


@dataclass(frozen=True)
class RouteSnapshot:
    """One ingest route's counters at one moment."""

    route: str
    requests: int = 0
    accepted: int = 0
    failures: int = 0
    retries: int = 0
    dropped: int = 0  # payloads given up on (for /logs: characters of output)
    queue_depth: int = 0  # payloads waiting in memory
    spool_bytes: int = 0  # bytes waiting on disk
    last_success: float | None = None  # epoch seconds of the last 2xx
    last_failure: str = ""  # why the last failed attempt failed, no secret in it

    @classmethod
    def of(cls, route: str, stats: RouteStats, *, queue_depth: int = 0,
           spool_bytes: int = 0) -> RouteSnapshot:
        """The snapshot of `IngestClient.stats[route]` plus what the route's batcher holds."""
        return cls(route, stats.requests, stats.accepted, stats.failures, stats.retries,
                   stats.dropped, queue_depth, spool_bytes, stats.last_success,
                   stats.last_failure)


@dataclass(frozen=True)
class SourceSnapshot:
    """One source's counters at one moment (a child stream, a tailed file, a TensorBoard dir)."""

    name: str
    kind: str  # "child", "log", "jsonl", "tensorboard", ...
    bytes_read: int = 0
    lines_read: int = 0  # lines or records
    points: int = 0  # metric points produced
    invalid: int = 0  # NaN/infinite values not sent
    skipped: int = 0  # unparseable lines or corrupt records


@dataclass(frozen=True)
class FileSnapshot:
    """One followed file at one moment."""

    path: str
    kind: str  # "log", "jsonl", "tensorboard"
    offset: int  # bytes read
    size: int  # bytes in the file, as last seen
    lag_bytes: int  # size - offset: what is still to read
    committed: int  # the offset acknowledged by the ingest and checkpointed
    last_read: float | None = None  # epoch seconds of the last read that found data


@dataclass(frozen=True)
class MatchSnapshot:
    """What one pattern of one source option names now ("--jsonl out/*.jsonl": 2 files)."""

    source: str
    files: int
    note: str = ""  # why it names nothing ("the folder out does not exist yet"), else ""


@dataclass(frozen=True)
class StatusSnapshot:
    """Everything the status endpoint shows, taken from the daemon's live objects."""

    run_id: str
    node: str
    mode: str  # "run" or "watch"
    offline: bool  # ENABLED=0: nothing is posted
    started_at: float  # epoch seconds
    routes: tuple[RouteSnapshot, ...] = ()
    sources: tuple[SourceSnapshot, ...] = ()
    files: tuple[FileSnapshot, ...] = ()
    matches: tuple[MatchSnapshot, ...] = ()
    sampler_duration_s: float | None = None  # how long the last hardware sample took
    lifecycle_recorded: tuple[str, ...] = ()  # events recorded, in order
    lifecycle_pending: tuple[str, ...] = ()  # events not yet acknowledged
    task_restarts: dict[str, int] = field(default_factory=dict)  # supervised tasks that failed
    signatures: dict[str, int] = field(default_factory=dict)  # failure signatures seen so far
    failure: dict[str, Any] | None = None  # the failed run's summary (sidecar.diagnose.Failure)
    stalled_s: float = 0.0  # how long the trainer has been stalled (--stall-after); 0: it is not
    taken_at: float = field(default_factory=time.time)

    @property
    def ready(self) -> bool:
        """Offline, or the ingest accepted at least one request (configuration is loaded, or
        there would be no snapshot)."""
        return self.offline or any(r.last_success is not None for r in self.routes)

    def to_json(self) -> dict[str, Any]:
        """The /status document."""
        doc = asdict(self)
        doc.update(ready=self.ready, version=__version__)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StatusSnapshot:
        """Read a /status document back; ValueError when it is not one."""
        try:
            return cls(
                run_id=str(doc["run_id"]), node=str(doc["node"]), mode=str(doc["mode"]),
                offline=bool(doc["offline"]), started_at=float(doc["started_at"]),
                routes=tuple(RouteSnapshot(**r) for r in doc.get("routes", ())),
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


def _make_app(snapshot: Callable[[], StatusSnapshot]) -> web.Application:
    prometheus = _Prometheus(snapshot)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        if snapshot().ready:
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready: the ingest has not accepted a request "
                            "yet\n")

    async def metrics(request: web.Request) -> web.Response:
        text = mask(await prometheus.text())
        return web.Response(body=text.encode("utf-8"),
                            headers={"Content-Type": prometheus.content_type})

    async def status(request: web.Request) -> web.Response:
        text = mask(json.dumps(snapshot().to_json(), ensure_ascii=False))
        return web.Response(text=text, content_type="application/json")

    app = web.Application(middlewares=[_supervised])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app


@web.middleware
async def _supervised(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An answer that raises is a 500, said and counted as a failure of the status server
    (sidecar.supervise), which goes on serving."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug in a snapshot or its rendering: never the server's end
        SUPERVISOR.failed("status-server", exc)
        return web.Response(status=500, text=f"{request.path} failed: {exc.__class__.__name__}; "
                            "the sidecar's log says more\n")


class StatusServer:
    """The running status endpoint; `address` is HOST:PORT as actually bound."""

    def __init__(self, runner: web.AppRunner, address: str, addr_file: Path | None) -> None:
        self._runner = runner
        self.address = address
        self.addr_file = addr_file

    async def close(self) -> None:
        """Stop listening; forget the address file if it still names this server."""
        await self._runner.cleanup()
        if self.addr_file is not None:
            try:
                if self.addr_file.read_text(encoding="utf-8").strip() == self.address:
                    self.addr_file.unlink()
            except OSError:
                pass


async def start_status_server(addr: str, run_dir: Path | None,
                              snapshot: Callable[[], StatusSnapshot]) -> StatusServer | None:
    """Serve the status endpoint on `addr` (HOST:PORT, or "off" for none); never raises for a
    port that cannot be had: it falls back to an ephemeral loopback port, or to nothing."""
    if addr == "off":
        return None
    host, port = parse_host_port(addr, "--status-addr")
    runner = web.AppRunner(_make_app(snapshot), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        fallback = _FALLBACK_HOSTS[6 if ":" in host else 4]
        try:
            await web.TCPSite(runner, fallback, 0).start()
        except OSError as second:
            log.warning("--status-addr %s: cannot listen there (%s) nor on an ephemeral "
                        "loopback port (%s); the status endpoint is off for this run",
                        addr, _reason(exc), _reason(second))
            await runner.cleanup()
            return None
        log.warning("--status-addr %s: cannot listen there (%s); the status endpoint is on %s "
                    "instead", addr, _reason(exc), _bound(runner))
    address = _bound(runner)
    addr_file = _write_addr_file(run_dir, address) if run_dir is not None else None
    log.info("status endpoint on http://%s (/status, /metrics, /healthz, /readyz)", address)
    return StatusServer(runner, address, addr_file)


def format_addr(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bound(runner: web.AppRunner) -> str:
    """The address a client on this node can connect to: a wildcard host becomes loopback."""
    host, port = runner.addresses[0][:2]
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
    partial = run_dir / f".{ADDR_FILE}.{os.getpid()}.tmp"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(address + "\n", encoding="utf-8")
        os.replace(partial, path)
    except OSError as exc:
        log.warning("cannot write %s (%s): `sidecar status` will need --status-addr %s",
                    path, _reason(exc), address)
        return None
    return path
