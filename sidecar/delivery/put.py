"""One file sent to a signed URL: streamed from its descriptor in chunks, never whole in
memory, under a bandwidth cap shared by every upload, each chunk dropped from the page cache once
sent so that the trainer's hot pages stay where they are (docs/checkpoints.md#uploads).

Blocking, on purpose: `put_file` runs in a thread of its own (delivery/upload.py), where a slow
object store holds that thread and never the event loop. It checks `stop` between chunks, so a
shutdown ends it within one chunk's time.
"""

from __future__ import annotations

import os
import re
import ssl
import threading
import time
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import http.client

CHUNK_BYTES = 256 << 10  # one read, one send, one rate check: s3transfer's step too
BURST_S = 0.25  # the cap lets this much of a second's allowance go at once
MAX_ANSWER_BYTES = 64 << 10
USER_AGENT = "sidecar-upload"
# What an object store says of a URL whose time ran out: S3's 403 "Request has expired", GCS's
# 400 ExpiredToken, Azure's 403 "Signed expiry time ... must be after".
_EXPIRED = re.compile(rb"expired|ExpiredToken|Signed expiry time|not valid in the specified time",
                      re.IGNORECASE)
_XML_FIELD = re.compile(rb"<(Code|Message)>([^<]{0,200})</\1>")


class Stopped(Exception):
    """The upload was told to stop (a shutdown) before the file was sent."""


class RateLimit:
    """A cap in bytes a second shared by threads: each `take` waits its turn; 0 is no cap."""

    def __init__(self, bytes_per_s: int) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time from which the next bytes may go

    def take(self, size: int, stop: threading.Event) -> None:
        if self.bytes_per_s <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now - BURST_S)
            self._free_at = start + size / self.bytes_per_s
        if start > now and stop.wait(start - now):
            raise Stopped


class SignedUrl(NamedTuple):
    """Where one file goes, as the ingest answered `artifact/upload-url`."""

    url: str
    method: str
    headers: dict[str, str]


class PutAnswer(NamedTuple):
    """What the object store answered one PUT (status 0: no answer, `reason` says why)."""

    status: int
    etag: str
    reason: str
    retry_after: str | None = None  # the answer's Retry-After header, as it came

    @property
    def throttled(self) -> bool:
        """The store asks us to slow down (S3's 503 SlowDown, GCS's 429): retried, never a
        refusal."""
        return self.status in (429, 503)

    @property
    def stored(self) -> bool:
        return 200 <= self.status < 300

    @property
    def expired(self) -> bool:
        """The URL's time ran out: ask the ingest for another. A 403 says so whatever its body
        (the stores word it each their own way); a 400 or 401 when its body says it."""
        return self.status == 403 or (
            self.status in (400, 401) and bool(_EXPIRED.search(self.reason.encode())))

    @property
    def redirected(self) -> bool:
        """A redirect: never followed (the URL is the credential), and it stores nothing."""
        return 300 <= self.status < 400


def store_reason(body: bytes) -> str:
    """An object store's error body in one short line: S3's and GCS's `Code: Message`."""
    fields = dict(_XML_FIELD.findall(body))
    if fields:
        return ": ".join(f.decode("utf-8", "replace") for f in
                         (fields.get(b"Code", b""), fields.get(b"Message", b"")) if f)
    return body[:200].decode("utf-8", "replace").strip()


def put_file(target: SignedUrl, fd: int, size: int, limit: RateLimit, stop: threading.Event,
             timeout_s: float, sent: list[int],
             ssl_context: ssl.SSLContext | None = None) -> PutAnswer:
    """Send the `size` bytes of the file open at `fd` (from its start) to `target`; `sent[0]`
    grows by what went (progress, read from the loop). A network failure is a PutAnswer with
    status 0. Raises Stopped when `stop` was set."""
    # only when a checkpoint is uploaded: http.client brings the email package, and random
    import http.client

    parts = urlsplit(target.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return PutAnswer(0, "", f"the ingest answered a URL that is not http(s): {parts.scheme}")
    port = parts.port
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout_s,
                                           context=ssl_context or ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout_s)
    try:
        # The URL's path and query go as they were signed: never re-encoded.
        conn.putrequest(target.method, parts.path + (f"?{parts.query}" if parts.query else ""),
                        skip_accept_encoding=True)
        headers = {"Content-Type": "application/octet-stream", "User-Agent": USER_AGENT,
                   **target.headers, "Content-Length": str(size)}
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        _send_body(conn, fd, size, limit, stop, sent)
        reply = conn.getresponse()
        body = reply.read(MAX_ANSWER_BYTES)
        etag = reply.getheader("ETag", "") or ""
        return PutAnswer(reply.status, etag.strip('"'),
                         "" if 200 <= reply.status < 300 else store_reason(body),
                         reply.getheader("Retry-After"))
    except (OSError, http.client.HTTPException) as exc:
        return PutAnswer(0, "", f"{exc.__class__.__name__}: {exc}")
    finally:
        conn.close()


def _send_body(conn: http.client.HTTPConnection, fd: int, size: int, limit: RateLimit,
               stop: threading.Event, sent: list[int]) -> None:
    offset = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    while offset < size:
        if stop.is_set():
            raise Stopped
        want = min(CHUNK_BYTES, size - offset)
        limit.take(want, stop)
        got = os.preadv(fd, [view[:want]], offset)
        if got <= 0:
            raise OSError(f"the file ended at {offset} of {size} bytes (it was cut short)")
        conn.send(view[:got])
        # Read once, sent once: the pages are of no more use to us and would push the
        # trainer's out (only clean, whole pages are dropped).
        os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
        offset += got
        sent[0] += got
