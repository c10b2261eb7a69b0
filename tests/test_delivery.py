"""Batcher and Ticket: at-least-once, in-order delivery of /metrics against the loopback ingest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from sidecar.delivery.batcher import Batcher
from sidecar.delivery.client import IngestClient
from sidecar.delivery.logs import LogShipper
from sidecar.records import MAX_POINTS_PER_REQUEST, Ticket
from tests.conftest import RUN_ID, TOKEN
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest

TS = "2026-11-30T10:00:00+00:00"
FLUSH_S = 10.0


def point(step: int, key: str = "loss") -> dict[str, Any]:
    return {"key": key, "step": step, "value": step / 10, "ts": TS}


def wrap(points: list[Any]) -> dict[str, Any]:
    return {"run_id": RUN_ID, "points": points}


@asynccontextmanager
async def delivering(ingest: RunningIngest, run_dir: Path, **options: Any
                     ) -> AsyncIterator[Batcher]:
    """A started /metrics Batcher on a real IngestClient; stopped and closed afterwards."""
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    batcher = Batcher(client, "metrics", wrap, run_dir, **options)
    batcher.start()
    try:
        yield batcher
    finally:
        await batcher.stop()
        await client.close()


def received(ingest: RunningIngest) -> list[dict[str, Any]]:
    """Every point the ingest accepted, in arrival order."""
    return [p for body in ingest.records("metrics") for p in body["points"]]


def request_sizes(ingest: RunningIngest) -> list[int]:
    return [len(body["points"]) for body in ingest.records("metrics")]


def dead_letters(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "dead-letter.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = FLUSH_S) -> None:
    """Poll `condition` while the event loop keeps running; AssertionError after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"not met within {timeout:g} s: {what}"
        await asyncio.sleep(0.01)


def refused_attempts(batcher: Batcher) -> int:
    return batcher.client.route_stats("metrics").failures


# --- healthy ingest ----------------------------------------------------------------------------


async def test_every_point_arrives_once_in_order_in_batches_of_at_most_2048(
        ingest: RunningIngest, tmp_path: Path) -> None:
    async with delivering(ingest, tmp_path / "run") as batcher:
        batcher.push([point(i) for i in range(5000)])
        for start in range(5000, 6000, 100):  # and some in small pieces
            await batcher.put([point(i) for i in range(start, start + 100)])
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == list(range(6000))
    sizes = request_sizes(ingest)
    assert max(sizes) == MAX_POINTS_PER_REQUEST == 2048
    assert len(sizes) < 6000 // 100  # batched, not one request per put
    assert ingest.stats.routes["metrics"].rejected == {}
    assert batcher.delivered == 6000 and batcher.dead_lettered == 0
    assert batcher.queued == 0


async def test_values_the_fast_encoder_refuses_still_arrive_exactly(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """orjson encodes the bulk; an integer beyond 64 bits (a JSONL step may be one) falls back
    to the standard encoder instead of failing the batch."""
    huge = 2**70 + 1
    async with delivering(ingest, tmp_path / "run") as batcher:
        batcher.push([point(1), {**point(2), "step": huge}])
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == [1, huge]
    assert batcher.delivered == 2 and batcher.dead_lettered == 0


async def test_flush_with_nothing_queued_returns_at_once(
        ingest: RunningIngest, tmp_path: Path) -> None:
    async with delivering(ingest, tmp_path / "run") as batcher:
        batcher.push([])
        assert await batcher.flush(1.0)
        assert batcher.queued == 0
        assert batcher.client.route_stats("metrics").requests == 0
    assert ingest.stats.total_requests == 0


# --- 413 ---------------------------------------------------------------------------------------


async def test_413_splits_batches_until_they_fit_and_everything_arrives(
        ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="metrics", too_large_above=100))
    async with delivering(ingest, tmp_path / "run") as batcher:
        batcher.push([point(i) for i in range(3000)])
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == list(range(3000))
    assert max(request_sizes(ingest)) <= 100
    assert ingest.stats.routes["metrics"].rejected.get(413, 0) > 0
    assert dead_letters(tmp_path / "run") == []
    assert batcher.dead_lettered == 0


async def test_413_splits_down_to_single_points(ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="metrics", too_large_above=1))
    async with delivering(ingest, tmp_path / "run") as batcher:
        batcher.push([point(i) for i in range(37)])
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == list(range(37))
    assert set(request_sizes(ingest)) == {1}


# --- permanent rejection -------------------------------------------------------------------------


async def test_poison_point_is_dead_lettered_alone_and_the_rest_flows_past(
        ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="metrics", reject_if_contains="poison"))
    run_dir = tmp_path / "run"
    points = [point(i, "poison/grad" if i == 1234 else "loss") for i in range(3000)]
    done: list[int] = []
    async with delivering(ingest, run_dir) as batcher:
        ticket = Ticket(lambda: done.append(batcher.delivered))
        batcher.push(points, ticket)
        ticket.seal()
        assert await batcher.flush(FLUSH_S)
        batcher.push([point(i) for i in range(3000, 3500)])  # later batches are not held up
        assert await batcher.flush(FLUSH_S)
    good = [p for p in points if p["key"] != "poison/grad"]
    assert received(ingest) == good + [point(i) for i in range(3000, 3500)]
    letters = dead_letters(run_dir)
    assert len(letters) == 1
    assert letters[0]["route"] == "metrics" and letters[0]["status"] == 400
    assert json.loads(letters[0]["body"]) == wrap([points[1234]])
    assert (batcher.delivered, batcher.dead_lettered) == (3499, 1)
    assert done == [2999]  # a dead-lettered point is settled: the ticket completes


# --- tickets -----------------------------------------------------------------------------------


async def test_ticket_over_several_requests_is_done_once_after_every_item_is_acknowledged(
        ingest: RunningIngest, tmp_path: Path) -> None:
    done: list[int] = []
    async with delivering(ingest, tmp_path / "run", max_items=10) as batcher:
        ticket = Ticket(lambda: done.append(batcher.delivered))
        batcher.push([point(i) for i in range(15)], ticket)
        await ingest.wait_for_async(lambda: len(received(ingest)) == 15, what="first part")
        assert done == []  # not sealed: more parts may follow

        ingest.stop_listening()
        batcher.push([point(i) for i in range(15, 30)], ticket)
        ticket.seal()
        await wait_until(lambda: refused_attempts(batcher) >= 1, "an attempt while stopped")
        assert done == []  # the second part is not acknowledged
        assert len(received(ingest)) == 15

        ingest.start_listening()
        await wait_until(lambda: done != [], "on_done after the ingest came back")
        assert await batcher.flush(FLUSH_S)
        batcher.push([point(30)])  # unrelated later work does not call it again
        assert await batcher.flush(FLUSH_S)
    assert done == [30]
    assert [p["step"] for p in received(ingest)] == list(range(31))
    assert max(request_sizes(ingest)) <= 10


async def test_tickets_complete_independently(ingest: RunningIngest, tmp_path: Path) -> None:
    done: list[str] = []
    async with delivering(ingest, tmp_path / "run", max_items=4) as batcher:
        first, second = Ticket(lambda: done.append("first")), Ticket(lambda: done.append("second"))
        batcher.push([point(i) for i in range(6)], first)
        batcher.push([point(i) for i in range(6, 9)], second)
        second.seal()
        await wait_until(lambda: done == ["second"], "the second ticket alone")
        first.seal()
        assert done == ["second", "first"]  # its items were all acknowledged already
        assert await batcher.flush(FLUSH_S)
    assert done == ["second", "first"]


def test_sealed_ticket_without_items_is_done_at_once() -> None:
    done: list[bool] = []
    ticket = Ticket(lambda: done.append(True))
    assert done == []
    ticket.seal()
    assert done == [True]


# --- back-pressure -----------------------------------------------------------------------------


async def test_put_waits_while_full_and_resumes_as_items_are_acknowledged(
        ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.stop_listening()
    async with delivering(ingest, tmp_path / "run", max_queued=5, max_items=2) as batcher:
        assert batcher.offer([point(i) for i in range(5)])
        assert not batcher.has_room
        assert not batcher.offer([point(99)])  # refused when full, and not queued
        assert batcher.queued == 5
        waiting = asyncio.create_task(batcher.put([point(i) for i in range(5, 8)]))
        await wait_until(lambda: refused_attempts(batcher) >= 1, "an attempt while stopped")
        assert not waiting.done()
        assert batcher.queued == 5
        assert not await batcher.flush(0.05)

        ingest.start_listening()
        await asyncio.wait_for(waiting, FLUSH_S)
        assert await batcher.flush(FLUSH_S)
        assert batcher.offer([point(8)])
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == list(range(9))
    assert max(request_sizes(ingest)) <= 2


async def test_offer_takes_items_while_there_is_room(
        ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.stop_listening()
    async with delivering(ingest, tmp_path / "run", max_queued=3) as batcher:
        assert batcher.offer([point(0)])
        assert batcher.offer([point(1), point(2)])
        assert batcher.queued == 3
        assert not batcher.offer([point(3)])
        ingest.start_listening()
        assert await batcher.flush(FLUSH_S)
        assert batcher.offer([point(3)])
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == [0, 1, 2, 3]


# --- bugs found --------------------------------------------------------------------------------


async def test_unwritable_dead_letter_file_does_not_stop_delivery(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """A dead letter that cannot be written (here: its folder is gone, as with a removed or
    full state dir) must not end the delivery task: later batches still go out."""
    ingest.add_fault(Fault(route="metrics", reject_if_contains="poison"))
    run_dir = tmp_path / "run"
    async with delivering(ingest, run_dir) as batcher:
        await asyncio.to_thread(run_dir.rmdir)
        batcher.push([point(i, "poison" if i == 3 else "loss") for i in range(10)])
        batcher.push([point(i) for i in range(10, 20)])
        delivered = await batcher.flush(3.0)
    assert delivered
    assert [p["step"] for p in received(ingest)] == [i for i in range(20) if i != 3]


async def test_a_point_after_a_quiet_spell_goes_at_once_and_a_trickle_waits_for_the_pace(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Every point was its own request when points came one at a time (10 a second: 10
    requests a second at the ingest). Now a point after a quiet spell still goes at once, and
    while points keep coming they wait for the pace (here 60 s, so that the count cannot
    depend on the machine's speed): a trickle of 20 points is 2 requests, the first point alone
    and the rest when the flush hurries them, each point once, in order."""
    async with delivering(ingest, tmp_path / "run", pace_s=60.0) as batcher:
        await batcher.put([point(0)])
        await wait_until(lambda: len(received(ingest)) == 1, "the lone point arrived",
                         timeout=30.0)
        for step in range(1, 20):
            await batcher.put([point(step)])
            await asyncio.sleep(0.01)  # a trickle, not a batch: the batcher runs in between
        assert batcher.queued == 19  # held for the pace, not sent one by one
        assert await batcher.flush(FLUSH_S)
    assert [p["step"] for p in received(ingest)] == list(range(20))
    assert request_sizes(ingest) == [1, 19]


async def test_a_full_batch_does_not_wait_for_the_pace(ingest: RunningIngest,
                                                       tmp_path: Path) -> None:
    """A flood is not held back by the pace: full requests go back to back, and the small
    batch at its end goes after the short linger, not a pace later."""
    async with delivering(ingest, tmp_path / "run", pace_s=60.0, max_items=100) as batcher:
        await batcher.put([point(step) for step in range(250)])
        await wait_until(lambda: len(received(ingest)) == 250, "the flood arrived",
                         timeout=30.0)
    assert request_sizes(ingest) == [100, 100, 50]


async def test_log_text_after_a_quiet_spell_goes_at_once_and_a_trickle_waits_for_the_pace(
        ingest: RunningIngest) -> None:
    """/logs as /metrics: a line after a quiet spell is sent at once, and a trickle of lines
    (each its own write: 14 to 18 requests a second at 100 lines/s) waits for the pace (60 s
    here), then goes in one request when the flush hurries it; every line once, in order."""
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    shipper = LogShipper(client, RUN_ID, pace_s=60.0)
    shipper.start()
    try:
        shipper.put("line 0\n")
        await wait_until(lambda: len(ingest.records("logs")) == 1, "the lone line arrived",
                         timeout=30.0)
        for i in range(1, 20):
            shipper.put(f"line {i}\n")
            await asyncio.sleep(0.01)  # a trickle, not a batch: the shipper runs in between
        assert shipper.queued == 19
        assert await shipper.flush(FLUSH_S)
    finally:
        await shipper.stop()
        await client.close()
    assert [len(body["chunks"]) for body in ingest.records("logs")] == [1, 19]
    assert "".join(c for body in ingest.records("logs") for c in body["chunks"]) == "".join(
        f"line {i}\n" for i in range(20))
