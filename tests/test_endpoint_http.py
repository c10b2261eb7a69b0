"""The status endpoint's HTTP server at its edges, over real loopback sockets: what a client that
sends too much, too little, too slowly or something else than a GET gets, keep-alive, HEAD, IPv6,
and a close that ends every open connection. tests/test_status.py covers what it serves."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from sidecar.observe.endpoint import (
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    FileSnapshot,
    StatusServer,
    StatusSnapshot,
    _Answer,
    _Connections,
    start_status_server,
)

DEADLINE_S = 10.0


def snapshot(files: tuple[FileSnapshot, ...] = ()) -> StatusSnapshot:
    return StatusSnapshot("run-1", "gpu-07", "watch", True, 1_790_000_000.0, files=files,
                          taken_at=1_790_000_100.0)


@asynccontextmanager
async def serving(idle_timeout_s: float = 60.0, addr: str = "127.0.0.1:0"
                  ) -> AsyncIterator[StatusServer]:
    server = await start_status_server(addr, None, snapshot, idle_timeout_s=idle_timeout_s)
    assert server is not None
    try:
        yield server
    finally:
        await server.close()


class Client:
    """One raw connection; answers are parsed by hand, so that nothing is taken on trust."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, address: str) -> Client:
        host, _, port = address.rpartition(":")
        return cls(*await asyncio.open_connection(host.strip("[]"), int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, *, head: bool = False) -> tuple[int, dict[str, str], bytes]:
        """The next answer: status, headers (names in lower case), body."""
        async with asyncio.timeout(DEADLINE_S):
            raw = await self.reader.readuntil(b"\r\n\r\n")
            status_line, *lines = raw.decode("latin-1").split("\r\n")
            headers = {name.strip().lower(): value.strip()
                       for name, _, value in (line.partition(":") for line in lines if line)}
            size = int(headers["content-length"])
            body = b"" if head else await self.reader.readexactly(size)
        return int(status_line.split()[1]), headers, body

    async def closed_by_server(self) -> bool:
        """True once the server ended the connection (a close, or a reset) with nothing more."""
        try:
            async with asyncio.timeout(DEADLINE_S):
                return await self.reader.read() == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.writer.transport.abort()


def connection_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "status-connection" and not t.done()]


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` while the event loop (and so the server) keeps running."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, f"not within {DEADLINE_S} s: {what}"
        await asyncio.sleep(0.01)


def get(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: test", *extra, "", ""]).encode()


async def healthy(address: str) -> bool:
    client = await Client.to(address)
    try:
        await client.send(get("/healthz", "Connection: close"))
        return (await client.answer())[0] == 200
    finally:
        client.close()


async def test_two_requests_on_one_connection_and_two_pipelined() -> None:
    async with serving() as server:
        client = await Client.to(server.address)
        try:
            await client.send(get("/healthz"))
            first = await client.answer()
            await client.send(get("/readyz"))
            second = await client.answer()
            await client.send(get("/healthz") + get("/status", "Connection: close"))
            third, fourth = await client.answer(), await client.answer()
            assert await client.closed_by_server()  # as the last request asked
        finally:
            client.close()
    assert first[0] == 200 and first[2] == b"ok\n" and "connection" not in first[1]
    assert second[0] == 200 and second[2] == b"ready\n"  # offline: ready
    assert third[2] == b"ok\n"
    assert fourth[0] == 200 and fourth[1]["content-type"] == "application/json; charset=utf-8"
    assert StatusSnapshot.from_json(json.loads(fourth[2])).run_id == "run-1"


async def test_head_has_the_get_headers_and_no_body() -> None:
    async with serving() as server:
        client = await Client.to(server.address)
        try:
            await client.send(get("/status"))
            got = await client.answer()
            await client.send(get("/status").replace(b"GET", b"HEAD", 1) + get("/healthz"))
            head = await client.answer(head=True)
            after = await client.answer()  # the next answer begins right after HEAD's headers
        finally:
            client.close()
    assert head[0] == 200
    assert head[1]["content-length"] == str(len(got[2]))
    assert head[1]["content-type"] == got[1]["content-type"]
    assert after[2] == b"ok\n"


async def test_other_methods_are_a_405_and_other_paths_a_404() -> None:
    async with serving() as server:
        client = await Client.to(server.address)
        try:
            await client.send(b"DELETE /status HTTP/1.1\r\nHost: test\r\n\r\n")
            deleted = await client.answer()
            await client.send(get("/nowhere"))
            missing = await client.answer()
            # A body is never read: the answer closes the connection, however long the body.
            await client.send(b"POST /metrics HTTP/1.1\r\nHost: test\r\n"
                              b"Content-Length: 100000000\r\n\r\n" + b"x" * 1000)
            posted = await client.answer()
            assert await client.closed_by_server()
        finally:
            client.close()
        assert await healthy(server.address)
    assert deleted[0] == 405 and deleted[1]["allow"] == "GET, HEAD"
    assert "connection" not in deleted[1]  # no body came with it: the connection stays
    assert missing[0] == 404 and b"/healthz, /readyz, /metrics, /status" in missing[2]
    assert posted[0] == 405 and posted[1]["connection"] == "close"


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"GET /healthz HTTP/1.1\r\nHost: test\r\nno colon here\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n",  # TLS
])
async def test_a_malformed_request_is_a_400_and_disconnected(request_bytes: bytes) -> None:
    async with serving() as server:
        client = await Client.to(server.address)
        try:
            await client.send(request_bytes)
            status, headers, body = await client.answer()
            assert await client.closed_by_server()
        finally:
            client.close()
        assert await healthy(server.address)  # the server goes on
    assert status == 400 and headers["connection"] == "close" and body.startswith(b"bad request")


async def test_oversize_headers_are_a_431_and_disconnected() -> None:
    async with serving() as server:
        client = await Client.to(server.address)
        try:
            await client.send(get("/healthz", "X-Big: " + "a" * (2 * MAX_REQUEST_BYTES)))
            status, headers, body = await client.answer()
            assert await client.closed_by_server()
        finally:
            client.close()
        assert await healthy(server.address)
    assert status == 431 and headers["connection"] == "close"
    assert str(MAX_REQUEST_BYTES).encode() in body


async def test_a_header_that_never_ends_is_cut_off() -> None:
    """A client that sends a header without end is answered once MAX_REQUEST_BYTES are in, while
    it is still sending: the server neither waits for the end nor keeps what comes."""
    async with serving() as server:
        client = await Client.to(server.address)

        async def flood() -> None:
            await client.send(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Endless: ")
            with pytest.raises(ConnectionError):
                while True:
                    await client.send(b"a" * 4096)

        flooding = asyncio.create_task(flood())
        try:
            status, _, _ = await client.answer()
            async with asyncio.timeout(DEADLINE_S):
                await flooding  # the server closed: the writes fail
        finally:
            flooding.cancel()
            client.close()
        assert await healthy(server.address)
    assert status == 431


async def test_an_idle_client_is_dropped() -> None:
    async with serving(idle_timeout_s=1.0) as server:
        silent = await Client.to(server.address)
        answered = await Client.to(server.address)
        try:
            await answered.send(get("/healthz"))
            assert (await answered.answer())[0] == 200
            assert await silent.closed_by_server()
            assert await answered.closed_by_server()  # idle after its answer
            await until(lambda: not connection_tasks(), "no connection task left")
        finally:
            silent.close()
            answered.close()


async def test_a_client_trickling_its_request_is_dropped() -> None:
    """The timeout is for the whole request, not for each read: one byte every 20 ms never
    completes a request, and the connection ends at the timeout."""
    async with serving(idle_timeout_s=1.0) as server:
        client = await Client.to(server.address)
        request = get("/healthz", "X-Slow: " + "a" * 1000)

        async def trickle() -> None:
            with pytest.raises(ConnectionError):
                for byte in request:
                    await client.send(bytes([byte]))
                    await asyncio.sleep(0.02)  # the client's pace, not a synchronisation

        trickling = asyncio.create_task(trickle())
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            assert await client.closed_by_server()
            ended = loop.time() - began
        finally:
            trickling.cancel()
            client.close()
        await asyncio.gather(trickling, return_exceptions=True)
    assert 0.8 <= ended < 5.0  # the request would have taken 20 s


async def test_idle_connections_never_starve_a_request() -> None:
    """32 connections opened and left silent made /healthz answer 503 until they timed out
    (75 s): a liveness probe's restart for anyone who can reach the port. The new request is
    answered at once; the connection idle the longest is the one closed to make room."""
    async with serving() as server:
        silent = [await Client.to(server.address) for _ in range(MAX_CONNECTIONS - 1)]
        kept_alive = await Client.to(server.address)  # idle too, since its answer
        try:
            await kept_alive.send(get("/healthz"))
            assert (await kept_alive.answer())[0] == 200
            await until(lambda: len(connection_tasks()) == MAX_CONNECTIONS, "all are served")
            async with asyncio.timeout(2.0):
                assert await healthy(server.address)
            assert await silent[0].closed_by_server()  # the oldest idle one
            await kept_alive.send(get("/healthz"))  # the others stay open
            assert (await kept_alive.answer())[0] == 200
            await until(lambda: len(connection_tasks()) == MAX_CONNECTIONS - 1,
                        "the probe's connection and the oldest are gone")
        finally:
            for client in (*silent, kept_alive):
                client.close()


async def test_a_connection_is_refused_with_503_only_while_every_one_is_being_answered(
        ) -> None:
    release = asyncio.Event()

    async def slow(_query: str) -> _Answer:
        await release.wait()
        return _Answer(200, "slow\n")

    connections = _Connections({"/slow": slow}, 60.0)
    listener = await asyncio.start_server(connections.accept, "127.0.0.1", 0)
    address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    clients = [await Client.to(address) for _ in range(MAX_CONNECTIONS)]
    try:
        for client in clients:
            await client.send(get("/slow"))
        await until(lambda: len(connection_tasks()) == MAX_CONNECTIONS
                    and not connections._idle, "every connection is being answered")
        extra = await Client.to(address)
        refused = await extra.answer()
        assert await extra.closed_by_server()
        release.set()
        assert [(await client.answer())[0] for client in clients] == [200] * MAX_CONNECTIONS
    finally:
        for client in clients:
            client.close()
        listener.close()
        await connections.close()
        await listener.wait_closed()
    assert refused[0] == 503 and refused[1]["connection"] == "close"


async def test_close_ends_open_connections() -> None:
    server = await start_status_server("127.0.0.1:0", None, snapshot)
    assert server is not None
    idle = await Client.to(server.address)
    partial = await Client.to(server.address)
    try:
        await idle.send(get("/healthz"))
        assert (await idle.answer())[0] == 200
        await partial.send(b"GET /status HTTP/1.1\r\nHo")
        await until(lambda: len(connection_tasks()) == 2, "both connections are served")
        async with asyncio.timeout(DEADLINE_S):
            await server.close()
        assert connection_tasks() == []
        assert await idle.closed_by_server() and await partial.closed_by_server()
    finally:
        idle.close()
        partial.close()
    with pytest.raises(ConnectionRefusedError):
        await Client.to(server.address)


async def test_close_ends_a_connection_whose_client_does_not_read() -> None:
    """An answer far larger than the socket buffers, to a client that reads nothing: close()
    does not wait for it to be taken."""
    files = tuple(FileSnapshot(f"/data/{'x' * 100}/{n}.log", "log", n, n, 0, n)
                  for n in range(100_000))  # /status: about 20 MB
    big = snapshot(files)
    server = await start_status_server("127.0.0.1:0", None, lambda: big)
    assert server is not None
    host, _, port = server.address.rpartition(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as reader:
        reader.setblocking(False)
        await loop.sock_connect(reader, (host, int(port)))
        await loop.sock_sendall(reader, get("/status"))

        def answer_begun() -> bool:
            try:
                return bool(reader.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                return False

        await until(answer_begun, "the answer is being written")
        async with asyncio.timeout(3):
            await server.close()
        assert connection_tasks() == []


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("addr", ["[::1]:0", "[::]:0"])
async def test_an_ipv6_host(addr: str) -> None:
    async with serving(addr=addr) as server:
        assert server.address.startswith("[::1]:")
        assert await healthy(server.address)
