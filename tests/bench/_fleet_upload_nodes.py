"""Nodes of the fleet upload benchmark: COUNT sidecars' real upload code in one process.

    python tests/bench/_fleet_upload_nodes.py FIRST COUNT ENDPOINT START END FILES FILE_BYTES

Each node is what a sidecar uploading checkpoints has: an `IngestClient` (its own keep-alive
connections, its retry policy), the strict `/artifact` sender (`Artifacts`, journaled) and
`Uploads` (staging, `artifact/upload-url`, the PUTs in threads, the ledger), each with its own
run folder, as `Pipeline` makes them. At epoch START every node submits the same step's
checkpoint (`step-1000/`, FILES files of FILE_BYTES each: hard links to one set of files, so a
fleet's checkpoints take one checkpoint's room; under /dev/shm where there is one, so that the
uploads' page-cache drops do not turn each read into a disk read), then waits until epoch END
for it to be uploaded and registered. Prints, as JSON, each node's run id, when its upload was
done and when its registration was acknowledged (epoch seconds; null: not by END), and how late
it was ready for START (0: in time).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sidecar.aio import wait_set
from sidecar.delivery.artifacts import Artifacts
from sidecar.delivery.client import IngestClient
from sidecar.delivery.upload import Checkpoint, Uploads

TOKEN = "sf_fleet_bench_0000000000000000"
STEP = 1000
RATE_BYTES_PER_S = 100_000_000  # --upload-rate's default
# Threads for the blocking steps (staging, the ledger, the PUTs): a sidecar has its own
# default pool (6 threads on 2 cores); this process holds hundreds of nodes.
THREADS = 64


async def node(number: int, endpoint: str, start: float, end: float, template: Path,
               files: list[str], root: Path) -> dict[str, Any]:
    run_id = f"fleet-{number:04d}"
    run_dir = root / run_id / "state"
    run_dir.mkdir(parents=True)
    checkpoint = root / run_id / "ckpt" / f"step-{STEP}"
    checkpoint.mkdir(parents=True)
    for rel in files:
        os.link(template / rel, checkpoint / rel)
    client = IngestClient(endpoint, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    artifacts = Artifacts(run_dir, run_id, client)
    artifacts.start()
    await artifacts.opened.wait()
    uploads = Uploads(run_dir, run_id, client, artifacts.register, artifacts.known,
                      RATE_BYTES_PER_S)
    uploads.start()
    await uploads.opened.wait()
    size = sum((template / rel).stat().st_size for rel in files)
    uploaded_at = registered_at = None
    try:
        late = time.time() - start  # > 0: made after the instant every node was to save
        await asyncio.sleep(max(-late, 0))
        uploads.submit(Checkpoint(str(checkpoint), f"{size}-{STEP}", f"step-{STEP}",
                                  tuple(files), {"kind": "checkpoint", "format": "distcp",
                                                 "size_bytes": size, "step": STEP}))
        # as a running sidecar waits (a drain would be a stop's: no start spread)
        if await wait_set(uploads.idle, max(end - time.time(), 0.1)) and uploads.refused == 0:
            uploaded_at = time.time()
            if await artifacts.drain(max(end - time.time(), 0.1)) and artifacts.delivered:
                registered_at = time.time()
        return {"run_id": run_id, "late_s": max(late, 0.0), "uploaded_at": uploaded_at,
                "registered_at": registered_at,
                "refused": uploads.refused, "files_uploaded": uploads.files_uploaded}
    finally:
        await uploads.close()
        await artifacts.close()
        await client.close()


def scratch() -> str | None:
    """/dev/shm where there is one to write to; else the default temporary folder."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


async def main(first: int, count: int, endpoint: str, start: float, end: float, files: int,
               file_bytes: int, where: str | None) -> None:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(THREADS))
    with tempfile.TemporaryDirectory(prefix="fleet-upload-", dir=where) as tmp:
        template = Path(tmp) / "template"
        template.mkdir()
        names = [f"__{i}_0.distcp" for i in range(files - 1)] + [".metadata"]
        for i, rel in enumerate(names):
            (template / rel).write_bytes(bytes([i]) * file_bytes)
        results = await asyncio.gather(*(node(n, endpoint, start, end, template, names,
                                              Path(tmp)) for n in range(first, first + count)))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]),
                     float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), scratch()))
