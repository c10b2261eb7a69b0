"""Nodes of the fleet benchmark: COUNT sidecars' real delivery code in one process.

    python tests/bench/_fleet_nodes.py FIRST COUNT ENDPOINT START GENERATE_S INTERVAL_S END

Each node is an `IngestClient` (its own keep-alive connections) and a /metrics `Batcher`, as a
sidecar has: its retry policy, its pacing, its queue. From epoch START (at a random phase) to
START + GENERATE_S every node puts one point each INTERVAL_S (key `nNNNN`, the step its
sequence, the value its time), whatever the ingest does; then it waits for its queue to be
acknowledged until epoch END. Prints, as JSON, each node's points put and left unacknowledged.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sidecar.delivery.batcher import Batcher
from sidecar.delivery.client import IngestClient

TOKEN = "sf_fleet_bench_0000000000000000"


async def node(number: int, endpoint: str, start: float, generate_s: float, interval_s: float,
               end: float, run_dir: Path) -> dict[str, Any]:
    client = IngestClient(endpoint, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    batcher = Batcher(client, "metrics", lambda points: {"run_id": f"fleet-{number}",
                                                         "points": points}, run_dir)
    batcher.start()
    key = f"n{number:04d}"
    step = 0
    first = start + random.uniform(0, interval_s)
    try:
        while True:
            due = first + step * interval_s
            if due >= start + generate_s:
                break
            await asyncio.sleep(max(due - time.time(), 0))
            now = time.time()
            await batcher.put([{"key": key, "step": step, "value": now,
                                "ts": time.strftime("%Y-%m-%dT%H:%M:%S+00:00",
                                                    time.gmtime(now))}])
            step += 1
        await batcher.flush(max(end - time.time(), 0.1))
        return {"key": key, "put": step, "unacknowledged": batcher.queued}
    finally:
        await batcher.stop()
        await client.close()


async def main(first: int, count: int, endpoint: str, start: float, generate_s: float,
               interval_s: float, end: float) -> None:
    with tempfile.TemporaryDirectory(prefix="fleet-nodes-") as tmp:
        results = await asyncio.gather(*(node(n, endpoint, start, generate_s, interval_s, end,
                                              Path(tmp)) for n in range(first, first + count)))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]),
                     float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])))
