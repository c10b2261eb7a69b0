"""The ingest of the fleet benchmark: a fixed capacity, an outage on demand, every point counted.

    python tests/bench/_fleet_ingest.py CAPACITY MAX_REQUESTS [SIGN_CAPACITY STORE_ORIGIN]
    (prints "port N control M")

The ingest port takes /api/ingest/* POSTs: at most CAPACITY requests a second are answered
200 (a token bucket of one second's worth); beyond it 503 with `Retry-After: 1`. Every /metrics
point taken is counted by (key, step), its arrival time and value (when it was put) kept. With
SIGN_CAPACITY and STORE_ORIGIN (the upload benchmark, _fleet_store.py), it signs too: `GET
/api/ingest/artifact/upload-url?run_id=R&name=N&size_bytes=S` is answered `{"url": STORE_ORIGIN
/bucket/R/N?signature=..., "path": "s3://bucket/R/N"}` at most SIGN_CAPACITY times a second (a
bucket of its own), 503 with `Retry-After: 1` beyond it; every /artifact taken is counted by
(run_id, path). Requests a second are also counted by route.

The control port answers `GET /_down` (the ingest port is closed and every connection on it
dropped: nodes see connection refused), `GET /_up` (listening again, same port), `GET /_stats`
(requests a second, answered and refused, and the points) and `GET /_quit`. Past MAX_REQUESTS
requests it stops answering and says so in its stats: the benchmark is bounded whatever the code
under test does.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: "
         b"application/json\r\nContent-Length: 2\r\n\r\n{}")


SIGN_ROUTE = b"GET /api/ingest/artifact/upload-url?"
BUCKET = "fleet"


class Bucket:
    """A token bucket of one second's worth: at most `capacity` admitted a second."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.tokens = capacity
        self.filled_at = time.monotonic()

    def admit(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.filled_at) * self.capacity)
        self.filled_at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


async def answer_json(writer: asyncio.StreamWriter, doc: Any) -> None:
    """A control request's answer: `doc` as JSON, then the connection closed by the caller."""
    body = json.dumps(doc).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    await writer.drain()


class Ingest:
    def __init__(self, capacity: float, max_requests: int, sign_capacity: float = 0.0,
                 store: str = "") -> None:
        self.bucket = Bucket(capacity)
        self.signer = Bucket(sign_capacity)
        self.store = store
        self.max_requests = max_requests
        self.requests: Counter[int] = Counter()  # by epoch second
        self.refused: Counter[int] = Counter()
        # by route ("sign", "artifact", "other"), then by epoch second
        self.by_route: dict[str, Counter[int]] = {}
        self.refused_by_route: dict[str, Counter[int]] = {}
        self.registered: Counter[str] = Counter()  # "run_id path" -> /artifact posts taken
        self.first_at: dict[str, float] = {}  # route -> its first request's arrival (epoch)
        # key -> step -> (first arrival, the point's value: when the node put it)
        self.points: dict[str, dict[int, tuple[float, float]]] = {}
        self.repeated = 0
        self.total = 0
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.down_at: float | None = None
        self.up_at: float | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                self.total += 1
                if self.total > self.max_requests:
                    return
                now = time.time()
                self.requests[int(now)] += 1
                signing = head.startswith(SIGN_ROUTE)
                route = "sign" if signing else "artifact" if head.startswith(
                    b"POST /api/ingest/artifact ") else "other"
                self.by_route.setdefault(route, Counter())[int(now)] += 1
                self.first_at.setdefault(route, now)
                if not (self.signer if signing else self.bucket).admit():
                    self.refused[int(now)] += 1
                    self.refused_by_route.setdefault(route, Counter())[int(now)] += 1
                    writer.write(_BUSY)
                    continue
                if signing:
                    writer.write(self._signed(head))
                    continue
                if route == "artifact":
                    doc = json.loads(body)
                    self.registered[f"{doc['run_id']} {doc['path']}"] += 1
                elif head.startswith(b"POST /api/ingest/metrics "):
                    for point in json.loads(body)["points"]:
                        steps = self.points.setdefault(point["key"], {})
                        if point["step"] in steps:
                            self.repeated += 1
                        else:
                            steps[point["step"]] = (now, point["value"])
                writer.write(_OK)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError,
                ValueError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    def _signed(self, head: bytes) -> bytes:
        """The answer to an upload-url request: a URL to the store, the object's URI."""
        query = parse_qs(urlsplit(head.split(b" ", 2)[1].decode()).query)
        key = f"{query['run_id'][0]}/{query['name'][0]}"
        body = json.dumps({"url": f"{self.store}/{BUCKET}/{quote(key)}?signature=fleet",
                           "path": f"s3://{BUCKET}/{key}"}).encode()
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def listen(self) -> None:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", self.port,
                                                 limit=1 << 20, backlog=4096, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        await self.server.wait_closed()
        self.down_at = time.time()

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "refused": self.refused, "total": self.total,
                "bounded": self.total > self.max_requests, "repeated": self.repeated,
                "down_at": self.down_at, "up_at": self.up_at, "by_route": self.by_route,
                "refused_by_route": self.refused_by_route, "registered": self.registered,
                "first_at": self.first_at,
                "points": {key: [[s, *t] for s, t in steps.items()]
                           for key, steps in self.points.items()}}


async def main(capacity: float, max_requests: int, sign_capacity: float, store: str) -> None:
    ingest = Ingest(capacity, max_requests, sign_capacity, store)
    await ingest.listen()
    quit_now = asyncio.Event()

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            if target == "/_down":
                await ingest.down()
            elif target == "/_up":
                await ingest.listen()
                ingest.up_at = time.time()
            elif target == "/_quit":
                quit_now.set()
            await answer_json(writer, ingest.stats() if target == "/_stats" else {})
        finally:
            writer.close()

    controller = await asyncio.start_server(control, "127.0.0.1", 0)
    print(f"port {ingest.port} control {controller.sockets[0].getsockname()[1]}", flush=True)
    await quit_now.wait()


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), int(sys.argv[2]),
                     float(sys.argv[3]) if len(sys.argv) > 3 else 0.0,
                     sys.argv[4] if len(sys.argv) > 4 else ""))
