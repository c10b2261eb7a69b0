"""The floor of issue 8, in a process of its own: the plainest loop that forwards a log file.

    python tests/bench/_floor.py FILE ENDPOINT TOKEN RUN_ID

Reads FILE in 1 MiB blocks, cuts each at its last newline (the rest goes in front of the next
block), decodes it, JSON-encodes it as one chunk with orjson and POSTs it to ENDPOINT/logs with
aiohttp, one request at a time on one kept-alive connection (issue 17's plain loop). Prints
"ready" once its imports and session are set up, then waits for a line on stdin before it starts
(so that the caller can measure the loop alone), and another after it finished (so that its CPU
time can still be read).
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import orjson

BLOCK_BYTES = 1 << 20


async def forward(path: str, endpoint: str, token: str, run_id: str) -> None:
    headers = {"Authorization": f"Bearer {token}", "X-StarForge-Token": token,
               "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        rest = b""
        with open(path, "rb") as f:  # noqa: ASYNC230 (the plain loop: blocking page-cache reads)
            while block := f.read(BLOCK_BYTES):
                data = rest + block
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                await _post(session, endpoint, run_id, data[:cut])
        if rest:
            await _post(session, endpoint, run_id, rest)
        print("done", flush=True)
        await asyncio.to_thread(sys.stdin.readline)


async def _post(session: aiohttp.ClientSession, endpoint: str, run_id: str,
                data: bytes) -> None:
    body = orjson.dumps({"run_id": run_id, "chunks": [data.decode("utf-8", "replace")],
                         "eof": False})
    async with session.post(endpoint + "/logs", data=body) as answer:
        await answer.read()
        answer.raise_for_status()


if __name__ == "__main__":
    asyncio.run(forward(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]))
