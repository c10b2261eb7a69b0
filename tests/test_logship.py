"""LogShipper's flush at shutdown: how long the end of a run waits for best-effort /logs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sidecar.delivery.client import IngestClient
from sidecar.delivery.crashtail import TAIL_BYTES, new_tails, take_tail
from sidecar.delivery.logs import FLUSH_STALL_S, LINGER_BELOW_CHARS, LINGER_S, LogShipper
from sidecar.records import Ticket
from tests.conftest import RUN_ID, TOKEN
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest
from tests.test_delivery import wait_until


@asynccontextmanager
async def shipping(ingest: RunningIngest, linger_s: float = LINGER_S) -> AsyncIterator[LogShipper]:
    """A started LogShipper on a real IngestClient; stopped and closed afterwards."""
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    shipper = LogShipper(client, RUN_ID, linger_s=linger_s)
    shipper.start()
    try:
        yield shipper
    finally:
        await shipper.stop()
        await client.close()


def chunks(ingest: RunningIngest) -> list[str]:
    return [c for body in ingest.records("logs") for c in body["chunks"]]


async def test_an_ingest_hung_during_the_run_costs_the_flush_nothing_more(
        ingest: RunningIngest) -> None:
    """The stall is counted from when the hung request was sent: a wrapper whose ingest stopped
    answering long before the child exited does not wait another FLUSH_STALL_S at its end."""
    ingest.add_fault(Fault(route="logs", latency_s=600))
    async with shipping(ingest) as shipper:
        shipper.put("step 1\n")
        await wait_until(lambda: shipper.client.route_stats("logs").requests == 1,
                         "the request was sent")
        loop = asyncio.get_running_loop()
        hung_since = loop.time()
        await wait_until(lambda: loop.time() - hung_since > FLUSH_STALL_S,
                         "the request has hung for a stall's length", timeout=3 * FLUSH_STALL_S)
        shipper.put("step 2\n")
        began = loop.time()
        assert not await shipper.flush(10.0)
        assert loop.time() - began < FLUSH_STALL_S / 2


async def test_a_slow_answer_after_a_quiet_spell_is_waited_for(ingest: RunningIngest) -> None:
    """Text put after the shipper sat idle longer than FLUSH_STALL_S starts the stall clock
    afresh, so a slow but answering ingest still gets the last lines."""
    async with shipping(ingest) as shipper:
        shipper.put("first\n")
        assert await shipper.flush(10.0)
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        await wait_until(lambda: loop.time() - idle_since > FLUSH_STALL_S,
                         "idle for a stall's length", timeout=3 * FLUSH_STALL_S)
        ingest.add_fault(Fault(route="logs", latency_s=FLUSH_STALL_S / 2, times=1))
        shipper.put("last\n")
        assert await shipper.flush(10.0)
        assert chunks(ingest) == ["first\n", "last\n"]


async def test_a_batch_worth_its_request_does_not_linger(ingest: RunningIngest) -> None:
    """Only a small batch waits for company, and only until the company makes it worth its
    request: the last quarter-megabyte of a file read from its start goes at once, not a linger
    later."""
    linger_s = 30.0
    async with shipping(ingest, linger_s=linger_s) as shipper:
        loop = asyncio.get_running_loop()
        began = loop.time()
        shipper.put("x" * (LINGER_BELOW_CHARS - 1) + "\n")
        await wait_until(lambda: len(chunks(ingest)) == 1, "the batch was sent",
                         timeout=linger_s / 3)
        shipper.put("small\n")  # wakes the shipper, which clears its wake-up as it lingers
        await wait_until(lambda: not shipper._wake.is_set(), "the shipper lingers over it")
        shipper.put("x" * LINGER_BELOW_CHARS + "\n")
        await wait_until(lambda: len(chunks(ingest)) == 3, "the small one went with the next",
                         timeout=linger_s / 3)
        assert loop.time() - began < linger_s / 3
        assert [len(body["chunks"]) for body in ingest.records("logs")] == [1, 2]


def _lines(count: int, width: int = 99) -> str:
    return "".join(f"{i:0{width}d}\n" for i in range(count))


async def test_a_proxy_that_refuses_large_bodies_gets_every_character_in_halves(
        ingest: RunningIngest) -> None:
    """/logs used to drop a batch its ingest answered 413 (a proxy's body limit), with one
    WARNING a minute: above the limit, every batch of a busy run was lost."""
    ingest.add_fault(Fault(route="logs", too_large_over_bytes=100_000))
    text = _lines(6_000)  # 600,000 characters, put as one text: one piece to cut
    released: list[bool] = []
    ticket = Ticket(lambda: released.append(True))
    async with shipping(ingest, linger_s=0) as shipper:
        shipper.put(text, ticket)
        ticket.seal()  # the source's own hold: the file's offset moves once both halves went
        assert await shipper.flush(20.0)
        assert released == [True]
        assert "".join(chunks(ingest)) == text
        assert shipper.dropped_chars == 0
        assert all(len(body["chunks"][0]) < 100_000 for body in ingest.records("logs"))
        assert shipper.max_request_chars <= 75_000  # it remembers the limit it met


async def test_no_body_is_over_what_nginx_takes_by_default(ingest: RunningIngest) -> None:
    """Requests were cut by characters alone: a full one of plain lines was a body of
    1,049,648 bytes, and one of non-ASCII text (CJK, a progress bar's blocks) up to three
    times that; an ingest behind nginx (client_max_body_size 1m by default) answered 413
    to the first request of every busy run, and a WARNING said so."""
    ingest.add_fault(Fault(route="logs", too_large_over_bytes=1 << 20))
    plain = _lines(12_000)  # 1.2 M characters, each line end escaped in the JSON
    dense = "".join(f"步骤 {i:06d} 损失 ████████████████\n" for i in range(40_000))  # 3 B each
    async with shipping(ingest, linger_s=0) as shipper:
        shipper.put(plain)
        shipper.put(dense)
        assert await shipper.flush(30.0)
        assert shipper.dropped_chars == 0
    assert ingest.stats.routes["logs"].rejected.get(413, 0) == 0
    assert "".join(chunks(ingest)) == plain + dense


async def test_a_batch_of_many_texts_is_split_between_them(ingest: RunningIngest) -> None:
    ingest.add_fault(Fault(route="logs", too_large_above=2))  # at most two chunks a request
    texts = [f"line {i}\n" for i in range(40)]
    async with shipping(ingest, linger_s=0) as shipper:
        for text in texts:  # all queued before the shipper runs: its first batch is all 40
            shipper.put(text)
        assert await shipper.flush(20.0)
    assert chunks(ingest) == texts
    assert all(len(body["chunks"]) <= 2 for body in ingest.records("logs"))


async def test_once_the_limit_is_known_a_long_text_goes_in_pieces_not_refused_again(
        ingest: RunningIngest) -> None:
    """After a 413 lowered the request size below a read's block, each block was sent whole
    and refused again before being halved: one refused upload of a MiB per block."""
    ingest.add_fault(Fault(route="logs", too_large_over_bytes=100_000))
    async with shipping(ingest, linger_s=0) as shipper:
        shipper.put(_lines(3_000, width=99))  # 300,000 characters: refused, halved, refused...
        assert await shipper.flush(20.0)
        refused = ingest.stats.routes["logs"].rejected.get(413, 0)
        assert refused >= 2
        later = _lines(3_000, width=99)
        shipper.put(later)
        assert await shipper.flush(20.0)
        assert ingest.stats.routes["logs"].rejected.get(413, 0) == refused  # none more
        assert "".join(chunks(ingest)).endswith(later) and shipper.dropped_chars == 0


def test_a_piece_acknowledged_in_parts_leaves_what_was_not() -> None:
    piece = new_tails(1)[0].add("x" * 100)
    piece.ack(0, 10)
    piece.ack(20, 30)
    piece.ack(10, 15)
    assert piece.unacked(5) == [(15, 20), (30, 100)]
    assert not piece.acked
    piece.ack(15, 20)
    piece.ack(30, 100)
    assert piece.acked and piece.unacked() == []


async def test_the_crash_tail_takes_only_its_window_of_a_queued_piece(
        ingest: RunningIngest) -> None:
    """A piece longer than the tail's window: the tail carries its end, and its start stays
    queued and is sent (it was lost: the whole piece was taken out of the queue)."""
    tail = new_tails(1)[0]
    text = "".join(f"{i:05d} " + "a" * 93 + "\n" for i in range(1000))  # 100,000 characters
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    shipper = LogShipper(client, RUN_ID)
    shipper.put(text, piece=tail.add(text))
    taken = take_tail([tail])
    cut = text.index("\n", len(text) - TAIL_BYTES - 1) + 1  # at the line the window cuts
    assert (taken.texts, taken.carried_from) == ([text[cut:]], {0: cut})
    shipper.forget(taken.carried_from)
    shipper.start()
    try:
        assert await shipper.flush(10.0)
    finally:
        await shipper.stop()
        await client.close()
    assert "".join(chunks(ingest)) == text[:cut]


async def test_each_part_of_a_cut_piece_is_settled_on_its_own(ingest: RunningIngest) -> None:
    """A piece sent in several requests, the first refused while the command runs: that part
    alone is dropped, said where it was by a line of ours, and never sent later by the crash
    tail out of its place; the others arrive."""
    ingest.add_fault(Fault(route="logs", status=400, times=1))
    tail = new_tails(1)[0]
    text = "".join(f"{i:04d} " + "b" * 94 + "\n" for i in range(30))  # 3,000 characters
    client = IngestClient(ingest.base_url, ("X-StarForge-Token",), lambda: TOKEN)
    await client.start()
    shipper = LogShipper(client, RUN_ID, max_request_chars=1000)
    shipper.put(text, piece=tail.add(text))
    shipper.start()
    try:
        assert await shipper.flush(10.0)
    finally:
        await shipper.stop()
        await client.close()
    marker = ("[sidecar] 1000 characters of output were dropped here: the ingest did not take "
              "it (HTTP 400)\n")
    assert "".join(chunks(ingest)) == marker + text[1000:]
    assert take_tail([tail]).texts == []
