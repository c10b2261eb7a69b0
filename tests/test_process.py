"""process.fresh(): every state the process holds beyond a run's, made as a new process has it
by one call (what conftest does after each test), never by editing a module's vars()."""

from __future__ import annotations

import asyncio

from sidecar import masking, process, supervise
from sidecar.log import open_line
from sidecar.sources.telemetry.nvml import bindings, memory


async def test_one_call_makes_every_held_state_fresh() -> None:
    masking.add_secret("tok-FRESH-0123456789abcdef")
    assert masking.mask("a tok-FRESH-0123456789abcdef b") != "a tok-FRESH-0123456789abcdef b"
    open_line._open.add(1)  # the command's output ended inside a line

    async def fails() -> None:
        raise RuntimeError("once")

    async def runs_once() -> None:
        task = supervise.supervise("fresh-test", fails)
        deadline = asyncio.get_running_loop().time() + 10
        while not supervise.SUPERVISOR.restarts.get("fresh-test"):
            assert asyncio.get_running_loop().time() < deadline, "no restart counted"
            await asyncio.sleep(0.01)
        task.cancel()

    await runs_once()
    bindings._BINDINGS.get()  # loaded, or found missing: either way remembered
    memory._memory_v1_only = True

    process.fresh()

    assert masking.mask("a tok-FRESH-0123456789abcdef b") == "a tok-FRESH-0123456789abcdef b"
    assert masking.secrets.longest == 0
    assert not open_line.close()
    assert supervise.SUPERVISOR.restarts == {}
    assert not bindings._BINDINGS._loaded and bindings._BINDINGS.missing == ""
    assert memory._memory_v1_only is False
