"""File events read by the event loop, and telling the filesystems where they never arrive."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sidecar.aio import cancel
from sidecar.sources.files import follow
from sidecar.sources.files.discover import watch_roots
from sidecar.sources.files.follow import Follower
from sidecar.sources.files.inotify import Inotify, filesystem_of, is_remote
from sidecar.sources.files.jsonl import JsonlParser
from sidecar.sources.files.kinds import BY_NAME
from sidecar.sources.files.offsets import Offsets
from sidecar.sources.files.spec import SourceSpec
from sidecar.sources.files.tensorboard import folder_parsers
from tests.test_delivery import wait_until as async_wait_until
from tests.test_follow import _Collect


async def test_a_change_in_a_watched_folder_calls_back(tmp_path: Path) -> None:
    fired = asyncio.Event()
    events = Inotify(fired.set)
    try:
        events.watch([str(tmp_path)])
        (tmp_path / "train.log").write_text("a line\n")
        await asyncio.wait_for(fired.wait(), 10)
        fired.clear()
        with (tmp_path / "train.log").open("a") as fh:
            fh.write("another\n")
        await asyncio.wait_for(fired.wait(), 10)
    finally:
        events.close()


async def test_a_missing_folder_is_reported_not_raised(tmp_path: Path) -> None:
    events = Inotify(lambda: None)
    try:
        events.watch([str(tmp_path / "not-there")])
    finally:
        events.close()


def test_filesystem_types() -> None:
    assert filesystem_of(Path("/proc/self")) == "proc"
    assert filesystem_of(Path("/proc/does/not/exist")) == "proc"  # the nearest existing parent
    assert not is_remote(filesystem_of(Path("/proc")))
    for remote in ("nfs", "nfs4", "fuse.sshfs", "cifs", "9p", "virtiofs"):
        assert is_remote(remote), remote
    for local in ("ext4", "xfs", "overlay", "tmpfs", ""):
        assert not is_remote(local), local


# -- folders that appear after start, found through events, not the safety poll ----------------

# Found within this long through file events; the safety poll is set far beyond it, so only an
# event can find them in time.
EVENT_DEADLINE_S = 3.0


@asynccontextmanager
async def following(monkeypatch: pytest.MonkeyPatch, spec: SourceSpec,
                    tmp_path: Path) -> AsyncIterator[tuple[Follower, _Collect]]:
    """A Follower in event mode whose safety poll never comes, its first look taken."""
    monkeypatch.setattr(follow, "SAFETY_POLL_S", 600.0)
    sink = _Collect()
    follower = Follower([spec], sink, Offsets(tmp_path / "offsets.json"))
    task = asyncio.create_task(follower.run())
    try:
        await async_wait_until(lambda: bool(follower.matches()), "the first look")
        assert follower._events is not None, "inotify works here"
        yield follower, sink
    finally:
        await cancel(task)
        follower.close()


def jsonl(pattern: Path) -> SourceSpec:
    return SourceSpec("jsonl", (str(pattern),), lambda path, state: JsonlParser.resume(state),
                      option="--jsonl")


def points(sink: _Collect) -> int:
    return sum(len(parsed.points) for parsed in sink.parsed)


async def test_a_folder_two_levels_deep_made_after_start_is_found_through_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither run/ nor run/metrics/ exists at start: the nearest existing parent is watched,
    then each folder as it appears."""
    metrics = tmp_path / "run" / "metrics" / "train.jsonl"
    async with following(monkeypatch, jsonl(metrics), tmp_path) as (_, sink):
        began = time.monotonic()
        metrics.parent.mkdir(parents=True)
        metrics.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
        await async_wait_until(lambda: points(sink) == 1, "the point", EVENT_DEADLINE_S)
        print(f"found {time.monotonic() - began:.3f} s after the folders were made")


async def test_a_tensorboard_run_folder_made_after_start_is_found_through_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs" / "exp1"
    spec = SourceSpec("tensorboard", (str(runs),), folder_parsers(runs),
                      option="--tensorboard", tree=BY_NAME["tensorboard"].tree)
    async with following(monkeypatch, spec, tmp_path) as (follower, _):
        event_file = runs / "train" / "events.out.tfevents.1.node"
        event_file.parent.mkdir(parents=True)  # runs/, exp1/ and train/ in one go
        event_file.write_bytes(b"\0" * 64)
        await async_wait_until(lambda: [f.path for f in follower.files()] == [str(event_file)],
                               "the event file", EVENT_DEADLINE_S)


async def test_a_folder_removed_and_made_again_is_watched_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = tmp_path / "out" / "train.jsonl"
    metrics.parent.mkdir()
    async with following(monkeypatch, jsonl(metrics), tmp_path) as (follower, sink):
        metrics.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
        await async_wait_until(lambda: points(sink) == 1, "the first point", EVENT_DEADLINE_S)
        shutil.rmtree(metrics.parent)
        await async_wait_until(lambda: not follower.files(), "the file is gone",
                               EVENT_DEADLINE_S)
        metrics.parent.mkdir()
        await async_wait_until(lambda: follower.matches()[0].note == "no such file yet",
                               "the new folder was looked at", EVENT_DEADLINE_S)
        metrics.write_text(json.dumps({"step": 2, "loss": 0.25}) + "\n")
        await async_wait_until(lambda: points(sink) == 2, "the point in the new folder",
                               EVENT_DEADLINE_S)


def test_watch_roots_climb_to_the_nearest_existing_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert watch_roots([str(tmp_path / "a" / "b" / "*.jsonl")]) == {str(tmp_path)}
    assert watch_roots([str(tmp_path / "a" / "**" / "*.log")]) == {str(tmp_path)}
    assert watch_roots([str(tmp_path / "*.log")]) == {str(tmp_path)}
    assert watch_roots([str(tmp_path / "file" / "x.log")]) == set()  # a file in the way


async def test_a_watch_the_kernel_ended_is_placed_again_on_the_new_folder(
        tmp_path: Path) -> None:
    fired = asyncio.Event()
    events = Inotify(fired.set)
    folder = tmp_path / "checkpoint-4"
    try:
        folder.mkdir()
        events.watch([str(folder)])
        folder.rmdir()  # rotated away: the kernel drops the watch
        await asyncio.wait_for(fired.wait(), 10)
        folder.mkdir()  # written again after a resume: a new folder under the same name
        events.watch([str(folder)])
        fired.clear()
        (folder / "trainer_state.json").write_text("{}")
        await asyncio.wait_for(fired.wait(), 10)
    finally:
        events.close()
