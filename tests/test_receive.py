"""The local ingest server: the rules of docs/ingest.md it enforces, what it stores, its faults,
and serve()."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.commands.receive import IngestServer, IngestStats, serve
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, running_ingest, wait_until

REPO = Path(__file__).resolve().parents[1]
TOKEN = "tok-3f9a71c2"
RUN_ID = "run-4f2a91"
TS = "2026-08-31T09:14:22+00:00"
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-StarForge-Token": TOKEN}
POINT = {"key": "train/loss", "step": 120, "value": 0.42, "ts": TS}

GOOD: dict[str, dict[str, Any]] = {
    "lifecycle": {"run_id": RUN_ID, "event": "running", "ts": TS},
    "logs": {"run_id": RUN_ID, "chunks": ["step 120 | loss 0.42\n", "héllo\n"], "eof": False},
    "metrics": {
        "run_id": RUN_ID,
        "points": [
            POINT,
            {"key": "train/reward", "step": 0, "value": 1, "ts": "2026-08-31T09:14:22Z"},
        ],
    },
    "hparams": {
        "run_id": RUN_ID,
        "params": {"optim.lr": 1e-6, "name": "grpo", "epochs": 3, "amp": True, "seed": None},
    },
    "hardware": {
        "run_id": RUN_ID,
        "node": "gpu-node-0",
        "points": [{"key": "gpu/0/utilization_percent", "value": 97.5, "ts": TS}],
    },
    "environment": {"run_id": RUN_ID, "python": "3.11.7", "packages": {"torch": "2.4.0"}},
    "environment/nodes": {"run_id": RUN_ID, "nodes": [{"node": "gpu-node-0", "gpus": 8}]},
    "validation": {
        "run_id": RUN_ID,
        "step": 120,
        "samples": [{"user": "2+2?", "assistant": "4", "reward": 0.83,
                     "extra": {"reference": "4"}}],
        "avg_reward": 0.71,
        "accuracy": 0.64,
        "chunk_index": 0,
        "total_chunks": 1,
    },
    "artifact": {
        "run_id": RUN_ID,
        "kind": "checkpoint",
        "path": "s3://bucket/runs/run-4f2a91/step-500",
        "format": "distcp",
        "step": 500,
        "size_bytes": 14203847362,
    },
    "benchmark": {"run_id": RUN_ID, "benchmark": "gsm8k", "score": 0.64},
}

MISSING = object()


def body(route: str, **changes: Any) -> dict[str, Any]:
    """A copy of the route's good body with top-level fields changed (MISSING removes one)."""
    result = copy.deepcopy(GOOD[route])
    for name, value in changes.items():
        if value is MISSING:
            del result[name]
        else:
            result[name] = value
    return result


def point(route: str, index: int = 0, **changes: Any) -> dict[str, Any]:
    """A copy of the route's good body with fields of points[index] changed."""
    result = body(route)
    result["points"] = [dict(POINT) for _ in range(index)] + result["points"][:1]
    for name, value in changes.items():
        if value is MISSING:
            del result["points"][index][name]
        else:
            result["points"][index][name] = value
    return result


@dataclass
class Answer:
    status: int
    body: Any
    headers: Mapping[str, str]


async def post(
    session: aiohttp.ClientSession,
    url: str,
    payload: Any,
    headers: Mapping[str, str] = AUTH,
    **options: Any,
) -> Answer:
    """POST JSON (or a raw str) without following redirects."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    all_headers = {"Content-Type": "application/json", **headers}
    async with session.post(
        url, data=data, headers=all_headers, allow_redirects=False, **options
    ) as response:
        return Answer(response.status, await response.json(), response.headers)


@pytest.fixture
def ingest(tmp_path: Path) -> Iterator[RunningIngest]:
    with running_ingest(tmp_path / "store", token=TOKEN, run_id=RUN_ID, faults=True) as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(GOOD))
async def test_a_valid_body_is_acknowledged_and_stored(
    ingest: RunningIngest, session: aiohttp.ClientSession, route: str
) -> None:
    answer = await post(session, ingest.url(route), GOOD[route])

    expected = {"ok": True, "inserted": 2} if route == "metrics" else {"ok": True}
    assert (answer.status, answer.body) == (200, expected)
    assert ingest.records(route) == [GOOD[route]]
    assert ingest.stats.routes[route].accepted == 1


async def test_limits_and_iso_variants_inside_the_contract_are_accepted(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    full = body("metrics", points=[dict(POINT, step=step) for step in range(2048)])
    times = ["2026-08-31T09:14:22Z", "2026-08-31T09:14:22.123456+05:30", "2026-08-31 09:14-01:00"]
    varied = body("metrics", points=[dict(POINT, ts=ts, value=10**20) for ts in times])

    assert (await post(session, ingest.url("metrics"), full)).body == {"ok": True, "inserted": 2048}
    assert (await post(session, ingest.url("metrics"), varied)).body == {"ok": True, "inserted": 3}
    assert ingest.stats.routes["metrics"].items == 2051


INVALID: list[tuple[str, Any, str]] = [
    ("lifecycle", body("lifecycle", event="started"), "event must be one of starting, running,"),
    ("lifecycle", body("lifecycle", event=MISSING), "event is required"),
    ("lifecycle", body("lifecycle", ts=MISSING), "ts is required"),
    ("lifecycle", body("lifecycle", ts="2026-08-31T09:14:22"), "ts has no timezone"),
    ("lifecycle", body("lifecycle", ts="yesterday"), "ts must be an ISO-8601 time"),
    ("lifecycle", body("lifecycle", ts=1756631662), "ts must be an ISO-8601 time"),
    ("logs", body("logs", chunks="line\n"), "chunks must be an array"),
    ("logs", body("logs", chunks=["a\n", 7]), "chunks[1] must be a string"),
    ("logs", body("logs", eof=True), "eof is set by the platform"),
    ("logs", body("logs", eof=MISSING), "eof is required"),
    ("logs", body("logs", eof=0), "eof must be false"),
    ("metrics", body("metrics", points=[]), "points must not be empty"),
    ("metrics", body("metrics", points=MISSING), "points is required"),
    ("metrics", body("metrics", points=[POINT] * 2049), "points has 2049 items, at most 2048"),
    ("metrics", body("metrics", points=["loss"]), "points[0] must be an object"),
    ("metrics", point("metrics", key=""), "points[0].key must be a non-empty string"),
    ("metrics", point("metrics", key=MISSING), "points[0].key is required"),
    ("metrics", point("metrics", step="5"), "points[0].step must be an integer"),
    ("metrics", point("metrics", step=True), "points[0].step must be an integer"),
    ("metrics", point("metrics", step=1.5), "points[0].step must be an integer"),
    ("metrics", point("metrics", value=True), "points[0].value must be a finite number"),
    ("metrics", point("metrics", value="0.4"), "points[0].value must be a finite number"),
    ("metrics", point("metrics", value=None), "points[0].value must be a finite number"),
    ("metrics", point("metrics", ts="2026-08-31T09:14:22"), "points[0].ts has no timezone"),
    ("metrics", point("metrics", index=2, step=None), "points[2].step must be an integer"),
    ("metrics", json.dumps(point("metrics", value=float("nan"))), "NaN is not a JSON number"),
    ("metrics", json.dumps(point("metrics", value=float("inf"))), "Infinity is not a JSON"),
    ("metrics", json.dumps(point("metrics", value=-float("inf"))), "-Infinity is not a JSON"),
    ("metrics", json.dumps(point("metrics")).replace("0.42", "1e999"), "1e999 overflows"),
    ("hparams", body("hparams", params=["lr"]), "params must be an object"),
    ("hparams", body("hparams", params={"a": {"b": 1}}), "params.a must be a string, number,"),
    ("hparams", body("hparams", params={"a": [1]}), "params.a must be a string, number,"),
    ("hparams", body("hparams", params=MISSING), "params is required"),
    ("hardware", body("hardware", node=MISSING), "node is required"),
    ("hardware", body("hardware", node=""), "node must be a non-empty string"),
    ("hardware", body("hardware", points=[]), "points must not be empty"),
    ("hardware", point("hardware", value="97"), "points[0].value must be a finite number"),
    ("hardware", point("hardware", ts="2026-08-31T09:14"), "points[0].ts has no timezone"),
    ("hardware", point("hardware", key=MISSING), "points[0].key is required"),
    ("environment/nodes", body("environment/nodes", nodes=[]), "nodes must not be empty"),
    ("environment/nodes", body("environment/nodes", nodes=[1]), "nodes[0] must be an object"),
    ("environment/nodes", body("environment/nodes", nodes=MISSING), "nodes is required"),
    ("validation", body("validation", step="1"), "step must be an integer"),
    ("validation", body("validation", samples=MISSING), "samples is required"),
    ("validation", body("validation", samples={}), "samples must be an array"),
    ("validation", body("validation", samples=[{"user": "q", "assistant": "a"}]),
     "samples[0].reward is required"),
    ("validation", body("validation", samples=[{"user": 1, "assistant": "a", "reward": 1}]),
     "samples[0].user must be a string"),
    ("validation", body("validation", avg_reward=MISSING), "avg_reward is required"),
    ("validation", body("validation", accuracy=1.5), "accuracy must be a number from 0 to 1"),
    ("validation", body("validation", chunk_index=1), "chunk_index must be an integer from 0"),
    ("validation", body("validation", total_chunks=0), "total_chunks must be an integer, 1"),
    ("artifact", body("artifact", kind="weights"), "kind must be one of checkpoint, hf_export,"),
    ("artifact", body("artifact", format=""), "format must be a non-empty string"),
    ("artifact", body("artifact", path=MISSING), "path is required"),
    ("artifact", body("artifact", step=-1), "step must be an integer, 0 or more"),
    ("artifact", body("artifact", step=None), "step must be an integer"),
    ("artifact", body("artifact", size_bytes="12"), "size_bytes must be an integer"),
    ("lifecycle", body("lifecycle", run_id=MISSING), "run_id is required"),
    ("logs", body("logs", run_id=""), "run_id must be a non-empty string"),
    ("hparams", body("hparams", run_id=7), "run_id must be a non-empty string"),
    ("environment", body("environment", run_id="run-other"), "run_id mismatch"),
    ("benchmark", "[]", "body must be a JSON object"),
    ("benchmark", '{"run_id": ', "body is not valid JSON"),
    ("environment", "", "body is not valid JSON"),
]


@pytest.mark.parametrize(
    ("route", "payload", "reason"), INVALID, ids=[reason for _, _, reason in INVALID]
)
async def test_an_invalid_body_is_rejected_with_a_reason_naming_the_field(
    ingest: RunningIngest, session: aiohttp.ClientSession, route: str, payload: Any, reason: str
) -> None:
    answer = await post(session, ingest.url(route), payload)

    assert answer.status == 400
    assert answer.body["ok"] is False
    assert reason in answer.body["error"]
    assert ingest.records(route) == []
    stats = ingest.stats.routes[route]
    assert (stats.accepted, stats.rejected) == (0, {400: 1})


async def test_a_body_beyond_the_size_limit_is_413(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    huge = body("logs", chunks=["x" * (17 * 1024 * 1024)])

    answer = await post(session, ingest.url("logs"), huge)

    assert answer.status == 413
    assert "body larger than" in answer.body["error"]
    assert ingest.records("logs") == []


async def test_paths_outside_the_routes_are_404_and_other_methods_405(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    root = ingest.base_url.removesuffix("/api/ingest")
    for path in ("/api/ingest/nope", "/api/ingest", "/"):
        answer = await post(session, root + path, GOOD["lifecycle"])
        assert (answer.status, answer.body["ok"]) == (404, False), path
    async with session.get(ingest.url("lifecycle"), headers=AUTH) as response:
        assert (response.status, response.headers["Allow"]) == (405, "POST")
    answer = await post(session, ingest.url("artifact/upload-url"), GOOD["lifecycle"])
    assert answer.status == 405  # a GET

    stats = ingest.stats
    assert (stats.total_requests, stats.not_found) == (5, 3)
    assert stats.routes["lifecycle"].rejected == {405: 1}


async def test_a_custom_prefix_moves_every_route(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    with running_ingest(tmp_path, token=TOKEN, prefix="/v2/ingest/") as server:
        assert server.base_url.endswith("/v2/ingest")
        moved = await post(session, server.url("lifecycle"), GOOD["lifecycle"])
        old = await post(session, server.url("lifecycle").replace("v2", "api"), GOOD["lifecycle"])

    assert (moved.status, old.status) == (200, 404)


# -- auth ------------------------------------------------------------------------------------------

BEARER = {"Authorization": f"Bearer {TOKEN}"}
AUTH_CASES: list[tuple[str, dict[str, str], int]] = [
    ("no headers", {}, 401),
    ("wrong bearer", {"Authorization": "Bearer tok-wrong"}, 401),
    ("basic scheme", {"Authorization": f"Basic {TOKEN}"}, 401),
    ("empty bearer", {"Authorization": "Bearer "}, 401),
    ("family header alone", {"X-StarForge-Token": TOKEN}, 401),
    ("wrong StarForge header", {**BEARER, "X-StarForge-Token": "tok-wrong"}, 401),
    ("wrong TunePlane header", {**BEARER, "X-TunePlane-Token": "tok-wrong"}, 401),
    ("bearer alone", BEARER, 200),
    ("lower-case scheme", {"Authorization": f"bearer {TOKEN}"}, 200),
    ("bearer and StarForge header", {**BEARER, "X-StarForge-Token": TOKEN}, 200),
    ("bearer and TunePlane header", {**BEARER, "X-TunePlane-Token": TOKEN}, 200),
]


@pytest.mark.parametrize(
    ("headers", "status"),
    [case[1:] for case in AUTH_CASES],
    ids=[case[0] for case in AUTH_CASES],
)
async def test_the_token_is_checked_in_the_bearer_and_the_family_header(
    ingest: RunningIngest, session: aiohttp.ClientSession, headers: dict[str, str], status: int
) -> None:
    answer = await post(session, ingest.url("lifecycle"), GOOD["lifecycle"], headers)

    assert answer.status == status
    assert len(ingest.records("lifecycle")) == (status == 200)
    if status == 401:
        assert TOKEN not in json.dumps(answer.body)
        assert ingest.stats.routes["lifecycle"].rejected == {401: 1}


async def test_auth_is_checked_before_the_body(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    answer = await post(session, ingest.url("metrics"), "not json", headers={})

    assert answer.status == 401


async def test_without_a_configured_token_any_consistent_bearer_is_accepted(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    anyone = {"Authorization": "Bearer whatever", "X-TunePlane-Token": "whatever"}
    with running_ingest(tmp_path) as server:
        accepted = await post(session, server.url("lifecycle"), body("lifecycle"), anyone)
        other_run = await post(
            session, server.url("lifecycle"), body("lifecycle", run_id="x"), anyone
        )
        missing = await post(session, server.url("lifecycle"), GOOD["lifecycle"], {})
        mismatched = {**anyone, "X-TunePlane-Token": "something-else"}
        inconsistent = await post(session, server.url("lifecycle"), GOOD["lifecycle"], mismatched)

    assert [a.status for a in (accepted, other_run, missing, inconsistent)] == [200, 200, 401, 401]


def test_an_empty_token_is_refused_rather_than_meaning_no_auth(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token must be non-empty"):
        IngestServer(tmp_path, token="")


# -- the store and the counters ----------------------------------------------------------------


async def test_the_store_holds_exactly_the_accepted_bodies_in_arrival_order(
    ingest: RunningIngest, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sent = [
        ("lifecycle", body("lifecycle", event="starting")),
        ("metrics", GOOD["metrics"]),
        ("metrics", point("metrics", value="bad")),
        ("logs", GOOD["logs"]),
        ("environment/nodes", GOOD["environment/nodes"]),
        ("lifecycle", body("lifecycle", event="running")),
        ("logs", body("logs", chunks=["second\n"])),
        ("lifecycle", body("lifecycle", event="succeeded")),
    ]
    for route, payload in sent:
        await post(session, ingest.url(route), payload)

    store = tmp_path / "store"
    expected_files = {"lifecycle.jsonl", "metrics.jsonl", "logs.jsonl", "environment_nodes.jsonl",
                      "rejected.jsonl"}
    assert {path.name for path in store.iterdir()} == expected_files
    for route in ("lifecycle", "metrics", "logs", "environment/nodes"):
        lines = (store / (route.replace("/", "_") + ".jsonl")).read_text().splitlines()
        accepted = [p for r, p in sent if r == route and p is not sent[2][1]]
        assert [json.loads(line) for line in lines] == accepted, route
        assert ingest.records(route) == accepted


def test_records_of_an_unknown_route_is_an_error(ingest: RunningIngest) -> None:
    with pytest.raises(ValueError, match="unknown route 'metric'"):
        ingest.records("metric")


async def test_counters_follow_every_request(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    for _ in range(3):
        await post(session, ingest.url("lifecycle"), GOOD["lifecycle"])
    await post(session, ingest.url("logs"), body("logs", chunks=["héllo\n", "ok\n"]))
    await post(session, ingest.url("metrics"), body("metrics", points=[POINT] * 3))
    await post(session, ingest.url("metrics"), point("metrics", step="x"))
    await post(session, ingest.url("metrics"), GOOD["metrics"], headers={})
    await post(session, ingest.base_url + "/nope", GOOD["metrics"])

    stats = ingest.stats
    assert stats.total_requests == 8
    assert stats.not_found == 1
    assert stats.routes["logs"].items == 2
    assert stats.routes["logs"].log_bytes == len("héllo\nok\n".encode())
    metrics = stats.routes["metrics"]
    assert (metrics.accepted, metrics.items, metrics.rejected) == (1, 3, {400: 1, 401: 1})
    assert stats.summary() == (
        "lifecycle 3 | logs 2 chunks 10 B | metrics 3 points | rejected 3: metrics 400 "
        'points[0].step must be an integer, got "x"; metrics 401 missing Authorization: Bearer '
        "<token>; /api/ingest/nope 404 no ingest route at /api/ingest/nope (rejected.jsonl)")


async def test_each_rejected_request_is_kept_with_its_route_status_and_reason(
    ingest: RunningIngest, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    bad = point("metrics", step="x")
    await post(session, ingest.url("metrics"), bad)
    await post(session, ingest.url("lifecycle"), GOOD["lifecycle"], headers={})
    await post(session, ingest.url("lifecycle"), GOOD["lifecycle"], headers={})
    await post(session, ingest.url("metrics"), GOOD["metrics"])

    lines = (tmp_path / "store" / "rejected.jsonl").read_text().splitlines()
    kept = [json.loads(line) for line in lines]
    assert [(k["route"], k["status"], k["reason"]) for k in kept] == [
        ("metrics", 400, 'points[0].step must be an integer, got "x"'),
        ("lifecycle", 401, "missing Authorization: Bearer <token>"),
        ("lifecycle", 401, "missing Authorization: Bearer <token>"),
    ]
    assert json.loads(kept[0]["body"]) == bad and kept[0]["method"] == "POST"
    assert TOKEN not in "".join(lines)
    assert ingest.records("metrics") == [GOOD["metrics"]]
    assert ingest.stats.summary() == (
        'metrics 2 points | rejected 3: metrics 400 points[0].step must be an integer, got "x"; '
        "2x lifecycle 401 missing Authorization: Bearer <token> (rejected.jsonl)")


async def test_validation_rounds_are_counted_once_every_chunk_arrived(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    for step, index, total in ((5, 0, 2), (6, 0, 1), (5, 0, 2), (7, 0, 2), (5, 1, 2)):
        chunk = body("validation", step=step, chunk_index=index, total_chunks=total)
        assert (await post(session, ingest.url("validation"), chunk)).status == 200

    # step 5 is whole (chunk 0 twice: at least once), step 6 of one chunk, step 7 half
    assert ingest.stats.summary() == "validation 5 samples in 2 rounds"
    assert len(ingest.records("validation")) == 5


def test_the_summary_line_names_routes_items_and_sizes() -> None:
    stats = IngestStats()
    assert stats.summary() == ""
    stats.routes["lifecycle"].accepted = 3
    stats.routes["logs"].accepted, stats.routes["logs"].items = 2, 12
    stats.routes["logs"].log_bytes = 4100
    stats.routes["metrics"].accepted, stats.routes["metrics"].items = 1, 2048
    stats.routes["metrics"].rejected = {413: 1}

    stats.reject("metrics", 413, "2049 items, at most 2048 accepted")
    expected = ("lifecycle 3 | logs 12 chunks 4.1 KB | metrics 2048 points | rejected 1: "
                "metrics 413 2049 items, at most 2048 accepted (rejected.jsonl)")
    assert stats.summary() == expected


# -- faults --------------------------------------------------------------------------------------


async def test_a_status_fault_answers_with_retry_after_and_stores_nothing(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    ingest.add_fault(Fault(route="lifecycle", status=503, retry_after="2", times=1))

    other_route = await post(session, ingest.url("metrics"), GOOD["metrics"])
    refused = await post(session, ingest.url("lifecycle"), GOOD["lifecycle"])
    assert ingest.records("lifecycle") == []
    retried = await post(session, ingest.url("lifecycle"), GOOD["lifecycle"])

    assert other_route.status == 200
    assert (refused.status, refused.headers["Retry-After"]) == (503, "2")
    assert refused.body == {"ok": False, "error": "injected fault: status 503"}
    assert retried.status == 200
    assert ingest.records("lifecycle") == [GOOD["lifecycle"]]
    assert ingest.stats.routes["lifecycle"].rejected == {503: 1}


@pytest.mark.parametrize(
    "fault",
    [
        {"status": 500},
        {"status": 401},
        {"status": 403},
        {"status": 400},
        {"status": 429, "retry_after": "Wed, 21 Oct 2026 07:28:00 GMT"},
    ],
)
async def test_faults_are_set_and_cleared_over_the_control_route(
    ingest: RunningIngest, session: aiohttp.ClientSession, fault: dict[str, Any]
) -> None:
    control = ingest.base_url.removesuffix("/api/ingest") + "/_control/faults"
    async with session.post(control, json={"route": "*", **fault}) as response:
        assert response.status == 200

    faulted = await post(session, ingest.url("hparams"), GOOD["hparams"])
    async with session.delete(control) as response:
        assert response.status == 200
    cleared = await post(session, ingest.url("hparams"), GOOD["hparams"])

    assert faulted.status == fault["status"]
    assert faulted.headers.get("Retry-After") == fault.get("retry_after")
    assert cleared.status == 200
    assert ingest.records("hparams") == [GOOD["hparams"]]


async def test_the_control_route_refuses_a_bad_fault_and_is_absent_without_faults(
    ingest: RunningIngest, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    control = ingest.base_url.removesuffix("/api/ingest") + "/_control/faults"
    async with session.post(control, json={"status": 500, "colour": "red"}) as response:
        assert response.status == 400
        assert "unknown fault fields: colour" in (await response.json())["error"]

    with running_ingest(tmp_path / "plain") as plain:
        plain_control = plain.base_url.removesuffix("/api/ingest") + "/_control/faults"
        async with session.post(plain_control, json={"status": 500}) as response:
            assert response.status == 404
        assert (await post(session, plain.url("lifecycle"), GOOD["lifecycle"])).status == 200


async def test_too_large_answers_413_above_n_and_stores_smaller_batches(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    ingest.add_fault(Fault(route="*", too_large_above=4))
    five, four = [POINT] * 5, [POINT] * 4

    answers = [
        await post(session, ingest.url("metrics"), body("metrics", points=five)),
        await post(session, ingest.url("metrics"), body("metrics", points=four)),
        await post(session, ingest.url("metrics"), body("metrics", points=[POINT] * 2049)),
        await post(session, ingest.url("logs"), body("logs", chunks=["x\n"] * 5)),
        await post(session, ingest.url("logs"), body("logs", chunks=["x\n"] * 3)),
        await post(session, ingest.url("lifecycle"), GOOD["lifecycle"]),
    ]

    assert [a.status for a in answers] == [413, 200, 413, 413, 200, 200]
    assert ingest.records("metrics") == [body("metrics", points=four)]
    assert ingest.records("logs") == [body("logs", chunks=["x\n"] * 3)]
    assert ingest.stats.routes["metrics"].rejected == {413: 2}


async def test_a_conditional_fault_spends_its_times_only_when_it_fires(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    ingest.add_fault(Fault(route="metrics", too_large_above=1, times=1))
    small, large = body("metrics", points=[POINT]), body("metrics", points=[POINT] * 2)

    statuses = [
        (await post(session, ingest.url("metrics"), p)).status for p in (small, large, large)
    ]

    assert statuses == [200, 413, 200]


async def test_latency_delays_the_answer(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    ingest.add_fault(Fault(route="metrics", latency_s=0.3, times=1))

    started = time.monotonic()
    answer = await post(session, ingest.url("metrics"), GOOD["metrics"])

    assert time.monotonic() - started >= 0.3
    assert answer.status == 200
    assert ingest.records("metrics") == [GOOD["metrics"]]


async def test_a_hang_times_the_client_out_without_blocking_the_server_or_its_stop(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    with running_ingest(tmp_path, token=TOKEN, faults=True) as server:
        server.add_fault(Fault(route="metrics", latency_s=600))
        hung = asyncio.create_task(post(session, server.url("metrics"), GOOD["metrics"]))
        other = await post(session, server.url("lifecycle"), GOOD["lifecycle"])
        assert not hung.done()
        with pytest.raises(TimeoutError):
            await post(
                session,
                server.url("metrics"),
                GOOD["metrics"],
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
        stopping = time.monotonic()
    stop_s = time.monotonic() - stopping

    assert other.status == 200
    assert stop_s < 5
    with pytest.raises(aiohttp.ClientConnectionError):
        await hung


async def test_a_redirect_is_answered_and_the_target_receives_nothing(
    ingest: RunningIngest, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with running_ingest(tmp_path / "elsewhere", token=TOKEN) as elsewhere:
        target = elsewhere.url("lifecycle")
        ingest.add_fault(Fault(route="lifecycle", redirect=target))
        answer = await post(session, ingest.url("lifecycle"), GOOD["lifecycle"])
        assert elsewhere.stats.total_requests == 0

    assert (answer.status, answer.headers["Location"]) == (307, target)
    assert ingest.records("lifecycle") == []
    assert ingest.stats.routes["lifecycle"].rejected == {307: 1}


async def test_a_reset_aborts_the_connection_without_an_answer(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    ingest.add_fault(Fault(route="lifecycle", reset=True, times=1))

    with pytest.raises(aiohttp.ClientConnectionError):
        await post(session, ingest.url("lifecycle"), GOOD["lifecycle"])
    assert ingest.records("lifecycle") == []
    assert ingest.stats.routes["lifecycle"].aborted == 1
    assert (await post(session, ingest.url("lifecycle"), GOOD["lifecycle"])).status == 200


async def test_a_poison_payload_is_rejected_while_others_pass(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    ingest.add_fault(Fault(route="logs", reject_if_contains="POISON"))
    first, poison, last = (body("logs", chunks=[text]) for text in ("a\n", "POISON\n", "b\n"))

    answers = [await post(session, ingest.url("logs"), p) for p in (first, poison, last)]

    assert [a.status for a in answers] == [200, 400, 200]
    assert "poison" in answers[1].body["error"]
    assert ingest.records("logs") == [first, last]


async def test_stop_listening_refuses_connections_until_start_listening(
    ingest: RunningIngest, session: aiohttp.ClientSession
) -> None:
    url = ingest.url("lifecycle")
    assert (await post(session, url, GOOD["lifecycle"])).status == 200

    ingest.stop_listening()
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(session, url, GOOD["lifecycle"])  # its kept-alive connection is closed too
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await post(fresh, url, GOOD["lifecycle"])
    ingest.start_listening()

    assert isinstance(refused.value.os_error, ConnectionRefusedError)
    assert ingest.url("lifecycle") == url
    assert (await post(session, url, GOOD["lifecycle"])).status == 200
    assert len(ingest.records("lifecycle")) == 2


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({}, "exactly one of"),
        ({"status": 500, "reset": True}, "exactly one of"),
        ({"route": "metric", "status": 500}, "route='metric'"),
        ({"status": 99}, "status=99"),
        ({"status": 600}, "status=600"),
        ({"status": 500, "times": 0}, "times=0"),
        ({"reset": True, "retry_after": "2"}, "retry_after='2'"),
        ({"latency_s": -1}, "latency_s=-1"),
        ({"too_large_above": -1}, "too_large_above=-1"),
        ({"redirect": ""}, "redirect=''"),
        ({"reject_if_contains": ""}, "reject_if_contains=''"),
    ],
)
def test_a_malformed_fault_is_refused(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Fault.from_json(fields)


# -- the in-process API, the fixture, and serve() -------------------------------------------------


async def test_the_server_runs_on_the_callers_loop(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    server = IngestServer(tmp_path, token=TOKEN)
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.base_url
    await server.start()
    try:
        await server.stop_listening()
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectorError):
                await post(fresh, server.base_url + "/lifecycle", GOOD["lifecycle"])
        await server.start_listening()
        answer = await post(session, server.base_url + "/lifecycle", GOOD["lifecycle"])
    finally:
        await server.stop()

    assert answer.status == 200
    assert server.records("lifecycle") == [GOOD["lifecycle"]]


def test_wait_for_fails_with_what_the_ingest_received(ingest: RunningIngest) -> None:
    with pytest.raises(AssertionError) as failure:
        ingest.wait_for(lambda: bool(ingest.records("lifecycle")), 0.05, "a lifecycle post")

    assert str(failure.value) == (
        "not met within 0.05 s: a lifecycle post; the ingest received 0 requests: "
        "nothing accepted; rejected by status: {}"
    )


def _post_sync(url: str, payload: dict[str, Any], token: str) -> int:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


SERVE = (
    "import sys; from pathlib import Path; from sidecar.commands.receive import serve; "
    "sys.exit(serve(Path(sys.argv[1]), host='127.0.0.1', port=0, token=sys.argv[2], "
    "run_id='run-4f2a91', ready_file=Path(sys.argv[3])))"
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_announces_itself_writes_the_ready_file_and_stops_cleanly(
    tmp_path: Path, signum: signal.Signals
) -> None:
    store, ready = tmp_path / "store", tmp_path / "ready" / "url"
    ready.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", SERVE, str(store), TOKEN, str(ready)]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as process:
        try:
            wait_until(lambda: ready.exists() or process.poll() is not None, 20, "ready file")
            assert process.poll() is None, process.communicate()
            url = ready.read_text().strip()
            assert _post_sync(url + "/lifecycle", GOOD["lifecycle"], TOKEN) == 200
            assert _post_sync(url + "/lifecycle", GOOD["lifecycle"], "tok-wrong") == 401
            process.send_signal(signum)
            out, err = process.communicate(timeout=20)
        finally:
            process.kill()

    assert process.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == f"receiving on {url}, storing in {store}"
    assert url.startswith("http://127.0.0.1:") and url.endswith("/api/ingest")
    assert lines[-1] == "lifecycle 1 | rejected 1: lifecycle 401 bearer token rejected " \
        "(rejected.jsonl)"
    assert TOKEN not in out + err
    assert os.listdir(ready.parent) == ["url"]
    stored = (store / "lifecycle.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in stored] == [GOOD["lifecycle"]]


def _control_sync(url: str, method: str, fault: dict[str, Any] | None = None) -> int:
    request = urllib.request.Request(url, data=json.dumps(fault).encode() if fault else None,
                                     method=method)
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


def test_the_faulty_ingest_runs_the_receiver_with_faults_armed_over_http(tmp_path: Path) -> None:
    store, ready = tmp_path / "store", tmp_path / "url"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tests.faulty_ingest", "--port", "0", "--dir", str(store),
               "--token", TOKEN, "--ready-file", str(ready), "--quiet"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=REPO) as process:
        try:
            wait_until(lambda: ready.exists() or process.poll() is not None, 20, "ready file")
            assert process.poll() is None, process.communicate()
            url = ready.read_text().strip()
            control = url.removesuffix("/api/ingest") + "/_control/faults"
            armed = _control_sync(control, "POST", {"route": "lifecycle", "status": 503})
            faulted = _post_sync(url + "/lifecycle", GOOD["lifecycle"], TOKEN)
            cleared = _control_sync(control, "DELETE")
            healed = _post_sync(url + "/lifecycle", GOOD["lifecycle"], TOKEN)
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=20)
        finally:
            process.kill()

    assert (armed, faulted, cleared, healed) == (200, 503, 200, 200)
    assert process.returncode == 0, err
    stored = (store / "lifecycle.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in stored] == [GOOD["lifecycle"]]


def test_serve_on_a_busy_port_says_so_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status = serve(tmp_path / "store", host="127.0.0.1", port=port, token=TOKEN, run_id=None)

    captured = capsys.readouterr()
    assert status == 1
    assert not (tmp_path / "store").exists(), "--dir is created only once the port is had"
    assert f"cannot start receiving on 127.0.0.1:{port}" in captured.err
    assert "address already in use" in captured.err
    assert TOKEN not in captured.out + captured.err


def test_serve_with_a_dir_it_cannot_create_names_it_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    store = tmp_path / "file" / "store"
    status = serve(store, host="127.0.0.1", port=0, token=TOKEN, run_id=None)

    assert status == 1
    assert f"cannot store in --dir {store}: Not a directory" in capsys.readouterr().err
