"""A TCP proxy of the tests' own between the sidecar and the ingest, for faults that live in the
connection rather than in the ingest's answers (issue 5's fault-injection suite).

    with running_proxy(ingest.base_url) as proxy:
        env = platform_env(proxy.base_url, state_dir)  # the sidecar talks to the proxy
        proxy.refuse()                                 # stop listening; open connections reset
        proxy.accept()                                 # listen again on the same port
        proxy.flap(period_s=2.0)                       # refuse and accept in turn
        proxy.cut_bodies(every=2, after_bytes=512)     # reset every 2nd request mid-body
        proxy.delay_answers(every=3, delay_s=3.0)      # hold every 3rd answer back
        proxy.fail(fraction=0.3)                       # answer 5xx itself, unforwarded
        proxy.clear()                                  # pass everything through again

Like tests/ingest_server.py it runs its own event loop in a background thread, and every method
is safe to call from any thread. It understands just enough HTTP/1.1 to find where requests and
answers begin and end (bodies framed by Content-Length, no pipelining: what aiohttp sends and
answers), which the faults need; every request it sees is kept as an `Exchange`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from tests.ingest_server import CALL_TIMEOUT_S, LoopHandle, background_loop

T = TypeVar("T")

_READ_BYTES = 64 << 10
_FAIL_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
                 504: "Gateway Timeout"}


@dataclass
class Exchange:
    """One request the proxy saw, and what became of it."""

    path: str
    sent_at: float  # epoch seconds: when its head reached the proxy
    body_bytes: int
    fate: str = "passed"  # passed, cut (reset mid-body), failed (answered by the proxy), delayed
    status: int | None = None  # the answer's status; None when there was none
    answered_at: float | None = None  # epoch seconds: when the answer left the proxy
    delay_s: float = 0.0


@dataclass
class ProxyStats:
    """Counters of the proxy."""

    connections: int = 0  # accepted from the client
    requests: int = 0
    cut: int = 0  # requests reset in the middle of their body
    delayed: int = 0  # answers held back
    failed: int = 0  # requests answered 5xx by the proxy itself
    resets: int = 0  # connections reset because the proxy stopped listening


@dataclass
class _Faults:
    cut_every: int = 0  # 0: off
    cut_after_bytes: int = 0
    delay_every: int = 0
    delay_s: float = 0.0
    fail_fraction: float = 0.0
    fail_statuses: tuple[int, ...] = (503,)


@dataclass
class _Piece:
    """A piece of one HTTP message as it went past."""

    data: bytes
    start_line: str | None  # set when the piece is the message's head
    length: int  # the message's body length (Content-Length)
    body_from: int  # where in the body this piece begins (0 for a head)
    end: bool  # the message ends with this piece


class _Framer:
    """Finds where the messages of one direction of an HTTP/1.1 connection begin and end."""

    def __init__(self) -> None:
        self._head = b""
        self._length = 0
        self._done = 0
        self._in_body = False

    def feed(self, data: bytes) -> list[_Piece]:
        pieces: list[_Piece] = []
        while data:
            if not self._in_body:
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if end < 0:
                    return pieces
                head, data = self._head[:end + 4], self._head[end + 4:]
                self._head = b""
                start_line, length = _parse_head(head)
                self._length, self._done, self._in_body = length, 0, length > 0
                pieces.append(_Piece(head, start_line, length, 0, length == 0))
                continue
            take = data[:self._length - self._done]
            data = data[len(take):]
            pieces.append(_Piece(take, None, self._length, self._done,
                                 self._done + len(take) == self._length))
            self._done += len(take)
            self._in_body = self._done < self._length
        return pieces


def _parse_head(head: bytes) -> tuple[str, int]:
    start_line, *headers = head.decode("latin-1").split("\r\n")
    length = 0
    for header in headers:
        name, _, value = header.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    return start_line, length


class _Cut(Exception):
    """The request was cut: reset both sides."""


@dataclass(eq=False)  # kept in a set, by identity
class _Connection:
    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    upstream_reader: asyncio.StreamReader
    upstream_writer: asyncio.StreamWriter
    awaiting: deque[Exchange] = field(default_factory=deque)  # forwarded, not yet answered
    reset: bool = False


class _Proxy:
    """The proxy itself; lives on its own event loop."""

    def __init__(self, upstream_host: str, upstream_port: int, seed: int) -> None:
        self.stats = ProxyStats()
        self.exchanges: list[Exchange] = []
        self.faults = _Faults()
        self._upstream = (upstream_host, upstream_port)
        self._random = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._port = 0
        self._connections: set[_Connection] = set()
        self._flapper: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self._port

    async def accept(self) -> None:
        """Listen (again, on the same port once one was chosen)."""
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self._port,
                                                  reuse_address=True)
        self._port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        """Stop listening and reset every open connection: clients see refused and reset."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            connection.reset = True
            self.stats.resets += 1
            _reset(connection.client_writer)
            _reset(connection.upstream_writer)

    async def flap(self, period_s: float) -> None:
        """Refuse and accept in turn, every `period_s`, starting with a refusal."""
        self._stop_flapping()

        async def flapping() -> None:
            while True:
                await self.refuse()
                await asyncio.sleep(period_s)
                await self.accept()
                await asyncio.sleep(period_s)

        self._flapper = asyncio.create_task(flapping(), name="proxy-flap")

    async def clear(self) -> None:
        """No fault any more: listening, passing everything through."""
        self._stop_flapping()
        self.faults = _Faults()
        await self.accept()

    async def close(self) -> None:
        """Stop listening and end every connection."""
        self._stop_flapping()
        await self.refuse()
        deadline = time.monotonic() + CALL_TIMEOUT_S / 2
        while self._connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the handlers notice the resets and finish

    def _stop_flapping(self) -> None:
        if self._flapper is not None:
            self._flapper.cancel()
            self._flapper = None

    async def _serve(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            _reset(client_writer)
            return
        connection = _Connection(client_reader, client_writer, upstream_reader, upstream_writer)
        self._connections.add(connection)
        pumps = [asyncio.create_task(self._requests(connection)),
                 asyncio.create_task(self._answers(connection))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            outcomes = await asyncio.gather(*pumps, return_exceptions=True)
            self._connections.discard(connection)
            cut = connection.reset or any(isinstance(o, _Cut) for o in outcomes)
            for writer in (client_writer, upstream_writer):
                if cut:
                    _reset(writer)
                else:
                    writer.close()

    async def _requests(self, connection: _Connection) -> None:
        """Client to ingest: count each request, decide its fate, forward (or not) its bytes."""
        framer = _Framer()
        exchange: Exchange | None = None
        while data := await connection.client_reader.read(_READ_BYTES):
            for piece in framer.feed(data):
                if piece.start_line is not None:
                    exchange = self._begin(piece)
                assert exchange is not None
                if exchange.fate == "failed":
                    if piece.end:
                        self._answer_failure(connection, exchange)
                    continue
                if exchange.fate == "cut":
                    await self._forward_until_cut(connection, piece)
                    continue
                if piece.start_line is not None:
                    connection.awaiting.append(exchange)
                connection.upstream_writer.write(piece.data)
            await connection.upstream_writer.drain()
            await connection.client_writer.drain()

    async def _forward_until_cut(self, connection: _Connection, piece: _Piece) -> None:
        """Forward a piece of a request to cut; raise _Cut once its cut point is reached."""
        cut_at = min(self.faults.cut_after_bytes, piece.length // 2)
        if piece.start_line is not None:
            connection.upstream_writer.write(piece.data)
            reached = cut_at == 0
        else:
            connection.upstream_writer.write(piece.data[:max(cut_at - piece.body_from, 0)])
            reached = piece.body_from + len(piece.data) >= cut_at
        if reached:
            await connection.upstream_writer.drain()
            raise _Cut

    def _begin(self, piece: _Piece) -> Exchange:
        assert piece.start_line is not None
        parts = piece.start_line.split(" ")
        exchange = Exchange(parts[1] if len(parts) > 1 else "", time.time(), piece.length)
        self.exchanges.append(exchange)
        self.stats.requests += 1
        n, faults = self.stats.requests, self.faults
        if faults.fail_fraction and self._random.random() < faults.fail_fraction:
            exchange.fate = "failed"
            exchange.status = self._random.choice(faults.fail_statuses)
            self.stats.failed += 1
        elif faults.cut_every and n % faults.cut_every == 0:
            exchange.fate = "cut"
            self.stats.cut += 1
        elif faults.delay_every and n % faults.delay_every == 0:
            exchange.fate, exchange.delay_s = "delayed", faults.delay_s
        return exchange

    def _answer_failure(self, connection: _Connection, exchange: Exchange) -> None:
        status = exchange.status or 503
        body = b'{"ok":false,"error":"injected by the test proxy"}'
        head = (f"HTTP/1.1 {status} {_FAIL_REASONS.get(status, 'Error')}\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        connection.client_writer.write(head + body)
        exchange.answered_at = time.time()

    async def _answers(self, connection: _Connection) -> None:
        """Ingest to client: note each answer's status; hold back the ones to delay."""
        framer = _Framer()
        while data := await connection.upstream_reader.read(_READ_BYTES):
            for piece in framer.feed(data):
                if piece.start_line is not None and connection.awaiting:
                    exchange = connection.awaiting.popleft()
                    exchange.status = int(piece.start_line.split(" ")[1])
                    if exchange.delay_s:
                        self.stats.delayed += 1
                        await asyncio.sleep(exchange.delay_s)
                    exchange.answered_at = time.time()
                connection.client_writer.write(piece.data)
            await connection.client_writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), as a crashed host or a cut cable would look."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class RunningProxy(LoopHandle):
    """Thread-safe handle on a proxy running in a background thread."""

    def __init__(self, proxy: _Proxy, loop: asyncio.AbstractEventLoop, prefix: str) -> None:
        super().__init__(loop)
        self._proxy = proxy
        self._prefix = prefix

    @property
    def base_url(self) -> str:
        """The ingest base URL through the proxy, e.g. http://127.0.0.1:PORT/api/ingest."""
        return f"http://127.0.0.1:{self._call(lambda: self._proxy.port)}{self._prefix}"

    @property
    def stats(self) -> ProxyStats:
        return self._call(lambda: copy.deepcopy(self._proxy.stats))

    def exchanges(self) -> list[Exchange]:
        """Every request seen so far, in arrival order (copies)."""
        return self._call(lambda: copy.deepcopy(self._proxy.exchanges))

    def refuse(self) -> None:
        """Stop listening: new connections are refused, open ones reset."""
        self._run(self._proxy.refuse())

    def accept(self) -> None:
        """Listen again on the same port."""
        self._run(self._proxy.accept())

    def flap(self, period_s: float) -> None:
        """Refuse for `period_s`, accept for `period_s`, and so on until clear()."""
        self._run(self._proxy.flap(period_s))

    def cut_bodies(self, every: int, after_bytes: int) -> None:
        """Reset every `every`-th request after `after_bytes` bytes of its body (at most half
        of it, so that even a small body is cut in its middle)."""
        self._set(cut_every=every, cut_after_bytes=after_bytes)

    def delay_answers(self, every: int, delay_s: float) -> None:
        """Hold every `every`-th answer back for `delay_s` (the ingest has already acted)."""
        self._set(delay_every=every, delay_s=delay_s)

    def fail(self, fraction: float, statuses: tuple[int, ...] = (500, 502, 503)) -> None:
        """Answer a random `fraction` of requests with one of `statuses` (no Retry-After),
        without forwarding them: the ingest never sees those."""
        self._set(fail_fraction=fraction, fail_statuses=statuses)

    def clear(self) -> None:
        """Stop every fault: listening and passing everything through."""
        self._run(self._proxy.clear())

    def _set(self, **faults: Any) -> None:
        def change() -> None:
            for name, value in faults.items():
                setattr(self._proxy.faults, name, value)

        self._call(change)


@contextmanager
def running_proxy(upstream_url: str, seed: int = 0) -> Iterator[RunningProxy]:
    """A proxy on an ephemeral loopback port in front of `upstream_url` (an ingest base URL),
    passing everything through until told otherwise; `seed` fixes its random choices."""
    parts = urlsplit(upstream_url)
    assert parts.hostname is not None and parts.port is not None, upstream_url
    with background_loop("tcp-proxy") as loop:
        proxy = _Proxy(parts.hostname, parts.port, seed)
        handle = RunningProxy(proxy, loop, parts.path.rstrip("/"))
        handle._run(proxy.accept())
        try:
            yield handle
        finally:
            handle._run(proxy.close())
