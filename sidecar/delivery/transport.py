"""HTTP/1.1 over keep-alive connections to one origin: the ingest client's transport layer.

It knows framing and connections, nothing of routes, tokens or status codes (client.py does).
h11 parses and writes the messages; an asyncio protocol carries them. Against the aiohttp client
it replaces, its import costs a sixteenth of the CPU (0.018 against 0.29 CPU-s on a 2-core
machine) and 13.5 MB less memory, which halved the daemon's start-up and took its idle RSS
under 36 MB; per request it costs about the same (h11's state machine in Python against
aiohttp's parser in C).

What docs/ingest.md#answers asks of an answer: at most MAX_ANSWER_BYTES of it are read (a
longer body closes the connection instead); a redirect is returned, never followed; no proxy is
used, so the token goes nowhere but the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import ssl
from typing import NamedTuple
from urllib.parse import urlsplit

import h11

from sidecar import __version__

MAX_ANSWER_BYTES = 64 << 10  # of any answer's body, the rest never read (docs/ingest.md#answers)
MAX_HEAD_BYTES = 64 << 10  # of an answer's status line and headers
READ_BUFFER_BYTES = 4 * MAX_ANSWER_BYTES  # of an answer received ahead of its reader
USER_AGENT = f"sidecar/{__version__}"


class TransportFailure(enum.Enum):
    """What kept a request from a usable answer, for a caller that sorts failures."""

    RESOLVE = "resolve"  # the host's name did not resolve
    CONNECT = "connect"  # the connection was refused, or could not be made
    CONNECT_TIMEOUT = "connect-timeout"  # connecting had no answer in time
    TLS = "tls"  # the TLS handshake, or TLS afterwards, failed
    CONNECTION = "connection"  # the connection failed or was closed during the exchange
    MALFORMED = "malformed"  # the answer was not HTTP/1.1


class TransportError(Exception):
    """A request that got no usable answer, and which kind of failure kept it from one; `str()`
    is a short reason for messages (no URL, no header)."""

    def __init__(self, kind: TransportFailure, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class Reply(NamedTuple):
    """An answer's status, the headers the client reads, and at most MAX_ANSWER_BYTES of body."""

    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its first value
    body: bytes


class Origin(NamedTuple):
    """Where requests go, from the endpoint's URL."""

    scheme: str
    host: str
    port: int
    path: str  # the URL's path, without a trailing slash: routes are appended to it

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class _Connection(asyncio.Protocol):
    """One connection: what arrives is fed to its h11 state machine as it arrives, so an answer
    sent before the request was fully written (a 413 from a proxy that then closed) is read, not
    lost to the reset that follows it."""

    def __init__(self) -> None:
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self.received = 0  # bytes of the current answer
        self.closed = False  # by either side
        self.error: OSError | None = None  # why the connection was lost, if it failed
        self._eof_told = False  # h11 was told of the close (once it had every byte before it)
        self._wake: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.h11.receive_data(data)
        if self.received > READ_BUFFER_BYTES and self.transport is not None:
            self.transport.pause_reading()  # resumed whenever the answer's reader needs more
        self._notify()

    def eof_received(self) -> bool:
        self._end()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, OSError):
            self.error = exc
        self._end()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # used by Transport

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise self.error or ConnectionResetError("the ingest closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._writable is not None:
            await self._writable
        if self.closed and self.error is not None:
            raise self.error

    async def next_event(self) -> object:
        """The answer's next h11 event, waiting for bytes when h11 needs more. h11 is told of a
        close only once it needs more than it has, so that an error it raises then is the close
        cutting the answer short, not a malformed answer."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                if not self._eof_told:
                    raise
                raise ConnectionResetError(
                    "the ingest closed the connection " + ("without answering" if not self.received
                                                           else "in the middle of its answer")
                ) from None
            if event is not h11.NEED_DATA:
                return event
            if self.closed:
                if not self._eof_told:
                    self._eof_told = True
                    self.h11.receive_data(b"")  # a ConnectionClosed, an end, or an error
                    continue
                raise ConnectionResetError("the ingest closed the connection")
            if self.transport is not None:
                self.transport.resume_reading()
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly and neither side closed the connection."""
        return (not self.closed and self.h11.our_state is h11.DONE
                and self.h11.their_state is h11.DONE)

    def next_cycle(self) -> None:
        self.h11.start_next_cycle()
        self.received = 0

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _end(self) -> None:
        self.closed = True  # h11 learns of it in next_event, after the bytes before it
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


class Transport:
    """Keep-alive connections to one origin, at most `max_connections` at a time."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None, *,
                 max_connections: int = 8, connect_timeout_s: float = 5.0) -> None:
        self.origin = Origin.of(url)
        self._ssl = ssl_context
        if self.origin.scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()  # only here: loading the CAs takes time
        self._connect_timeout_s = connect_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()

    async def post(self, path: str, body: bytes, headers: dict[str, str],
                   timeout_s: float, method: str = "POST") -> Reply:
        """POST `body` (or another `method`'s) to the origin's path + `path`. Raises
        TransportError or TimeoutError (past `timeout_s` in all, connecting included); any
        answer, 3xx to 5xx, is a Reply."""
        async with asyncio.timeout(timeout_s), self._slots:  # waiting for a connection counts
            while self._idle:
                conn = self._idle.pop()
                if conn.closed:  # the server closed it while it was idle
                    conn.close()
                    continue
                with contextlib.suppress(_Stale):
                    return await self._exchange(conn, method, path, body, headers, reused=True)
            return await self._exchange(await self._connect(), method, path, body, headers,
                                        reused=False)

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()

    async def _connect(self) -> _Connection:
        origin = self.origin
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await asyncio.get_running_loop().create_connection(
                    _Connection, origin.host, origin.port, ssl=self._ssl,
                    server_hostname=origin.host if self._ssl else None)
        except TimeoutError:
            raise TransportError(TransportFailure.CONNECT_TIMEOUT, f"cannot connect (no answer "
                                 f"within {self._connect_timeout_s:g} s)") from None
        except ssl.SSLError as exc:
            raise TransportError(TransportFailure.TLS,
                                 f"TLS handshake failed ({_ssl_reason(exc)})") from None
        except socket.gaierror as exc:
            raise TransportError(TransportFailure.RESOLVE,
                                 f"cannot resolve {origin.host} ({exc.strerror})") from None
        except OSError as exc:
            raise TransportError(TransportFailure.CONNECT, "cannot connect "
                                 f"({exc.strerror or exc.__class__.__name__})") from None
        return conn

    async def _exchange(self, conn: _Connection, method: str, path: str, body: bytes,
                        headers: dict[str, str], *, reused: bool) -> Reply:
        """One request and its answer on `conn`, which is then kept for the next or closed."""
        self._busy.add(conn)
        try:
            try:
                await self._send(conn, method, path, body, headers)
            except OSError as exc:  # the server may have answered early (a 413) and closed
                sent: OSError | None = exc
            else:
                sent = None
            try:
                reply = await self._receive(conn)
            except (OSError, h11.ProtocolError) as exc:
                conn.close()
                if reused and conn.received == 0:
                    # Closed as the request went out on a kept-alive connection: nothing of
                    # it was answered, so the caller sends it once more on another one.
                    raise _Stale from None
                raise _failed(sent or exc) from None
        except BaseException:  # a timeout or a cancellation leaves it mid-exchange
            conn.close()
            raise
        finally:
            self._busy.discard(conn)
        if conn.reusable():
            conn.next_cycle()
            self._idle.append(conn)
        else:
            conn.close()
        return reply

    async def _send(self, conn: _Connection, method: str, path: str, body: bytes,
                    headers: dict[str, str]) -> None:
        fields = [("Host", self.origin.host_header), ("User-Agent", USER_AGENT),
                  ("Content-Length", str(len(body))), *headers.items()]
        request = h11.Request(method=method, target=self.origin.path + path, headers=fields)
        for event in (request, h11.Data(data=body), h11.EndOfMessage()):
            for data in conn.h11.send_with_data_passthrough(event) or ():
                conn.write(data)  # the body is written as it is, never copied
        await conn.drain()

    async def _receive(self, conn: _Connection) -> Reply:
        status, headers, body = 0, dict[str, str](), bytearray()
        while True:
            event = await conn.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
                for name, value in event.headers:
                    headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
            elif isinstance(event, h11.Data):
                body += event.data[:MAX_ANSWER_BYTES - len(body)]
                if len(body) >= MAX_ANSWER_BYTES:  # a huge body: drop the connection instead
                    conn.close()
                    return Reply(status, headers, bytes(body))
            elif isinstance(event, h11.EndOfMessage):
                return Reply(status, headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError("the ingest closed the connection")
            # an InformationalResponse (1xx) is followed by the real one


class _Stale(Exception):
    """A reused connection the server had closed before it read the request."""


def _ssl_reason(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return exc.verify_message or "certificate verify failed"
    return exc.reason or exc.__class__.__name__


def _failed(exc: BaseException) -> TransportError:
    """The TransportError of an exchange that `exc` cut short."""
    if isinstance(exc, h11.RemoteProtocolError):
        return TransportError(TransportFailure.MALFORMED, f"a malformed answer ({exc})")
    if isinstance(exc, ssl.SSLError):
        return TransportError(TransportFailure.TLS, f"TLS failed ({_ssl_reason(exc)})")
    if isinstance(exc, ConnectionResetError) and exc.args and isinstance(exc.args[0], str):
        return TransportError(TransportFailure.CONNECTION, exc.args[0])
    if isinstance(exc, OSError) and exc.strerror:
        return TransportError(TransportFailure.CONNECTION, f"connection failed ({exc.strerror})")
    return TransportError(TransportFailure.CONNECTION,
                          f"connection failed ({exc.__class__.__name__})")
