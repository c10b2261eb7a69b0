"""The status endpoint over real HTTP, and `sidecar status` in a real pseudo-terminal."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.commands.status import HOME, LEAVE_SCREEN
from sidecar.delivery.client import IngestClient
from sidecar.log import log
from sidecar.masking import add_secret
from sidecar.observe.address import STATUS_ADDR_FILE as ADDR_FILE
from sidecar.observe.endpoint import (
    CheckpointSnapshot,
    FileSnapshot,
    MatchSnapshot,
    RouteSnapshot,
    SourceSnapshot,
    StatusServer,
    StatusSnapshot,
    start_status_server,
)
from tests.conftest import (
    RUN_ID,
    SIDECAR,
    TOKEN,
    Sidecar,
    clean_environ,
    platform_env,
    python_child,
)
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, wait_until

# Until the CLI has `sidecar status`, the real process is started through this one-liner; the
# tests marked `wired` run `sidecar status` (and `sidecar run` serving it) once cli.py has it.
STATUS_MAIN = ("import sys; from sidecar.commands.status import status_command; from sidecar.cli "
               "import build_parser; sys.exit(status_command(build_parser().parse_args("
               "['status', *sys.argv[1:]])))")
STATUS_COMMAND = [sys.executable, "-c", STATUS_MAIN]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def cli_has(command: str) -> bool:
    from sidecar.cli import COMMANDS

    return command in COMMANDS


wired = pytest.mark.skipif(not cli_has("status"), reason="cli.py does not have `status` yet")


def sample(**changes: Any) -> StatusSnapshot:
    fields: dict[str, Any] = dict(
        run_id=RUN_ID, node="gpu-07", mode="run", offline=False, started_at=1_790_000_000.0,
        routes=(
            RouteSnapshot("lifecycle", requests=3, accepted=2, failures=1, retries=1,
                          last_success=1_790_000_100.0, last_failure="HTTP 502"),
            RouteSnapshot("logs", requests=40, accepted=37, failures=3, retries=2, dropped=5,
                          queue_depth=4, spool_bytes=0, last_success=1_790_000_110.0,
                          dropped_chars=512, latency_counts=(1, 0, 2, 30, 4, 0, 0, 0, 0, 0, 0,
                                                             0, 3),
                          latency_sum_s=92.5),
            RouteSnapshot("metrics", requests=9, accepted=9, queue_depth=1, spool_bytes=65536,
                          last_success=1_790_000_111.0),
        ),
        sources=(
            SourceSnapshot("stdout", "child", bytes_read=123_456, lines_read=789),
            SourceSnapshot("/data/run/metrics.jsonl", "jsonl", bytes_read=2048, lines_read=20,
                           points=60, invalid=2, skipped=1),
        ),
        sampler_duration_s=0.125,
        lifecycle_recorded=("starting", "running"),
        lifecycle_pending=("running",),
        taken_at=1_790_000_120.0,
    )
    return StatusSnapshot(**{**fields, **changes})


async def get(address: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(f"http://{address}{path}") as r:
        return r.status, await r.text()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed by prometheus_client's own parser."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@contextmanager
def warnings_of_sidecar() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# -- the endpoint ------------------------------------------------------------------------------


async def test_metrics_equal_the_snapshot(tmp_path: Path) -> None:
    snap = sample()
    server = await start_status_server("127.0.0.1:0", tmp_path, lambda: snap)
    assert server is not None
    try:
        status, text = await get(server.address, "/metrics")
    finally:
        await server.close()
    assert status == 200
    found = samples(text)

    def value(name: str, **labels: str) -> float:
        return found[(name, tuple(sorted(labels.items())))]

    assert value("sidecar_info", run_id=RUN_ID, node="gpu-07", mode="run",
                 version="0.1.0") == 1
    assert value("sidecar_offline") == 0
    assert value("sidecar_ready") == 1
    assert value("sidecar_start_time_seconds") == snap.started_at
    assert value("sidecar_sampler_duration_seconds") == 0.125
    assert value("sidecar_lifecycle_events_recorded_total") == 2
    assert value("sidecar_lifecycle_events_pending") == 1
    for route in snap.routes:
        r = route.route
        assert value("sidecar_route_requests_total", route=r) == route.requests
        assert value("sidecar_route_accepted_total", route=r) == route.accepted
        assert value("sidecar_route_failures_total", route=r) == route.failures
        assert value("sidecar_route_retries_total", route=r) == route.retries
        assert value("sidecar_route_dropped_total", route=r) == route.dropped
        assert value("sidecar_route_queue_depth", route=r) == route.queue_depth
        assert value("sidecar_route_spool_bytes", route=r) == route.spool_bytes
        assert route.last_success is not None
        assert value("sidecar_route_last_success_timestamp_seconds",
                     route=r) == route.last_success
        assert value("sidecar_route_last_success_age_seconds",
                     route=r) == snap.taken_at - route.last_success
        assert value("sidecar_route_request_duration_seconds_count", route=r) == sum(
            route.latency_counts)
        assert value("sidecar_route_request_duration_seconds_sum", route=r) == route.latency_sum_s
    # Items and characters are series of their own, one unit each.
    assert value("sidecar_route_dropped_total", route="logs") == 5
    assert value("sidecar_route_dropped_characters_total", route="logs") == 512
    assert ("sidecar_route_dropped_characters_total", (("route", "metrics"),)) not in found
    buckets = [(le, value("sidecar_route_request_duration_seconds_bucket", route="logs", le=le))
               for le in ("0.005", "0.025", "0.05", "0.1", "30.0", "+Inf")]
    assert buckets == [("0.005", 1), ("0.025", 3), ("0.05", 33), ("0.1", 37), ("30.0", 37),
                       ("+Inf", 40)]
    for source in snap.sources:
        labels = {"source": source.name, "kind": source.kind}
        assert value("sidecar_source_read_bytes_total", **labels) == source.bytes_read
        assert value("sidecar_source_read_lines_total", **labels) == source.lines_read
        assert value("sidecar_source_points_total", **labels) == source.points
        assert value("sidecar_source_invalid_total", **labels) == source.invalid
        assert value("sidecar_source_skipped_total", **labels) == source.skipped
    assert all(name.startswith(("sidecar_", "process_")) for name, _ in found)
    # The sidecar's own CPU and memory, from the process collector.
    assert value("process_cpu_seconds_total") > 0
    assert value("process_resident_memory_bytes") > 1 << 20


async def test_metrics_count_what_the_ingest_received(ingest: RunningIngest,
                                                      tmp_path: Path) -> None:
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    started = time.time()

    def snapshot() -> StatusSnapshot:
        routes = tuple(RouteSnapshot.of(name, stats) for name, stats in client.stats.items())
        return StatusSnapshot(RUN_ID, "gpu-07", "watch", False, started, routes=routes)

    server = await start_status_server("127.0.0.1:0", tmp_path, snapshot)
    assert server is not None
    try:
        _, before = await get(server.address, "/readyz")
        for n in range(3):
            body = json.dumps({"run_id": RUN_ID, "chunks": [f"line {n}\n"], "eof": False})
            assert (await client.post("logs", body.encode())).ok
        ingest.add_fault(Fault(route="logs", status=500, times=2))
        assert not (await client.post("logs", b"{}")).ok
        assert not (await client.post("logs", b"{}")).ok
        scraped, text = await get(server.address, "/metrics")
        ready, _ = await get(server.address, "/readyz")
    finally:
        await server.close()
        await client.close()
    found = samples(text)
    received = ingest.stats.routes["logs"]
    assert found[("sidecar_route_accepted_total", (("route", "logs"),))] == received.accepted == 3
    assert found[("sidecar_route_failures_total", (("route", "logs"),))] == sum(
        received.rejected.values()) == 2
    assert found[("sidecar_route_requests_total", (("route", "logs"),))] == 5
    assert found[("sidecar_route_request_duration_seconds_count", (("route", "logs"),))] == 5
    assert 0 < found[("sidecar_route_request_duration_seconds_sum", (("route", "logs"),))] < 60
    assert scraped == 200
    assert before.startswith("not ready") and ready == 200


async def test_dropped_logs_count_chunks_and_their_characters_apart(
        ingest: RunningIngest) -> None:
    """/logs given up on: sidecar_route_dropped_total counts chunks (items, as on every route),
    sidecar_route_dropped_characters_total their characters."""
    from sidecar.delivery.logs import LogShipper

    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    shipper = LogShipper(client, RUN_ID, linger_s=0.5)
    ingest.add_fault(Fault(route="logs", status=400))
    texts = ["first line\n", "second\n", "third and last\n"]
    shipper.start()
    try:
        for text in texts:
            shipper.put(text)
        assert await shipper.flush(10.0)
    finally:
        await shipper.stop()
        await client.close()
    snap = StatusSnapshot(RUN_ID, "gpu-07", "run", False, 0.0,
                          routes=(RouteSnapshot.of("logs", client.route_stats("logs")),))
    server = await start_status_server("127.0.0.1:0", None, lambda: snap)
    assert server is not None
    try:
        _, text = await get(server.address, "/metrics")
    finally:
        await server.close()
    found = samples(text)
    assert ingest.stats.routes["logs"].rejected == {400: 1}
    assert found[("sidecar_route_dropped_total", (("route", "logs"),))] == len(texts)
    assert found[("sidecar_route_dropped_characters_total", (("route", "logs"),))] == sum(
        map(len, texts))


async def test_healthz_and_readyz_transitions(tmp_path: Path) -> None:
    current = [sample(routes=(RouteSnapshot("lifecycle", requests=4, failures=4),))]
    server = await start_status_server("127.0.0.1:0", tmp_path, lambda: current[0])
    assert server is not None
    try:
        assert await get(server.address, "/healthz") == (200, "ok\n")
        not_ready = await get(server.address, "/readyz")
        current[0] = sample()
        ready = await get(server.address, "/readyz")
        current[0] = sample(routes=(), offline=True)
        offline = await get(server.address, "/readyz")
    finally:
        await server.close()
    assert not_ready[0] == 503 and "not ready" in not_ready[1]
    assert ready == (200, "ready\n")
    assert offline == (200, "ready\n")


async def test_status_json_round_trips(tmp_path: Path) -> None:
    snap = sample()
    server = await start_status_server("127.0.0.1:0", tmp_path, lambda: snap)
    assert server is not None
    try:
        status, text = await get(server.address, "/status")
    finally:
        await server.close()
    assert status == 200
    doc = json.loads(text)
    assert doc["ready"] is True and doc["version"] == "0.1.0"
    assert doc["routes"][1]["route"] == "logs" and doc["routes"][1]["dropped_chars"] == 512
    assert StatusSnapshot.from_json(doc).to_json() == snap.to_json()


def test_the_status_document_keeps_its_keys_their_order_and_its_own_copies() -> None:
    """The /status document, key for key and in order, as it was made by `dataclasses.asdict`
    (nested records as objects, tuples as lists): what `sidecar status` and users' scripts read."""
    failure = {"exit_status": 1, "duration_s": 12.5, "cause": "CUDA out of memory",
               "signature": "cuda_oom", "stream": "stderr", "quote": "torch.OutOfMemoryError",
               "node": "gpu-07", "rank": 0, "multi_node": False}
    snap = sample(files=(FileSnapshot("/data/run/train.log", "log", 100, 150, 50, 90,
                                      1_790_000_115.0),),
                  matches=(MatchSnapshot("--jsonl out/*.jsonl", 0,
                                         "the folder out does not exist yet"),),
                  task_restarts={"follow": 2}, signatures={"cuda_oom": 1}, failure=failure,
                  stalled_s=30.0, checkpoints=(CheckpointSnapshot(
                      "/data/ckpt", ("/data/ckpt/checkpoint-500",),
                      (("/data/ckpt/checkpoint-600", "no trainer_state.json yet"),), (), 1, 0, 2),))
    expected = {
        "run_id": RUN_ID, "node": "gpu-07", "mode": "run", "offline": False,
        "started_at": 1_790_000_000.0,
        "routes": [
            {"route": "lifecycle", "requests": 3, "accepted": 2, "failures": 1, "retries": 1,
             "dropped": 0, "queue_depth": 0, "spool_bytes": 0, "last_success": 1_790_000_100.0,
             "last_failure": "HTTP 502", "dropped_chars": 0, "latency_counts": [],
             "latency_sum_s": 0.0},
            {"route": "logs", "requests": 40, "accepted": 37, "failures": 3, "retries": 2,
             "dropped": 5, "queue_depth": 4, "spool_bytes": 0,
             "last_success": 1_790_000_110.0, "last_failure": "", "dropped_chars": 512,
             "latency_counts": [1, 0, 2, 30, 4, 0, 0, 0, 0, 0, 0, 0, 3], "latency_sum_s": 92.5},
            {"route": "metrics", "requests": 9, "accepted": 9, "failures": 0, "retries": 0,
             "dropped": 0, "queue_depth": 1, "spool_bytes": 65536,
             "last_success": 1_790_000_111.0, "last_failure": "", "dropped_chars": 0,
             "latency_counts": [], "latency_sum_s": 0.0},
        ],
        "sources": [
            {"name": "stdout", "kind": "child", "bytes_read": 123_456, "lines_read": 789,
             "points": 0, "invalid": 0, "skipped": 0},
            {"name": "/data/run/metrics.jsonl", "kind": "jsonl", "bytes_read": 2048,
             "lines_read": 20, "points": 60, "invalid": 2, "skipped": 1},
        ],
        "files": [{"path": "/data/run/train.log", "kind": "log", "offset": 100, "size": 150,
                   "lag_bytes": 50, "committed": 90, "last_read": 1_790_000_115.0}],
        "matches": [{"source": "--jsonl out/*.jsonl", "files": 0,
                     "note": "the folder out does not exist yet"}],
        "sampler_duration_s": 0.125, "lifecycle_recorded": ["starting", "running"],
        "lifecycle_pending": ["running"], "task_restarts": {"follow": 2},
        "signatures": {"cuda_oom": 1}, "failure": failure, "stalled_s": 30.0,
        "taken_at": 1_790_000_120.0, "ready": True, "version": "0.1.0",
        "checkpoints": [{"folder": "/data/ckpt", "registered": ["/data/ckpt/checkpoint-500"],
                         "waiting": [["/data/ckpt/checkpoint-600", "no trainer_state.json yet"]],
                         "skipped": [], "aliases": 1, "not_posted": 0,
                         "deleted_before_complete": 2, "note": "", "deleted": []}],
        "uploads": [], "upload_totals": {}, "time_shares": None,
    }
    doc = snap.to_json()
    assert json.dumps(doc) == json.dumps(expected)  # the order of the keys too
    assert StatusSnapshot.from_json(json.loads(json.dumps(doc))).checkpoints == snap.checkpoints
    doc["failure"]["cause"] = doc["signatures"]["cuda_oom"] = doc["task_restarts"]["follow"] = 0
    assert snap.failure == failure and failure["cause"] == "CUDA out of memory"
    assert snap.signatures == {"cuda_oom": 1} and snap.task_restarts == {"follow": 2}


async def test_nothing_secret_in_any_answer(tmp_path: Path) -> None:
    add_secret(TOKEN)
    snap = sample(routes=(RouteSnapshot("logs", requests=1, failures=1,
                                        last_failure=f"echoed {TOKEN}"),),
                  sources=(SourceSnapshot(f"/tmp/{TOKEN}.log", "log"),))
    server = await start_status_server("127.0.0.1:0", tmp_path, lambda: snap)
    assert server is not None
    try:
        answers = [await get(server.address, path)
                   for path in ("/status", "/metrics", "/healthz", "/readyz")]
    finally:
        await server.close()
    for _, text in answers:
        assert TOKEN not in text
    assert "***" in answers[0][1] and "***" in answers[1][1]


async def test_busy_default_port_falls_back_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        monkeypatch.setattr("sidecar.observe.endpoint.DEFAULT_STATUS_ADDR", taken)  # not 9620:
        #                                            whatever listens there on this machine
        with warnings_of_sidecar() as warnings:
            server = await start_status_server(taken, tmp_path / "run", sample)
        assert server is not None
        try:
            assert server.address != taken
            assert server.address.startswith("127.0.0.1:")
            assert (tmp_path / "run" / ADDR_FILE).read_text() == server.address + "\n"
            assert await get(server.address, "/healthz") == (200, "ok\n")
        finally:
            await server.close()
    assert [r.levelno for r in warnings] == [logging.WARNING]
    message = warnings[0].getMessage()
    assert taken in message and server.address in message and "in use" in message


async def test_a_busy_address_given_explicitly_never_moves(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        with warnings_of_sidecar() as warnings:
            server = await start_status_server(taken, tmp_path / "run", sample)
    assert server is None
    assert not (tmp_path / "run" / ADDR_FILE).exists()
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "the status endpoint is off" in warnings[0].getMessage()


async def test_addr_file_names_a_connectable_address(tmp_path: Path) -> None:
    server = await start_status_server("0.0.0.0:0", tmp_path, sample)
    assert server is not None
    try:
        written = (tmp_path / ADDR_FILE).read_text().strip()
        assert written == server.address and written.startswith("127.0.0.1:")
        assert await get(written, "/healthz") == (200, "ok\n")
        assert names(tmp_path) == [ADDR_FILE]  # no temporary file left
    finally:
        await server.close()
    assert not (tmp_path / ADDR_FILE).exists()


async def test_off_starts_nothing(tmp_path: Path) -> None:
    called: list[int] = []

    def snapshot() -> StatusSnapshot:
        called.append(1)
        return sample()

    assert await start_status_server("off", tmp_path, snapshot) is None
    assert names(tmp_path) == []
    assert called == []


# -- `sidecar status` ----------------------------------------------------------------------------


@dataclass
class Counters:
    """What the test's snapshot serves; the test changes it while `sidecar status` watches.
    Both counters are one value, set and read at once: set one after the other, a snapshot
    taken between the two (the server runs in a thread) showed the new requests beside the old
    bytes, and the test found a byte rate of 0 on a busy machine."""

    counts: tuple[int, int] = (40, 1000)  # (the logs route's requests, stdout's bytes read)

    def snapshot(self) -> StatusSnapshot:
        requests, bytes_read = self.counts
        snap = sample()
        logs = snap.routes[1]._replace(requests=requests)
        stdout = snap.sources[0]._replace(bytes_read=bytes_read)
        return sample(taken_at=time.time(), routes=(snap.routes[0], logs, snap.routes[2]),
                      sources=(stdout, snap.sources[1]))


@contextmanager
def serving(snapshot: Callable[[], StatusSnapshot], run_dir: Path | None) -> Iterator[str]:
    """A status server on its own loop in a thread, for tests that drive a process."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="status-server", daemon=True)
    thread.start()
    server: StatusServer | None = None
    try:
        server = asyncio.run_coroutine_threadsafe(
            start_status_server("127.0.0.1:0", run_dir, snapshot), loop).result(10)
        assert server is not None
        yield server.address
    finally:
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def status_process(args: list[str], env: dict[str, str] | None = None, *, cli: bool = False
                   ) -> subprocess.CompletedProcess[str]:
    command = [*SIDECAR, "status"] if cli else STATUS_COMMAND
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_once_prints_the_table(tmp_path: Path) -> None:
    with serving(Counters().snapshot, None) as address:
        done = status_process(["--once", "--status-addr", address], wide())
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"sidecar run  run {RUN_ID}  node gpu-07  up ")
    assert "ready" in lines[0] and address in lines[0]
    assert lines[1].startswith("lifecycle: starting, running   pending: running")
    assert "hardware sample: 0.12 s" in lines[1]
    routes = next(i for i, line in enumerate(lines) if line.startswith("ROUTE"))
    assert lines[routes].split() == ["ROUTE", "REQUESTS", "REQ/S", "ACCEPTED", "FAILED",
                                     "RETRIES", "DROPPED", "QUEUE", "SPOOL", "LAST", "OK"]
    assert lines[routes + 1].split()[:8] == ["lifecycle", "3", "-", "2", "1", "1", "0", "0"]
    assert lines[routes + 2].split()[:8] == ["logs", "40", "-", "37", "3", "2", "5", "4"]
    assert "64.0 KiB" in lines[routes + 3]
    assert lines[routes + 4] == "lifecycle last error: HTTP 502"
    sources = next(i for i, line in enumerate(lines) if line.startswith("SOURCE"))
    assert lines[sources + 1].split()[:3] == ["stdout", "child", "1000"]
    assert lines[sources + 2].split() == ["/data/run/metrics.jsonl", "jsonl", "2.0", "KiB", "-",
                                          "20", "-", "60", "-", "2", "1"]
    assert "\x1b" not in done.stdout


def wide(columns: int = 200, **extra: str) -> dict[str, str]:
    return {**clean_environ(), "COLUMNS": str(columns), **extra}


def cells(lines: list[str], key: str) -> list[str]:
    """Every cell of the row(s) starting with `key`, across the blocks a narrow table wraps to."""
    return [cell for line in lines if line.startswith(key + " ") for cell in line.split()[1:]]


def busy_sample() -> StatusSnapshot:
    """sample() with the widest rows a day's run has: a long route name, six-figure counts,
    a spool of megabytes, hours since the last success, a TensorBoard source."""
    snap = sample()
    heavy_route = RouteSnapshot("environment/nodes", requests=123_456, accepted=123_400,
                                failures=56, retries=56, queue_depth=1, spool_bytes=123_456_789,
                                last_success=snap.taken_at - 12 * 3600)
    tensorboard = SourceSnapshot("/data/run/tensorboard", "tensorboard", bytes_read=123_456_789,
                                 lines_read=1_234_567, points=9_876_543, invalid=0, skipped=3)
    return sample(routes=(*snap.routes, heavy_route), sources=(*snap.sources, tensorboard))


def tables(lines: list[str]) -> dict[str, list[list[str]]]:
    """Each table's blocks of lines, by the header of its first column."""
    found: dict[str, list[list[str]]] = {}
    for index, line in enumerate(lines):
        if line.startswith(("ROUTE ", "SOURCE ")):
            block = lines[index:]
            found.setdefault(line.split()[0], []).append(block[:block.index("")]
                                                           if "" in block else block)
    return found


def test_once_at_80_columns_keeps_each_table_whole() -> None:
    with serving(busy_sample, None) as address:
        narrow = status_process(["--once", "--status-addr", address], wide(80))
        full = status_process(["--once", "--status-addr", address], wide())
    assert narrow.returncode == 0, narrow.stderr
    lines, full_lines = narrow.stdout.splitlines(), full.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, narrow.stdout
    assert max(len(line) for line in full_lines) > 80  # the narrow one had something to fit
    found = tables(lines)
    assert [len(found["ROUTE"]), len(found["SOURCE"])] == [1, 1], narrow.stdout
    [routes], [sources] = found["ROUTE"], found["SOURCE"]
    assert routes[0].split() == ["ROUTE", "REQS", "REQ/S", "ACKED", "FAILED", "RETRY", "DROP",
                                 "QUEUE", "SPOOL", "LAST", "OK"]
    assert cells(routes, "environment/nodes") == ["123k", "-", "123k", "56", "56", "0", "1",
                                                  "118M", "12h00m"]
    assert cells(routes, "logs") == [*cells(full_lines, "logs")[:7], "0B", "10s"]
    assert sources[0].split() == ["SOURCE", "KIND", "READ", "/S", "LINES", "/S", "POINTS", "/S",
                                  "INVAL", "SKIP"]
    assert cells(sources, "/data/run/tensorboard") == ["tensorboard", "118M", "-", "1.23M", "-",
                                                       "9.88M", "-", "0", "3"]
    assert "lifecycle last error: HTTP 502" in narrow.stdout


def test_once_narrower_than_80_wraps_a_table_and_keeps_every_column() -> None:
    with serving(busy_sample, None) as address:
        narrow = status_process(["--once", "--status-addr", address], wide(60))
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 60, narrow.stdout
    assert len(tables(lines)["ROUTE"]) == 2
    assert cells(lines, "logs") == ["40", "-", "37", "3", "2", "5", "4", "0B", "10s"]
    assert "SKIP" in narrow.stdout and "LAST OK" in narrow.stdout
    jsonl = next(line for line in lines if "metrics.jsonl" in line)
    assert jsonl.startswith("…") and jsonl.split()[0].endswith("metrics.jsonl")


def test_json_is_the_status_document(tmp_path: Path) -> None:
    counters = Counters()
    with serving(counters.snapshot, None) as address:
        done = status_process(["--json", "--status-addr", address])
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert StatusSnapshot.from_json(doc).run_id == RUN_ID
    assert doc["routes"][1]["requests"] == counters.counts[0]
    assert doc["ready"] is True and "version" in doc


def test_status_addr_that_is_not_host_port(tmp_path: Path) -> None:
    done = status_process(["--once", "--status-addr", "foo"], cli=True)
    assert done.returncode == 2
    assert "--status-addr 'foo': expected HOST:PORT" in done.stderr
    assert "Traceback" not in done.stderr and "not known" not in done.stderr


@contextmanager
def refusing() -> Iterator[str]:
    """A loopback address that refuses connections while the test runs: a port bound, never
    listened on, so no other process can take it. Given as the configured --status-addr, it keeps
    `sidecar status` from finding a daemon that happens to run on this machine at the default
    127.0.0.1:9620."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{bound.getsockname()[1]}"


@pytest.fixture
def nowhere() -> Iterator[str]:
    with refusing() as address:
        yield address


def test_two_daemons_and_no_run_id_asks_which(tmp_path: Path, nowhere: str) -> None:
    state = tmp_path / "state"
    env = wide(SIDECAR_STATE_DIR=str(state), SIDECAR_STATUS_ADDR=nowhere)
    other = "run-second"
    with serving(Counters().snapshot, state / RUN_ID) as first, \
            serving(lambda: sample(run_id=other, mode="watch"), state / other) as second:
        both = status_process(["--once"], env, cli=True)
        chosen = status_process(["--once", "--run-id", other], env, cli=True)
        unknown = status_process(["--once", "--run-id", "run-none"], env, cli=True)
    assert both.returncode == 2, both.stderr
    assert both.stdout == ""
    assert "2 daemons answer on this node; say which with --run-id ID" in both.stderr
    assert f"--run-id {RUN_ID}  (run on node gpu-07, --status-addr {first})" in both.stderr
    assert f"--run-id {other}  (watch on node gpu-07, --status-addr {second})" in both.stderr
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.startswith(f"sidecar watch  run {other}  ")
    assert unknown.returncode == 1
    assert "no daemon of run run-none answers" in unknown.stderr and other in unknown.stderr


@pytest.mark.parametrize("variables", [
    {"STARFORGE_RUN_ID": "run-second"},  # a node's shell: the run id alone
    {"TUNEPLANE_JOB_RUN_ID": "run-second", "TUNEPLANE_JOB_ENABLED": "0"},  # offline
])
def test_two_daemons_and_the_platform_s_run_id_pick_its_own(
        tmp_path: Path, nowhere: str, variables: dict[str, str]) -> None:
    """With two daemons on a node, the run the platform's variable names is the one shown,
    `sidecar status` and `sidecar stacks` alike, with no --run-id (they asked for one)."""
    state = tmp_path / "state"
    env = {**wide(SIDECAR_STATE_DIR=str(state), SIDECAR_STATUS_ADDR=nowhere), **variables}
    with serving(Counters().snapshot, state / RUN_ID), \
            serving(lambda: sample(run_id="run-second", mode="watch"), state / "run-second"):
        shown = status_process(["--once"], env, cli=True)
        stacks = subprocess.run([*SIDECAR, "stacks"], env=env, capture_output=True, text=True,
                                timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("sidecar watch  run run-second  ")
    assert "daemons answer on this node" not in stacks.stderr, stacks.stderr


def test_a_stale_address_file_is_not_a_second_daemon(tmp_path: Path, nowhere: str) -> None:
    state = tmp_path / "state"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        (state / "run-old").mkdir(parents=True)
        (state / "run-old" / ADDR_FILE).write_text(f"127.0.0.1:{closed.getsockname()[1]}\n")
    env = wide(SIDECAR_STATE_DIR=str(state), SIDECAR_STATUS_ADDR=nowhere)
    with serving(Counters().snapshot, state / RUN_ID):
        done = status_process(["--once"], env, cli=True)
    assert done.returncode == 0, done.stderr
    assert f"run {RUN_ID}" in done.stdout


@pytest.mark.parametrize("option", ["--once", "--json"])
def test_a_reader_that_left_gets_no_traceback(option: str) -> None:
    """`sidecar status --once | head -1` once head has exited: the write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    with serving(Counters().snapshot, None) as address:
        done = subprocess.run([*SIDECAR, "status", option, "--status-addr", address],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                              check=False, env=wide())
    os.close(write)
    assert done.returncode == 0
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_head_minus_one_in_a_shell() -> None:
    with serving(Counters().snapshot, None) as address:
        done = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {shlex.join(SIDECAR)} status --once "
             f"--status-addr {address} | head -1"],
            capture_output=True, text=True, timeout=60, check=False, env=wide())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("sidecar run  run ")
    assert "Traceback" not in done.stderr


def test_address_found_in_the_state_dir(ingest: RunningIngest, tmp_path: Path,
                                        nowhere: str) -> None:
    state = tmp_path / "state"
    env = {**platform_env(ingest, state), "SIDECAR_STATUS_ADDR": nowhere}
    with serving(Counters().snapshot, state / RUN_ID):
        from_run_dir = status_process(["--once"], env)
        shell = {k: v for k, v in env.items() if not k.startswith("STARFORGE_")}
        from_scan = status_process(["--once"], shell)  # a login shell without the variables
    assert from_run_dir.returncode == 0, from_run_dir.stderr
    assert from_scan.returncode == 0, from_scan.stderr
    assert f"run {RUN_ID}" in from_run_dir.stdout and f"run {RUN_ID}" in from_scan.stdout


def test_nothing_answers(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    done = status_process(["--once", "--status-addr", address])
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"nothing answers at {address} (connection refused)" in done.stderr
    assert "--status-addr" in done.stderr
    assert "Traceback" not in done.stderr


def test_nothing_answers_names_the_state_folder_searched_and_each_address_tried(
        tmp_path: Path) -> None:
    """It said `nothing answers at 127.0.0.1:9620 ... <state-dir>/<run>/status-addr` without
    the folder it searched, so a daemon run with another --state-dir looked like none at all
    (issue 35)."""
    closed_ports = []
    for _ in range(2):
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            closed_ports.append(f"127.0.0.1:{closed.getsockname()[1]}")
    # the configured address, not the default: another sidecar on this machine may hold that
    gone, configured = closed_ports
    state = tmp_path / "state"
    (state / "run-1").mkdir(parents=True)
    (state / "run-1" / "status-addr").write_text(gone + "\n")
    env = {**clean_environ(), "SIDECAR_STATE_DIR": str(state), "SIDECAR_STATUS_ADDR": configured}
    done = status_process(["--once"], env, cli=True)
    assert done.returncode == 1, done.stderr
    said = done.stderr
    assert len(said.strip().splitlines()) == 1, said
    assert f"nothing answers at {gone} (connection refused), the address written in " \
           f"{state / 'run-1' / 'status-addr'}" in said
    assert f"{configured} (connection refused), the configured --status-addr" in said
    assert f"The state folder searched: {state} (from SIDECAR_STATE_DIR)" in said
    assert "the same --state-dir" in said


class Terminal:
    """A process on the slave side of a pseudo-terminal; the test reads its screen output."""

    def __init__(self, command: list[str], rows: int = 40, columns: int = 160) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        # The terminal's own size, not a COLUMNS/LINES the test runner may have set.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        self.proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, env=env)
        os.close(slave)
        self.master = master
        self.output = b""

    # A deadline for a busy machine: the first frame waits on an interpreter that, in a fresh
    # clone, compiles every module it imports, beside other suites on two cores.
    def read_until(self, condition: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not condition(self.text):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"screen not as expected within {timeout} s:\n{self.text}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: the process closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the process closed the terminal:\n{self.text}")
                self.output += chunk
        return self.text

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def frames(self) -> list[str]:
        """Each redraw's text, without escape sequences or carriage returns."""
        parts = self.text.split(HOME)[1:]
        return [ANSI.sub("", part).replace("\r", "") for part in parts]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def logs_requests(frame: str) -> int | None:
    row = next((line for line in frame.splitlines() if line.startswith("logs ")), None)
    return int(row.split()[1]) if row else None


def test_live_table_refreshes_in_place_until_ctrl_c(tmp_path: Path) -> None:
    counters = Counters()
    with serving(counters.snapshot, None) as address:
        terminal = Terminal([*STATUS_COMMAND, "--status-addr", address])
        try:
            terminal.read_until(lambda _: any(logs_requests(f) == 40
                                              for f in terminal.frames()))
            counters.counts = (46, 1000 + 4096)
            terminal.read_until(lambda _: any(logs_requests(f) == 46
                                              for f in terminal.frames()))
            terminal.proc.send_signal(signal.SIGINT)
            # the screen read to its end before the wait: a terminal nobody reads can hold the
            # last frames' writes, and the process with them
            terminal.read_until(lambda text: LEAVE_SCREEN in text)
            assert terminal.proc.wait(60) == 0
        finally:
            terminal.close()
    frames = terminal.frames()
    first = next(f for f in frames if logs_requests(f) == 40)
    changed = next(f for f in frames if logs_requests(f) == 46)
    assert frames.index(first) < frames.index(changed)
    assert f"run {RUN_ID}" in first and "ROUTE" in first and "SOURCE" in first
    row = next(line for line in first.splitlines() if line.startswith("lifecycle "))
    assert row.split()[2] == "-"  # no rate from a single snapshot
    row = next(line for line in changed.splitlines() if line.startswith("logs "))
    assert float(row.split()[2]) > 0  # REQ/S, from the two snapshots
    stdout = next(line for line in changed.splitlines() if line.startswith("stdout "))
    rate = re.search(r" (\d+\.\d|\d+) (B|KiB)/s ", stdout)
    assert rate is not None and float(rate.group(1)) > 0, stdout
    assert terminal.text.startswith("\x1b[?1049h")  # the alternate screen, left at the end
    assert terminal.text.rstrip().endswith(LEAVE_SCREEN.rstrip())


# -- with a real run (once the CLI and the daemon are wired) --------------------------------------


@wired
def test_run_serves_status_and_metrics(ingest: RunningIngest, tmp_path: Path) -> None:
    go = tmp_path / "go"
    child = python_child(
        "import os, time\nprint('hello from the trainer', flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n")
    state = tmp_path / "state"
    env = platform_env(ingest, state, SIDECAR_STATUS_ADDR="127.0.0.1:0")
    run = Sidecar(["run", "--", *child], env, tmp_path / "run")
    try:
        addr_file = state / RUN_ID / ADDR_FILE
        wait_until(addr_file.exists, 20, "the run wrote its status address")
        address = addr_file.read_text().strip()
        ingest.wait_for(lambda: ingest.stats.routes["logs"].accepted >= 1
                        and ingest.stats.routes["lifecycle"].accepted == 2, 20)

        def scraped_equal_received() -> bool:
            found = samples(asyncio.run(get(address, "/metrics"))[1])
            return all(found.get(("sidecar_route_accepted_total", (("route", r),)))
                       == ingest.stats.routes[r].accepted for r in ("logs", "lifecycle"))

        wait_until(scraped_equal_received, 10, "/metrics equals what the ingest received")
        shown = status_process(["--once"], env, cli=True)
        assert shown.returncode == 0, shown.stderr
        assert f"run {RUN_ID}" in shown.stdout and "logs" in shown.stdout
    finally:
        go.touch()
    assert run.wait(30).status == 0



def test_a_malformed_status_addr_variable_is_said_not_ignored(tmp_path: Path) -> None:
    env = wide(SIDECAR_STATE_DIR=str(tmp_path), SIDECAR_STATUS_ADDR="foo")
    done = status_process(["--once"], env, cli=True)
    assert done.returncode == 2
    assert "SIDECAR_STATUS_ADDR" in done.stderr and "HOST:PORT" in done.stderr


def test_a_number_holding_eight_digits_of_the_token_leaves_the_documents_whole() -> None:
    """Every run of 8 characters of the token is masked: masked as text, a count that holds
    `12345678` (the test token's digits) became `***`, and /status no longer parsed (the
    suite's `--once` tests failed after any test that had added the token)."""
    add_secret(TOKEN)
    path = f"/data/{TOKEN}/train.jsonl"

    def leaky() -> StatusSnapshot:
        snap = busy_sample()
        return sample(routes=snap.routes, sources=(*snap.sources, SourceSnapshot(
            path, "jsonl", bytes_read=123_456_789, lines_read=1, points=1, invalid=0, skipped=0)))

    with serving(leaky, None) as address:
        with urllib.request.urlopen(f"http://{address}/status", timeout=30) as answer:
            doc = json.loads(answer.read())
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
            exposition = answer.read().decode()
    assert 123_456_789 in [route["spool_bytes"] for route in doc["routes"]]
    assert TOKEN[:8] not in json.dumps(doc) and "***" in json.dumps(doc)
    assert list(text_string_to_metric_families(exposition))  # every line still parses
    assert TOKEN[:8] not in exposition
