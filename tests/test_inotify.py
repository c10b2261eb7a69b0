"""File events read by the event loop, and telling the filesystems where they never arrive."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sidecar.sources.files.inotify import Inotify, filesystem_of, is_remote


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


async def test_a_folder_removed_and_made_again_is_watched_again(tmp_path: Path) -> None:
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
