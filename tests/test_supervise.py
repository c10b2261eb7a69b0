"""sidecar.supervise: a long-lived task that raises is logged once, restarted and counted
(issue 13, cause 1); the restarts show in /status and /metrics."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from sidecar.observe.endpoint import StatusSnapshot
from sidecar.supervise import Supervisor


async def test_a_task_that_raises_is_logged_once_restarted_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor()
    rounds: list[int] = []
    done = asyncio.Event()

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) <= 3:
            raise KeyError("files")
        done.set()
        await asyncio.Event().wait()

    with caplog.at_level(logging.DEBUG, logger="sidecar"):
        task = supervisor.spawn("follow", work)
        async with asyncio.timeout(5):
            await done.wait()
    assert supervisor.restarts == {"follow": 3}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # the next two within a minute are counted, not repeated
    assert "task follow failed (KeyError: 'files' at " in errors[0].getMessage()
    assert "\n" not in errors[0].getMessage()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert supervisor.restarts == {"follow": 3}  # a cancellation is no failure


async def test_a_task_that_returns_is_not_restarted() -> None:
    supervisor = Supervisor()
    calls = 0

    async def work() -> None:
        nonlocal calls
        calls += 1

    await supervisor.spawn("environment", work)
    assert calls == 1 and supervisor.restarts == {}


async def test_an_armed_fault_is_raised_once_at_a_fault_point() -> None:
    supervisor = Supervisor(fault_window_s=0.05)
    rounds = 0

    async def work() -> None:
        nonlocal rounds
        while rounds < 30:
            supervisor.fault_point()
            rounds += 1
            await asyncio.sleep(0.01)

    async with asyncio.timeout(5):
        await supervisor.spawn("deliver-metrics", work)
    assert supervisor.restarts == {"deliver-metrics": 1}


def test_restarts_are_shown_in_status_and_metrics() -> None:
    from sidecar.observe.prometheus import exposition

    snap = StatusSnapshot(run_id="r", node="n", mode="run", offline=False, started_at=0.0,
                          task_restarts={"follow": 2, "deliver-metrics": 1})
    assert StatusSnapshot.from_json(snap.to_json()).task_restarts == snap.task_restarts
    text = exposition(lambda: snap)().decode()
    assert 'sidecar_task_restarts_total{task="follow"} 2.0' in text
    assert 'sidecar_task_restarts_total{task="deliver-metrics"} 1.0' in text


async def test_a_status_answer_that_raises_is_a_500_said_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from sidecar.observe.endpoint import start_status_server
    from sidecar.supervise import restarts
    from tests.test_status import get

    calls = 0

    def snapshot() -> StatusSnapshot:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the snapshot")
        return StatusSnapshot(run_id="r", node="n", mode="run", offline=True, started_at=0.0)

    before = restarts().get("status-server", 0)
    server = await start_status_server("127.0.0.1:0", tmp_path, snapshot)
    assert server is not None
    try:
        with caplog.at_level(logging.ERROR, logger="sidecar"):
            failed, _ = await get(server.address, "/status")
        again, text = await get(server.address, "/status")
    finally:
        await server.close()
    assert (failed, again) == (500, 200) and '"run_id": "r"' in text
    assert restarts()["status-server"] == before + 1
    assert any("task status-server failed (RuntimeError" in r.getMessage()
               for r in caplog.records)
