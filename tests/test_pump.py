"""The pump of a child's pipe: its own output stays byte for byte what the child wrote, whichever
way each block goes (read and offered to /logs, or spliced past Python), and every byte not
offered is reported as skipped."""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from sidecar.sources.console.child import READ_BYTES, Pump
from tests.test_delivery import wait_until

CHUNK = b"".join(b"line %06d of the child's output\n" % i for i in range(4000))  # 128 KB


@dataclass
class Gate:
    """Wants a block while `open` is set; counts what was taken."""

    open: threading.Event = field(default_factory=threading.Event)
    taken_bytes: int = 0

    def allowance(self) -> tuple[int, str]:
        return (READ_BYTES, "") if self.open.is_set() else (0, "closed for the test")

    def taken(self, size: int) -> None:
        self.taken_bytes += size


@dataclass
class Pumped:
    offered: list[bytes] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    eof: asyncio.Event = field(default_factory=asyncio.Event)

    def moved(self) -> int:
        """Bytes the pump has dealt with either way."""
        return sum(map(len, self.offered)) + sum(size for size, _ in self.skipped)

    def moved_all(self, size: int) -> bool:
        return self.moved() == size


@pytest.fixture
def pipe() -> tuple[int, int]:
    """The child's pipe: the pump closes the read end at EOF, `finish` the write end."""
    return os.pipe()


def start(read_end: int, sink_fd: int, gate: Gate) -> Pumped:
    pumped = Pumped()
    Pump("stdout", read_end, sink_fd, gate, pumped.offered.append,
         lambda size, why: pumped.skipped.append((size, why)), pumped.eof.set,
         asyncio.get_running_loop()).start()
    return pumped


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def finish(write_end: int, pumped: Pumped) -> None:
    os.close(write_end)
    await asyncio.wait_for(pumped.eof.wait(), 10)


@pytest.mark.parametrize("flags", [os.O_TRUNC, os.O_APPEND], ids=["file", "append-only file"])
async def test_unwanted_output_reaches_the_sink_whole_and_is_counted(
        pipe: tuple[int, int], tmp_path: Path, flags: int) -> None:
    """Spliced to a plain file; read and written where splice(2) refuses (O_APPEND)."""
    read_end, write_end = pipe
    sink = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | flags)
    gate = Gate()
    pumped = start(read_end, sink, gate)
    data = CHUNK * 40
    assert len(data) > 4 * READ_BYTES  # several splices or reads
    await asyncio.to_thread(write_all, write_end, data)
    await finish(write_end, pumped)
    os.close(sink)
    assert (tmp_path / "out").read_bytes() == data
    assert pumped.offered == []
    assert sum(size for size, _ in pumped.skipped) == len(data)
    assert {why for _, why in pumped.skipped} == {"closed for the test"}
    assert gate.taken_bytes == 0


async def test_wanted_and_unwanted_blocks_interleave_without_a_byte_lost(
        pipe: tuple[int, int], tmp_path: Path) -> None:
    read_end, write_end = pipe
    sink = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    gate = Gate()
    pumped = start(read_end, sink, gate)
    written = b""
    for turn in range(12):
        if turn % 2:
            gate.open.set()
        else:
            gate.open.clear()
        await asyncio.to_thread(write_all, write_end, CHUNK)
        written += CHUNK
        # the pump has taken this turn's bytes before the gate changes again
        await wait_until(partial(pumped.moved_all, len(written)), "the pump took the turn")
    await finish(write_end, pumped)
    os.close(sink)
    assert (tmp_path / "out").read_bytes() == written
    offered = sum(map(len, pumped.offered))
    assert offered == gate.taken_bytes == 6 * len(CHUNK)
    assert sum(size for size, _ in pumped.skipped) == 6 * len(CHUNK)


async def test_the_gate_is_asked_when_output_arrives_not_when_the_wait_began(
        pipe: tuple[int, int], tmp_path: Path) -> None:
    """A rate budget spent by a burst refills while the child is quiet: the next line must be
    forwarded, not dropped on a decision taken before the quiet spell."""
    read_end, write_end = pipe
    sink = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    gate = Gate()
    pumped = start(read_end, sink, gate)
    await asyncio.to_thread(write_all, write_end, CHUNK)
    await wait_until(lambda: pumped.moved() == len(CHUNK), "the burst skipped")  # now it waits
    gate.open.set()
    write_all(write_end, b"after the quiet spell\n")
    await finish(write_end, pumped)
    os.close(sink)
    assert b"".join(pumped.offered) == b"after the quiet spell\n"
    assert (tmp_path / "out").read_bytes() == CHUNK + b"after the quiet spell\n"


async def test_a_closed_sink_still_lets_wanted_output_through(pipe: tuple[int, int]) -> None:
    """The sidecar's own stdout gone (EPIPE): the child is never blocked, /logs still gets it."""
    read_end, write_end = pipe
    sink_read, sink_write = os.pipe()
    os.close(sink_read)
    gate = Gate()
    pumped = start(read_end, sink_write, gate)
    await asyncio.to_thread(write_all, write_end, CHUNK)  # spliced: EPIPE
    await wait_until(lambda: pumped.moved() == len(CHUNK), "the block skipped")
    gate.open.set()
    await asyncio.to_thread(write_all, write_end, CHUNK * 2)
    await finish(write_end, pumped)
    os.close(sink_write)
    assert b"".join(pumped.offered) == CHUNK * 2


@dataclass
class BrokenGate(Gate):
    """Raises once, as a bug on the /logs side would (issue 13: never the trainer's pipe)."""

    where: str = "allowance"
    calls: int = 0

    def allowance(self) -> tuple[int, str]:
        self.calls += 1
        if self.where == "allowance" and self.calls == 2:
            raise RuntimeError("a bug in the gate")
        return READ_BYTES, ""

    def taken(self, size: int) -> None:
        if self.where == "taken":
            raise RuntimeError("a bug in the budget")
        super().taken(size)


@pytest.mark.parametrize("where", ["allowance", "taken"])
async def test_a_gate_that_raises_never_closes_the_pipe_early(
        pipe: tuple[int, int], tmp_path: Path, where: str) -> None:
    read_end, write_end = pipe
    sink = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    pumped = start(read_end, sink, BrokenGate(where=where))
    written = CHUNK * 6
    await asyncio.to_thread(write_all, write_end, written)  # EPIPE were the pipe closed early
    await finish(write_end, pumped)
    os.close(sink)
    assert (tmp_path / "out").read_bytes() == written
