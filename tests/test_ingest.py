"""The ingest client: answer classification and each route's policy, over real loopback HTTP."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import time
from email.utils import formatdate
from pathlib import Path

import pytest

from sidecar.delivery.client import (
    HARDWARE_SPOOL_BYTES,
    ROUTES,
    Guarantee,
    IngestClient,
    Verdict,
    classify,
    parse_retry_after,
)
from sidecar.log import log
from tests.conftest import RUN_ID, TOKEN
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, running_ingest


def lifecycle_body(event: str = "running") -> bytes:
    return json.dumps({"run_id": RUN_ID, "event": event,
                       "ts": "2026-08-31T09:14:22+00:00"}).encode()


def metrics_body(n: int) -> bytes:
    points = [{"key": "loss", "step": i, "value": 0.5, "ts": "2026-08-31T09:14:22+00:00"}
              for i in range(n)]
    return json.dumps({"run_id": RUN_ID, "points": points}).encode()


async def started(ingest: RunningIngest | str, token: str = TOKEN,
                  read_token: object = None) -> IngestClient:
    endpoint = ingest if isinstance(ingest, str) else ingest.base_url
    client = IngestClient(endpoint, ("X-StarForge-Token",),
                          read_token if callable(read_token) else (lambda: token))
    await client.start()
    return client


@pytest.mark.parametrize(("status", "verdict"), [
    (200, Verdict.ACCEPTED), (204, Verdict.ACCEPTED), (301, Verdict.REDIRECT),
    (307, Verdict.REDIRECT), (400, Verdict.REJECTED), (401, Verdict.AUTH),
    (403, Verdict.AUTH), (404, Verdict.REJECTED), (413, Verdict.TOO_LARGE),
    (422, Verdict.REJECTED), (429, Verdict.RETRY), (500, Verdict.RETRY),
    (502, Verdict.RETRY), (503, Verdict.RETRY)])
def test_classify(status: int, verdict: Verdict) -> None:
    assert classify(status, None).verdict is verdict


def test_retry_after_in_seconds_and_as_http_date() -> None:
    now = time.time()
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, 1)
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("99999") == 300.0  # capped


def test_policies_are_data() -> None:
    assert ROUTES["logs"].guarantee is Guarantee.BEST_EFFORT
    assert ROUTES["lifecycle"].guarantee is Guarantee.STRICT
    assert ROUTES["lifecycle"].max_attempts is None
    # the crash tail posts to /logs, strictly: the same path under a policy of its own
    assert (ROUTES["logs/tail"].path, ROUTES["logs/tail"].guarantee) == ("/logs", Guarantee.STRICT)
    assert all(p.path == "/" + name for name, p in ROUTES.items()
               if name != "logs/tail" and p.of_ingest)
    assert [name for name, p in ROUTES.items() if not p.of_ingest] == ["artifact/put"]


def _route_names_compared(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where `tree` compares a route's name to a literal (`route == "hardware"`, `route in
    ("logs", "x")`), or holds a list of routes by name (`("logs", "logs/tail")`, read by an `in`
    elsewhere): a branch on names that a column of ROUTES should be."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                found.update((node.lineno, item.value) for item in items
                             if isinstance(item, ast.Constant) and item.value in names)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            listed = [item.value for item in node.elts
                      if isinstance(item, ast.Constant) and item.value in names]
            if len(listed) > 1:
                found.update((node.lineno, name) for name in listed)
    return sorted(found)


def test_the_client_reads_a_route_s_policy_and_never_branches_on_its_name() -> None:
    import sidecar.delivery.client as client_module

    source = Path(client_module.__file__).read_text(encoding="utf-8")
    assert "route ==" not in source and "route in (" not in source
    assert ROUTES["logs/tail"].carries == "the command's last output"


def test_no_module_compares_a_route_s_name_to_a_literal() -> None:
    """What differs between routes is a column of ROUTES (the receiver's: of its own table),
    read where it matters; no module of the package names routes to branch on them."""
    import sidecar
    from sidecar.commands.receive import ROUTE_NAMES

    package = Path(sidecar.__file__).parent
    names = set(ROUTES) | set(ROUTE_NAMES)
    compared = {
        f"{path.relative_to(package)}:{line} {name!r}"
        for path in package.rglob("*.py")
        for line, name in _route_names_compared(ast.parse(path.read_text(), str(path)), names)
    }
    assert compared == set()
    assert [name for name, policy in ROUTES.items() if policy.documents] == [
        "hardware", "environment", "environment/nodes"]
    assert [name for name, policy in ROUTES.items() if policy.thinned] == ["hardware"]
    assert [name for name, policy in ROUTES.items() if policy.text_items] == ["logs", "logs/tail"]


def test_the_route_rule_finds_a_name_compared_or_listed() -> None:
    found = _route_names_compared(ast.parse(
        'if route == "hardware" or "logs" != name or kind in ("metrics", "jsonl"):\n    pass\n'
        'TEXT = ("logs", "logs/tail")\n'
        'ROUTES = {"metrics": 1, "hparams": 2}\n'
        'client.deliver("metrics", body)\n'), {"hardware", "logs", "logs/tail", "metrics",
                                                "hparams"})
    assert found == [(1, "hardware"), (1, "logs"), (1, "metrics"), (3, "logs"), (3, "logs/tail")]


def test_the_hardware_spool_is_the_smaller_so_that_samples_are_thinned_first(
        tmp_path: Path) -> None:
    from sidecar.delivery.spool import MAX_SPOOL_BYTES
    from sidecar.pipeline import DOCUMENT_ROUTES, document_batcher

    client = IngestClient("http://127.0.0.1:9/api/ingest", (), lambda: TOKEN)
    caps = {}
    for route in DOCUMENT_ROUTES:
        spool = document_batcher(client, route, tmp_path).spool
        assert spool is not None
        caps[route] = spool.max_bytes
    assert caps == {"hardware": HARDWARE_SPOOL_BYTES, "environment": MAX_SPOOL_BYTES,
                    "environment/nodes": MAX_SPOOL_BYTES}
    assert HARDWARE_SPOOL_BYTES < MAX_SPOOL_BYTES


async def test_accepted_with_both_headers(ingest: RunningIngest) -> None:
    client = await started(ingest)
    try:
        answer = await client.post("lifecycle", lifecycle_body())
    finally:
        await client.close()
    assert answer.ok
    assert ingest.records("lifecycle")[0]["event"] == "running"


async def test_wrong_token_is_auth(ingest: RunningIngest) -> None:
    client = await started(ingest, token="wrong")
    try:
        answer = await client.post("lifecycle", lifecycle_body())
    finally:
        await client.close()
    assert answer.verdict is Verdict.AUTH
    assert ingest.records("lifecycle") == []


async def test_413_is_returned_for_the_caller_to_split(ingest: RunningIngest) -> None:
    ingest.add_fault(Fault(route="metrics", too_large_above=10))
    client = await started(ingest)
    try:
        big = await client.deliver("metrics", metrics_body(11))
        small = await client.deliver("metrics", metrics_body(10))
    finally:
        await client.close()
    assert big.verdict is Verdict.TOO_LARGE
    assert small.ok
    assert len(ingest.records("metrics")) == 1


async def test_poison_payload_is_rejected_not_retried(ingest: RunningIngest) -> None:
    ingest.add_fault(Fault(route="lifecycle", reject_if_contains="failed"))
    client = await started(ingest)
    try:
        bad = await client.deliver("lifecycle", lifecycle_body("failed"))
        good = await client.deliver("lifecycle", lifecycle_body("running"))
    finally:
        await client.close()
    assert bad.verdict is Verdict.REJECTED
    assert good.ok
    assert client.route_stats("lifecycle").requests == 2


async def test_429_retry_after_is_honoured(ingest: RunningIngest) -> None:
    ingest.add_fault(Fault(route="lifecycle", status=429, retry_after="1", times=1))
    client = await started(ingest)
    began = time.monotonic()
    try:
        answer = await client.deliver("lifecycle", lifecycle_body())
    finally:
        await client.close()
    assert answer.ok
    assert time.monotonic() - began >= 1.0
    assert client.route_stats("lifecycle").retries == 1


async def test_connection_reset_is_retried(ingest: RunningIngest) -> None:
    ingest.add_fault(Fault(route="lifecycle", reset=True, times=2))
    client = await started(ingest)
    try:
        answer = await client.deliver("lifecycle", lifecycle_body())
    finally:
        await client.close()
    assert answer.ok
    assert client.route_stats("lifecycle").failures == 2


async def test_best_effort_is_retried_until_its_sender_gives_up(ingest: RunningIngest) -> None:
    """/logs retries while its buffer has room: `give_up`, asked after each failed attempt,
    ends it (it was given up after three)."""
    ingest.add_fault(Fault(route="logs", status=500))
    client = await started(ingest)
    body = json.dumps({"run_id": RUN_ID, "chunks": ["x\n"], "eof": False}).encode()
    try:
        answer = await client.deliver(
            "logs", body, lambda: client.route_stats("logs").requests >= 5)
    finally:
        await client.close()
    assert answer.verdict is Verdict.RETRY
    assert client.route_stats("logs").requests == 5
    assert ROUTES["logs"].max_attempts is None


async def test_redirect_not_followed_and_target_untouched(ingest: RunningIngest,
                                                          tmp_path: Path) -> None:
    with running_ingest(tmp_path / "elsewhere") as elsewhere:
        ingest.add_fault(Fault(redirect=elsewhere.base_url + "/logs"))
        client = await started(ingest)
        body = json.dumps({"run_id": RUN_ID, "chunks": ["x\n"], "eof": False}).encode()
        try:
            answer = await client.deliver("logs", body)
        finally:
            await client.close()
        assert answer.verdict is Verdict.REDIRECT
        assert elsewhere.stats.total_requests == 0
        assert TOKEN not in answer.detail


async def test_401_rereads_the_token_file_and_errors_once(ingest: RunningIngest, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("expired\n")
    client = await started(ingest, read_token=lambda: token_file.read_text().strip())
    log.propagate = True
    caplog.set_level(logging.ERROR, logger="sidecar")
    try:
        delivery = asyncio.create_task(client.deliver("lifecycle", lifecycle_body()))
        await ingest.wait_for_async(lambda: ingest.stats.routes["lifecycle"].rejected.get(401,
                                    0) >= 3, 20, "three 401s")
        token_file.write_text(TOKEN + "\n")  # the Secret is rotated
        answer = await asyncio.wait_for(delivery, 30)
    finally:
        log.propagate = False
        await client.close()
    assert answer.ok
    # caplog may hold one record twice when another test attached its handler to "sidecar"
    errors = {id(r): r for r in caplog.records if "token" in r.getMessage()}
    assert len(errors) == 1  # once a minute, not once an attempt
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(("route", "kept"), [
    ("logs/tail", "the command's last output is kept and delivery retried"),
    ("metrics", "data is kept and delivery retried"),
    ("logs", "this output is dropped and counted (/logs is best-effort)"),
])
async def test_a_rejected_token_says_what_the_route_keeps(
        ingest: RunningIngest, caplog: pytest.LogCaptureFixture, route: str, kept: str) -> None:
    client = await started(ingest, token="tok-WRONG-0123456789")
    log.propagate = True
    caplog.set_level(logging.ERROR, logger="sidecar")
    try:
        answer = await client.post(route, metrics_body(1))
    finally:
        await client.close()  # which says the cause still gathering its routes
        log.propagate = False
    assert answer.verdict is Verdict.AUTH
    said = [r.getMessage() for r in caplog.records if "rejected the token" in r.getMessage()]
    assert said and f"the ingest rejected the token; {kept}" in said[0], said


# -- issue 13: answers that must not stop a sender ----------------------------------------------

@pytest.mark.parametrize("value", ["²", "-5", "1e9", "", " ", "٣"])
def test_a_malformed_retry_after_is_treated_as_absent(value: str) -> None:
    assert parse_retry_after(value) is None
    assert classify(503, value).retry_after_s is None


@pytest.mark.parametrize("value", ["²", "-5", "1e9", ""])
async def test_a_malformed_retry_after_is_retried_with_backoff(ingest: RunningIngest,
                                                               value: str) -> None:
    """`Retry-After: ²` raised inside post() and ended the sender for the rest of the run."""
    ingest.add_fault(Fault(route="lifecycle", status=503, retry_after=value, times=2))
    client = await started(ingest)
    try:
        async with asyncio.timeout(10):
            answer = await client.deliver("lifecycle", lifecycle_body())
    finally:
        await client.close()
    assert answer.ok and client.route_stats("lifecycle").retries == 2


async def test_an_unexpected_exception_in_post_is_an_answer_to_retry(
        ingest: RunningIngest, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = classify

    def flaky(status: int, retry_after: str | None) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in classification")
        return real(status, retry_after)

    monkeypatch.setattr("sidecar.delivery.client.classify", flaky)
    client = await started(ingest)
    try:
        first = await client.post("lifecycle", lifecycle_body())
        again = await client.deliver("lifecycle", lifecycle_body())
    finally:
        await client.close()
    assert first.verdict is Verdict.RETRY and "RuntimeError" in first.detail
    assert again.ok


async def test_at_most_64_kib_of_an_answer_is_read() -> None:
    """A 200 with a 400 MiB body took the wrapper to 1.5 GB RSS: it was read whole."""
    from aiohttp import web

    sent = 0

    async def huge(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        await request.read()
        response = web.StreamResponse(status=200)
        response.content_length = 256 << 20
        await response.prepare(request)
        block = b"x" * (1 << 20)
        try:
            for _ in range(256):
                await response.write(block)
                sent += len(block)
        except (ConnectionError, RuntimeError):
            pass
        return response

    app = web.Application()
    app.router.add_post("/api/ingest/lifecycle", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = await started(f"http://127.0.0.1:{port}/api/ingest")
    try:
        answer = await client.post("lifecycle", lifecycle_body())
    finally:
        await client.close()
        await runner.cleanup()
    assert answer.ok
    assert sent <= 32 << 20, f"{sent >> 20} MiB of the answer were sent to be read"


def test_the_local_ingest_takes_the_client_s_routes_and_only_those() -> None:
    """`sidecar receive` checks the routes of the client's table, each with its own check: a route
    added to ROUTES without a check fails at import, and a check no route has is found here."""
    from sidecar.commands import ingest_checks

    assert set(ingest_checks.ROUTE_NAMES) == {policy.path[1:] for policy in ROUTES.values()
                                              if policy.of_ingest}
    assert set(ingest_checks._BY_NAME) == set(ingest_checks.ROUTE_NAMES)


async def test_retried_waits_a_retry_after_whole_and_stops_at_the_policy_s_attempts() -> None:
    """One retry machine: the answer that said Retry-After is waited for as told (the sleep is
    told so, not given a wait whose sign says it), a backoff wait is not, and a row's
    max_attempts ends the retries with the last answer."""
    from sidecar.delivery.client import retried

    policy = ROUTES["metrics"]._replace(max_attempts=3, first_backoff_s=0.001,
                                        max_backoff_s=0.002)
    answers = iter([("busy", 0.01), ("busy", None), ("busy", None), ("never", None)])
    slept: list[tuple[float, bool]] = []
    retries: list[str] = []

    async def sleep(seconds: float, told: bool) -> None:
        slept.append((seconds, told))

    async def again() -> tuple[str, float | None]:
        return next(answers)

    last = await retried(policy, await again(), again, retryable=lambda a: a[0] == "busy",
                         told_s=lambda a: a[1], sleep=sleep,
                         on_retry=lambda a: retries.append(a[0]))
    assert last == ("busy", None)  # the third attempt's, the policy's last
    assert [told for _, told in slept] == [True, False]
    assert 0.01 <= slept[0][0] <= 0.015 and 0 <= slept[1][0] <= 0.002
    assert retries == ["busy", "busy"]


def test_only_the_client_holds_a_retry_loop() -> None:
    """Every retry, the ingest's routes' and the object store's PUT alike, goes through
    client.retried under a row of ROUTES: no other module imports tenacity or computes a wait."""
    import sidecar

    package = Path(sidecar.__file__).parent
    found = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or "", *(a.name for a in node.names)]
                     if isinstance(node, ast.ImportFrom) else [])
            if any(n == "tenacity" or n == "retry_wait" for n in names):
                found.add(str(path.relative_to(package)))
    assert found == {"delivery/client.py"}
