"""`sidecar check` against a real ingest over loopback, answering each failure in turn."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import shlex
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sidecar.cli import build_parser
from sidecar.commands import check_endpoint as endpoint_steps
from sidecar.commands.check import check
from sidecar.delivery.client import MAX_REASON_CHARS, refusal_reason
from sidecar.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from tests.conftest import RUN_ID, SIDECAR, TOKEN, clean_environ, platform_env
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest

# Until the CLI has `sidecar check`, the real process is started through this one-liner; the
# tests marked `wired` below run the `sidecar check` command itself once cli.py has it.
CHECK_MAIN = ("import os, sys; from sidecar.commands.check import check; from sidecar.cli import "
              "build_parser; sys.exit(check(build_parser().parse_args(['check', *sys.argv[1:]]), "
              "os.environ))")


def cli_has(command: str) -> bool:
    from sidecar.cli import COMMANDS

    return command in COMMANDS


wired = pytest.mark.skipif(not cli_has("check"), reason="cli.py does not have `check` yet")


@dataclass
class Checked:
    code: int
    out: str
    steps: dict[str, str] = field(default_factory=dict)  # step name -> its whole line

    def line(self, step: str) -> str:
        return self.steps[step]


@pytest.fixture(autouse=True)
def no_container_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether this machine has /.dockerenv must not change the results; tests that want a
    container say so."""
    monkeypatch.setattr(endpoint_steps, "CONTAINER_MARKERS", ())


def run_check(env: Mapping[str, str], capsys: pytest.CaptureFixture[str], *options: str
              ) -> Checked:
    code = check(build_parser().parse_args(["check", *options]), env)
    out = capsys.readouterr().out
    assert TOKEN not in out
    steps = {}
    for line in out.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("ok", "warn", "FAIL", "skip"):
            steps[rest.split()[0]] = line
    return Checked(code, out, steps)


def test_healthy_endpoint_exits_0(ingest: RunningIngest, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    result = run_check(platform_env(ingest, tmp_path), capsys)
    assert result.code == EXIT_OK, result.out
    assert list(result.steps) == ["configuration", "stacks", "state", "dns", "address", "tcp",
                                  "tls", "probe"]
    assert result.line("stacks").startswith("ok ")  # py-spy may read a child of ours here
    assert "each rank's time measured every 60 s (--time-window)" in result.line("stacks")
    assert "StarForge" in result.line("configuration")
    assert "token from STARFORGE_TOKEN" in result.line("configuration")
    assert result.line("probe").startswith("ok ")
    assert "HTTP 200" in result.line("probe")
    assert result.out.splitlines()[-1] == "sidecar check: ok"
    assert ingest.records("logs") == [{"run_id": RUN_ID, "chunks": [], "eof": False}]


def test_json_is_one_document(ingest: RunningIngest, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    result = run_check(platform_env(ingest, tmp_path), capsys, "--json")
    doc = json.loads(result.out)
    assert result.code == EXIT_OK
    assert doc["ok"] is True and doc["exit_status"] == 0
    assert doc["run_id"] == RUN_ID and doc["endpoint"] == ingest.base_url
    assert [(s["name"], s["status"]) for s in doc["steps"]] == [
        ("configuration", "ok"), ("stacks", "ok"), ("state", "ok"), ("dns", "ok"),
        ("address", "ok"),
        ("tcp", "ok"), ("tls", "skip"), ("probe", "ok")]
    assert doc["steps"][-1]["details"] == {"http_status": 200, "verdict": "accepted"}


def test_refused(ingest: RunningIngest, tmp_path: Path,
                 capsys: pytest.CaptureFixture[str]) -> None:
    env = platform_env(ingest, tmp_path)
    ingest.stop_listening()
    result = run_check(env, capsys)
    assert result.code == EXIT_FAILED
    assert result.line("tcp").startswith("FAIL")
    assert "refused the connection" in result.line("tcp")
    assert "probe" not in result.steps
    assert result.out.splitlines()[-1] == "sidecar check: failed (first failed step: tcp)"


def test_name_that_does_not_resolve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_check(platform_env("https://ingest.invalid/api/ingest", tmp_path), capsys)
    assert result.code == EXIT_FAILED
    assert result.line("dns").startswith("FAIL")
    assert "ingest.invalid" in result.line("dns")
    assert "STARFORGE_ENDPOINT" in result.line("dns") or "resolv.conf" in result.line("dns")
    assert "tcp" not in result.steps


@pytest.mark.parametrize(("fault", "expected"), [
    (Fault(route="logs", status=401), ["HTTP 401", "rejected the token", "30 days",
                                       f"STARFORGE_RUN_ID={RUN_ID}"]),
    (Fault(route="logs", status=403), ["HTTP 403", "rejected the token"]),
    (Fault(route="logs", redirect="https://login.example.com/sso?next=/api/ingest/logs"),
     ["HTTP 307", "https://login.example.com", "not followed", "STARFORGE_ENDPOINT"]),
    (Fault(route="logs", status=502), ["HTTP 502", "healthy backend"]),
    (Fault(route="logs", status=503, retry_after="7"), ["HTTP 503", "Retry-After 7 s"]),
])
def test_each_answer_has_its_diagnosis(ingest: RunningIngest, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str], fault: Fault,
                                       expected: list[str]) -> None:
    ingest.add_fault(fault)
    result = run_check(platform_env(ingest, tmp_path), capsys)
    assert result.code == EXIT_FAILED
    probe = result.line("probe")
    assert probe.startswith("FAIL")
    for text in expected:
        assert text in probe
    assert "sso?next" not in probe  # the redirect's path and query are not repeated
    assert ingest.records("logs") == []


def test_wrong_token_from_the_real_ingest(ingest: RunningIngest, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-from-an-older-run-0000\n")
    result = run_check(platform_env(ingest, tmp_path), capsys, "--token-file", str(token_file))
    assert result.code == EXIT_FAILED
    assert "HTTP 401" in result.line("probe")
    assert f"--token-file {token_file}" in result.line("probe")
    assert "tok-from-an-older-run-0000" not in result.out


def test_a_wrong_token_is_said_by_the_report_alone(ingest: RunningIngest,
                                                   tmp_path: Path) -> None:
    """The real `sidecar check`: the probe's client says nothing of its own on stderr (its
    ERROR came before the report, as if a run had failed), the report says it all."""
    env = {**platform_env(ingest, tmp_path), "STARFORGE_TOKEN": "tok-from-an-older-run-0000"}
    done = subprocess.run([*SIDECAR, "check"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == EXIT_FAILED
    assert done.stderr == ""
    assert "HTTP 401" in done.stdout and "rejected the token" in done.stdout


def test_base_url_without_api_ingest_is_a_configuration_error(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An endpoint not ending in /api/ingest is refused before anything is tried
    (docs/ingest.md#the-platforms-variables; issue 13: `run` posted the billing events to 404
    and dead-lettered them)."""
    base = ingest.base_url.removesuffix("/api/ingest")
    result = run_check(platform_env(base, tmp_path), capsys)
    assert result.code == 2
    assert "STARFORGE_ENDPOINT" in result.line("configuration")
    assert "does not end in /api/ingest" in result.line("configuration")
    assert not ingest.records("lifecycle")


def test_probe_that_hangs_times_out(ingest: RunningIngest, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    ingest.add_fault(Fault(route="logs", latency_s=60))
    result = run_check(platform_env(ingest, tmp_path), capsys, "--timeout", "0.5")
    assert result.code == EXIT_FAILED
    assert "no answer within 0.5 s" in result.line("probe")


def test_loopback_endpoint_inside_a_pod(ingest: RunningIngest, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    env = platform_env(ingest, tmp_path, KUBERNETES_SERVICE_HOST="10.96.0.1")
    result = run_check(env, capsys)
    assert result.code == EXIT_FAILED  # although something on loopback took the probe
    address = result.line("address")
    assert address.startswith("FAIL")
    assert "the ingest URL must be reachable from the GPU node" in address
    assert "127.0.0.1 inside a pod is the pod itself" in address
    assert "KUBERNETES_SERVICE_HOST" in address
    assert result.line("probe").startswith("ok")
    assert result.out.splitlines()[-1] == "sidecar check: failed (first failed step: address)"


def test_loopback_in_a_plain_container_is_settled_by_the_connection(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A try-out in a container against a `sidecar receive` in it (or on the host's network)
    warned about /.dockerenv and the loopback address although that is what was meant
    (issue 35): a receiver that takes the connection settles it; none, and the warning stays."""
    marker = tmp_path / ".dockerenv"
    marker.touch()
    monkeypatch.setattr(endpoint_steps, "CONTAINER_MARKERS", ((marker, "a marker exists"),))
    env = platform_env(ingest, tmp_path)
    accepted = run_check(env, capsys)
    assert accepted.code == EXIT_OK
    assert accepted.line("address").startswith("ok")
    assert "a receiver in this container's own network" in accepted.line("address")
    assert accepted.out.splitlines()[-1] == "sidecar check: ok"
    ingest.stop_listening()
    refused = run_check(env, capsys)
    assert refused.code == EXIT_FAILED
    assert refused.line("address").startswith("warn")
    assert "inside a container is the container itself" in refused.line("address")
    assert refused.line("tcp").startswith("FAIL")


def test_proxy_is_said_to_be_bypassed_and_blamed_when_the_request_failed(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = platform_env(ingest, tmp_path, HTTPS_PROXY="http://alice:s3cr@t@proxy.corp:3128")
    healthy = run_check(env, capsys)
    assert healthy.code == EXIT_OK
    bypassed = healthy.line("proxy")
    assert bypassed.startswith("ok")
    assert "HTTPS_PROXY=http://***@proxy.corp:3128 set and bypassed" in bypassed
    assert "reaches the ingest directly" in bypassed
    assert [step for step in healthy.steps if step == "proxy"] == ["proxy"]
    assert "s3cr" not in healthy.out
    ingest.stop_listening()
    failed = run_check(env, capsys)
    assert failed.code == EXIT_FAILED
    proxy = failed.line("proxy")
    assert proxy.startswith("warn") and "need a direct route to the ingest" in proxy
    assert "HTTPS_PROXY=http://***@proxy.corp:3128" in proxy
    assert "s3cr" not in failed.out and "alice" not in failed.out


def test_configuration_error_is_a_failed_step(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    env = platform_env("http://127.0.0.1:9/api/ingest", tmp_path)
    del env["STARFORGE_ENABLED"]
    result = run_check(env, capsys)
    assert result.code == EXIT_CONFIG
    assert result.line("configuration").startswith("FAIL")
    assert "STARFORGE_ENABLED" in result.line("configuration")
    assert "Traceback" not in result.out
    assert list(result.steps) == ["configuration"]


def test_reporting_off_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = clean_environ()
    env.update(STARFORGE_ENABLED="0", SIDECAR_STATE_DIR=str(tmp_path))
    result = run_check(env, capsys)
    assert result.code == EXIT_OK
    assert "reporting is off" in result.line("configuration")
    assert list(result.steps) == ["configuration"]


def test_state_dir_that_cannot_be_made(ingest: RunningIngest, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_check(platform_env(ingest, blocker / "state"), capsys)
    assert result.code == EXIT_FAILED
    assert result.line("state").startswith("FAIL")
    assert "--state-dir" in result.line("state")
    assert result.line("probe").startswith("ok")


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("169.254.169.254", "link-local"), ("fe80::1%eth0", "link-local"),
    ("0.0.0.0", "unspecified"), ("10.0.0.5", ""), ("2001:db8::1", ""), ("192.0.2.7", "")])
def test_addresses_that_never_leave_the_node(address: str, kind: str) -> None:
    assert endpoint_steps._local_kind(address) == kind


# -- TLS ---------------------------------------------------------------------------------------


@dataclass
class TlsIngest:
    base_url: str
    received: list[dict[str, Any]]


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sidecar test ingest")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1)).not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=False, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "ingest.pem", directory / "ingest.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@contextmanager
def tls_ingest(cert: Path, key: Path) -> Iterator[TlsIngest]:
    """An aiohttp ingest over TLS on loopback taking /api/ingest/logs with the test's token."""
    received: list[dict[str, Any]] = []

    async def logs(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"ok": False}, status=401)
        received.append(await request.json())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/api/ingest/logs", logs)
    runner = web.AppRunner(app, access_log=None)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="tls-ingest", daemon=True)
    thread.start()

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        return int(runner.addresses[0][1])

    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        yield TlsIngest(f"https://127.0.0.1:{port}/api/ingest", received)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_self_signed_endpoint_then_ca_file(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = self_signed_certificate(tmp_path)
    with tls_ingest(cert, key) as server:
        env = platform_env(server.base_url, tmp_path)
        untrusted = run_check(env, capsys)
        assert untrusted.code == EXIT_FAILED
        tls = untrusted.line("tls")
        assert tls.startswith("FAIL")
        assert "self-signed" in tls and "not trusted" in tls
        assert "--ca-file" in tls
        assert "probe" not in untrusted.steps

        trusted = run_check(env, capsys, "--ca-file", str(cert))
        assert trusted.code == EXIT_OK, trusted.out
        assert trusted.line("tls").startswith("ok")
        assert "sidecar test ingest" in trusted.line("tls")
        assert trusted.line("probe").startswith("ok")
        assert server.received == [{"run_id": RUN_ID, "chunks": [], "eof": False}]


def test_https_to_a_plain_http_port(ingest: RunningIngest, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    result = run_check(platform_env(ingest.base_url.replace("http:", "https:"), tmp_path), capsys)
    assert result.code == EXIT_FAILED
    assert "plain HTTP" in result.line("tls")


# -- the real process ----------------------------------------------------------------------------


def check_process(args: list[str], env: Mapping[str, str], *, cli: bool = False
                  ) -> subprocess.CompletedProcess[str]:
    command = [*SIDECAR, "check"] if cli else [sys.executable, "-c", CHECK_MAIN]
    return subprocess.run([*command, *args], env=dict(env), capture_output=True, text=True,
                          timeout=60, check=False)


def test_process_healthy_and_rejected(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path)
    healthy = check_process(["--json"], env)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert json.loads(healthy.stdout)["steps"][-1]["status"] == "ok"
    rejected = check_process(["--json"], {**env, "STARFORGE_TOKEN": "tok-revoked-1234"})
    assert rejected.returncode == 1
    doc = json.loads(rejected.stdout)
    assert doc["steps"][-1]["details"]["http_status"] == 401
    for output in (healthy, rejected):
        assert TOKEN not in output.stdout + output.stderr
        assert "tok-revoked-1234" not in output.stdout + output.stderr


@wired
def test_cli_check(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path)
    healthy = check_process([], env, cli=True)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert healthy.stdout.splitlines()[-1] in (
        "sidecar check: ok", "sidecar check: ok, with warnings (address)")  # in a container
    ingest.add_fault(Fault(route="logs", status=401))
    rejected = check_process(["--json"], env, cli=True)
    assert rejected.returncode == 1
    assert json.loads(rejected.stdout)["steps"][-1]["details"]["http_status"] == 401


# -- what the ingest said, the sources, and a reader that leaves early ---------------------------


def test_the_ingest_s_own_reason_for_a_400(ingest: RunningIngest, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    env = platform_env(ingest, tmp_path, STARFORGE_RUN_ID="run-2")
    result = run_check(env, capsys)
    assert result.code == EXIT_FAILED
    probe = result.line("probe")
    assert probe.startswith("FAIL") and "HTTP 400" in probe
    assert f"saying: run_id mismatch: expected {RUN_ID!r}, got \"run-2\"" in probe
    assert "STARFORGE_RUN_ID=run-2" in probe
    assert "it may not know the run" not in probe


def test_a_refusal_s_reason_is_bounded_on_one_line_and_masks_the_token() -> None:
    assert refusal_reason(b'{"ok": false, "error": "token tok-1 is\\nnot for run-2"}',
                          "tok-1") == "token *** is not for run-2"
    assert refusal_reason(b"<html>\n  <h1>Bad   Request</h1></html>", "tok") == \
        "<html> <h1>Bad Request</h1></html>"
    long = refusal_reason(b"x" * 100_000, "tok")
    assert len(long) == MAX_REASON_CHARS and long.endswith("…")
    assert refusal_reason(b"", "tok") == ""


def test_source_options_say_what_each_matches(ingest: RunningIngest, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "shared"
    logs.mkdir()
    for name in ("a.log", "b.log", "c.log", "d.log"):
        (logs / name).write_text("line\n")
    tb = tmp_path / "tb"
    (tb / "train").mkdir(parents=True)
    (tb / "train" / "events.out.tfevents.1.host").write_bytes(b"")
    empty_tb = tmp_path / "tb-empty"
    empty_tb.mkdir()
    hparams = tmp_path / "config.yaml"
    hparams.write_text("lr: 0.1\nmodel:\n  layers: 4\n")
    result = run_check(platform_env(ingest, tmp_path), capsys,
                       "--log", f"{logs}/*.log", "--jsonl", f"{tmp_path}/nowhere/*.jsonl",
                       "--jsonl", f"{logs}/*.jsonl", "--tensorboard", str(tb),
                       "--tensorboard", str(empty_tb), "--hparams", str(hparams))
    assert result.code == EXIT_OK, result.out
    lines = result.out.splitlines()
    log = next(line for line in lines if line.split()[1] == "log")
    assert log.startswith("ok") and f"--log {logs}/*.log: 4 files" in log and ", and 1 more" in log
    jsonl = [line for line in lines if line.split()[1] == "jsonl"]
    assert jsonl[0].startswith("warn")
    assert f"the folder {tmp_path}/nowhere does not exist" in jsonl[0]
    assert jsonl[1].startswith("warn") and "nothing matches yet" in jsonl[1]
    board = [line for line in lines if line.split()[1] == "tensorboard"]
    assert board[0].startswith("ok") and "1 file (" in board[0] and "train/events" in board[0]
    assert board[1].startswith("warn") and "no events.out.tfevents.* file under it" in board[1]
    assert result.line("hparams").startswith("ok")
    assert "2 parameters" in result.line("hparams")


def test_an_unreadable_hparams_file_fails_and_a_missing_one_is_waited_for(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    result = run_check(platform_env(ingest, tmp_path), capsys, "--hparams", str(bad))
    assert result.code == EXIT_FAILED  # `run` starts; nothing of the file is sent
    assert result.line("hparams").startswith("FAIL") and "not a mapping" in result.line("hparams")
    later = run_check(platform_env(ingest, tmp_path), capsys, "--hparams",
                      str(tmp_path / ".hydra" / "config.yaml"))
    assert later.code == EXIT_OK
    assert later.line("hparams").startswith("warn") and "does not exist yet" in later.out


def test_a_reader_that_left_gets_the_verdict_and_no_traceback(ingest: RunningIngest,
                                                              tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path)
    read, write = os.pipe()
    os.close(read)  # as `| head -1` once head has exited
    try:
        done = subprocess.run([*SIDECAR, "check"], env=env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write)
    assert done.returncode == EXIT_OK
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize(("listening", "reader", "status"), [
    (True, "grep -q ^ok", EXIT_OK), (True, "head -1", EXIT_OK), (False, "head -1", EXIT_FAILED)])
def test_pipelines_end_with_check_s_verdict(ingest: RunningIngest, tmp_path: Path,
                                            listening: bool, reader: str, status: int) -> None:
    if not listening:
        ingest.stop_listening()
    line = f"set -o pipefail; {shlex.join(SIDECAR)} check | {reader}"
    done = subprocess.run(["bash", "-c", line], env=platform_env(ingest, tmp_path),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr


# -- empty charts explained before the run ----------------------------------------------------


@wired
@pytest.mark.parametrize("reporting", ["on", "off"])
def test_check_fails_on_a_jsonl_file_of_python_dicts_with_the_hint(
        ingest: RunningIngest, tmp_path: Path, reporting: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(f"{{'step': {i}, 'loss': 1.0}}\n"
                                               for i in range(5)))
    env = platform_env(ingest, tmp_path / "state")
    if reporting == "off":
        env["STARFORGE_ENABLED"] = "0"
    done = check_process(["--jsonl", f"{out}/*.jsonl"], env, cli=True)
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.split()[1:2] == ["jsonl"])
    assert line.startswith("FAIL")
    assert f"{out}/metrics.jsonl: 5 lines skipped, line 1: single quotes: a Python dict" in line
    assert "write json.dumps(record)" in line
    assert done.stdout.splitlines()[-1] == "sidecar check: failed (first failed step: jsonl)"


def test_check_counts_the_points_at_the_head_of_each_jsonl_file(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.jsonl").write_text('{"step": 1, "loss": 0.5, "acc": 0.1}\n')
    (tmp_path / "b.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": "0.4"}\n')
    (tmp_path / "c.jsonl").write_text('{"step": 1, "loss": NaN}\n')
    (tmp_path / "d.jsonl").write_text("")
    env = platform_env(ingest, tmp_path / "state")
    result = run_check(env, capsys, "--jsonl", f"{tmp_path}/a.jsonl", "--jsonl",
                       f"{tmp_path}/[ab].jsonl", "--jsonl", f"{tmp_path}/c.jsonl", "--jsonl",
                       f"{tmp_path}/d.jsonl")
    lines = [line for line in result.out.splitlines() if line.split()[1:2] == ["jsonl"]]
    assert lines[0].startswith("ok") and "1 file" in lines[0] and "2 points" in lines[0]
    assert lines[1].startswith("warn") and "3 points in their first lines" in lines[1]
    assert "2 points in its first lines" in lines[0]
    assert f"{tmp_path}/b.jsonl: 1 line skipped, line 2: no number in it: 'loss' is the string " \
           "'0.4'" in lines[1]
    assert lines[2].startswith("FAIL") and "only NaN or infinite values" in lines[2]
    assert f"{tmp_path}/c.jsonl: 1 NaN or infinite value never sent, the first 'loss' at step " \
           "1 (line 1)" in lines[2]
    assert lines[3].startswith("warn") and "no complete line in it yet" in lines[3]
    assert result.code == EXIT_FAILED


def test_check_names_each_files_nan_values_and_skipped_lines_beside_its_points(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "clean.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (tmp_path / "nan.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 0.5, "grad": math.nan if step >= 7 else 1.0}) + "\n"
        for step in range(10)))
    (tmp_path / "skips.jsonl").write_text('{"step": 1, "loss": 0.5}\nloss=0.4\n{"step": 3}\n')
    env = platform_env(ingest, tmp_path / "state")
    result = run_check(env, capsys, "--json", "--jsonl", f"{tmp_path}/*.jsonl")
    [step] = [s for s in json.loads(result.out)["steps"] if s["name"] == "jsonl"]
    assert step["status"] == "warn", step
    assert "19 points in their first lines, but" in step["message"]
    assert f"{tmp_path}/nan.jsonl: 3 NaN or infinite values never sent, the first 'grad' at " \
           "step 7 (line 8)" in step["message"]
    assert f"{tmp_path}/skips.jsonl: 2 lines skipped, line 2: not JSON (loss=0.4)" \
        in step["message"]
    assert "clean.jsonl:" not in step["message"]
    heads = {Path(h["file"]).name: (h["points"], h["not_finite"], h["skipped"])
             for h in step["details"]["heads"]}
    assert heads == {"clean.jsonl": (1, 0, 0), "nan.jsonl": (17, 3, 0), "skips.jsonl": (1, 0, 2)}


@wired
def test_an_unknown_sidecar_variable_is_part_of_the_verdict(ingest: RunningIngest,
                                                             tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path, SIDECAR_JSONLL="out/*.jsonl")
    text = check_process([], env, cli=True)
    assert text.returncode == EXIT_OK, text.stdout + text.stderr
    assert "SIDECAR_JSONLL" not in text.stderr
    line = next(line for line in text.stdout.splitlines() if line.split()[1:2] == ["variables"])
    assert line.startswith("warn") and "did you mean SIDECAR_JSONL?" in line
    assert text.stdout.splitlines()[-1].startswith("sidecar check: ok, with warnings (variables")
    doc = json.loads(check_process(["--json"], env, cli=True).stdout)
    assert doc["ok"] and doc["warnings"][0] == "variables"
    step = next(step for step in doc["steps"] if step["name"] == "variables")
    assert step["details"]["unknown"] == ["SIDECAR_JSONLL"]


def test_an_unwritable_default_state_folder_is_a_warning_not_a_failure(
        ingest: RunningIngest, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    env = platform_env(ingest, tmp_path, XDG_STATE_HOME=str(blocker / "state"))
    del env["SIDECAR_STATE_DIR"]
    result = run_check(env, capsys)
    assert result.code == EXIT_OK, result.out
    assert result.line("state").startswith("warn")
    assert "a private folder under the temporary directory" in result.line("state")


@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="no /usr/bin/python3")
def test_check_says_which_python_the_snapshot_of_a_command_would_describe(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """`sidecar check -- ./train.py`, a script whose #! line names another interpreter, with
    the sidecar's own virtualenv active: the step names that interpreter and how."""
    script = tmp_path / "train.py"
    script.write_text("#!/usr/bin/python3\nprint('hi')\n")
    script.chmod(0o755)
    env = {**platform_env(ingest, tmp_path), "VIRTUAL_ENV": sys.prefix,
           "PATH": f"{Path(sys.prefix) / 'bin'}:{os.defpath}"}
    done = subprocess.run([*SIDECAR, "check", "--", str(script)], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("ok    python")]
    assert f"describes /usr/bin/python3 (the #! line of {script}) for {script}" in line
