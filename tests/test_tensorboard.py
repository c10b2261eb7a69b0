"""TensorBoard event files (docs/ingest.md#tensorboard): files from real writers, read by our
parser and by the `tensorboard` package's own loader as the oracle, compared point by point; the
file growing, cut at every byte, corrupted and replaced by garbage."""

from __future__ import annotations

import gc
import json
import math
import random
import signal
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.exits import EXIT_CONFIG
from sidecar.sources.files import tensorboard as tensorboard_source
from sidecar.sources.files.tensorboard import (
    MAX_RECORD_BYTES,
    Decoded,
    EventFileParser,
    ScalarPoint,
    masked_crc32c,
)
from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child, sidecar
from tests.ingest_server import running_ingest, wait_until

Point = tuple[str, int, float, float]


@dataclass
class Found:
    """Everything one reader got out of one event file."""

    points: list[Point] = field(default_factory=list)
    invalid: Counter[str] = field(default_factory=Counter)
    hparams: dict[str, Any] = field(default_factory=dict)
    corrupt: int = 0
    consumed: int = 0

    def add(self, decoded: Decoded) -> None:
        self.points += [_as_tuple(p) for p in decoded.points]
        self.invalid.update(decoded.invalid_values)
        self.hparams.update(decoded.hparams or {})
        self.corrupt += decoded.corrupt_records
        self.consumed += decoded.consumed


def _as_tuple(point: ScalarPoint) -> Point:
    key, step, value, wall_time = point
    return (key, step, value, wall_time)


def event_files(logdir: Path) -> list[tuple[Path, str]]:
    """Every event file under `logdir`, with the key prefix the follower gives it."""
    found = []
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        folder = path.parent.relative_to(logdir).as_posix()
        found.append((path, "" if folder == "." else folder + "/"))
    return found


def ours(data: bytes, prefix: str = "", cuts: Sequence[int] = (),
         state: dict[str, Any] | None = None) -> Found:
    """Our parser fed `data` as a file that grows to each cut offset in turn, then to its end;
    the state goes through JSON at every step, as the follower persists it."""
    found = Found()
    for end in [*cuts, len(data)]:
        parser = EventFileParser(prefix, state)
        found.add(parser.parse(data[found.consumed:end]))
        state = json.loads(json.dumps(parser.state()))
    return found


def oracle(path: Path, prefix: str = "") -> Found:
    """What TensorBoard itself reads from the file: scalars by its plugin rule, hparams from the
    session-start record."""
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    from google.protobuf import json_format
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    found = Found()
    plugins: dict[str, str] = {}  # tag -> plugin of its first value, after TensorBoard's migration
    for event in loader.EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            plugin = plugins.setdefault(value.tag, value.metadata.plugin_data.plugin_name)
            key = prefix + value.tag
            if plugin == "scalars":
                number = tensor_util.make_ndarray(value.tensor).item()
                if math.isfinite(number):
                    found.points.append((key, event.step, number, event.wall_time))
                else:
                    found.invalid[key] += 1
            if value.metadata.plugin_data.plugin_name == "hparams":
                data = plugin_data_pb2.HParamsPluginData.FromString(
                    value.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    found.hparams.update(json_format.MessageToDict(data.session_start_info)
                                         ["hparams"])
    return found


def assert_matches_oracle(logdir: Path) -> dict[str, Found]:
    """Each event file under `logdir` read by us equals the oracle's reading; returns ours."""
    results = {}
    for path, prefix in event_files(logdir):
        data = path.read_bytes()
        got, want = ours(data, prefix), oracle(path, prefix)
        assert got.points == want.points, path
        assert got.invalid == want.invalid, path
        assert got.hparams == want.hparams, path
        assert (got.corrupt, got.consumed) == (0, len(data)), path
        results[prefix] = got
    return results


def all_keys(results: dict[str, Found]) -> set[str]:
    return {point[0] for found in results.values() for point in found.points}


# --- files from real writers ----------------------------------------------------------------

def test_torch_summary_writer_matches_the_loader(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    writer = tensorboard.SummaryWriter(str(tmp_path))
    for step in [0, 1, 2, 127, 128, 300, 16383, 16384, 2**21 - 1, 2**21, 2**35, -7]:  # each width
        writer.add_scalar("loss", 1.0 / (abs(step) + 1), step)
        writer.add_scalar("lr", torch.tensor(3e-4), step, new_style=True)
        writer.add_scalar("grad/norm", 0.1 * step, step, new_style=True, double_precision=True)
        writer.add_scalar("batch", step % 7, step)
    writer.add_scalar("loss", float("nan"), 11)
    writer.add_scalar("loss", float("inf"), 12)
    writer.add_scalar("lr", float("-inf"), 13, new_style=True)
    writer.add_histogram("weights", torch.arange(10.0), 1)
    writer.add_text("note", "not a scalar", 1)
    writer.add_scalars("acc", {"train": 0.5, "val": 0.25}, 3)
    writer.add_hparams({"lr": 3e-4, "batch_size": 32, "optimizer": "adamw", "amsgrad": True},
                       {"hparam/accuracy": 0.9}, run_name="trial-1")
    writer.close()

    results = assert_matches_oracle(tmp_path)
    assert {"loss", "lr", "grad/norm", "batch", "acc_train/acc", "acc_val/acc",
            "trial-1/hparam/accuracy"} <= all_keys(results)
    assert results[""].invalid == {"loss": 2, "lr": 1}
    assert results["trial-1/"].hparams == {
        "lr": 3e-4, "batch_size": 32, "optimizer": "adamw", "amsgrad": True}
    assert isinstance(results["trial-1/"].hparams["batch_size"], int)
    assert [p[:3] for p in results[""].points if p[1] < 0] == [
        ("loss", -7, 0.125), ("lr", -7, pytest.approx(3e-4)), ("grad/norm", -7, 0.1 * -7),
        ("batch", -7, 0)]


def test_tensorboardx_summary_writer_matches_the_loader(tmp_path: Path) -> None:
    tbx = pytest.importorskip("tensorboardX")
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboardX.proto.tensor_pb2 import TensorProto

    writer = tbx.SummaryWriter(str(tmp_path))
    for step in range(0, 3000, 7):
        writer.add_scalar("train/loss", 10.0 / (step + 1), step)
        writer.add_scalar("described", step * 0.5, step, display_name="Described",
                          summary_description="simple_value with metadata")
    writer.add_scalar("train/loss", float("nan"), 3000)
    writer.add_scalars("metrics", {"precision": 0.5, "recall": 0.75}, 5)
    writer.add_hparams({"lr": 0.01, "layers": 4, "act": "gelu", "dropout": False},
                       {"hparam/loss": 0.5}, name="trial-2")
    # Tensor scalars as TF2 writes them: the plugin named on each tag's first value only.
    for step in range(5):
        metadata = (SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
                    if step == 0 else None)
        value = Summary.Value(tag="tf2/accuracy", metadata=metadata, tensor=TensorProto(
            dtype=1, tensor_content=struct.pack("<f", step / 4)))
        writer.file_writer.add_summary(Summary(value=[value]), step)
    writer.close()

    results = assert_matches_oracle(tmp_path)
    assert {"train/loss", "described", "tf2/accuracy", "metrics/precision/metrics",
            "metrics/recall/metrics", "trial-2/hparam/loss"} <= all_keys(results)
    assert results[""].invalid == {"train/loss": 1}
    assert sum(p[0] == "tf2/accuracy" for p in results[""].points) == 5
    assert results["trial-2/"].hparams == {"lr": 0.01, "layers": 4, "act": "gelu",
                                          "dropout": False}


def _write_with_tensorboard(logdir: Path, events: Sequence[Any]) -> Path:
    """The `tensorboard` package's own writer (no TensorFlow needed)."""
    writer_module = pytest.importorskip("tensorboard.summary.writer.event_file_writer")
    writer = writer_module.EventFileWriter(str(logdir))
    for event in events:
        writer.add_event(event)
    writer.close()
    [(path, _)] = event_files(logdir)
    return path


def _tensor_scalar_events() -> list[Any]:
    """One tag per way a TF2 writer can store a scalar tensor; metadata on the first value."""
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2

    def tensor(dtype: int, step: int) -> Any:
        v = step + 0.5 if dtype in (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE,
                                    types_pb2.DT_HALF) else step
        return {
            "float_val": tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[v]),
            "double_val": tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[v]),
            "int_val": tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32, int_val=[-int(v)]),
            "int64_val": tensor_pb2.TensorProto(dtype=types_pb2.DT_INT64,
                                                int64_val=[int(v) * 2**40]),
            "bool_val": tensor_pb2.TensorProto(dtype=types_pb2.DT_BOOL, bool_val=[step % 2 == 1]),
            "half_val": tensor_pb2.TensorProto(
                dtype=types_pb2.DT_HALF,
                half_val=[struct.unpack("<H", struct.pack("<e", v))[0]]),
            "content_f32": tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT,
                                                  tensor_content=struct.pack("<f", v)),
            "content_f64": tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE,
                                                  tensor_content=struct.pack("<d", v)),
            "content_i32": tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32,
                                                  tensor_content=struct.pack("<i", -int(v))),
            "content_i64": tensor_pb2.TensorProto(dtype=types_pb2.DT_INT64,
                                                  tensor_content=struct.pack("<q", int(v))),
            "content_f16": tensor_pb2.TensorProto(dtype=types_pb2.DT_HALF,
                                                  tensor_content=struct.pack("<e", v)),
        }

    scalars = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    images = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="images"))
    events = []
    for step in range(4):
        values = [summary_pb2.Summary.Value(tag=tag, tensor=proto,
                                            metadata=scalars if step == 0 else None)
                  for tag, proto in tensor(types_pb2.DT_FLOAT, step).items()]
        # not scalars: another plugin's tensor, and a vector under the scalars plugin
        values.append(summary_pb2.Summary.Value(
            tag="picture", metadata=images if step == 0 else None,
            tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0])))
        events.append(event_pb2.Event(step=step, wall_time=1.7e9 + step,
                                      summary=summary_pb2.Summary(value=values)))
    return events


def test_tensor_scalars_of_every_representation_match_the_loader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    path = _write_with_tensorboard(tmp_path, _tensor_scalar_events())
    got = ours(path.read_bytes(), "run/")
    assert got.points == oracle(path, "run/").points
    assert len(got.points) == 4 * 11
    assert "run/picture" not in {p[0] for p in got.points}
    assert ("run/half_val", 3, 3.5, 1.7e9 + 3) in got.points
    assert ("run/int64_val", 2, 2.0 * 2**40, 1.7e9 + 2) in got.points
    assert ("run/bool_val", 1, 1.0, 1.7e9 + 1) in got.points


def test_the_plugin_named_on_a_tags_first_value_survives_a_restart(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    path = _write_with_tensorboard(tmp_path, _tensor_scalar_events())
    data = path.read_bytes()
    whole = ours(data)
    for cut in range(0, len(data), 97):  # each restart with the state persisted at `cut`
        assert ours(data, cuts=[cut]).points == whole.points
    first = EventFileParser()
    decoded = first.parse(data[:len(data) // 2])
    # without the state the later tensors have no plugin: none of them is a point
    assert EventFileParser().parse(data[decoded.consumed:]).points == []


def test_bfloat16_and_small_integer_tensors() -> None:
    """Dtypes the oracle cannot convert without TensorFlow, checked by value."""
    from sidecar.sources.files import tensorboard_schema as schema

    def event(tag: str, tensor: Any) -> bytes:
        value = schema.Event(step=1, wall_time=2.0)
        item = value.summary.value.add(tag=tag)
        item.metadata.plugin_data.plugin_name = "scalars"
        item.tensor.CopyFrom(tensor)
        return _frame(value.SerializeToString())

    tensor_proto = schema.TensorProto
    bf16 = struct.unpack("<I", struct.pack("<f", -2.5))[0] >> 16
    data = b"".join([
        event("bf16", tensor_proto(dtype=schema.DT_BFLOAT16, half_val=[bf16])),
        event("bf16c", tensor_proto(dtype=schema.DT_BFLOAT16,
                                    tensor_content=struct.pack("<H", bf16))),
        event("u8", tensor_proto(dtype=schema.DT_UINT8, tensor_content=b"\xff")),
        event("i8", tensor_proto(dtype=schema.DT_INT8, int_val=[-3])),
        event("u64", tensor_proto(dtype=schema.DT_UINT64, uint64_val=[2**63])),
        event("shape11", tensor_proto(dtype=schema.DT_FLOAT, float_val=[4.0],
                                      tensor_shape={"dim": [{"size": 1}, {"size": 1}]})),
        event("vector", tensor_proto(dtype=schema.DT_FLOAT, float_val=[1.0, 2.0],
                                     tensor_shape={"dim": [{"size": 2}]})),
        event("string", tensor_proto(dtype=7)),
        event("short_content", tensor_proto(dtype=schema.DT_DOUBLE, tensor_content=b"\0" * 4)),
    ])
    got = ours(data)
    assert {p[0]: p[2] for p in got.points} == {
        "bf16": -2.5, "bf16c": -2.5, "u8": 255.0, "i8": -3.0, "u64": 2.0**63, "shape11": 4.0}
    assert got.corrupt == 0


def test_hparams_of_every_value_kind() -> None:
    from google.protobuf import struct_pb2
    hparams_plugin = pytest.importorskip("tensorboard.plugins.hparams.plugin_data_pb2")
    from tensorboard.compat.proto import event_pb2, summary_pb2

    info = hparams_plugin.SessionStartInfo(group_name="g", start_time_secs=1.0)
    params: dict[str, Any] = {
        "lr": 0.001, "epochs": 10.0, "big": 2.0**60, "name": "resnet", "flag": False, "none": None,
        "model": {"depth": 50, "head": {"dim": 512.5}}, "sizes": [1, "two", True, None],
        "empty": {},
    }
    for name, value in params.items():
        info.hparams[name].CopyFrom(_json_value(value, struct_pb2))
    info.hparams["bad"].number_value = float("nan")
    info.hparams["worse"].number_value = float("-inf")
    content = hparams_plugin.HParamsPluginData(version=0, session_start_info=info)
    metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
        plugin_name="hparams", content=content.SerializeToString()))
    event = event_pb2.Event(wall_time=1.0, summary=summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag="_hparams_/session_start_info", metadata=metadata)]))

    decoded = EventFileParser("trial/").parse(_frame(event.SerializeToString()))
    assert decoded.hparams == {
        "lr": 0.001, "epochs": 10, "big": 2.0**60, "name": "resnet", "flag": False,
        "model.depth": 50, "model.head.dim": 512.5,
        "sizes.0": 1, "sizes.1": "two", "sizes.2": True,
    }
    assert type(decoded.hparams["epochs"]) is int and type(decoded.hparams["big"]) is float
    assert decoded.invalid_values == {"bad": 1, "worse": 1}
    assert decoded.points == [] and decoded.corrupt_records == 0


def _json_value(value: Any, struct_pb2: Any) -> Any:
    proto = struct_pb2.Value()
    if value is None:
        proto.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        proto.bool_value = value
    elif isinstance(value, int | float):
        proto.number_value = value
    elif isinstance(value, str):
        proto.string_value = value
    elif isinstance(value, dict):
        proto.struct_value.SetInParent()  # an empty struct is still a struct
        for k, v in value.items():
            proto.struct_value.fields[k].CopyFrom(_json_value(v, struct_pb2))
    else:
        proto.list_value.SetInParent()
        proto.list_value.values.extend(_json_value(v, struct_pb2) for v in value)
    return proto


# --- a growing file -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Found]:
    """A small torch-written file of mixed records, and what the oracle reads from it."""
    torch = pytest.importorskip("torch")
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    logdir = tmp_path_factory.mktemp("torch")
    writer = tensorboard.SummaryWriter(str(logdir))
    for step in range(0, 400, 3):
        writer.add_scalar("loss", 1.0 / (step + 1), step)
        writer.add_scalar("acc", step / 400, step, new_style=True)
        if step % 100 == 0:
            writer.add_histogram("w", torch.arange(5.0) * step, step)
            writer.add_text("t", f"step {step}", step)
    writer.add_scalar("loss", float("nan"), 401)
    writer.close()
    [(path, _)] = event_files(logdir)
    return path.read_bytes(), oracle(path)


def _record_starts(data: bytes) -> list[int]:
    starts, pos = [], 0
    while pos < len(data):
        starts.append(pos)
        pos += 16 + struct.unpack_from("<Q", data, pos)[0]
    return starts


def test_random_cut_points_yield_every_point_once(torch_file: tuple[bytes, Found]) -> None:
    data, want = torch_file
    rng = random.Random(3)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(data)), rng.randint(1, 60)))
        got = ours(data, cuts=cuts)
        assert got.points == want.points
        assert (got.invalid, got.corrupt, got.consumed) == (want.invalid, 0, len(data))


def test_a_cut_at_every_byte_of_the_last_record(torch_file: tuple[bytes, Found]) -> None:
    data, want = torch_file
    last = _record_starts(data)[-1]
    before = EventFileParser().parse(data[:last])
    assert before.consumed == last
    for cut in range(last, len(data) + 1):
        parser = EventFileParser()
        first = parser.parse(data[:cut])
        assert first.consumed == (len(data) if cut == len(data) else last), cut
        second = parser.parse(data[first.consumed:])
        assert [*first.points, *second.points] == before.points + (
            EventFileParser().parse(data[last:]).points)
        assert first.corrupt_records + second.corrupt_records == 0
        assert first.consumed + second.consumed == len(data)
    assert [_as_tuple(p) for p in EventFileParser().parse(data).points] == want.points


def test_a_file_growing_one_byte_at_a_time(torch_file: tuple[bytes, Found]) -> None:
    data, want = torch_file
    data = data[:_record_starts(data)[60]]
    parser, found, pending = EventFileParser(), Found(), b""
    for byte in range(len(data)):
        pending += data[byte:byte + 1]
        decoded = parser.parse(pending)
        found.add(decoded)
        pending = pending[decoded.consumed:]
    assert found.points == want.points[:len(found.points)] and len(found.points) > 50
    assert (found.corrupt, found.consumed, pending) == (0, len(data), b"")


def test_reading_while_the_writer_appends(tmp_path: Path) -> None:
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    writer = tensorboard.SummaryWriter(str(tmp_path))
    parser, found, offset = EventFileParser(), Found(), 0
    for step in range(50):
        writer.add_scalar("loss", 1.0 / (step + 1), step)
        writer.add_scalar("acc", step / 50, step, new_style=True)
        writer.flush()
        [(path, _)] = event_files(tmp_path)
        with path.open("rb") as f:
            f.seek(offset)
            decoded = parser.parse(f.read())
        offset += decoded.consumed
        found.add(decoded)
    writer.close()
    found.add(parser.parse(path.read_bytes()[offset:]))
    assert found.points == oracle(path).points and len(found.points) == 100


# --- bad input --------------------------------------------------------------------------------

def _frame(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x5A]) + data[offset + 1:]


@pytest.mark.parametrize("where", ["length", "length_crc", "data", "data_crc"])
def test_a_corrupt_record_is_skipped_and_counted(torch_file: tuple[bytes, Found],
                                                 where: str) -> None:
    data, want = torch_file
    starts = _record_starts(data)
    victims = starts[10], starts[40], starts[-5]
    length = {v: struct.unpack_from("<Q", data, v)[0] for v in victims}
    offset = {"length": 0, "length_crc": 9, "data": 14, "data_crc": None}[where]
    for victim in victims:
        data = _flip(data, victim + (offset if offset is not None else 12 + length[victim] + 2))
    lost = {_as_tuple(p) for v in victims
            for p in EventFileParser().parse(torch_file[0][v:v + 16 + length[v]]).points}
    assert len(lost) == 3  # each victim held one point
    expected = [p for p in want.points if p not in lost]
    for cuts in ([], list(range(0, len(data), 11)), sorted(random.Random(1).sample(
            range(len(data)), 100))):
        got = ours(data, cuts=cuts)
        assert got.points == expected
        assert (got.corrupt, got.consumed) == (3, len(data))


def test_a_valid_record_that_is_not_an_event_is_counted(torch_file: tuple[bytes, Found]) -> None:
    data, want = torch_file
    starts = _record_starts(data)
    garbage = _frame(b"\xff\xff\xff") + _frame(b"\x0a\x05ab")  # bad varint; field cut short
    got = ours(data[:starts[5]] + garbage + data[starts[5]:])
    assert got.points == want.points and got.corrupt == 2


def test_undecodable_hparams_are_counted_and_the_records_scalars_kept() -> None:
    from sidecar.sources.files import tensorboard_schema as schema

    event = schema.Event(step=4, wall_time=9.0)
    hparams = event.summary.value.add(tag="_hparams_/session_start_info")
    hparams.metadata.plugin_data.plugin_name = "hparams"
    hparams.metadata.plugin_data.content = b"\x1a\x05\x0a"  # session_start_info cut short
    event.summary.value.add(tag="loss", simple_value=2.0)
    decoded = EventFileParser().parse(_frame(event.SerializeToString()))
    assert [_as_tuple(p) for p in decoded.points] == [("loss", 4, 2.0, 9.0)]
    assert (decoded.hparams, decoded.corrupt_records) == (None, 1)


def test_an_absurd_length_is_garbage_not_a_wait(torch_file: tuple[bytes, Found]) -> None:
    data, want = torch_file
    for length in (MAX_RECORD_BYTES + 1, 2**40, 2**64 - 1):
        header = struct.pack("<Q", length)
        bogus = header + struct.pack("<I", masked_crc32c(header))
        got = ours(bogus + data)
        assert got.points == want.points and (got.corrupt, got.consumed) == (1, len(bogus + data))


def test_a_truncated_file_waits_without_spinning(torch_file: tuple[bytes, Found]) -> None:
    data, _ = torch_file
    starts = _record_starts(data)
    cut = data[:starts[30] + 7]
    parser = EventFileParser()
    decoded = parser.parse(cut)
    assert (decoded.consumed, decoded.corrupt_records) == (starts[30], 0)
    again = parser.parse(cut[decoded.consumed:])
    assert (again.consumed, again.points, again.corrupt_records) == (0, [], 0)


@pytest.mark.timeout(20)
def test_random_bytes_named_like_an_event_file(tmp_path: Path) -> None:
    path = tmp_path / "events.out.tfevents.1700000000.host"
    path.write_bytes(random.Random(7).randbytes(8 << 20))
    data = path.read_bytes()
    got = ours(data)
    assert got.points == [] and got.corrupt == 1
    assert len(data) - 11 <= got.consumed <= len(data)
    chunked = ours(data, cuts=range(0, len(data), 1 << 16))  # one resync, however many calls
    assert (chunked.points, chunked.corrupt) == ([], 1) and chunked.consumed >= len(data) - 11


@pytest.mark.timeout(20)
@pytest.mark.parametrize("filler", [b"\0", b"\0\0\0\0\0\0\0\1", b"\0\0\0\0\xff"])
def test_zero_heavy_garbage_then_a_valid_record(filler: bytes) -> None:
    """A crash can leave a zero-filled tail; zeros look like the high half of every length."""
    event = _frame(_torch_like_scalar_event())
    data = filler * ((4 << 20) // len(filler)) + event
    got = ours(data)
    assert (got.corrupt, got.consumed, len(got.points)) == (1, len(data), 1)


def _torch_like_scalar_event() -> bytes:
    from sidecar.sources.files import tensorboard_schema as schema

    event = schema.Event(wall_time=5.0, step=3)
    event.summary.value.add(tag="loss", simple_value=0.5)
    return bytes(event.SerializeToString())


def test_state_is_json_and_a_damaged_one_is_forgotten() -> None:
    parser = EventFileParser("a/")
    parser.parse(_frame(_torch_like_scalar_event()))
    assert json.loads(json.dumps(parser.state())) == parser.state()
    for damaged in ({}, {"plugins": [1, 2]}, {"plugins": {"x": 3}, "resyncing": "yes"},
                    {"version": 99}):
        decoded = EventFileParser("a/", damaged).parse(_frame(_torch_like_scalar_event()))
        assert [_as_tuple(p) for p in decoded.points] == [("a/loss", 3, 0.5, 5.0)]


def test_fast_and_general_paths_agree(torch_file: tuple[bytes, Found]) -> None:
    """A parser decodes the first point of each tag through protobuf and the rest on the fast
    path; a fresh parser per record decodes every record through protobuf."""
    data, _ = torch_file
    fast = [_as_tuple(p) for p in EventFileParser().parse(data).points]
    starts = _record_starts(data)
    general = []
    for start, end in zip(starts, [*starts[1:], len(data)], strict=True):
        parser = EventFileParser(state={"plugins": {"acc": "scalars"}})
        general += [_as_tuple(p) for p in parser.parse(data[start:end]).points]
    assert general == fast and len(fast) > 200


@pytest.mark.parametrize("offset", [12, 14, 16])  # the summary, value and tag lengths
@pytest.mark.parametrize("delta", [-1, 1])
def test_a_simple_scalar_with_inconsistent_lengths_is_not_a_point(offset: int,
                                                                  delta: int) -> None:
    """Valid CRCs around an event whose inner lengths disagree: protobuf rejects it, and so
    does the fast path, also the second time the same bytes come (when its cache is warm)."""
    event = bytearray(_torch_like_scalar_event())
    assert event[11:17:2] == b"\x2a\x0a\x0a"  # the framing bytes before the lengths
    good = _frame(bytes(event))
    event[offset] += delta
    bad = _frame(bytes(event))
    decoded = EventFileParser().parse(good + bad + good + bad)
    assert [_as_tuple(p) for p in decoded.points] == [("loss", 3, 0.5, 5.0)] * 2
    assert decoded.corrupt_records == 2


def test_a_tag_first_written_as_simple_value_is_a_scalar_tag(tmp_path: Path) -> None:
    """TensorBoard's rule: a simple_value makes its tag a `scalars` tag, so later tensors of
    the tag without metadata are scalars too; a tag whose first value had no metadata never
    becomes one."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2

    scalars = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    events = [event_pb2.Event(step=0, wall_time=1.0, summary=summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag="mixed", simple_value=1.5),
        summary_pb2.Summary.Value(tag="late", tensor=tensor_pb2.TensorProto(
            dtype=1, float_val=[9.0])),
    ]))]
    for step in (1, 2):
        events.append(event_pb2.Event(step=step, wall_time=2.0, summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="mixed", tensor=tensor_pb2.TensorProto(
                       dtype=1, float_val=[step])),
                   summary_pb2.Summary.Value(tag="late", metadata=scalars,
                                             tensor=tensor_pb2.TensorProto(
                                                 dtype=1, float_val=[step]))])))
    path = _write_with_tensorboard(tmp_path, events)
    got = ours(path.read_bytes(), cuts=[_record_starts(path.read_bytes())[2]])
    assert got.points == oracle(path).points == [
        ("mixed", 0, 1.5, 1.0), ("mixed", 1, 1.0, 2.0), ("mixed", 2, 2.0, 2.0)]


def test_the_cycle_collector_is_paused_only_while_records_decode() -> None:
    """Decoding turns the collector off for the call and leaves it as it found it."""
    seen: list[bool] = []

    class Watching(EventFileParser):
        def _decode(self, data: bytes, pos: int, out: Decoded) -> int:
            seen.append(gc.isenabled())
            return super()._decode(data, pos, out)

    assert gc.isenabled()
    Watching().parse(b"")
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        Watching().parse(b"")
        assert not gc.isenabled()  # one who had turned it off keeps it off
    finally:
        gc.enable()


# --- repeating runs: the same tags in the same order at every step ---------------------------

@pytest.fixture
def template_points(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many points the whole-run path (`_Template`) made: [count], kept up to date."""
    counted = [0]
    real = tensorboard_source._Template.decode

    def counting(self: Any, data: bytes, pos: int, points: list[ScalarPoint]) -> int:
        before = len(points)
        end = real(self, data, pos, points)
        counted[0] += len(points) - before
        return end

    monkeypatch.setattr(tensorboard_source._Template, "decode", counting)
    return counted


def _scalar_run_events(steps: Sequence[int], tags: Sequence[str] = ("loss", "acc", "lr"),
                       step_offsets: Sequence[int] | None = None) -> list[Any]:
    """What a trainer logging `tags` with add_scalar at each of `steps` writes (each tag's
    step plus its offset)."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2

    offsets = step_offsets or [0] * len(tags)
    return [event_pb2.Event(wall_time=1.7e9 + index / 4, step=step + offset,
                            summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(
                                tag=tag, simple_value=(step % 97) / (column + 1))]))
            for index, step in enumerate(steps)
            for column, (tag, offset) in enumerate(zip(tags, offsets, strict=True))]


def _one_record_at_a_time(data: bytes) -> Found:
    """The record-by-record path alone: a call that holds one record never sees a repeat."""
    parser, found = EventFileParser(), Found()
    starts = _record_starts(data)
    for start, end in zip(starts, [*starts[1:], len(data)], strict=True):
        found.add(parser.parse(data[start:end]))
    return found


def _in_chunks(data: bytes, seed: int) -> Found:
    """One parser fed the file as a follower reads it, in reads of random sizes."""
    parser, found, pending, rng, offset = EventFileParser(), Found(), b"", random.Random(seed), 0
    while offset < len(data):
        read = rng.randint(1, 4000)
        pending += data[offset:offset + read]
        offset += read
        decoded = parser.parse(pending)
        found.add(decoded)
        pending = pending[decoded.consumed:]
    return found


@pytest.mark.parametrize(("steps", "offsets"), [
    ([*range(100, 140), *range(16370, 16400), *range(2**21 - 20, 2**21 + 20)], (0, 0, 0)),
    ([0] * 50, (0, 0, 0)),  # no step field at all
    (range(-60, -20), (0, 0, 0)),  # ten-byte varints
    (range(100, 160), (0, 5000, 2**40)),  # each tag of a run at a step of its own
], ids=["every-step-width", "step-zero", "negative", "steps-differ"])
def test_repeating_runs_match_the_loader(tmp_path: Path, template_points: list[int],
                                         steps: Sequence[int], offsets: Sequence[int]) -> None:
    path = _write_with_tensorboard(tmp_path, _scalar_run_events(steps, step_offsets=offsets))
    data = path.read_bytes()
    want = oracle(path)
    whole = ours(data)
    assert template_points[0] >= 0.9 * len(want.points)  # a new step width: learned again
    for got in (whole, _in_chunks(data, seed=1), _in_chunks(data, seed=2)):
        assert got.points == want.points
        assert (got.invalid, got.corrupt, got.consumed) == (want.invalid, 0, len(data))


def _poison(event: bytearray, how: str) -> None:
    """Change one event's bytes, keeping it as long: what the run path must notice."""
    value_at = len(event) - 4
    if how == "wall_time field":
        event[0] = 0x19  # field 3, 64-bit: protobuf keeps it as an unknown field
    elif how == "step field":
        event[9] = 0x18  # field 3 as a varint: unknown too, and no step
    elif how == "step varint":
        event[10], event[11] = event[10] & 0x7F, event[11] | 0x80  # a one-byte varint, then 0x8_
    elif how == "tag":
        event[value_at - 2] = ord("d")  # "acc" -> "acd": another tag, as long
    elif how == "simple_value field":
        event[value_at - 1] = 0x1D  # field 3, 32-bit: a value without a simple_value
    elif how in ("nan", "inf", "-inf"):
        event[value_at:] = struct.pack("<f", float(how))


@pytest.mark.parametrize("how", ["wall_time field", "step field", "step varint", "tag",
                                 "simple_value field", "nan", "inf", "-inf", "data crc"])
def test_a_record_unlike_its_run_is_decoded_as_it_is(template_points: list[int],
                                                     how: str) -> None:
    """One event in the middle of repeating runs differs where the run path compares: it and
    its run are decoded record by record, exactly as without the run path."""
    events = [bytearray(event.SerializeToString())
              for event in _scalar_run_events(range(100, 180))]
    victim = 3 * 40 + 1  # "acc" at step 140: two-byte steps, runs learned before it
    assert events[victim][9:12] == b"\x10\x8c\x01"
    _poison(events[victim], how)
    frames = [_frame(bytes(event)) for event in events]
    if how == "data crc":
        frames[victim] = _flip(frames[victim], 20)
    data = b"".join(frames)
    want = _one_record_at_a_time(data)
    assert len(want.points) + sum(want.invalid.values()) + want.corrupt >= len(events) - 1
    expected_effect = {"nan": want.invalid == {"acc": 1}, "inf": want.invalid == {"acc": 1},
                       "-inf": want.invalid == {"acc": 1}, "data crc": want.corrupt == 1,
                       "tag": [p[:2] for p in want.points if p[0] == "acd"] == [("acd", 140)]}
    assert expected_effect.get(how, True)
    whole = ours(data)
    assert template_points[0] >= 0.9 * len(want.points)
    for got in (whole, _in_chunks(data, seed=3)):
        assert got.points == want.points
        assert (got.invalid, got.corrupt, got.consumed) == (want.invalid, want.corrupt, len(data))


def test_tags_in_a_changing_order_pause_the_search_for_runs(template_points: list[int]) -> None:
    """Runs that never repeat pause the record-by-record path's search for one; in the same
    call, once the pause is over, the runs of tags written in a fixed order are found."""
    rng, tags, events = random.Random(5), ["loss", "acc", "lr", "norm"], []
    for step in range(100):
        rng.shuffle(tags)
        events += _scalar_run_events([step], tags)
    fixed = _scalar_run_events(range(100, 4100))
    data = b"".join(_frame(event.SerializeToString()) for event in events + fixed)
    want = _one_record_at_a_time(data)
    template_points[0] = 0
    got = EventFileParser().parse(data)
    assert [_as_tuple(p) for p in got.points] == want.points and len(want.points) == 400 + 12000
    assert (got.consumed, got.corrupt_records) == (len(data), 0)
    assert template_points[0] >= 0.8 * len(fixed)


_CHANGES = ["wall_time field", "step field", "step varint", "tag", "simple_value field", "nan",
            "inf", "data crc", "drop", "swap", "text"]


@settings(max_examples=150, deadline=None)
@given(first_step=st.sampled_from([0, 1, 120, 16380, 2**21 - 3, -3]),
       steps=st.integers(2, 25), changes=st.lists(
           st.tuples(st.integers(0, 10**6), st.sampled_from(_CHANGES)), max_size=6),
       reads=st.lists(st.integers(1, 3000), min_size=1, max_size=8))
def test_runs_with_any_changes_read_as_record_by_record(first_step: int, steps: int,
                                                        changes: list[tuple[int, str]],
                                                        reads: list[int]) -> None:
    """Repeating runs with events changed, dropped, swapped or put between them, read by one
    parser in reads of any size: the same as the record-by-record path reads them."""
    events = [bytearray(event.SerializeToString())
              for event in _scalar_run_events(range(first_step, first_step + steps))]
    for where, how in changes:
        index = where % len(events)
        if how == "drop" and len(events) > 1:
            del events[index]
        elif how == "swap":
            events[index - 1], events[index] = events[index], events[index - 1]
        elif how == "text":
            events.insert(index, bytearray(b"\x09" + bytes(8) + b"\x1a\x05hello"))
        elif how != "drop":
            _poison(events[index], how)
    frames = [_frame(bytes(event)) for event in events]
    for where, how in changes:
        if how == "data crc":
            frames[where % len(frames)] = _flip(frames[where % len(frames)], 20)
    data = b"".join(frames)
    want = _one_record_at_a_time(data)
    parser, got, offset, pending = EventFileParser(), Found(), 0, b""
    for read in [*reads, len(data)]:
        pending += data[offset:offset + read]
        offset += read
        decoded = parser.parse(pending)
        got.add(decoded)
        pending = pending[decoded.consumed:]
    assert got.points == want.points
    assert (got.invalid, got.corrupt, got.consumed) == (want.invalid, want.corrupt, len(data))


# --- keys from the folders writers make -------------------------------------------------------

@pytest.mark.parametrize(("folder", "prefix"), [
    (".", ""),
    ("train", "train/"),
    ("run1/1796192167.6776414", "run1/"),  # torch's add_hparams: <logdir>/<time.time()>/
    ("1796192167.6776414", ""),
    ("lightning_logs/version_0", "lightning_logs/version_0/"),  # Lightning's TensorBoardLogger
    ("fit/validation", "fit/validation/"),  # Keras' TensorBoard callback
    ("2024.1", "2024.1/"),  # a version, not a time
    ("1796192167.6776414/eval", "1796192167.6776414/eval/"),  # only the last folder is a writer's
])
def test_a_key_prefix_is_the_folder_without_add_hparams_time_named_one(folder: str,
                                                                       prefix: str) -> None:
    assert tensorboard_source.key_prefix(Path(folder)) == prefix


def test_watch_keys_torch_add_hparams_without_its_time_folder_and_keeps_other_layouts(
        tmp_path: Path) -> None:
    """Through the real process, torch's own SummaryWriter writing: add_hparams' metrics in
    run1/<time.time()>/, Lightning's version_N folder and Keras' train/validation folders."""
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    logdir = tmp_path / "tb"
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID) as ingest:
        env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
        watch = Sidecar(["watch", "--tensorboard", str(logdir)], env, tmp_path / "watch")
        stderr = tmp_path / "watch" / "stderr"
        try:
            wait_until(lambda: f"--tensorboard {logdir}: " in stderr.read_text(), 20,
                       "the missing folder said")
            run1 = tensorboard.SummaryWriter(str(logdir / "run1"))
            for step in range(3):
                run1.add_scalar("loss", 1.0 / (step + 1), step)
            run1.add_hparams({"lr": 0.01, "batch": 32}, {"hparam/final_loss": 0.25})
            run1.close()
            for folder, tag in (("lightning_logs/version_0", "train_loss"),
                                ("fit/train", "epoch_loss"), ("fit/validation", "epoch_loss")):
                with tensorboard.SummaryWriter(str(logdir / folder)) as writer:
                    writer.add_scalar(tag, 0.5, 1)
            [hparams_folder] = [p.parent for p in (logdir / "run1").glob("*/events.out.*")]
            assert float(hparams_folder.name) > 1e9  # the layout this test is about

            def keys() -> set[str]:
                return {p["key"] for r in ingest.records("metrics") for p in r["points"]}

            wait_until(lambda: len(keys()) >= 5 and bool(ingest.records("hparams")), 20,
                       "the points and hparams")
        finally:
            watch.proc.send_signal(signal.SIGTERM)
            done = watch.wait(60)
        assert done.status == 0, done.stderr
        assert keys() == {"run1/loss", "run1/hparam/final_loss",
                          "lightning_logs/version_0/train_loss", "fit/train/epoch_loss",
                          "fit/validation/epoch_loss"}
        params = {k: v for r in ingest.records("hparams") for k, v in r["params"].items()}
        assert params == {"lr": 0.01, "batch": 32}
        said = done.stderr.decode()
        assert f"--tensorboard {logdir}: no such folder yet" in said
        assert "no such file" not in said


def test_an_event_file_given_as_tensorboard_is_followed_and_another_file_refused(
        tmp_path: Path) -> None:
    """`--tensorboard logs/events.out.tfevents...` (the file a user sees in the folder) is
    followed as that file, its keys unprefixed; a file of another name there is refused with
    the configuration's exit status before the command starts."""
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    logdir = tmp_path / "tb"
    with tensorboard.SummaryWriter(str(logdir)) as writer:
        writer.add_scalar("loss", 0.5, 1)
    [event_file] = logdir.glob("events.out.tfevents.*")
    # the command appends a point to the file given, through tensorboard's own record writer
    child = python_child(
        "from tensorboard.compat.proto.event_pb2 import Event\n"
        "from tensorboard.compat.proto.summary_pb2 import Summary\n"
        "from tensorboard.summary.writer.record_writer import RecordWriter\n"
        f"with open({str(event_file)!r}, 'ab') as fh:\n"
        "    w = RecordWriter(fh)\n"
        "    v = Summary.Value(tag='loss', simple_value=0.25)\n"
        "    event = Event(wall_time=1.0, step=2, summary=Summary(value=[v]))\n"
        "    w.write(event.SerializeToString())\n"
        "    w.flush()\n")
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID) as ingest:
        env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
        done = sidecar(["run", "--tensorboard", str(event_file), "--", *child], env,
                       tmp_path / "run")
        assert done.status == 0, done.stderr
        points = sorted((p["key"], p["step"], p["value"]) for r in ingest.records("metrics")
                        for p in r["points"])
        assert points == [("loss", 1, 0.5), ("loss", 2, 0.25)]
        assert b"is a file" not in done.stderr

        log = tmp_path / "train.log"
        log.write_text("step 1\n")
        refused = sidecar(["run", "--tensorboard", str(log), "--", "true"],
                          {**env, "STARFORGE_RUN_ID": RUN_ID}, tmp_path / "refused")
        assert refused.status == EXIT_CONFIG
        assert (f"--tensorboard {log} is a file not named events.out.tfevents.*: give the "
                f"folder the event files are written to (here {tmp_path}) or one of them"
                ).encode() in refused.stderr
