"""`sidecar inject` under the API server's load: reviews of a JobSet's pod posted at a fixed rate
over kept-alive HTTPS connections, as the API server sends them, each answer's latency measured
from its send; the target is p99 under 50 ms at 200 reviews a second.

    python tests/bench/bench_inject.py [--rate 200] [--seconds 10] [--connections 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _harness import REPO, SIDECAR, Row, limit_row, print_table

sys.path.insert(0, str(REPO))
from tests.test_check import self_signed_certificate
from tests.test_inject import JOBSET_POD, review

P99_TARGET_MS = 50.0


async def load(url: str, context: ssl.SSLContext, rate: float, seconds: float,
               connections: int) -> tuple[list[float], int]:
    """Latencies (ms) of the answers, and how many failed."""
    latencies: list[float] = []
    failed = 0
    body = json.dumps(review(JOBSET_POD)).encode()
    connector = aiohttp.TCPConnector(ssl=context, limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> None:
            nonlocal failed
            began = time.perf_counter()
            try:
                async with session.post(url + "/mutate", data=body, headers={
                        "Content-Type": "application/json"}) as answer:
                    doc = await answer.json()
                    if answer.status != 200 or "patch" not in doc["response"]:
                        failed += 1
                        return
            except aiohttp.ClientError:
                failed += 1
                return
            latencies.append((time.perf_counter() - began) * 1000)

        tasks = []
        start = time.perf_counter()
        for n in range(int(rate * seconds)):
            await asyncio.sleep(max(start + n / rate - time.perf_counter(), 0))
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    return latencies, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 s")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        cert, key = self_signed_certificate(work)
        ready = work / "url"
        server = subprocess.Popen(
            [*SIDECAR, "inject", "--listen", "127.0.0.1:0", "--tls-cert", str(cert),
             "--tls-key", str(key), "--ready-file", str(ready)], cwd=work,
            stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not (ready.exists() and ready.read_text().endswith("\n")):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the webhook did not start")
                time.sleep(0.05)
            context = ssl.create_default_context(cafile=str(cert))
            latencies, failed = asyncio.run(load(ready.read_text().strip(), context,
                                                 args.rate, seconds, args.connections))
        finally:
            server.terminate()
            server.wait(20)
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1] if latencies else float("inf")
    rows = [
        Row("inject", f"p50 at {args.rate:g} reviews/s", statistics.median(latencies), "ms"),
        limit_row("inject", f"p99 at {args.rate:g} reviews/s", p99, "ms", "<", P99_TARGET_MS),
        limit_row("inject", "reviews not answered with a patch", failed, "", "<=", 0),
    ]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([row.__dict__ for row in rows]))
    return 0 if all(row.passed is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
