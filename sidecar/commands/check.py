"""`sidecar check`: resolve the configuration as `run` would and probe the ingest from this node.

Steps, in order, each printed as soon as it is known: the platform's variables, the state dir,
DNS, where the address leads (a loopback endpoint inside a pod is the pod itself, the most common
cause of empty charts), TCP, TLS, and an authenticated harmless request: an empty `/logs` batch
posted by the daemon's own client, so the headers are exactly the daemon's. A failure names the
likely cause and the fix. Exit 0 only when the probe was accepted (or reporting is off).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from sidecar.commands import print_out
from sidecar.config import FAMILIES, Config, Family, resolve, unknown_variables
from sidecar.delivery.client import Answer, Verdict
from sidecar.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, ConfigError
from sidecar.log import log
from sidecar.masking import add_secret, mask
from sidecar.sources.base import Head
from sidecar.sources.files.discover import match
from sidecar.sources.files.kinds import FILE_KINDS

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
SHOWN_FILES = 3  # files named in a source's line; --json lists up to MAX_LISTED_FILES
MAX_LISTED_FILES = 100
HEAD_BYTES = 64 << 10  # of each file of a kind that probes heads, to tell whether it gives points
_NETWORK_STEPS = frozenset({"dns", "tcp", "tls", "probe"})  # where a proxy may be the cause


@dataclass
class Step:
    """One step's finding: status is ok, warn (worth knowing, not fatal), fail or skip."""

    name: str
    status: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


class _Report:
    """Prints each step as it is found (text), or everything at the end as one JSON document."""

    def __init__(self, as_json: bool, out: TextIO) -> None:
        self.as_json = as_json
        self.out = out
        self.steps: list[Step] = []

    def add(self, name: str, status: str, message: str, **details: Any) -> Step:
        step = Step(name, status, message, details)
        self.steps.append(step)
        if not self.as_json:
            label = "FAIL" if status == "fail" else status
            self._print(f"{label:<5} {name:<13} {message}")
        return step

    @property
    def failed(self) -> bool:
        return any(step.status == "fail" for step in self.steps)

    @property
    def warned(self) -> list[str]:
        """The steps that warned, each named once."""
        return list(dict.fromkeys(step.name for step in self.steps if step.status == "warn"))

    def finish(self, code: int, cfg: Config | None) -> None:
        verdict = {EXIT_OK: "ok", EXIT_FAILED: "failed", EXIT_CONFIG: "configuration error"}
        if self.as_json:
            doc = {
                "ok": code == EXIT_OK,
                "exit_status": code,
                "result": verdict[code],
                "endpoint": cfg.platform.endpoint if cfg else None,
                "run_id": cfg.platform.run_id if cfg else None,
                "warnings": self.warned,
                "steps": [asdict(step) for step in self.steps],
            }
            self._print(json.dumps(doc, indent=2, ensure_ascii=False))
            return
        failures = [s.name for s in self.steps if s.status == "fail"]
        # each failed step once, with how many times it failed, in the order found
        failed = [name + (f" ({failures.count(name)})" if failures.count(name) > 1 else "")
                  for name in dict.fromkeys(failures)]
        if not failed and self.warned:
            self._print(f"sidecar check: ok, with warnings ({', '.join(self.warned)})")
        elif not failed:
            self._print("sidecar check: ok")
        elif len(failures) == 1 and not self.warned:
            self._print(f"sidecar check: {verdict[code]} (first failed step: {failed[0]})")
        else:
            # every problem, worst first: the failed steps (the configuration's lead, being
            # found first), then those that only warned
            warned = [name for name in self.warned if name not in failures]
            also = f"; warnings: {', '.join(warned)}" if warned else ""
            self._print(f"sidecar check: {verdict[code]} (failed: {', '.join(failed)}{also})")

    def _print(self, text: str) -> None:
        print_out(mask(text), self.out)


@dataclass(frozen=True)
class _Target:
    """The endpoint as the steps need it, and the names of the variables behind it."""

    url: str
    scheme: str
    host: str
    port: int
    family: Family | None

    @classmethod
    def of(cls, cfg: Config, environ: Mapping[str, str]) -> _Target:
        parts = urlsplit(cfg.platform.endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(cfg.platform.endpoint, parts.scheme, parts.hostname or "", port,
                   _family(environ))

    def var(self, which: str) -> str:
        """The variable name of `which` (endpoint, run_id, token) in the family in use."""
        return getattr(self.family, which) if self.family else which.upper()


def check(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run every step, print what each found; 0 when the probe was accepted or reporting is
    off, 2 for a configuration error, 1 for anything else."""
    timeout_s = args.timeout
    report = _Report(args.json, sys.stdout)
    cfg, mistaken = _configuration(args, environ, report)
    _variables(environ, report)
    # Past a mistake, what can still be looked at is: the sources, and the endpoint when its
    # variable is good (a missing token still lets DNS, TCP and TLS be tried).
    _sources(cfg, report)
    if cfg.platform.enabled:  # with reporting off nothing is said of a stall
        _stacks(report)
    code = EXIT_OK
    if cfg.platform.enabled and cfg.platform.endpoint:
        code = asyncio.run(_check_endpoint(cfg, environ, report, timeout_s))
    if mistaken:
        code = EXIT_CONFIG
    elif code == EXIT_OK and report.failed:  # a source that would send nothing
        code = EXIT_FAILED
    report.finish(code, None if mistaken else cfg)
    return code


def _configuration(args: argparse.Namespace, environ: Mapping[str, str],
                   report: _Report) -> tuple[Config, bool]:
    """The configuration as `run` would resolve it, and whether it holds a mistake: each one a
    failed step of its own, worst first (the platform's variables, then the options); the
    Config then has each bad option at its default, for the steps that can still be taken."""
    problems: list[str] = []
    cfg = resolve(args, "check", environ, problems=problems)
    add_secret(cfg.token)
    for problem in problems:
        report.add("configuration", "fail", mask(problem))
    if problems:
        return cfg, True
    family = _family(environ)
    name = f"{family.name} variables" if family else "platform variables"
    enabled = f"{family.enabled}={environ[family.enabled]}" if family else "ENABLED"
    if not cfg.platform.enabled:
        report.add("configuration", "ok", f"{name}, {enabled}: reporting is off; `sidecar run` "
                   "passes the output through and posts nothing, so there is nothing to probe",
                   family=family.name if family else None, enabled=False)
        return cfg, False
    token = f"--token-file {cfg.token_file}" if cfg.token_file else cfg.platform.token_variable
    both = " (both families set, and they agree)" if len(cfg.platform.token_headers) > 1 else ""
    report.add("configuration", "ok", f"{name}{both}, {enabled}: run {cfg.platform.run_id} at "
               f"{cfg.platform.endpoint}; token from {token}",
               family=family.name if family else None, enabled=True,
               run_id=cfg.platform.run_id, endpoint=cfg.platform.endpoint, token_from=token)
    return cfg, False


def _variables(environ: Mapping[str, str], report: _Report) -> None:
    """SIDECAR_* variables no option reads: a typo there is otherwise silently ignored."""
    unknown = unknown_variables(environ)
    if unknown:
        report.add("variables", "warn", "; ".join(unknown),
                   unknown=[warning.split()[0] for warning in unknown])


def _heads(head: Callable[[bytes], Head], files: Sequence[str]) -> list[tuple[str, Head]]:
    """What the head of each file gives, parsed as `watch` would."""
    heads = []
    for name in files[:MAX_LISTED_FILES]:
        try:
            with open(name, "rb") as fh:
                data = fh.read(HEAD_BYTES)
        except OSError as exc:
            heads.append((name, Head(0, 0, f"cannot be read ({exc.strerror})")))
            continue
        heads.append((name, head(data)))
    return heads


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _head_note(name: str, found: Head) -> str:
    """What is wrong in one file's head: its lines skipped and its NaN values, each with the
    first; "" when nothing is."""
    parts = []
    if found.problem:
        skipped = f"{_plural(found.skipped, 'line')} skipped, " if found.skipped else ""
        parts.append(f"{skipped}{found.problem}")
    if found.not_finite:
        parts.append(f"{_plural(found.not_finite, 'NaN or infinite value')} never sent, the "
                     f"first {found.first_not_finite}")
    return f"{name}: {'; '.join(parts)}" if parts else ""


def _head_step(step: str, head: Callable[[bytes], Head], what: str, pattern: str,
               files: list[str], report: _Report) -> None:
    """A pattern's files read at their head: fail when they hold lines and no point; each file
    with lines skipped or NaN values named, with the first of each."""
    heads = _heads(head, files)
    points = sum(found.points for _, found in heads)
    listed = ", ".join(files[:SHOWN_FILES]) + (
        f", and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else "")
    count = f"{len(files)} file{'s' if len(files) > 1 else ''} ({listed})"
    notes = [note for note in (_head_note(name, found) for name, found in heads) if note]
    details: dict[str, Any] = {
        "pattern": pattern, "files": files[:MAX_LISTED_FILES], "matched": len(files),
        "points": points,
        "problems": [{"file": name, "problem": found.problem}
                     for name, found in heads if found.problem],
        "heads": [{"file": name, "points": found.points, "skipped": found.skipped,
                   "not_finite": found.not_finite, "problem": found.problem,
                   "first_not_finite": found.first_not_finite} for name, found in heads]}
    said = "; ".join(notes[:SHOWN_FILES]) + (
        f"; and {len(notes) - SHOWN_FILES} more files" if len(notes) > SHOWN_FILES else "")
    their, them = ("its", "it") if len(files) == 1 else ("their", "them")
    if not points and any(found.problem for _, found in heads):
        report.add(step, "fail", f"{what}: {count}, and no point in {their} first lines: "
                   f"{said}", **details)
    elif not points and notes:
        report.add(step, "fail", f"{what}: {count}, and only NaN or infinite values in "
                   f"{their} first lines, which are never sent: {said}", **details)
    elif notes:
        report.add(step, "warn", f"{what}: {count}, {points} points in {their} first lines, "
                   f"but {said}", **details)
    elif not points:
        report.add(step, "warn", f"{what}: {count}, no complete line in {them} yet; points "
                   "are sent as the trainer writes them", **details)
    else:
        report.add(step, "ok", f"{what}: {count}, {points} points in {their} first lines",
                   **details)


def _sources(cfg: Config, report: _Report) -> None:
    """What each source option matches now, as `watch` would expand it."""
    given = [(kind, pattern) for kind in FILE_KINDS for pattern in cfg.files.get(kind.name, ())]
    for kind, pattern in given:
        names, note = match(pattern, kind.flag, kind.name, kind.tree)
        files = [p for p in names if os.path.isfile(p)]
        what = f"{kind.flag} {pattern}"
        if files and kind.head is not None:
            _head_step(kind.name, kind.head, what, pattern, files, report)
            continue
        if files and kind.survey is not None:
            found = kind.survey(cfg, files)
            report.add(kind.name, found.status, f"{what}: {found.message}", pattern=pattern,
                       **found.details)
            continue
        if files:
            more = f", and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else ""
            report.add(kind.name, "ok", f"{what}: {len(files)} file{'s' if len(files) > 1 else ''} "
                       f"({', '.join(files[:SHOWN_FILES])}{more})", pattern=pattern,
                       files=files[:MAX_LISTED_FILES], matched=len(files))
            continue
        hint = ("in a pod, check the volume's mountPath, the same in both containers"
                if "does not exist" in note else "files that appear later are followed, but "
                "check the name (and quote a pattern, so that the shell leaves it to the sidecar)")
        report.add(kind.name, "warn", f"{what}: {note or 'nothing matches yet'}; {hint}",
                   pattern=pattern, matched=0)
    for folder in cfg.checkpoints:
        _checkpoints(cfg, folder, report)
    if cfg.hparams is not None:
        _hparams(cfg.hparams, report)


def _stacks(report: _Report) -> None:
    """Whether stacks can be taken at a stall (docs/stalls.md#where-it-cannot-look): py-spy is
    here, and may read a child of ours (`run`'s case) and a ranked process in view (`watch`'s)."""
    from sidecar.stacks import Process, dump, find_tool, ranked_processes

    tool = find_tool()
    if tool is None:
        report.add("stacks", "warn", "py-spy is not installed: a stall is said without the "
                   "command's stacks; install the package with its dependencies "
                   "(docs/stalls.md#where-it-cannot-look)")
        return
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; print(flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert child.stdout is not None
        child.stdout.readline()
        probe = Process(child.pid, os.getpid(), "python")
        dump(tool, [probe], native=False, timeout_s=5.0)
    finally:
        child.kill()
        child.wait()
    if probe.error:
        report.add("stacks", "warn", f"py-spy cannot read even a child of ours ({probe.error}): "
                   "a stall is said without the stacks; a container needs CAP_SYS_PTRACE "
                   "(docs/stalls.md#where-it-cannot-look)", tool=tool)
        return
    ranked = [p for p in ranked_processes() if p.pid != os.getpid()][:1]
    if ranked:
        dump(tool, ranked, native=False, timeout_s=5.0)
        if ranked[0].error.startswith("refused"):
            report.add("stacks", "warn", f"`run`'s command can be read, but not PID "
                       f"{ranked[0].pid} (RANK {ranked[0].rank}), which `watch` would read: "
                       "ptrace is refused; give the sidecar CAP_SYS_PTRACE "
                       "(deploy/kubernetes/overlays/stacks)", tool=tool)
            return
    report.add("stacks", "ok", f"stacks can be taken at a stall ({tool})", tool=tool)


def _hparams(path: Path, report: _Report) -> None:
    """The --hparams file as `run` would read it: one the trainer writes later is waited for,
    one that cannot be read is never sent (the run goes on either way)."""
    from sidecar.sources.files.hparams import load_hparams

    if not path.exists():
        report.add("hparams", "warn", f"--hparams {path} does not exist yet; it is sent once "
                   "the trainer writes it (check the path if it never does)", path=str(path))
        return
    try:
        params = load_hparams(path)
    except ConfigError as exc:
        report.add("hparams", "fail", f"{exc}: nothing of it would be sent", path=str(path))
        return
    report.add("hparams", "ok", f"--hparams {path}: {len(params)} parameters",
               path=str(path), parameters=len(params))


async def _check_endpoint(cfg: Config, environ: Mapping[str, str], report: _Report,
                          timeout_s: float) -> int:
    target = _Target.of(cfg, environ)
    _state_dir(cfg, report)
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


def _state_dir(cfg: Config, report: _Report) -> None:
    """Whether the run's state folder can be created and written, without creating it."""
    existing = cfg.run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        report.add("state", "ok", f"{cfg.run_dir} is writable", path=str(cfg.run_dir))
        return
    if cfg.state_dir_is_default:
        report.add("state", "warn", f"{cfg.run_dir} cannot be written ({existing} is not a "
                   "writable folder): `run` keeps its state in a private folder under the "
                   "temporary directory instead, which a reboot may clear; pass --state-dir "
                   "(SIDECAR_STATE_DIR) a lasting writable folder", path=str(cfg.run_dir))
        return
    report.add("state", "fail", f"{cfg.run_dir} cannot be written ({existing} is not a writable "
               "folder): the spool and the lifecycle journal live there; pass --state-dir "
               "(SIDECAR_STATE_DIR) a writable folder, in a pod an emptyDir volume",
               path=str(cfg.run_dir))


async def _dns(target: _Target, report: _Report, timeout_s: float) -> list[str]:
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


def _dns_failure(target: _Target, exc: socket.gaierror) -> str:
    if exc.errno == socket.EAI_AGAIN:
        return (f"{target.host} cannot be resolved now ({exc.strerror}): this node's DNS servers "
                "did not answer; check /etc/resolv.conf and the network")
    return (f"{target.host} does not resolve ({exc.strerror}): check the host in "
            f"{target.var('endpoint')}; from a pod, a name inside the cluster needs its "
            "namespace (NAME.NAMESPACE.svc) and a name outside it needs DNS that reaches out")


def _placement(target: _Target, addresses: Sequence[str], environ: Mapping[str, str],
               report: _Report) -> tuple[str, str, str] | None:
    """Diagnose an endpoint that cannot be the platform as seen from a GPU node in a pod. In a
    plain container, where the TCP step settles it, (where, evidence, warning) for
    `_container_loopback`, the step not yet said."""
    kinds = [_local_kind(a) for a in addresses]
    if not all(kinds):
        report.add("address", "ok", f"{addresses[0]} is neither loopback nor link-local")
        return None
    pod, container = _container_evidence(environ)
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
                        report: _Report) -> None:
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


def _checkpoints(cfg: Config, folder: str, report: _Report) -> None:
    """What one --checkpoints folder holds now, by writer, complete or not, and whether its
    paths would be posted (in a container, only those --artifact-uri maps)."""
    from collections import Counter

    from sidecar.config import parse_artifact_uri
    from sidecar.sources.files.checkpoints import (
        ArtifactPaths,
        container_signal,
        survey,
        uploads_unmapped,
    )

    what = f"--checkpoints {folder}"
    if not os.path.isdir(folder):
        note = "is not a folder" if os.path.exists(folder) else "does not exist yet"
        report.add("checkpoints", "warn", f"{what}: {note}; checkpoints written there later "
                   "are found, but check the path (in a pod, the volume's mountPath)",
                   folder=folder, matched=0)
        return
    found, aliases = survey(os.path.abspath(folder))
    container = container_signal(os.environ)
    upload = uploads_unmapped(cfg.checkpoint_upload, container)
    paths = ArtifactPaths([parse_artifact_uri(m) for m in cfg.artifact_uri], container,
                          upload=upload)
    formats = Counter(f"{c.shape.format} ({c.shape.kind})" for c in found)
    waiting = [f"{os.path.relpath(c.path, folder)}: {c.assessment.why}" for c in found
               if not c.assessment.complete]
    summary = (", ".join(f"{n} {name}" for name, n in sorted(formats.items())) or
               "no checkpoint yet")
    complete = len(found) - len(waiting)
    message = (f"{what}: {summary}; {complete} complete"
               + (f", {len(waiting)} not complete ({'; '.join(waiting[:SHOWN_FILES])})"
                  if waiting else "")
               + (f"; {aliases} aliases (last.ckpt, links) passed over" if aliases else ""))
    status = "ok"
    posted = paths.resolve(os.path.abspath(folder))
    if posted is None and upload:
        message += (f"; uploaded through the ingest's signed URLs (--checkpoint-upload "
                    f"{cfg.checkpoint_upload}{', in a container' if container else ''}), "
                    "then posted as the object-store URI it answers")
    elif posted is None:
        status = "warn"
        message += (f"; NOT POSTED: this runs in a container ({paths.container}), where a local "
                    "path is useless to the platform: give --artifact-uri LOCAL=URI naming "
                    "the object-store URI this folder mirrors, or let it be uploaded "
                    "(--checkpoint-upload auto)")
    elif posted != os.path.abspath(folder):
        message += f"; posted as {posted}/..."
    report.add("checkpoints", status, message, folder=folder, matched=len(found),
               complete=complete, waiting=waiting, aliases=aliases, posted_as=posted)


def _container_evidence(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """Why this process is in a Kubernetes pod, and why in a container, each None if not."""
    pod = None
    if environ.get("KUBERNETES_SERVICE_HOST"):
        pod = "KUBERNETES_SERVICE_HOST is set (a Kubernetes pod)"
    container = next((why for path, why in CONTAINER_MARKERS if path.exists()), None)
    return pod, container


async def _tcp(target: _Target, addresses: Sequence[str], report: _Report,
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


async def _tls(cfg: Config, target: _Target, address: str, report: _Report,
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


def _untrusted(cfg: Config, target: _Target, exc: ssl.SSLCertVerificationError) -> str:
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


async def _probe(cfg: Config, target: _Target, report: _Report, timeout_s: float) -> None:
    from sidecar.daemon import make_client  # the daemon's own client: its exact headers

    client = make_client(cfg)
    assert client is not None  # reporting is on
    body = json.dumps({"run_id": cfg.platform.run_id, "chunks": [], "eof": False}).encode()
    try:
        await client.start()
        with _quiet_client_log():  # the step explains the answer; the daemon's ERROR would not
            answer = await asyncio.wait_for(client.post("logs", body), timeout_s)
    except TimeoutError:
        report.add("probe", "fail", f"POST {target.url}/logs: no answer within {timeout_s:g} s: "
                   "the ingest took the connection but did not respond")
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


def _explain(answer: Answer, cfg: Config, target: _Target) -> str:
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


def _proxy_note(environ: Mapping[str, str], report: _Report, *, failed: bool) -> None:
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


def _family(environ: Mapping[str, str]) -> Family | None:
    """The family whose ENABLED variable is set, as config.resolve_platform picks it."""
    return next((f for f in FAMILIES if f.enabled in environ), None)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
