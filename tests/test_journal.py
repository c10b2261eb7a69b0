"""Journal: a durable, ordered queue of records, forgotten only once acknowledged."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.delivery.journal import Journal

RECORDS = [b'{"event":"starting"}', b'{"event":"running"}' * 50, b"",
           b'\x00\xff binary \n{"event":"succeeded","ts":"2024-05-01T12:00:00Z"}']
_HEADER_BYTES = 8  # <u32 length><u32 crc32>


def _written(path: Path, records: list[bytes]) -> Journal:
    journal = Journal(path)
    assert journal.open() == []
    for record in records:
        journal.append(record)
    return journal


def _ack_file(path: Path) -> Path:
    return path.with_name(path.name + ".acked")


def _last_frame_start(path: Path, records: list[bytes]) -> int:
    size = path.stat().st_size
    start = size - _HEADER_BYTES - len(records[-1])
    assert start == sum(_HEADER_BYTES + len(r) for r in records[:-1])
    return start


def test_fresh_journal_is_empty_and_creates_its_folder(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "a" / "b" / "lifecycle.journal")
    assert journal.open() == []
    assert journal.pending == 0
    assert journal.torn_bytes == 0
    assert (tmp_path / "a" / "b").is_dir()


def test_records_survive_reopen_in_order(tmp_path: Path) -> None:
    path = tmp_path / "j"
    journal = _written(path, RECORDS)
    assert journal.pending == len(RECORDS)
    reopened = Journal(path)
    assert reopened.open() == RECORDS
    assert reopened.pending == len(RECORDS)
    assert reopened.torn_bytes == 0


def test_ack_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "j"
    journal = _written(path, RECORDS)
    journal.ack()
    assert journal.pending == len(RECORDS) - 1
    journal.ack(2)
    assert journal.pending == len(RECORDS) - 3
    reopened = Journal(path)
    assert reopened.open() == RECORDS[3:]
    assert reopened.pending == len(RECORDS) - 3
    reopened.append(b"after")
    reopened.ack()
    again = Journal(path)
    assert again.open() == [b"after"]


def test_ack_beyond_the_records_is_clamped(tmp_path: Path) -> None:
    path = tmp_path / "j"
    journal = _written(path, RECORDS[:3])
    journal.ack(10)
    assert journal.pending == 0
    journal.append(b"later")
    assert journal.pending == 1
    reopened = Journal(path)
    assert reopened.open() == [b"later"]
    assert reopened.pending == 1


def test_truncation_anywhere_in_the_last_record_drops_only_it(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS)
    whole = path.read_bytes()
    start = _last_frame_start(path, RECORDS)
    for cut in range(start + 1, len(whole)):
        path.write_bytes(whole[:cut])
        _ack_file(path).unlink(missing_ok=True)
        journal = Journal(path)
        assert journal.open() == RECORDS[:-1], cut
        assert journal.torn_bytes == cut - start
        assert path.stat().st_size == start  # the torn tail is cut off the file
        journal.append(b"fresh")
        journal.append(b"fresher")
        reopened = Journal(path)
        assert reopened.open() == [*RECORDS[:-1], b"fresh", b"fresher"]
        assert reopened.torn_bytes == 0


def test_truncation_at_a_record_boundary_is_not_torn(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS)
    start = _last_frame_start(path, RECORDS)
    path.write_bytes(path.read_bytes()[:start])
    journal = Journal(path)
    assert journal.open() == RECORDS[:-1]
    assert journal.torn_bytes == 0


@pytest.mark.parametrize("where", ["payload-first", "payload-last", "crc", "length"])
def test_corrupt_last_record_is_dropped_and_counted(tmp_path: Path, where: str) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS)
    data = bytearray(path.read_bytes())
    start = _last_frame_start(path, RECORDS)
    offset = {"payload-first": start + _HEADER_BYTES, "payload-last": len(data) - 1,
              "crc": start + 4, "length": start}[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    journal = Journal(path)
    assert journal.open() == RECORDS[:-1]
    assert journal.torn_bytes == len(data) - start
    journal.append(b"next")
    assert Journal(path).open() == [*RECORDS[:-1], b"next"]


def test_absurd_length_in_a_header_is_torn_not_allocated(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS[:2])
    size = path.stat().st_size
    with open(path, "ab") as fh:
        fh.write(struct.pack("<II", 0xFFFFFFFF, 0) + b"junk")
    journal = Journal(path)
    assert journal.open() == RECORDS[:2]
    assert journal.torn_bytes == _HEADER_BYTES + 4
    assert path.stat().st_size == size


@pytest.mark.parametrize("content", [b"garbage", b"\xff\xfe\x00", b"", b"3.5", b"  \n", b"1e3"])
def test_corrupt_ack_file_replays_everything(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS).ack(2)
    _ack_file(path).write_bytes(content)
    journal = Journal(path)
    assert journal.open() == RECORDS
    assert journal.pending == len(RECORDS)
    journal.ack()
    assert Journal(path).open() == RECORDS[1:]


def test_negative_ack_file_replays_everything(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS)
    _ack_file(path).write_bytes(b"-1")
    assert Journal(path).open() == RECORDS


def test_stale_ack_count_on_disk_does_not_swallow_new_records(tmp_path: Path) -> None:
    path = tmp_path / "j"
    _written(path, RECORDS[:2])
    _ack_file(path).write_bytes(b"10")
    journal = Journal(path)
    assert journal.open() == []
    journal.append(b"new")
    assert journal.pending == 1
    assert Journal(path).open() == [b"new"]


_ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.binary(max_size=40)),
    st.tuples(st.just("ack"), st.integers(min_value=0, max_value=4)),
    st.tuples(st.just("reopen"), st.just(0)),
), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=_ops)
def test_journal_matches_a_queue_model(ops: list[tuple[str, bytes | int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "j"
        journal = Journal(path)
        assert journal.open() == []
        model: list[bytes] = []
        for op, arg in ops:
            if op == "append":
                assert isinstance(arg, bytes)
                journal.append(arg)
                model.append(arg)
            elif op == "ack":
                assert isinstance(arg, int)
                journal.ack(arg)
                del model[:arg]
            else:
                journal = Journal(path)
                assert journal.open() == model
            assert journal.pending == len(model)
        assert Journal(path).open() == model
