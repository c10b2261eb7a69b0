"""`sidecar inject`: the admission webhook that adds the sidecar to a training operator's pods
(docs/webhook.md).

An HTTPS server for the API server's `AdmissionReview` (admission.k8s.io/v1) at `POST /mutate`
and a probe at `GET /healthz`. It answers every review, allowed, with the request's uid: what it
adds, and why a pod was left alone, are inject.py's. It needs no access to the Kubernetes API and
writes nothing. The certificate and key are read again when their files change (cert-manager
renews them in place), and the old pair is kept when the new one cannot be loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import time
from pathlib import Path

from aiohttp import web

from sidecar.exits import ConfigError
from sidecar.inject import MAX_REVIEW_BYTES, Selector, answer
from sidecar.log import log, setup
from sidecar.observe.address import parse_host_port

CERT_CHECK_S = 10.0  # how often the certificate's files are looked at
# a review's body that takes longer is not waited for: the API server's timeout is about as
# long, and the pod is admitted without the sidecar then anyway
READ_LIMIT_S = 5.0


class Certificate:
    """The server's TLS context, loaded again when the certificate or key file changes."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._seen = self._stamp()
        try:
            self.context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--tls-cert {cert} / --tls-key {key}: cannot be loaded ({exc}); "
                              "give the PEM certificate for the webhook Service's DNS name and "
                              "its key (docs/webhook.md#install-it)") from None

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in (self.cert, self.key):
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_ino))
            except OSError:
                stamps.append((0, 0))
        return tuple(stamps)

    def reload_if_changed(self) -> None:
        """New handshakes use the files' new pair; on a failure the old one stays, said."""
        stamp = self._stamp()
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            self.context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            log.error("the renewed certificate %s cannot be loaded (%s): the previous one is "
                      "still served", self.cert, exc)
            return
        log.info("certificate %s loaded again: it changed", self.cert)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(CERT_CHECK_S)
            self.reload_if_changed()


async def _body(request: web.Request) -> bytes:
    """The review's body, or all of it to MAX_REVIEW_BYTES + 1 (then it is not read)."""
    chunks, size = [], 0
    while size <= MAX_REVIEW_BYTES:
        chunk = await request.content.read(MAX_REVIEW_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def make_app(image: str, selectors: tuple[Selector, ...] = ()) -> web.Application:
    """The webhook's routes: /mutate, and /mutate/restricted for the namespaces that enforce
    Pod Security's baseline or restricted level (the webhook configuration routes them)."""
    async def mutate(request: web.Request) -> web.Response:
        began = time.monotonic()
        try:
            body = await asyncio.wait_for(_body(request), READ_LIMIT_S)
        except (TimeoutError, ConnectionError) as exc:
            body = b""
            log.warning("a review's body was not read (%s): admitted unchanged",
                        exc.__class__.__name__)
        result = answer(body, image, restricted=request.path.endswith("/restricted"),
                        selectors=selectors)
        if result.patch:
            log.info("review %s: the sidecar added (%d operations) in %.1f ms", result.uid,
                     len(result.patch), (time.monotonic() - began) * 1000)
        for warning in result.warnings:
            log.warning("review %s: %s", result.uid or "(no uid)", warning)
        return web.json_response(result.review())

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_REVIEW_BYTES + 1)
    app.router.add_post("/mutate", mutate)
    app.router.add_post("/mutate/restricted", mutate)
    app.router.add_get("/healthz", healthz)
    return app


async def serve_webhook(listen: str, certificate: Certificate, image: str,
                        ready_file: Path | None = None,
                        selectors: tuple[Selector, ...] = ()) -> None:
    """Serve until SIGTERM or SIGINT."""
    host, port = parse_host_port(listen, "--listen")
    runner = web.AppRunner(make_app(image, selectors), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=certificate.context,
                       shutdown_timeout=2.0)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"--listen {listen}: cannot listen there ({exc.strerror or exc})"
                          ) from None
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    url = f"https://{host}:{bound}"
    log.info("admission webhook on %s/mutate, injecting image %s", url, image)
    if ready_file is not None:
        await asyncio.to_thread(ready_file.write_text, url + "\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    watcher = asyncio.ensure_future(certificate.watch())
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    """`sidecar inject`."""
    setup()
    if args.tls_cert is None or args.tls_key is None:
        raise ConfigError("--tls-cert and --tls-key are required: the API server calls a "
                          "webhook over HTTPS alone (docs/webhook.md#install-it)")
    certificate = Certificate(args.tls_cert, args.tls_key)
    selectors = tuple(Selector.named(text) for text in args.select)
    if any(not s.label for s in selectors):
        raise ConfigError("--select takes a label or annotation, KEY or KEY=VALUE: "
                          f"{args.select!r} has an empty key")
    asyncio.run(serve_webhook(args.listen, certificate, args.image, args.ready_file, selectors))
    return 0
