"""Run sidecar.commands.receive.IngestServer, its faults armable (tests/faulty_ingest.py), in a
background thread, for sync and async tests alike.

    with running_ingest(tmp_path, token="tok", run_id="run-1", faults=True) as ingest:
        ...  # point the code under test at ingest.base_url
        ingest.wait_for(lambda: len(ingest.records("lifecycle")) >= 3, timeout=10)

The server has its own event loop in its own thread, so a test's loop (or none) never has to
drive it; every accessor runs on the server's loop and is safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sidecar.commands.receive import (
    DEFAULT_PREFIX,
    URL_LIFETIME_S,
    IngestServer,
    IngestStats,
    LocalObjects,
)
from tests.faulty_ingest import Fault, Faults

T = TypeVar("T")
Signer = Callable[[str, str, int], dict[str, Any]]

CALL_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.01


class LoopHandle:
    """Calls into an object that lives on a background event loop, from the test's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _call(self, function: Callable[[], T]) -> T:
        async def call() -> T:
            return function()

        return self._run(call())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CALL_TIMEOUT_S)


class RunningIngest(LoopHandle):
    """Thread-safe handle on an IngestServer running in a background thread."""

    def __init__(self, server: IngestServer, faults: Faults,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._server = server
        self._faults = faults

    @property
    def base_url(self) -> str:
        """The ingest base URL, e.g. http://127.0.0.1:PORT/api/ingest."""
        return self._call(lambda: self._server.base_url)

    def url(self, route: str) -> str:
        """The full URL of one route, e.g. url("environment/nodes")."""
        return f"{self.base_url}/{route}"

    @property
    def objects(self) -> LocalObjects:
        """The server's own object folder (what `sidecar receive` signs URLs for)."""
        return self._server.objects

    def sign_locally(self, run_id: str, name: str, size: int,
                     lifetime_s: float = URL_LIFETIME_S) -> dict[str, Any]:
        """An upload-url answer for the server's own object folder (for a test's signer)."""
        return self._server.objects.sign(self._server.origin, run_id, name, size, lifetime_s)

    @property
    def stats(self) -> IngestStats:
        """A snapshot of the server's counters."""
        return self._call(lambda: copy.deepcopy(self._server.stats))

    def records(self, route: str) -> list[dict[str, Any]]:
        """The bodies the route accepted, in arrival order."""
        return self._call(lambda: self._server.records(route))

    def log_text(self) -> str:
        """Every /logs chunk accepted, joined in arrival order: the text the console shows."""
        return "".join(chunk for body in self.records("logs") for chunk in body["chunks"])

    def log_lines(self) -> list[str]:
        return self.log_text().splitlines()

    def events(self) -> list[str]:
        """The lifecycle events accepted, in arrival order."""
        return [body["event"] for body in self.records("lifecycle")]

    def add_fault(self, fault: Fault) -> None:
        """Arm a fault on the server."""
        self._call(lambda: self._faults.add(fault))

    def clear_faults(self) -> None:
        """Disarm every fault."""
        self._call(self._faults.clear)

    def stop_listening(self) -> None:
        """Close the port and every connection: clients see connection refused."""
        self._run(self._server.stop_listening())

    def start_listening(self) -> None:
        """Listen again on the same port."""
        self._run(self._server.start_listening())

    def wait_for(
        self, condition: Callable[[], bool], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Poll condition until it holds; else AssertionError with the server's counters."""
        wait_until(condition, timeout, what, self._received)

    async def wait_for_async(
        self, condition: Callable[[], bool], timeout: float = 10.0, what: str = ""
    ) -> None:
        """wait_for for a test whose own event loop must keep running while it waits."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(_timeout_message(condition, timeout, what, self._received))
            await asyncio.sleep(_POLL_INTERVAL_S)

    def _received(self) -> str:
        stats = self.stats
        rejected = {route: c.rejected for route, c in stats.routes.items() if c.rejected}
        return (
            f"the ingest received {stats.total_requests} requests: "
            f"{stats.summary() or 'nothing accepted'}; rejected by status: {rejected}"
        )


def wait_until(
    condition: Callable[[], bool],
    timeout: float = 10.0,
    what: str = "",
    details: Callable[[], str] | None = None,
) -> None:
    """Poll condition until it holds, else AssertionError naming what and details()."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(_timeout_message(condition, timeout, what, details))
        time.sleep(_POLL_INTERVAL_S)


def _timeout_message(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    details: Callable[[], str] | None,
) -> str:
    described = what or getattr(condition, "__qualname__", repr(condition))
    message = f"not met within {timeout:g} s: {described}"
    return f"{message}; {details()}" if details is not None else message


@contextmanager
def running_ingest(
    store_dir: Path,
    *,
    token: str | None = None,
    run_id: str | None = None,
    faults: bool = False,
    prefix: str = DEFAULT_PREFIX,
    signer: Signer | None = None,
) -> Iterator[RunningIngest]:
    """An IngestServer listening on an ephemeral loopback port for the block's duration, its
    faults armed through the handle; with `faults`, also over HTTP (faulty_ingest.CONTROL_PATH).
    `signer`: its answers to artifact/upload-url (S3Store.sign; default: its own objects)."""
    with background_loop("ingest-server") as loop:
        layer = Faults(control=faults)
        server = IngestServer(store_dir, token=token, run_id=run_id, hooks=layer, prefix=prefix,
                              signer=signer)
        handle = RunningIngest(server, layer, loop)
        handle._run(server.start())
        try:
            yield handle
        finally:
            handle._run(server.stop())


@contextmanager
def background_loop(name: str) -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in its own thread for the block's duration."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CALL_TIMEOUT_S)
        loop.close()


class S3Store:
    """A real S3 protocol server (moto's server mode) on loopback, with a bucket, and the
    ingest's side of it: `sign` answers artifact/upload-url with a presigned PUT (boto3, SigV4,
    path-style), as the platform does. moto checks neither expiry nor signatures."""

    BUCKET = "ckpt"

    def __init__(self) -> None:
        import boto3
        from botocore.config import Config
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.client = boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
        self.client.create_bucket(Bucket=self.BUCKET)

    def sign(self, run_id: str, name: str, size: int) -> dict[str, Any]:
        key = f"{run_id}/{name}"
        url = self.client.generate_presigned_url(
            "put_object", ExpiresIn=3600, Params={
                "Bucket": self.BUCKET, "Key": key, "ContentType": "application/octet-stream"})
        return {"url": url, "path": f"s3://{self.BUCKET}/{key}", "method": "PUT",
                "headers": {"Content-Type": "application/octet-stream"}}

    def read(self, uri: str) -> bytes:
        """The object at s3://BUCKET/KEY, read back through the S3 API."""
        key = uri.removeprefix(f"s3://{self.BUCKET}/")
        body: bytes = self.client.get_object(Bucket=self.BUCKET, Key=key)["Body"].read()
        return body

    def object_keys(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.BUCKET).get("Contents", [])
        return sorted(str(item["Key"]) for item in listed)

    def stop(self) -> None:
        self._server.stop()
