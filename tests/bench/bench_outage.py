"""Benchmark (not a test): the RSS of `sidecar run` over an ingest outage, and how fast the
backlog drains once the ingest is back (issue 5).

    python tests/bench/bench_outage.py [--outage-s 600] [--rate 5000] [--log-bytes 1000000]

A trainer writes `--rate` JSONL points a second to the file `sidecar run --jsonl` follows and
`--log-bytes` of log lines a second to its stdout, for the whole run. After `--warmup-s` of
normal delivery to a counting receiver on loopback (in this process, a thread), the receiver
stops listening for `--outage-s` (connection refused: an unreachable endpoint); the sidecar's
RSS (its own process, not the trainer's) is sampled every half second. Then the receiver
listens again and the clock runs until every point written before the outage ended has arrived;
the backlog over the time from the first point delivered again (the retry backoff may wait up
to 30 s before that) is the drain rate. Hardware sampling is on at its default (10 s).

Target (issue 5): RSS at most 30 MB above its value when the outage began.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _harness import SIDECAR, Row, bench_arguments, finish, info_row, limit_row, sidecar_env

BENCH = "outage"
RSS_GROWTH_LIMIT_MB = 30.0
SAMPLE_S = 0.5
DRAIN_TIMEOUT_S = 1800.0
POINT_LINE = '{"key":"loss","step":%-12d,"value":%.6f}\n'  # fixed width: size counts points
LINE_BYTES = len(POINT_LINE % (0, 0.0))

TRAINER = r"""
import os, sys, time
path, rate, log_bytes, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
POINT_LINE = sys.argv[5]
TICKS = 10
per_tick, log_per_tick = rate // TICKS, log_bytes // TICKS
line = "epoch 3 step %09d loss 0.4321 lr 3e-4 " + "x" * 60 + "\n"
log_lines = max(log_per_tick // len(line % 0), 1)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
out = sys.stdout.buffer
step, start, tick = 0, time.monotonic(), 0
while not os.path.exists(stop):
    points = []
    for _ in range(per_tick):
        points.append(POINT_LINE % (step, step % 1000 / 1000))
        step += 1
    os.write(fd, "".join(points).encode())
    out.write("".join(line % (step + i) for i in range(log_lines)).encode())
    out.flush()
    tick += 1
    pause = start + tick / TICKS - time.monotonic()
    if pause > 0:
        time.sleep(pause)
"""


class CountingIngest:
    """A bare ingest on loopback in a thread: answers 200 to every POST, counts metric points
    and log bytes, and can stop listening (connection refused) and start again."""

    def __init__(self) -> None:
        self.points = 0
        self.log_bytes = 0
        self.requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/ingest"

    def up(self) -> None:
        self._call(self._listen())

    def down(self) -> None:
        self._call(self._refuse())

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port,
                                                  reuse_address=True, limit=1 << 22)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, _, headers = head.decode("latin-1").partition("\r\n")
                length = next((int(h.split(":", 1)[1]) for h in headers.split("\r\n")
                               if h.lower().startswith("content-length:")), 0)
                body = await reader.readexactly(length) if length else b""
                path = request_line.split(" ")[1]
                self.requests += 1
                if path.endswith("/metrics"):
                    self.points += body.count(b'"key":')
                elif path.endswith("/logs"):
                    self.log_bytes += len(body)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


@dataclass
class Measured:
    rss_at_outage_mb: float = 0.0
    rss_samples_mb: list[float] = field(default_factory=list)
    backlog_points: int = 0
    reconnect_s: float = 0.0  # from the ingest's return to the first point delivered
    drain_s: float = 0.0  # from then until the backlog was delivered
    points_written: int = 0
    points_received: int = 0
    exit_status: int | None = None

    @property
    def peak_growth_mb(self) -> float:
        return max(self.rss_samples_mb, default=0.0) - self.rss_at_outage_mb


def written(path: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return path.stat().st_size // LINE_BYTES
    return 0


def rss_mb(proc: psutil.Process) -> float:
    return float(proc.memory_info().rss) / 1e6


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


def measure(outage_s: float, warmup_s: float, rate: int, log_bytes: int) -> Measured:
    m = Measured()
    ingest = CountingIngest()
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as tmp:
        work = Path(tmp)
        points, stop = work / "metrics.jsonl", work / "stop"
        env = sidecar_env(ingest.endpoint, work / "state", hardware_interval="10",
                          drain_timeout="60")
        command = [*SIDECAR, "run", "--jsonl", str(points), "--", sys.executable, "-c",
                   TRAINER, str(points), str(rate), str(log_bytes), str(stop), POINT_LINE]
        run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
        try:
            sidecar = psutil.Process(run.pid)
            wait_for(lambda: ingest.points > 0, 60, "the first points delivered")
            time.sleep(warmup_s)  # steady delivery under load before the outage
            lag = written(points) - ingest.points
            print(f"warm: {ingest.points:,} points delivered, {lag:,} behind; "
                  f"RSS {rss_mb(sidecar):.1f} MB")
            ingest.down()
            m.rss_at_outage_mb = rss_mb(sidecar)
            ends = time.monotonic() + outage_s
            next_report = time.monotonic() + 30
            while time.monotonic() < ends:
                m.rss_samples_mb.append(rss_mb(sidecar))
                if time.monotonic() >= next_report:
                    print(f"  outage {outage_s - (ends - time.monotonic()):5.0f} s: RSS "
                          f"{m.rss_samples_mb[-1]:.1f} MB (peak {max(m.rss_samples_mb):.1f}), "
                          f"{written(points) - ingest.points:,} points waiting")
                    next_report += 30
                time.sleep(SAMPLE_S)  # sampling period, not synchronisation
            target = written(points)
            before = ingest.points
            ingest.up()
            back = time.monotonic()
            wait_for(lambda: ingest.points > before, DRAIN_TIMEOUT_S, "delivery again")
            resumed = time.monotonic()
            m.reconnect_s = resumed - back
            m.backlog_points = target - before
            wait_for(lambda: ingest.points >= target, DRAIN_TIMEOUT_S, "the backlog delivered")
            m.drain_s = time.monotonic() - resumed
            stop.touch()
            m.exit_status = run.wait(120)
            m.points_written, m.points_received = written(points), ingest.points
        finally:
            if run.poll() is None:
                run.send_signal(signal.SIGKILL)
                run.wait()
            ingest.close()
    return m


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--outage-s", type=float, default=600.0, help="outage length (600)")
    options.add_argument("--warmup-s", type=float, default=15.0, help="delivery before it")
    options.add_argument("--rate", type=int, default=5000, help="points a second (5000)")
    options.add_argument("--log-bytes", type=int, default=1_000_000,
                         help="log bytes a second on the trainer's stdout (1 MB)")
    args = options.parse_args()
    outage_s = 60.0 if args.quick and args.outage_s == 600.0 else args.outage_s
    print(f"outage of {outage_s:.0f} s at {args.rate:,} points/s and "
          f"{args.log_bytes / 1e6:g} MB/s of logs (pid {os.getpid()})")
    m = measure(outage_s, args.warmup_s, args.rate, args.log_bytes)
    rate = m.backlog_points / m.drain_s if m.drain_s else float("inf")
    print(f"backlog of {m.backlog_points:,} points: first delivered {m.reconnect_s:.1f} s after "
          f"the ingest came back (the retry backoff), all in {m.drain_s:.1f} s more; sidecar exit "
          f"{m.exit_status}; {m.points_received:,} points received of {m.points_written:,} "
          "written (repeats included)")
    rows: list[Row] = [
        info_row(BENCH, "RSS when the outage began", m.rss_at_outage_mb, "MB"),
        info_row(BENCH, "peak RSS during the outage", max(m.rss_samples_mb), "MB"),
        limit_row(BENCH, f"RSS growth over a {outage_s:.0f} s outage", m.peak_growth_mb, "MB",
                  "<=", RSS_GROWTH_LIMIT_MB),
        info_row(BENCH, "backlog at the outage's end", m.backlog_points, "points"),
        info_row(BENCH, "first delivery after the outage", m.reconnect_s, "s"),
        info_row(BENCH, "backlog drain rate", rate, "points/s"),
        info_row(BENCH, "drain rate / write rate", rate / args.rate, "x"),
    ]
    finish(rows, args.json)
    if m.exit_status != 0:
        raise SystemExit(f"the sidecar exited {m.exit_status}")


if __name__ == "__main__":
    main()
