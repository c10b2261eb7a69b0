"""The disk spool of document routes, and `sidecar replay` delivering what a run left."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from sidecar.delivery.spool import Spool, SpoolFull
from tests.conftest import RUN_ID, Sidecar, platform_env, sidecar
from tests.ingest_server import RunningIngest, wait_until


def payloads(n: int, start: int = 0) -> list[bytes]:
    return [f'{{"n": {i}}}'.encode() for i in range(start, start + n)]


def test_append_peek_ack_in_order_across_reopen(tmp_path: Path) -> None:
    queue = Spool(tmp_path / "q")
    queue.open()
    queue.append(payloads(5))
    queue.append(payloads(5, 5))
    assert queue.peek(3) == payloads(3)
    queue.ack(3)
    again = Spool(tmp_path / "q")
    again.open()
    assert again.records == 7
    assert again.peek(100) == payloads(7, 3)
    again.ack(7)
    assert again.records == 0 and again.size_bytes == 0
    assert not list((tmp_path / "q").glob("*.seg"))


def test_segments_roll_over_and_are_deleted_once_acknowledged(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setattr("sidecar.delivery.spool.SEGMENT_BYTES", 64)
    queue = Spool(tmp_path / "q")
    queue.open()
    for i in range(20):
        queue.append(payloads(1, i))
    assert len(list((tmp_path / "q").glob("*.seg"))) > 3
    queue.ack(15)
    assert queue.peek(100) == payloads(5, 15)
    assert len(list((tmp_path / "q").glob("*.seg"))) <= 3


def test_torn_tail_is_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    queue = Spool(tmp_path / "q")
    queue.open()
    queue.append(payloads(4))
    segment = next((tmp_path / "q").glob("*.seg"))
    data = segment.read_bytes()
    for cut in range(len(data) - len(payloads(1, 3)[0]) - 7, len(data)):
        segment.write_bytes(data[:cut])
        torn = Spool(tmp_path / "q")
        torn.open()
        assert torn.peek(10) == payloads(3), cut
        assert torn.torn_bytes == cut - (len(data) - len(payloads(1, 3)[0]) - 8)
        torn.append(payloads(1, 9))
        reopened = Spool(tmp_path / "q")
        reopened.open()
        assert reopened.peek(10) == [*payloads(3), *payloads(1, 9)]
        segment.write_bytes(data)


def test_cap_and_corrupt_cursor(tmp_path: Path) -> None:
    queue = Spool(tmp_path / "q", max_bytes=100)
    queue.open()
    queue.append(payloads(5))
    with pytest.raises(SpoolFull):
        queue.append(payloads(10))
    (tmp_path / "q" / "cursor").write_text("garbage")
    again = Spool(tmp_path / "q")
    again.open()
    assert again.peek(10) == payloads(5)


def test_hardware_spooled_during_an_outage_is_replayed(ingest: RunningIngest, tmp_path: Path,
                                                       fast_sampling: None) -> None:
    ingest.stop_listening()
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0.1",
                       SIDECAR_DRAIN_TIMEOUT="1")
    watch = Sidecar(["watch"], env, tmp_path / "watch")
    spool = tmp_path / "state" / RUN_ID / "spool" / "hardware"
    wait_until(lambda: spool.is_dir() and sum(p.stat().st_size for p in spool.glob("*.seg")) > 0,
               15, "samples spooled to disk")
    watch.proc.send_signal(signal.SIGTERM)
    done = watch.wait()
    assert done.status == 0
    assert b"undelivered" in done.stderr
    ingest.start_listening()
    replayed = sidecar(["replay"], env, tmp_path / "replay")
    assert replayed.status == 0, replayed.stderr
    samples = ingest.records("hardware")
    assert len(samples) >= 2
    assert all(s["node"] and s["points"] for s in samples)
    times = sorted(p["ts"] for s in samples for p in s["points"])
    assert len(set(times)) >= 2  # distinct samples, with the times they were taken
    again = sidecar(["replay"], env, tmp_path / "replay2")
    assert again.status == 0
    assert len(ingest.records("hardware")) == len(samples)  # nothing twice
