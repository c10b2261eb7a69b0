"""`sidecar lifecycle running` inside a `run --running-when marker` child hands its event here.

The wrapper listens on an abstract Unix socket (no file, no path length limit) and passes the
child SIDECAR_WRAPPER_SOCKET=`<name>#<secret>`. The name can be seen by anyone in the pod's
network namespace (/proc/net/unix), the child's environment only by its own user, so only the
wrapped command's processes can give the secret and have an event taken. The event's time is the
wrapper's clock when it arrives, never one the sender claims (a `ts` of 0 was posted as the
billing start). The wrapper persists the event in its own ordered journal before it answers, so
the child's `sidecar lifecycle running` returns only once the event is durable.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable

from sidecar.log import log
from sidecar.supervise import SUPERVISOR

WRAPPER_SOCKET_VARIABLE = "SIDECAR_WRAPPER_SOCKET"  # set by `run` for its child: where to hand off
Acceptor = Callable[[str, float], Awaitable["str | None"]]  # (event, time it arrived)
HANDOFF_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 4096


def new_address() -> str:
    """A fresh socket name and secret, as SIDECAR_WRAPPER_SOCKET holds them: `@` stands for the
    leading NUL of the abstract namespace (an environment variable cannot hold a NUL)."""
    return f"@sidecar-{os.getpid()}-{os.urandom(8).hex()}#{os.urandom(16).hex()}"


def _split(address: str) -> tuple[str, str]:
    """The socket path and the secret of an address."""
    name, _, secret = address.partition("#")
    return ("\0" + name[1:] if name.startswith("@") else name), secret


async def listen(address: str, accept: Acceptor) -> asyncio.Server:
    """Listen on `address`; `accept(event, ts)` returns None when taken, else the refusal. A
    request without the address's secret is refused before `accept` sees it."""
    path, secret = _split(address)

    async def take(reader: asyncio.StreamReader) -> str | None:
        try:
            async with asyncio.timeout(HANDOFF_TIMEOUT_S):
                line = await reader.readline()
            arrived = time.time()
            request = json.loads(line[:MAX_REQUEST_BYTES])
            if not hmac.compare_digest(str(request.get("secret", "")), secret):
                return ("refused: only the wrapped command's own processes may hand over an "
                        "event (the secret in " + WRAPPER_SOCKET_VARIABLE + ")")
            return await accept(str(request["event"]), arrived)
        except (ValueError, KeyError, TypeError, AttributeError, TimeoutError) as exc:
            return f"malformed hand-off ({exc.__class__.__name__})"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """asyncio's callback, which must not raise: asyncio would print the traceback raw."""
        try:
            refusal = await take(reader)
            writer.write(json.dumps({"ok": refusal is None, "error": refusal}).encode() + b"\n")
            await writer.drain()
        except ConnectionError:  # the same line each time: the log's repeat filter holds it
            log.warning("a hand-off client (`sidecar lifecycle` in the command) went away "
                        "before its answer")
        except Exception as exc:  # a bug of ours: this hand-off ends, the wrapper goes on
            SUPERVISOR.failed("handoff", exc)
        finally:
            writer.close()

    return await asyncio.start_unix_server(handle, path=path, limit=MAX_REQUEST_BYTES)


async def hand_over(address: str, event: str) -> str | None:
    """Give `event` (happening now) to the wrapper; None when it took it, else why not."""
    path, secret = _split(address)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path),
                                                HANDOFF_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        return (f"cannot reach the wrapping `sidecar run` at "
                f"{WRAPPER_SOCKET_VARIABLE}={address.partition('#')[0]} ({exc})")
    try:
        writer.write(json.dumps({"event": event, "secret": secret}).encode() + b"\n")
        await writer.drain()
        reply = json.loads(await asyncio.wait_for(reader.readline(), HANDOFF_TIMEOUT_S))
    except (ValueError, TimeoutError, ConnectionError) as exc:
        return f"the wrapping `sidecar run` did not answer ({exc.__class__.__name__})"
    finally:
        writer.close()
    return None if reply.get("ok") else str(reply.get("error"))
