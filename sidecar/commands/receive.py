"""A local ingest server that checks every request as docs/ingest.md describes it.

It is `sidecar receive` on a machine without the platform, and the server every integration
test talks to over loopback HTTP: it validates each route's body as strictly as the platform
would, appends what it accepts to `<store_dir>/<route>.jsonl` and what it refuses, with the
route, status and reason, to `<store_dir>/rejected.jsonl`, and counts everything. A caller may
add a layer that acts on each request (`Hooks`): the tests inject faults through it
(tests/faulty_ingest.py); `sidecar receive` runs with none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import ClientError as aiohttp_ClientError
from aiohttp import web

from sidecar.commands.ingest_checks import (
    CHECKS,
    QUERY_ROUTES,
    ROUTE_NAMES,
    Rejected,
    Reset,
    described,
    item_count,
    parse_body,
    text_field,
)

__all__ = ["DEFAULT_PREFIX", "ROUTE_NAMES", "Hooks", "IngestServer", "IngestStats", "ReceivedRoute",
           "Rejected", "Reset", "serve"]

DEFAULT_PREFIX = "/api/ingest"
FAMILY_TOKEN_HEADERS = ("X-StarForge-Token", "X-TunePlane-Token")  # docs/ingest.md#requests

_MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any batch the sidecar builds; beyond it: 413
_SHUTDOWN_TIMEOUT_S = 2.0  # handlers still running at stop() are cancelled after this
_SUMMARY_INTERVAL_S = 1.0
REJECTED_STORE = "rejected.jsonl"  # no route's store name: a route's has no "rejected"
_MAX_KEPT_BODY_CHARS = 64 * 1024  # of a rejected body, in the rejected store
# S3's limit on one PUT, 5 GB, read as 10^9 bytes: a margin whichever GB AWS means
OBJECTS_PATH = "/_objects"  # where `sidecar receive` takes uploads itself (LocalObjects)
OBJECTS_FOLDER = "objects"  # in the store dir
URL_LIFETIME_S = 3600.0
_OBJECT_CHUNK_BYTES = 1 << 20


def _store_name(route: str) -> str:
    return route.replace("/", "_") + ".jsonl"


def _bearer(authorization: str) -> str:
    scheme, _, credentials = authorization.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _answer(
    status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(payload, status=status, headers=headers)


# ---------------------------------------------------------------------------------------------
# Hooks.


class Hooks:
    """A layer of the caller's that acts on each request to a route, at four moments of its
    handling, in this order. Each may raise Rejected (the request is answered with its status,
    counted and kept as a refusal) or Reset (its connection is cut, unanswered), and `stopping`
    is set once the server stops. The tests inject faults through it (tests/faulty_ingest.py);
    `sidecar receive` runs with these, which do nothing."""

    def routes(self) -> list[web.RouteDef]:
        """Routes of the layer's own, served beside the ingest's."""
        return []

    async def arrived(self, route: str, stopping: asyncio.Event) -> None:
        """Before the token is checked (where a proxy or an overloaded platform answers)."""

    def read(self, route: str, raw: bytes) -> None:
        """The body as read, before it is parsed."""

    def parsed(self, route: str, items: int) -> None:
        """The body parsed, its run_id checked and its `items` counted, before its route's
        checks."""

    async def stored(self, route: str, stopping: asyncio.Event) -> None:
        """The body stored, before it is acknowledged."""


# ---------------------------------------------------------------------------------------------
# Counters.


@dataclass
class ReceivedRoute:
    """What one route received."""

    accepted: int = 0
    rejected: dict[int, int] = field(default_factory=dict)  # status -> requests
    aborted: int = 0  # connections a hook reset
    items: int = 0  # accepted points, chunks or nodes
    log_bytes: int = 0  # accepted log text, UTF-8 bytes


@dataclass
class Rejections:
    """The requests of one route (or one unknown path) refused with one status."""

    count: int = 0
    last_reason: str = ""


@dataclass
class IngestStats:
    """Counters of everything the server received."""

    total_requests: int = 0  # every request on any path, answered or not
    not_found: int = 0  # requests outside the ingest routes
    routes: dict[str, ReceivedRoute] = field(
        default_factory=lambda: {route: ReceivedRoute() for route in CHECKS}
    )
    # the route of each accepted request, in order across routes
    arrivals: list[str] = field(default_factory=list)
    # by route or unknown path, and status; in first order
    rejections: dict[tuple[str, int], Rejections] = field(default_factory=dict)
    # /validation: the chunk indexes received of each round, by step, and its total_chunks
    rounds: dict[int, tuple[set[int], int]] = field(default_factory=dict)

    def add_chunk(self, body: dict[str, Any]) -> None:
        chunks, _ = self.rounds.setdefault(body["step"], (set(), body["total_chunks"]))
        chunks.add(body["chunk_index"])

    @property
    def complete_rounds(self) -> int:
        """Rounds of which every chunk arrived."""
        return sum(len(chunks) >= total for chunks, total in self.rounds.values())

    def reject(self, where: str, status: int, reason: str) -> None:
        """Count a refusal of a request to a route (or an unknown path) and keep its reason."""
        kept = self.rejections.setdefault((where, status), Rejections())
        kept.count += 1
        kept.last_reason = reason

    def rejected_total(self) -> int:
        """Requests answered with an error status, on any path."""
        return self.not_found + sum(sum(r.rejected.values()) for r in self.routes.values())

    def summary(self) -> str:
        """One line: what each route accepted and how many requests were rejected."""
        parts = []
        for route, counts in self.routes.items():
            if not counts.accepted:
                continue
            items_field = CHECKS[route].items_field
            part = (
                f"{route} {counts.items} {items_field}"
                if items_field
                else f"{route} {counts.accepted}"
            )
            if counts.log_bytes:
                part += f" {_human_bytes(counts.log_bytes)}"
            if CHECKS[route].rounds:
                part += f" in {self.complete_rounds} rounds"
            parts.append(part)
        rejected = self.rejected_total()
        if rejected:
            parts.append(f"rejected {rejected}: {self._rejection_reasons()} ({REJECTED_STORE})")
        return " | ".join(parts)

    def _rejection_reasons(self) -> str:
        """Each route's (or path's) refusals by status with the latest reason:
        `metrics 400 points[0].step must be an integer, got "x"; 2x lifecycle 401 ...`."""
        said = []
        for (where, status), kept in self.rejections.items():
            times = f"{kept.count}x " if kept.count > 1 else ""
            said.append(f"{times}{where} {status} {kept.last_reason}".rstrip())
        return "; ".join(said)


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


# ---------------------------------------------------------------------------------------------
# The server.


class IngestServer:
    """An aiohttp ingest server on loopback that validates, stores and counts every request."""

    def __init__(
        self,
        store_dir: Path,
        *,
        token: str | None = None,
        run_id: str | None = None,
        hooks: Hooks | None = None,
        prefix: str = DEFAULT_PREFIX,
        signer: Callable[[str, str, int], dict[str, Any]] | None = None,
    ) -> None:
        """Configure the server; nothing listens until start(). `signer(run_id, name,
        size_bytes)`: the answer of artifact/upload-url (default: URLs to the server's own
        object folder, LocalObjects)."""
        if token == "":
            raise ValueError("token must be non-empty, or None to accept any bearer token")
        self.store_dir = store_dir
        self.stats = IngestStats()
        self._token = token
        self._run_id = run_id
        self._prefix = prefix.rstrip("/")
        self._paths = {f"{self._prefix}/{route}": route for route in CHECKS}
        self._hooks = hooks or Hooks()
        self.objects = LocalObjects(store_dir / OBJECTS_FOLDER)
        self._signer = signer or self._local_signer
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._host = "127.0.0.1"
        self._port = 0
        self._app = self._make_app()

    @property
    def base_url(self) -> str:
        """The ingest base URL, ending in the prefix, e.g. http://127.0.0.1:PORT/api/ingest."""
        if self._runner is None:
            raise RuntimeError("the ingest server is not started")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}{self._prefix}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on host:port (port 0: an ephemeral one), then create the store directory: a
        port that cannot be had leaves no directory behind. OSError naming the store directory
        (its `filename`) when that cannot be created."""
        self._host, self._port = host, port
        self._runner = web.AppRunner(
            self._app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S
        )
        await self._runner.setup()
        try:
            await self.start_listening()
            self._make_store_dir()
        except BaseException:
            await self.stop()
            raise

    def _make_store_dir(self) -> None:
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.store_dir)) from exc

    async def stop(self) -> None:
        """Stop listening, end hung handlers and close every connection."""
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self._site = None

    async def stop_listening(self) -> None:
        """Close the listening socket and every open connection: clients see connection refused."""
        if self._site is None:
            return
        await self._site.stop()
        self._site = None
        if self._runner is not None and self._runner.server is not None:
            for connection in self._runner.server.connections:
                connection.force_close()

    async def start_listening(self) -> None:
        """Listen again on the port chosen at start()."""
        if self._runner is None:
            raise RuntimeError("the ingest server is not started")
        if self._site is not None:
            return
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self._site = site
        self._port = self._runner.addresses[0][1]

    def records(self, route: str) -> list[dict[str, Any]]:
        """The bodies this route's store file holds, in arrival order."""
        if route not in CHECKS:
            raise ValueError(f"unknown route {route!r}; routes are {', '.join(CHECKS)}")
        path = self.store_dir / _store_name(route)
        if not path.exists():
            return []
        with path.open(encoding="utf-8") as store:
            return [json.loads(line) for line in store]

    # -- request handling ---------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        @web.middleware
        async def count_requests(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            self.stats.total_requests += 1
            return await handler(request)

        app = web.Application(middlewares=[count_requests], client_max_size=_MAX_BODY_BYTES)
        app.router.add_routes(self._hooks.routes())
        app.router.add_route("PUT", OBJECTS_PATH + "/{path:.*}", self.objects.handle)
        app.router.add_route("*", "/{path:.*}", self._handle_ingest)
        return app

    async def _handle_ingest(self, request: web.Request) -> web.StreamResponse:
        route = self._paths.get(request.path)
        if route is None:
            self.stats.not_found += 1
            reason = f"no ingest route at {request.path}"
            await self._keep_rejected(request, request.path, 404, reason)
            return _answer(404, {"ok": False, "error": reason})
        counts = self.stats.routes[route]
        try:
            payload = await self._ingest(route, request)
        except Rejected as exc:
            counts.rejected[exc.status] = counts.rejected.get(exc.status, 0) + 1
            await self._keep_rejected(request, route, exc.status, exc.reason)
            return _answer(exc.status, {"ok": False, "error": exc.reason}, exc.headers)
        except Reset:
            counts.aborted += 1
            _abort(request)
            return web.Response(status=500)  # never written: the transport is gone
        return _answer(200, payload)

    async def _ingest(self, route: str, request: web.Request) -> dict[str, Any]:
        method = "GET" if route in QUERY_ROUTES else "POST"
        if request.method != method:
            raise Rejected(405, f"{request.method} is not allowed; use {method}",
                           {"Allow": method})
        await self._hooks.arrived(route, self._stopping)
        self._check_auth(request)
        if route in QUERY_ROUTES:
            return self._sign(route, request)
        raw = await self._read(request)
        self._hooks.read(route, raw)
        body = parse_body(raw)
        self._check_run_id(body)
        items = item_count(route, body)
        self._hooks.parsed(route, items)
        CHECKS[route].check(body)
        self._store(route, body, items)
        await self._hooks.stored(route, self._stopping)
        return {"ok": True, "inserted": items} if CHECKS[route].answers_inserted else {"ok": True}

    def _sign(self, route: str, request: web.Request) -> dict[str, Any]:
        """artifact/upload-url: the query checked and stored as a body, then signed."""
        body: dict[str, Any] = dict(request.query)
        if "size_bytes" in body:
            with contextlib.suppress(ValueError):
                body["size_bytes"] = int(body["size_bytes"])
        self._check_run_id(body)
        self._hooks.parsed(route, 0)
        CHECKS[route].check(body)
        self._store(route, body, 0)
        return self._signer(body["run_id"], body["name"], body["size_bytes"])

    def _local_signer(self, run_id: str, name: str, size: int) -> dict[str, Any]:
        return self.objects.sign(self.origin, run_id, name, size)

    @property
    def origin(self) -> str:
        """http://HOST:PORT of the server."""
        return self.base_url[: -len(self._prefix)] if self._prefix else self.base_url

    def _check_auth(self, request: web.Request) -> None:
        bearer = _bearer(request.headers.get("Authorization", ""))
        if not bearer:
            raise Rejected(401, "missing Authorization: Bearer <token>")
        if self._token is not None and not _same(bearer, self._token):
            raise Rejected(401, "bearer token rejected")
        expected = self._token if self._token is not None else bearer
        for header in FAMILY_TOKEN_HEADERS:
            value = request.headers.get(header)
            if value is not None and not _same(value, expected):
                raise Rejected(401, f"{header} rejected")

    @staticmethod
    async def _read(request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Rejected(413, f"body larger than {_MAX_BODY_BYTES} bytes") from None

    def _check_run_id(self, body: dict[str, Any]) -> None:
        run_id = text_field(body, "run_id")
        if self._run_id is not None and run_id != self._run_id:
            raise Rejected(
                400, f"run_id mismatch: expected {self._run_id!r}, got {described(run_id)}"
            )

    def _store(self, route: str, body: dict[str, Any], items: int) -> None:
        # Written synchronously on the loop: arrival order is store order, and each line is on
        # disk before the request is acknowledged.
        line = json.dumps(body, separators=(",", ":")) + "\n"
        with (self.store_dir / _store_name(route)).open("a", encoding="utf-8") as store:
            store.write(line)
        counts = self.stats.routes[route]
        self.stats.arrivals.append(route)
        counts.accepted += 1
        counts.items += items
        if CHECKS[route].rounds:
            self.stats.add_chunk(body)
        if CHECKS[route].text_items:
            counts.log_bytes += sum(
                len(chunk.encode("utf-8", "surrogatepass")) for chunk in body["chunks"]
            )


    async def _keep_rejected(self, request: web.Request, where: str, status: int,
                             reason: str) -> None:
        """Count the refusal and append the request (route, status, reason, the body as text,
        bounded) to the rejected store. The headers are not kept: they carry the token."""
        self.stats.reject(where, status, reason)
        try:
            raw = await request.read()
        except (web.HTTPRequestEntityTooLarge, aiohttp_ClientError, OSError):
            raw = b""  # too large (the reason says so), or the client went away
        text = raw.decode("utf-8", "replace")
        record = {"ts": datetime.now(UTC).isoformat(), "route": where, "method": request.method,
                  "status": status, "reason": reason, "body": text[:_MAX_KEPT_BODY_CHARS]}
        if len(text) > _MAX_KEPT_BODY_CHARS:
            record["body_chars"] = len(text)
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with (self.store_dir / REJECTED_STORE).open("a", encoding="utf-8") as store:
            store.write(line)


class LocalObjects:
    """An object folder that takes PUTs to the URLs it signed, as an object store does: each
    URL is good for one object and for URL_LIFETIME_S (a 403 once it expired, one for a
    signature that does not match); the body needs its Content-Length and is written to disk
    as it arrives. Stored under `folder/<run_id>/<name>`, answered with the MD5 as the ETag."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stored = 0  # objects taken
        self.refused: list[tuple[int, str]] = []  # status and code of each refused PUT
        self._key = os.urandom(32)

    def sign(self, origin: str, run_id: str, name: str, size: int,
             lifetime_s: float = URL_LIFETIME_S) -> dict[str, Any]:
        """The upload-url answer for one object, as an ingest gives it."""
        from urllib.parse import quote

        expires = int(time.time() + lifetime_s)
        key = f"{run_id}/{name}"
        url = (f"{origin}{OBJECTS_PATH}/{quote(key)}?expires={expires}&size={size}"
               f"&signature={self._signature(key, expires, size)}")
        return {"url": url, "path": (self.folder / key).as_uri(), "method": "PUT",
                "expires_at": datetime.fromtimestamp(expires, UTC).isoformat()}

    def _signature(self, key: str, expires: int, size: int) -> str:
        message = f"{key}\n{expires}\n{size}".encode()
        return hmac.new(self._key, message, "sha256").hexdigest()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["path"]
        try:
            expires, size = int(request.query["expires"]), int(request.query["size"])
            signature = request.query["signature"]
        except (KeyError, ValueError):
            return self._refuse(403, "AccessDenied", "Query-string authentication is required")
        if not hmac.compare_digest(signature, self._signature(key, expires, size)):
            return self._refuse(403, "SignatureDoesNotMatch", "The request signature we "
                                "calculated does not match the signature you provided")
        if time.time() > expires:
            return self._refuse(403, "AccessDenied", "Request has expired")
        if request.headers.get("Transfer-Encoding"):
            return self._refuse(501, "NotImplemented", "A header you provided implies "
                                "functionality that is not implemented")
        if request.content_length != size:
            return self._refuse(400, "BadRequest", f"Content-Length {request.content_length} "
                                f"is not the {size} bytes signed")
        target = self.folder / key
        if ".." in Path(key).parts:
            return self._refuse(400, "InvalidObjectName", "the name leaves the folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        digest = hashlib.md5(usedforsecurity=False)
        with partial.open("wb") as out:
            async for chunk in request.content.iter_chunked(_OBJECT_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        if partial.stat().st_size != size:
            partial.unlink()
            return self._refuse(400, "IncompleteBody", "the body ended before its length")
        os.replace(partial, target)
        self.stored += 1
        return web.Response(status=200, headers={"ETag": f'"{digest.hexdigest()}"'})

    def _refuse(self, status: int, code: str, message: str) -> web.Response:
        self.refused.append((status, code))
        body = f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>" \
               f"<Message>{message}</Message></Error>"
        return web.Response(status=status, text=body, content_type="application/xml")


def _abort(request: web.Request) -> None:
    """Close the connection with a TCP reset, so the client sees an error and no answer."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


# ---------------------------------------------------------------------------------------------
# `sidecar receive`.


def serve(
    store_dir: Path,
    *,
    host: str,
    port: int,
    token: str | None,
    run_id: str | None,
    summary: bool = True,
    ready_file: Path | None = None,
    hooks: Hooks | None = None,
) -> int:
    """Receive until SIGTERM or SIGINT, printing a live summary; 0 on a clean stop. `hooks`:
    a layer that acts on each request (none for `sidecar receive`)."""
    server = IngestServer(store_dir, token=token, run_id=run_id, hooks=hooks)
    return asyncio.run(_serve(server, host, port, summary, ready_file))


async def _serve(server: IngestServer, host: str, port: int, summary: bool,
                 ready_file: Path | None) -> int:
    try:
        await server.start(host, port)
    except OSError as exc:
        if exc.filename == str(server.store_dir):
            print(f"sidecar receive: cannot store in --dir {server.store_dir}: {exc.strerror}",
                  file=sys.stderr)
        else:
            print(f"sidecar receive: cannot start receiving on {host}:{port}: {exc}",
                  file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        print(f"receiving on {server.base_url}, storing in {server.store_dir}", flush=True)
        if ready_file is not None:
            _write_atomically(ready_file, server.base_url + "\n")
        await _report(server.stats, stop, summary)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await server.stop()
    return 0


async def _report(stats: IngestStats, stop: asyncio.Event, summary: bool) -> None:
    """Until stop is set, print the summary when it changed, at most once a second and at stop."""
    shown = ""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _SUMMARY_INTERVAL_S)
        line = stats.summary()
        if summary and line != shown:
            print(line, flush=True)
            shown = line


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def main(args: argparse.Namespace) -> int:
    """`sidecar receive`."""
    return serve(args.dir, host=args.host, port=args.port, token=args.token,
                 run_id=args.run_id, summary=not args.quiet, ready_file=args.ready_file)
