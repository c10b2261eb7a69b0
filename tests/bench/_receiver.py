"""A bare ingest for the benchmarks, in a process of its own: raw asyncio HTTP/1.1, keep-alive.

    python tests/bench/_receiver.py MODE     (prints "port N" once listening)

MODE:
  count      /logs bodies are counted, not parsed: lines are the `\\n` escapes in the JSON text
             (every chunk's line end), or for a JSON array (Fluent Bit's `Format json`, one
             record a line, its newline stripped) the `{"date":` record openings (the
             benchmark's lines hold no quote or backslash, so neither occurs inside a line);
             bytes are the body's length. Every route answers 200.
  hang-logs  as count, but a /logs request is read and never answered (the connection stays
             open until the client gives up); every other route answers 200.
  soak       as count, and every /metrics point whose key holds `soak_` is counted by (key,
             step); `GET /_down` starts an outage (every ingest request is read, then its
             connection closed unanswered: the ingest is unreachable) and `GET /_up` ends it;
             `GET /_soak` answers, per key, the distinct steps and the extra copies.
  latency    /logs and /metrics bodies are parsed: each log line `LAT <epoch> ...` (of the
             sidecar's chunks, or of Fluent Bit's records' `log`) and each point with key
             `latency_probe` gives one (arrival - write) delay, by `ts`.

`GET /_stats` answers the counters as JSON; `GET /_delays` the latency mode's delays (seconds,
log lines and points separately). It is deliberately not `sidecar receive`: that one validates
every body, and the benchmarks must measure the sidecar, not the receiver.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections import Counter
from datetime import datetime
from typing import Any

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
_LAT_LINE = re.compile(r"^LAT (\d+\.\d+) ", re.MULTILINE)
LATENCY_KEY = "latency_probe"


class Receiver:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lines = 0
        self.log_bytes = 0
        self.log_requests = 0
        self.routes: Counter[str] = Counter()
        self.first_log_at: float | None = None
        self.last_log_at: float | None = None
        self.hung = 0
        self.log_delays: list[float] = []
        self.point_delays: list[float] = []
        self.down = False
        self.soak_points: Counter[tuple[str, int]] = Counter()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target, length = _parse_head(head)
                body = await reader.readexactly(length) if length else b""
                if self.down and method != "GET":
                    self.routes["refused during the outage"] += 1
                    return  # closed unanswered
                answer = self._handle(method, target, body)
                if answer is None:  # hang: never answer; the client gives up in its own time
                    self.hung += 1
                    await asyncio.Event().wait()
                    return
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def _handle(self, method: str, target: str, body: bytes) -> bytes | None:
        if method == "GET":
            if target in ("/_down", "/_up"):
                self.down = target == "/_down"
                return _json_answer({"down": self.down})
            if target == "/_soak":
                return _json_answer(self._soak())
            return _json_answer(self._stats() if target == "/_stats" else {
                "logs": self.log_delays, "points": self.point_delays})
        route = target.split("/api/ingest", 1)[-1]
        self.routes[route] += 1
        if route == "/logs":
            now = time.time()
            self.log_requests += 1
            # a JSON array is Fluent Bit's records; an object, the sidecar's chunks
            self.lines += body.count(b'{"date":') if body[:1] == b"[" else body.count(b"\\n")
            self.log_bytes += len(body)
            self.first_log_at = self.first_log_at or now
            self.last_log_at = now
            if self.mode == "latency":
                doc = json.loads(body)
                chunks = [record.get("log", "") for record in doc] if isinstance(doc, list) \
                    else doc["chunks"]  # Fluent Bit's records, or the sidecar's chunks
                for chunk in chunks:
                    self.log_delays.extend(now - float(t) for t in _LAT_LINE.findall(chunk))
            if self.mode == "hang-logs":
                return None
        elif route == "/metrics" and self.mode == "soak":
            for point in json.loads(body)["points"]:
                if "soak_" in point["key"]:
                    self.soak_points[point["key"], int(point["step"])] += 1
        elif route == "/metrics" and self.mode == "latency":
            now = time.time()
            for point in json.loads(body)["points"]:
                if point["key"] == LATENCY_KEY:
                    written = datetime.fromisoformat(point["ts"]).timestamp()
                    self.point_delays.append(now - written)
        return _OK

    def _stats(self) -> dict[str, Any]:
        return {"lines": self.lines, "log_bytes": self.log_bytes,
                "log_requests": self.log_requests, "routes": dict(self.routes),
                "first_log_at": self.first_log_at, "last_log_at": self.last_log_at,
                "hung": self.hung}


    def _soak(self) -> dict[str, Any]:
        keys: dict[str, dict[str, int]] = {}
        for (key, _), copies in self.soak_points.items():
            entry = keys.setdefault(key, {"distinct": 0, "repeated": 0})
            entry["distinct"] += 1
            entry["repeated"] += copies - 1
        return keys


def _parse_head(head: bytes) -> tuple[str, str, int]:
    request_line, *headers = head.decode("latin-1").split("\r\n")
    method, target, _ = request_line.split(" ", 2)
    length = 0
    for header in headers:
        name, _, value = header.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return method, target, length


def _json_answer(doc: Any) -> bytes:
    body = json.dumps(doc).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def main(mode: str) -> None:
    receiver = Receiver(mode)
    server = await asyncio.start_server(receiver.serve, "127.0.0.1", 0, limit=1 << 20)
    port = server.sockets[0].getsockname()[1]
    print(f"port {port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("count", "hang-logs", "latency", "soak"):
        raise SystemExit(__doc__)
    asyncio.run(main(sys.argv[1]))
