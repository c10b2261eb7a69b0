"""`sidecar lifecycle running` inside a `run --running-when marker` child hands its event here.

The wrapper listens on an abstract Unix socket (no file, no path length limit, invisible outside
the pod's network namespace) whose name it passes to the child as SIDECAR_WRAPPER_SOCKET. The
wrapper persists the event in its own ordered journal before it answers, so the child's
`sidecar lifecycle running` returns only once the event is durable.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable

from sidecar.config import WRAPPER_SOCKET_VARIABLE

ENV_VAR = WRAPPER_SOCKET_VARIABLE
Acceptor = Callable[[str, float], Awaitable["str | None"]]
HANDOFF_TIMEOUT_S = 10.0


def new_address() -> str:
    """A fresh, unguessable socket name, written with `@` for the leading NUL of the abstract
    namespace (an environment variable cannot hold a NUL)."""
    return f"@sidecar-{os.getpid()}-{os.urandom(8).hex()}"


def _socket_path(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


async def serve(address: str, accept: Acceptor) -> asyncio.Server:
    """Listen on `address`; `accept(event, ts)` returns None when taken, else the refusal."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), HANDOFF_TIMEOUT_S))
            refusal = await accept(str(request["event"]), float(request["ts"]))
        except (ValueError, KeyError, TypeError, TimeoutError) as exc:
            refusal = f"malformed hand-off ({exc.__class__.__name__})"
        writer.write(json.dumps({"ok": refusal is None, "error": refusal}).encode() + b"\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path=_socket_path(address))


async def hand_over(address: str, event: str) -> str | None:
    """Give `event` (happening now) to the wrapper; None when it took it, else why not."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(_socket_path(address)), HANDOFF_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        return f"cannot reach the wrapping `sidecar run` at {ENV_VAR}={address} ({exc})"
    writer.write(json.dumps({"event": event, "ts": time.time()}).encode() + b"\n")
    await writer.drain()
    try:
        reply = json.loads(await asyncio.wait_for(reader.readline(), HANDOFF_TIMEOUT_S))
    except (ValueError, TimeoutError) as exc:
        return f"the wrapping `sidecar run` did not answer ({exc.__class__.__name__})"
    finally:
        writer.close()
    return None if reply.get("ok") else str(reply.get("error"))
