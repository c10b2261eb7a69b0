"""The object store of the fleet upload benchmark: a fixed capacity of PUTs, every object counted.

    python tests/bench/_fleet_store.py CAPACITY MAX_REQUESTS   (prints "port N control M")

The store port takes the PUTs of the URLs the fleet ingest signs (`/<bucket>/<key>?...`): each
body is read whole (its MD5 is the ETag; the bytes are not kept, so a fleet's checkpoints take
no memory), then at most CAPACITY PUTs a second are answered 200 with the ETag (a token bucket
of one second's worth); beyond it `503 SlowDown` with S3's XML body and no Retry-After, as S3
answers. Every answer closes its connection (http.client, which the upload uses, sends one PUT a
connection). Each object's size, ETag and how many PUTs stored it are kept. The control port
answers `GET /_stats` (PUTs a second, answered and refused, and the objects) and `GET /_quit`.
Past MAX_REQUESTS requests it stops answering and says so in its stats: the benchmark is
bounded whatever the code under test does.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections import Counter
from typing import Any
from urllib.parse import unquote, urlsplit

from _fleet_ingest import Bucket, answer_json

_SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
              b"<Message>Please reduce your request rate.</Message></Error>")
_BUSY = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
         b"Content-Length: " + str(len(_SLOW_DOWN)).encode() + b"\r\n\r\n" + _SLOW_DOWN)
_BAD = b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
READ_BYTES = 256 << 10


class Store:
    def __init__(self, capacity: float, max_requests: int) -> None:
        self.bucket = Bucket(capacity)
        self.max_requests = max_requests
        self.requests: Counter[int] = Counter()  # PUTs by epoch second of their answer
        self.refused: Counter[int] = Counter()
        self.objects: dict[str, list[Any]] = {}  # key -> [size, etag, PUTs that stored it]
        self.total = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            digest = hashlib.md5(usedforsecurity=False)
            left = length
            while left:
                chunk = await reader.read(min(left, READ_BYTES))
                if not chunk:
                    return
                digest.update(chunk)
                left -= len(chunk)
            self.total += 1
            if self.total > self.max_requests:
                return
            now = time.time()
            self.requests[int(now)] += 1
            if method != b"PUT":
                writer.write(_BAD)
                return
            if not self.bucket.admit():
                self.refused[int(now)] += 1
                writer.write(_BUSY)
                return
            key = unquote(urlsplit(target.decode()).path.lstrip("/"))
            etag = digest.hexdigest()
            kept = self.objects.setdefault(key, [length, etag, 0])
            kept[0], kept[1] = length, etag
            kept[2] += 1
            writer.write(b"HTTP/1.1 200 OK\r\nETag: \"" + etag.encode() + b"\"\r\n"
                         b"Connection: close\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError,
                ValueError):
            pass
        finally:
            writer.close()

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "refused": self.refused, "total": self.total,
                "bounded": self.total > self.max_requests, "objects": self.objects}


async def main(capacity: float, max_requests: int) -> None:
    store = Store(capacity, max_requests)
    server = await asyncio.start_server(store.serve, "127.0.0.1", 0, limit=1 << 20,
                                        backlog=4096)
    quit_now = asyncio.Event()

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            if target == "/_quit":
                quit_now.set()
            await answer_json(writer, store.stats() if target == "/_stats" else {})
        finally:
            writer.close()

    controller = await asyncio.start_server(control, "127.0.0.1", 0)
    print(f"port {server.sockets[0].getsockname()[1]} control "
          f"{controller.sockets[0].getsockname()[1]}", flush=True)
    await quit_now.wait()


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), int(sys.argv[2])))
