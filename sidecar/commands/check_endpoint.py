"""`sidecar check`'s steps towards the ingest: DNS, where the address leads (a loopback endpoint
inside a pod is the pod itself, the most common cause of empty charts), TCP, TLS, and an
authenticated harmless request, an empty `/logs` batch posted by the running sidecar's own
client, so that the headers are exactly its own. A failure names the likely cause and the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sidecar.commands.check_report import CheckReport
from sidecar.config import FAMILIES, Config, Family
from sidecar.delivery.client import Answer, Verdict
from sidecar.exits import EXIT_FAILED, EXIT_OK
from sidecar.log import log

# Files a container runtime leaves in the root of a container (Docker, Podman).
CONTAINER_MARKERS: tuple[tuple[Path, str], ...] = (
    (Path("/.dockerenv"), "/.dockerenv exists (a Docker container)"),
    (Path("/run/.containerenv"), "/run/.containerenv exists (a Podman container)"),
)
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                   "all_proxy")
# OpenSSL verify codes (x509_vfy.h) that mean "signed by a CA this node does not trust".
_UNTRUSTED_CODES = frozenset({2, 18, 19, 20, 21})
_EXPIRED_CODES = frozenset({9, 10})
_HOSTNAME_MISMATCH_CODE = 62
_LOCAL_MEANING = {
    "loopback": "{address} inside a {place} is the {place} itself",
    "link-local": "a link-local address like {address} never leaves the {place}'s own network "
                  "link (169.254.169.254 is a cloud's metadata service, not the platform)",
    "unspecified": "{address} is no destination, it stands for this {place} itself",
}
_NETWORK_STEPS = frozenset({"dns", "tcp", "tls", "probe"})  # where a proxy may be the cause


@dataclass(frozen=True)
class Endpoint:
    """The endpoint as the steps need it, and the names of the variables behind it."""

    url: str
    scheme: str
    host: str
    port: int
    family: Family | None

    @classmethod
    def of(cls, cfg: Config, environ: Mapping[str, str]) -> Endpoint:
        parts = urlsplit(cfg.platform.endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(cfg.platform.endpoint, parts.scheme, parts.hostname or "", port,
                   family_of(environ))

    def var(self, which: str) -> str:
        """The variable name of `which` (endpoint, run_id, token) in the family in use."""
        return getattr(self.family, which) if self.family else which.upper()


async def check_endpoint(cfg: Config, environ: Mapping[str, str], report: CheckReport,
                          timeout_s: float) -> int:
    target = Endpoint.of(cfg, environ)
    _proxy_note(environ, report, failed=False)
    addresses = await _dns(target, report, timeout_s)
    if addresses:
        in_container = _placement(target, addresses, environ, report)
        connected = await _tcp(target, addresses, report, timeout_s)
        if in_container:
            _container_loopback(in_container, connected, report)
        if connected and await _tls(cfg, target, connected, report, timeout_s):
            if cfg.token and cfg.platform.run_id:
                await _probe(cfg, target, report, timeout_s)
            else:
                report.add("probe", "skip", "no authenticated request without the run id and "
                           "the token (see configuration above)")
    if any(s.status == "fail" and s.name in _NETWORK_STEPS for s in report.steps):
        _proxy_note(environ, report, failed=True)
    return EXIT_FAILED if report.failed else EXIT_OK


async def _dns(target: Endpoint, report: CheckReport, timeout_s: float) -> list[str]:
    if _ip(target.host) is not None:
        report.add("dns", "ok", f"{target.host} is an address, nothing to resolve",
                   addresses=[target.host])
        return [target.host]
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM), timeout_s)
    except TimeoutError:
        report.add("dns", "fail", f"{target.host}: no answer from the resolver within "
                   f"{timeout_s:g} s: this node's DNS servers (/etc/resolv.conf) cannot be "
                   "reached")
        return []
    except socket.gaierror as exc:
        report.add("dns", "fail", _dns_failure(target, exc), error=exc.strerror)
        return []
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    report.add("dns", "ok", f"{target.host} resolves to {', '.join(addresses)}",
               addresses=addresses)
    return addresses


def _dns_failure(target: Endpoint, exc: socket.gaierror) -> str:
    if exc.errno == socket.EAI_AGAIN:
        return (f"{target.host} cannot be resolved now ({exc.strerror}): this node's DNS servers "
                "did not answer; check /etc/resolv.conf and the network")
    return (f"{target.host} does not resolve ({exc.strerror}): check the host in "
            f"{target.var('endpoint')}; from a pod, a name inside the cluster needs its "
            "namespace (NAME.NAMESPACE.svc) and a name outside it needs DNS that reaches out")


def _placement(target: Endpoint, addresses: Sequence[str], environ: Mapping[str, str],
               report: CheckReport) -> tuple[str, str, str] | None:
    """Diagnose an endpoint that cannot be the platform as seen from a GPU node in a pod. In a
    plain container, where the TCP step settles it, (where, evidence, warning) for
    `_container_loopback`, the step not yet said."""
    kinds = [_local_kind(a) for a in addresses]
    if not all(kinds):
        report.add("address", "ok", f"{addresses[0]} is neither loopback nor link-local")
        return None
    pod, container = container_evidence(environ)
    address = addresses[0]
    where = (f"{address} is a {kinds[0]} address" if target.host == address
             else f"{target.host} is {address}, a {kinds[0]} address")
    if pod is None and container is None:
        report.add("address", "ok", f"{where}: this machine; right for a receiver on this "
                   "machine, but no GPU node of a cluster reaches the platform there")
        return None
    place = "pod" if pod is not None else "container"
    message = (f"{where} and {pod or container}: the ingest URL must be reachable from the GPU "
               f"node, {_LOCAL_MEANING[kinds[0]].format(address=address, place=place)}; set "
               f"{target.var('endpoint')} to the platform's address (its external URL or a "
               "cluster Service name)")
    if pod is not None:
        report.add("address", "fail", message, evidence=pod)
        return None
    assert container is not None
    return where, container, message


def _container_loopback(found: tuple[str, str, str], connected: str | None,
                        report: CheckReport) -> None:
    """A loopback endpoint in a plain container: something listening there is in this
    container's own network (it shares the host's, or runs the receiver itself, as a try-out
    against `sidecar receive` does), which is what the user meant; nothing listening, the
    endpoint may be meant for the host or the platform, and that is worth a warning."""
    where, container, message = found
    if connected:
        report.add("address", "ok", f"{where} and {container}, and {connected} takes "
                   "connections: a receiver in this container's own network (it shares the "
                   "host's, or runs the receiver itself)", evidence=container)
        return
    report.add("address", "warn", message + ", unless this container shares the host's network "
               "or runs the receiver itself", evidence=container)


def _local_kind(address: str) -> str:
    """"loopback", "link-local" or "unspecified" for an address that never leaves the node."""
    ip = _ip(address.split("%")[0])
    if ip is None:
        return ""
    for kind in ("loopback", "link_local", "unspecified"):
        if getattr(ip, "is_" + kind):
            return kind.replace("_", "-")
    return ""


def container_evidence(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """Why this process is in a Kubernetes pod, and why in a container, each None if not."""
    pod = None
    if environ.get("KUBERNETES_SERVICE_HOST"):
        pod = "KUBERNETES_SERVICE_HOST is set (a Kubernetes pod)"
    container = next((why for path, why in CONTAINER_MARKERS if path.exists()), None)
    return pod, container


async def _tcp(target: Endpoint, addresses: Sequence[str], report: CheckReport,
               timeout_s: float) -> str | None:
    """The first address that takes a TCP connection, or None."""
    failures: list[str] = []
    for address in addresses:
        shown = _host_port(address, target.port)
        started = time.monotonic()
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(address, target.port), timeout_s)
        except TimeoutError:
            failures.append(f"no answer from {shown} within {timeout_s:g} s: a firewall or "
                            "network policy drops the packets, or the address is not routable "
                            "from this node")
        except ConnectionRefusedError:
            failures.append(f"{shown} refused the connection: nothing listens there (the ingest "
                            f"is down, or the port in {target.var('endpoint')} is wrong)")
        except OSError as exc:
            failures.append(f"cannot connect to {shown} ({exc.strerror or exc}): this node has "
                            "no route to it")
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            took_ms = (time.monotonic() - started) * 1000
            report.add("tcp", "ok", f"connected to {shown} in {took_ms:.0f} ms", address=address)
            return address
    report.add("tcp", "fail", "; ".join(failures), addresses=list(addresses))
    return None


async def _tls(cfg: Config, target: Endpoint, address: str, report: CheckReport,
               timeout_s: float) -> bool:
    if target.scheme != "https":
        local = _local_kind(address)
        report.add("tls", "skip" if local else "warn", "plain http: no TLS"
                   + ("" if local else ", the token crosses the network unencrypted; use "
                      "https if the platform offers it"))
        return True
    try:
        context = ssl.create_default_context()
        if cfg.ca_file is not None:
            context.load_verify_locations(cafile=str(cfg.ca_file))
    except (OSError, ssl.SSLError) as exc:
        report.add("tls", "fail", f"--ca-file {cfg.ca_file} cannot be loaded as a PEM CA bundle "
                   f"({getattr(exc, 'strerror', None) or exc})")
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(
            address, target.port, ssl=context, server_hostname=target.host), timeout_s)
    except ssl.SSLCertVerificationError as exc:
        report.add("tls", "fail", _untrusted(cfg, target, exc), verify_code=exc.verify_code,
                   verify_message=exc.verify_message)
        return False
    except ssl.SSLError as exc:
        report.add("tls", "fail", f"the TLS handshake with {target.host} failed "
                   f"({exc.reason or exc}): is this port serving plain HTTP? then the endpoint "
                   "should start with http://")
        return False
    except (TimeoutError, OSError) as exc:
        report.add("tls", "fail", f"the TLS handshake with {target.host} did not finish "
                   f"({exc.__class__.__name__}): something on the way drops or blocks TLS")
        return False
    report.add("tls", "ok", _describe_tls(writer.get_extra_info("ssl_object")))
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()
    return True


def _untrusted(cfg: Config, target: Endpoint, exc: ssl.SSLCertVerificationError) -> str:
    why = exc.verify_message or str(exc)
    if exc.verify_code in _UNTRUSTED_CODES:
        if cfg.ca_file is not None:
            return (f"{target.host}'s certificate is not trusted ({why}), and --ca-file "
                    f"{cfg.ca_file} does not hold the authority that signed it: ask the "
                    "platform's operators for its CA bundle")
        return (f"{target.host}'s certificate is not trusted here ({why}): the endpoint uses a "
                "self-signed or private certificate authority; pass its CA bundle with "
                "--ca-file PATH (or SIDECAR_CA_FILE)")
    if exc.verify_code in _EXPIRED_CODES:
        return (f"{target.host}'s certificate is outside its validity ({why}): the platform "
                "must renew it (or this node's clock is wrong); --ca-file cannot fix this")
    if exc.verify_code == _HOSTNAME_MISMATCH_CODE:
        return (f"{target.host}'s certificate is for another name ({why}): use a host name "
                f"the certificate names in {target.var('endpoint')}")
    return f"{target.host}'s certificate was refused ({why})"


def _describe_tls(tls: ssl.SSLObject | None) -> str:
    if tls is None:
        return "handshake done"
    cert = tls.getpeercert() or {}
    subject = _cert_name(cert.get("subject", ()))
    issuer = _cert_name(cert.get("issuer", ()))
    until = cert.get("notAfter", "?")
    return f"{tls.version()}, certificate for {subject} from {issuer}, valid until {until}"


def _cert_name(name: Any) -> str:
    fields = {key: value for rdn in name for key, value in rdn}
    return str(fields.get("commonName") or fields.get("organizationName") or "?")


async def _probe(cfg: Config, target: Endpoint, report: CheckReport, timeout_s: float) -> None:
    from sidecar.runtime import make_client  # the running sidecar's own client: its exact headers

    client = make_client(cfg)
    assert client is not None  # reporting is on
    body = json.dumps({"run_id": cfg.platform.run_id, "chunks": [], "eof": False}).encode()
    # the step explains the answer; the daemon's ERROR would not, and its client says a
    # failure as late as its close, before the report is printed
    with _quiet_client_log():
        try:
            await client.start()
            answer = await asyncio.wait_for(client.post("logs", body), timeout_s)
        except TimeoutError:
            report.add("probe", "fail", f"POST {target.url}/logs: no answer within "
                       f"{timeout_s:g} s: the ingest took the connection but did not respond")
            return
        except (OSError, ssl.SSLError) as exc:
            report.add("probe", "fail", f"the ingest client could not start ({exc})")
            return
        finally:
            await client.close()
    status = "ok" if answer.ok else "fail"
    report.add("probe", status, _explain(answer, cfg, target), http_status=answer.status,
               verdict=answer.verdict.value, **({"reason": answer.reason} if answer.reason else {}))


@contextlib.contextmanager
def _quiet_client_log() -> Iterator[None]:
    disabled = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = disabled


def _explain(answer: Answer, cfg: Config, target: Endpoint) -> str:
    """What the ingest's answer to the probe means, and what to do about it."""
    http = f"HTTP {answer.status}" if answer.status is not None else "no answer"
    run = f"{target.var('run_id')}={cfg.platform.run_id}"
    verdict = answer.verdict
    if verdict is Verdict.ACCEPTED:
        return (f"{http}: the ingest accepted an empty /logs batch for run "
                f"{cfg.platform.run_id}; this node can report")
    if verdict is Verdict.AUTH:
        source = (f"check that the Secret mounted at --token-file {cfg.token_file} is this run's"
                  if cfg.token_file else f"{cfg.platform.token_variable} must be the token "
                  "issued with this run id")
        said = f" (the ingest said: {answer.reason})" if answer.reason else ""
        return (f"{http}{said}: the ingest rejected the token: it expired (tokens last 30 "
                f"days), was revoked, or belongs to another run than {run}; {source}")
    if verdict is Verdict.REDIRECT:
        return (f"{http}: {answer.detail}; a proxy, a login page or a load balancer answered "
                f"instead of the ingest, or the URL is wrong (http where https is needed?): "
                f"{target.var('endpoint')} must be the ingest's own URL")
    if answer.status in (404, 405):
        if target.url.endswith("/api/ingest"):
            return (f"{http}: nothing takes POST {target.url}/logs although the path is right: "
                    "another service answers at this address")
        return (f"{http}: nothing at {target.url}/logs: {target.var('endpoint')} must be the "
                "base URL ending in /api/ingest")
    if verdict is Verdict.REJECTED and answer.reason:
        return (f"{http}: the ingest refused the probe, saying: {answer.reason} (for "
                f"{run}; the run id and token must be the ones the platform issued together)")
    if verdict is Verdict.REJECTED:
        return (f"{http}: the ingest refused the probe; it may not know the run ({run}), or it "
                "speaks another version of the API")
    if verdict is Verdict.TOO_LARGE:
        return f"{http} for an empty batch: a proxy in front of the ingest limits request size"
    if answer.status in (429, 503):
        wait = f" (Retry-After {answer.retry_after_s:g} s)" if answer.retry_after_s else ""
        return (f"{http}: the ingest is overloaded{wait}; the daemon would wait and retry, try "
                "again later")
    if answer.status is not None:
        return (f"{http}: the ingest failed: a load balancer without a healthy backend, or the "
                "platform is down; the daemon retries with backoff")
    return f"{http} from {target.url}/logs: {answer.detail}"


def _proxy_note(environ: Mapping[str, str], report: CheckReport, *, failed: bool) -> None:
    """The sidecar never uses a proxy (one would see the token): say so when one is set, and
    that it may be why a network step `failed`."""
    found = [(name, environ[name]) for name in PROXY_VARIABLES if environ.get(name)]
    if not found:
        return
    shown = ", ".join(f"{name}={_mask_credentials(value)}" for name, value in found)
    names = [name for name, _ in found]
    if failed:
        report.add("proxy", "warn", f"{shown} set, but the sidecar connects to the ingest "
                   "directly, never through a proxy: if this node reaches the platform only "
                   "through that proxy, the GPU nodes need a direct route to the ingest",
                   variables=names)
    else:
        report.add("proxy", "ok", f"{shown} set and bypassed: the sidecar reaches the ingest "
                   "directly, never through a proxy (one would see the token)", variables=names)


def _mask_credentials(url: str) -> str:
    """A proxy URL with any user:password replaced by ***."""
    scheme, sep, rest = url.rpartition("://")
    authority, slash, path = rest.partition("/")
    _, at, host = authority.rpartition("@")
    return f"{scheme}{sep}***@{host}{slash}{path}" if at else url


def family_of(environ: Mapping[str, str]) -> Family | None:
    """The family whose ENABLED variable is set, as config.resolve_platform picks it."""
    return next((f for f in FAMILIES if f.enabled in environ), None)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
