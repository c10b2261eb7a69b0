"""The ingest client's transport over real loopback sockets, against servers that misbehave in
the ways a proxy, a load balancer or a half-broken ingest does: closing kept-alive connections,
answering before the body is read, garbling the answer."""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sidecar.delivery.client import ROUTES, Answer, IngestClient, RouteStats, Verdict, retry_wait
from sidecar.delivery.transport import (
    MAX_ANSWER_BYTES,
    Transport,
    TransportError,
    TransportFailure,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"


class RawServer:
    """A loopback TCP server running `handler(reader, writer, connection_number)`."""

    def __init__(self, handler: Handler | None = None, host: str = "127.0.0.1") -> None:
        self.handler = handler or self.answer_once
        self.host = host
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, self.host, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}/api/ingest"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def answer_once(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          n: int = 0, answer: bytes = OK) -> None:
        """Read one request and write `answer` (the handler when none is given)."""
        await self.read_request(reader)
        writer.write(answer)
        await writer.drain()

    async def read_request(self, reader: asyncio.StreamReader, *, body: bool = True) -> bytes:
        """One request's head (and its Content-Length body, when `body`)."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        if body:
            await reader.readexactly(length)
        self.requests.append(head)
        return head


@contextlib.asynccontextmanager
async def serving(handler: Handler | None = None) -> AsyncIterator[RawServer]:
    async with RawServer(handler) as server:
        yield server


async def posted_twice(server: RawServer, route: str) -> tuple[Answer, Answer, RouteStats]:
    """Two posts to `route`, one after the other, through the ingest client, and its counters."""
    client = IngestClient(server.url, ("X-StarForge-Token",), lambda: "tok")
    await client.start()
    try:
        return (await client.post(route, b"{}"), await client.post(route, b"{}"),
                client.route_stats(route))
    finally:
        await client.close()


async def test_a_kept_alive_connection_closed_by_the_server_is_not_a_failure() -> None:
    """A load balancer that closes an idle connection as the next request goes out made every
    such request a failed attempt (a WARNING, a backoff, for /logs a third of its tries)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.answer_once(reader, writer)
        if n == 1:  # the next request on this connection arrives, and is not answered
            await server.read_request(reader)

    async with serving(handler) as server:
        first, second, stats = await posted_twice(server, "logs")
    assert first.ok and second.ok, second
    assert server.connections == 2 and stats.failures == 0


async def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.answer_once(reader, writer)
        closed.set()

    closed = asyncio.Event()
    async with serving(handler) as server:
        transport = Transport(server.url)
        try:
            await transport.post("/logs", b"{}", {}, 5)
            await asyncio.wait_for(closed.wait(), 5)
            deadline = asyncio.get_running_loop().time() + 5
            while not transport._idle[0].closed:  # the close reached the client's protocol
                assert asyncio.get_running_loop().time() < deadline, "the close never arrived"
                await asyncio.sleep(0.01)
            again = await transport.post("/logs", b"{}", {}, 5)
        finally:
            await transport.close()
    assert again.status == 200 and server.connections == 2


async def test_a_413_answered_before_the_body_was_read_is_seen_as_a_413() -> None:
    """A proxy that refuses a large body from its headers answers at once and closes."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.read_request(reader, body=False)
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()

    async with serving(handler) as server:
        client = IngestClient(server.url, ("X-StarForge-Token",), lambda: "tok")
        await client.start()
        try:
            answer = await client.post("metrics", b"{" + b" " * (4 << 20) + b"}")
        finally:
            await client.close()
    assert answer.verdict is Verdict.TOO_LARGE, answer


@pytest.mark.parametrize(("answer", "said"), [
    (b"HTTP/1.1 two hundred OK\r\n\r\n", "malformed"),
    (b"garbage\r\n\r\n", "malformed"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (16 * MAX_ANSWER_BYTES) + b"\r\n\r\n", "malformed"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "closed"),
    (b"", "the ingest closed the connection without answering"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "the ingest closed the connection in the middle of its "
                                       "answer"),
])
async def test_a_garbled_answer_is_an_attempt_to_retry_and_the_next_one_works(
        answer: bytes, said: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.answer_once(reader, writer, answer=answer if n == 1 else OK)

    async with serving(handler) as server:
        bad, good, _ = await posted_twice(server, "metrics")
    assert bad.verdict is Verdict.RETRY and said in bad.detail, bad
    assert good.ok


async def test_a_chunked_answer_longer_than_64_kib_is_cut_there() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(1024):  # 64 MiB offered
                writer.write(b"10000\r\n" + b"e" * 0x10000 + b"\r\n")
                await writer.drain()
                sent[0] += 0x10000

    sent = [0]
    async with serving(handler) as server:
        transport = Transport(server.url)
        try:
            reply = await transport.post("/metrics", b"{}", {}, 10)
        finally:
            await transport.close()
    assert reply.status == 400 and len(reply.body) == MAX_ANSWER_BYTES
    assert sent[0] < 32 << 20


async def test_the_request_carries_host_length_and_the_given_headers() -> None:
    async with serving() as server:
        transport = Transport(server.url)
        port = transport.origin.port
        try:
            await transport.post("/hardware", b'{"a":1}', {"Authorization": "Bearer t"}, 5)
        finally:
            await transport.close()
    [head] = server.requests
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /api/ingest/hardware HTTP/1.1"
    assert {f"host: 127.0.0.1:{port}", "content-length: 7", "authorization: bearer t"} <= {
        line.lower() for line in lines}


async def test_nothing_listening_is_a_short_reason() -> None:
    with_nothing = RawServer()
    async with with_nothing:
        url = with_nothing.url
    transport = Transport(url)
    with pytest.raises(TransportError, match=r"^cannot connect \(Connect call failed|refused"):
        await transport.post("/logs", b"{}", {}, 5)


async def test_nothing_listening_is_a_failure_to_connect_which_the_client_calls_refused() -> None:
    with_nothing = RawServer()
    async with with_nothing:
        url = with_nothing.url
    transport = Transport(url)
    with pytest.raises(TransportError) as info:
        await transport.post("/logs", b"{}", {}, 5)
    assert info.value.kind is TransportFailure.CONNECT
    client = IngestClient(url, ("X-StarForge-Token",), lambda: "tok")
    await client.start()
    try:
        answer = await client.post("metrics", b"{}")
    finally:
        await client.close()
    assert answer.failure is TransportFailure.CONNECT and answer.detail == str(info.value)
    # transient: an ingest restarting refuses connections for a few seconds
    assert client.never_accepted is None


@pytest.mark.parametrize(("answer", "kind"), [
    (b"", TransportFailure.CONNECTION),
    (b"garbage\r\n\r\n", TransportFailure.MALFORMED),
])
async def test_an_answer_cut_short_or_garbled_is_no_refused_connection(
        answer: bytes, kind: TransportFailure) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.answer_once(reader, writer, answer=answer)

    async with serving(handler) as server:
        client = IngestClient(server.url, ("X-StarForge-Token",), lambda: "tok")
        await client.start()
        try:
            failed = await client.post("metrics", b"{}")
        finally:
            await client.close()
    assert failed.failure is kind, failed
    assert client.never_accepted is None  # the ingest may yet answer


async def test_at_most_max_connections_are_open_at_once() -> None:
    open_now, most = 0, 0
    three_open = asyncio.Event()  # no answer before all three are open: they must overlap

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        if open_now == 3:
            three_open.set()
        try:
            while True:
                await server.read_request(reader)
                await asyncio.wait_for(three_open.wait(), 5)
                writer.write(OK)
                await writer.drain()
        finally:
            open_now -= 1

    async with serving(handler) as server:
        transport = Transport(server.url, max_connections=3)
        try:
            replies = await asyncio.gather(*(transport.post("/logs", b"{}", {}, 10)
                                             for _ in range(12)))
        finally:
            await transport.close()
    assert [r.status for r in replies] == [200] * 12
    assert most == 3 and server.connections == 3


async def test_a_timeout_closes_the_connection_and_the_next_request_gets_a_new_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        await server.read_request(reader)
        if n == 1:
            await asyncio.sleep(30)
        writer.write(OK)
        await writer.drain()

    async with serving(handler) as server:
        transport = Transport(server.url)
        try:
            with pytest.raises(TimeoutError):
                await transport.post("/logs", b"{}", {}, 0.3)
            again = await transport.post("/logs", b"{}", {}, 5)
        finally:
            await transport.close()
    assert again.status == 200 and server.connections == 2


async def test_an_ipv6_endpoint_is_reached_and_named_in_brackets() -> None:
    try:
        server = RawServer(host="::1")
        await server.__aenter__()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        transport = Transport(server.url)
        try:
            reply = await transport.post("/logs", b"{}", {}, 5)
        finally:
            await transport.close()
    finally:
        await server.__aexit__()
    assert reply.status == 200
    assert f"host: [::1]:{transport.origin.port}" in server.requests[0].decode().lower()


def test_retries_wait_with_full_jitter_and_spread_a_retry_after() -> None:
    """A backoff of 2^n times first_backoff_s plus at most first_backoff_s of jitter brought a
    fleet that lost its ingest together back together: every node waited 30 to 30.5 s once at
    the cap, so a recovering ingest met them in waves. Full jitter draws each wait between 0
    and the capped backoff; a Retry-After is never cut short and is spread over half as long
    again."""
    policy = ROUTES["metrics"]  # 0.5 s doubling to 30 s
    rng_state = random.getstate()
    random.seed(25)
    try:
        capped = [retry_wait(policy, 12) for _ in range(20_000)]
        early = [retry_wait(policy, 3) for _ in range(20_000)]  # at most 0.5 * 2^2 = 2 s
        told = [retry_wait(policy, 12, 10.0) for _ in range(20_000)]
    finally:
        random.setstate(rng_state)
    assert 0.0 <= min(capped) < 0.5 and 29.5 < max(capped) <= policy.max_backoff_s
    assert statistics.fmean(capped) == pytest.approx(15.0, abs=0.5)
    deciles = statistics.quantiles(capped, n=10)  # uniform: a tenth of the waits in each 3 s
    assert all(abs(d - 3.0 * (i + 1)) < 0.6 for i, d in enumerate(deciles))
    assert min(early) >= 0.0 and max(early) <= 2.0
    assert statistics.fmean(early) == pytest.approx(1.0, abs=0.05)
    assert min(told) >= 10.0 and max(told) <= 15.0
    assert statistics.fmean(told) == pytest.approx(12.5, abs=0.1)
