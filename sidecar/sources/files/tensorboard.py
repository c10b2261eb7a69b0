"""TensorBoard event files -> scalar points and hparams (docs/ingest.md#tensorboard).

A pure, incremental decoder for one `events.out.tfevents.*` file: the caller reads bytes from the
growing file and hands over everything from its last unconsumed offset; the parser returns what
the whole records in it hold and how many bytes they took. No file I/O, no clock.

Framing (TFRecord): uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes, the
data, uint32 masked CRC32C of the data. Policy for bad input, which never raises and never
waits on garbage:

- A record cut anywhere (header, data or data CRC) at the end of the input is not consumed: it
  is waited for.
- A header whose length CRC is wrong, or whose length is over `MAX_RECORD_BYTES`, starts a
  *resync*: the parser advances byte by byte (in C: only offsets whose length has four zero
  high bytes can be headers) to the next offset holding a valid header, skipping and consuming
  the bytes in between. One resync counts as one corrupt record, however many calls it spans.
- A record whose header is valid but whose data CRC is wrong is skipped whole (its length was
  vouched for by the header CRC) and counted.
- A record whose CRCs are right but whose data is not a decodable event is skipped and counted.

Events: TF1 `simple_value` scalars, and tensor scalars whose plugin is `scalars` (the plugin is
named by metadata that writers put only on a tag's first value, so it is remembered per tag and
kept in `state()` across restarts). The hparams plugin's session-start record becomes
`hparams`. Everything else (the file-version event, graphs, images, histograms, text) yields
nothing.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import google_crc32c
from google.protobuf.message import DecodeError

from sidecar.records import iso_ts
from sidecar.sources.base import Parsed, Parser
from sidecar.sources.files import tensorboard_schema as schema

MAX_RECORD_BYTES = 256 * 1024 * 1024  # a longer record is taken for garbage, not waited for
SCALARS_PLUGIN = "scalars"
HPARAMS_PLUGIN = "hparams"

_HEADER_BYTES = 12  # uint64 length + uint32 masked CRC of it
_FOOTER_BYTES = 4  # uint32 masked CRC of the data
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_MAX_CACHED_HEADERS = 4096
_MAX_CACHED_KEYS = 65536
_MAX_TEMPLATE_RECORDS = 256  # a longer repeating run of scalar events is decoded record by record
# Tags written in a changing order never make a template: after so many runs in a row that did
# not repeat, the record-by-record path stops looking for one for a while (looking costs it a
# tenth of its time).
_MAX_MISSED_REPEATS = 8
_LEARNING_PAUSE_BYTES = 64 << 10
_STATE_VERSION = 1

if google_crc32c.implementation != "c":  # its fallback is a pure-Python loop: 100x slower
    raise ImportError("google-crc32c could not load its C extension; reinstall it from a wheel "
                      "for this platform (pip install --force-reinstall google-crc32c)")
_crc32c_value: Callable[[bytes], int] = google_crc32c.value
_unpack_u32 = struct.Struct("<I").unpack_from
_unpack_header = struct.Struct("<QI").unpack
_unpack_wall = struct.Struct("<d").unpack_from
_unpack_f32 = struct.Struct("<f").unpack_from
_is_finite = math.isfinite

# _SIMPLE_EVENT: the shape of every simple_value scalar event written by TensorFlow 1, torch
# and tensorboardX, decoded without protobuf. Protobuf bytes, by field number:
#   09 <wall_time: 8 bytes>  [10 <step: varint>]  2a <summary_len>
#     0a <value_len>  0a <tag_len> <tag>  15 <simple_value: float32>
# with one-byte lengths (a tag under 119 bytes). The part from 2a to the tag, the *tail*, is
# checked once per distinct tag and then only looked up. An event of any other shape takes the
# general protobuf path, which gives the same answer. Such events mostly come in a run that
# repeats every step (the same tags in the same order): once the record-by-record path has
# seen one repeat, whole runs are decoded at a time (_Template), as long as they match it.
_WALL_TIME_FIELD = 0x09  # field 1, 64-bit
_STEP_FIELD = 0x10  # field 2, varint
_SIMPLE_VALUE_FIELD = 0x15  # field 2 of Summary.Value, 32-bit
_MIN_SIMPLE_EVENT = 20  # 9 (wall_time) + _SIMPLE_TAIL_BYTES + 5 (simple_value)
_SIMPLE_TAIL_BYTES = 6  # 2a summary_len 0a value_len 0a tag_len, an empty tag
# The high half of every length up to MAX_RECORD_BYTES: see _resync.
_ZERO_HIGH_HALF = b"\x00\x00\x00\x00"
_NON_ZERO_BYTE = re.compile(rb"[^\x00]")
_ALL_ZERO_HEADER = bytes(_HEADER_BYTES)

HParamValue = str | int | float | bool
# str(time.time()): the folder add_hparams writes into (epoch seconds, digits after the point)
_TIME_NAMED = re.compile(r"\d{9,11}\.\d+")
_MAX_EXACT_INT = 2**53  # a double holds every integer up to here exactly


# One scalar for `/metrics`: (key, step, value, wall_time). key: the tag, prefixed by the event
# file's folder under the --tensorboard dir ("train/loss"); value: finite only (NaN and
# infinities are counted, never returned); wall_time: the event's, epoch seconds. A plain tuple,
# not a named one: made millions of times a second, and zip() builds a whole run of them in C
# (a NamedTuple costs ten times as much each).
ScalarPoint = tuple[str, int, float, float]


class Decoded:
    """What one `EventFileParser.parse` call found."""

    __slots__ = ("consumed", "corrupt_records", "hparams", "invalid_steps", "invalid_values",
                 "points")

    def __init__(self) -> None:
        self.points: list[ScalarPoint] = []
        self.hparams: dict[str, HParamValue] | None = None  # session-start, flattened; None: none
        self.consumed = 0  # leading bytes that were whole records or skipped garbage: drop them
        self.corrupt_records = 0  # skipped and counted (see the module docstring for the policy)
        self.invalid_values: dict[str, int] = {}  # NaN/inf count per key
        self.invalid_steps: dict[str, int] = {}  # the step of each key's first NaN/inf value


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C: the CRC rotated right by 15 bits plus a constant."""
    crc = _crc32c_value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def _record_length(header: bytes) -> int | None:
    """The data length a 12-byte header announces, or None if it is not a valid header."""
    length: int
    length_crc: int
    length, length_crc = _unpack_header(header)
    if length > MAX_RECORD_BYTES or masked_crc32c(header[:8]) != length_crc:
        return None
    return length


# A valid header's data length, and for a length a simple scalar event can have, how to read
# that event's wall_time and simple_value in one call (see _SIMPLE_EVENT).
_Frame = tuple[int, Callable[[bytes], tuple[float, float]] | None]


def _frame_of(header: bytes) -> _Frame | None:
    """The _Frame of a 12-byte header, or None if it is not a valid header."""
    length = _record_length(header)
    if length is None:
        return None
    if length < _MIN_SIMPLE_EVENT:
        return length, None
    return length, struct.Struct(f"<xd{length - 13}xf").unpack  # at 1 and at length - 4


# Headers already checked: a file repeats a few lengths millions of times.
_VALID_HEADERS: dict[bytes, _Frame] = {}

# A simple scalar event as the record-by-record path found it: its 12-byte header, where its
# tail starts (after the step field, if any), the tail and the key it names.
_Shape = tuple[bytes, int, bytes, str]
_SHAPE_KEY = 3
# What _Template's struct gives per record, in file order: the header and the wall_time field
# number (the *head*), wall_time, the step field (none at step 0), the tail and the
# simple_value field number, simple_value, the data CRC as it is stored.
_TEMPLATE_FIELDS = "{head}sd{step}s{tail}sf4s"
_HEAD, _WALL, _STEP, _TAIL, _VALUE, _FOOTER = range(6)
_STRIDE = 6
_LANE_BYTES = 8  # _Template masks CRCs as the 64-bit lanes of one integer
_LANE_GAP = bytes(_LANE_BYTES - _FOOTER_BYTES)
_MAX_CACHED_STEPS = 4096


class _Steps(dict[bytes, int]):
    """A step field's bytes (`10 <varint>`, or none at step 0) -> the step; KeyError if they
    are not one varint filling the field exactly. The records of one run mostly share a
    step, so each new step is decoded once."""

    def __missing__(self, step_field: bytes) -> int:
        if not step_field:
            step = 0  # proto3 leaves a zero step out
        else:
            step, end = _read_varint(step_field, 1)
            if step_field[0] != _STEP_FIELD or end != len(step_field):
                raise KeyError(step_field)
        if len(self) >= _MAX_CACHED_STEPS:
            self.clear()
        self[step_field] = step
        return step


class _Template:
    """A run of simple scalar events that repeats, identical but for each event's wall_time,
    step and value and the data CRC: what a trainer logging the same tags in the same order
    every step writes. A whole run is decoded with two struct calls (its fields; its records'
    data, for the CRCs) and compared with the run it was learned from as tuples, in C; zip()
    makes its points. Only a run that passes every check the record-by-record path makes
    (same headers and tails, right CRCs, well-formed steps, finite values) is taken whole;
    anything else is left to that path, which finds, skips and counts it the same as always."""

    def __init__(self, shapes: list[_Shape]) -> None:
        fields, records = ["<"], ["<"]
        for _, tail_start, tail, _ in shapes:
            fields.append(_TEMPLATE_FIELDS.format(
                head=_HEADER_BYTES + 1, step=tail_start - 9, tail=len(tail) + 1))
            records.append(f"{_HEADER_BYTES}x{tail_start + len(tail) + 5}s{_FOOTER_BYTES}x")
        self._fields = struct.Struct("".join(fields)).unpack_from
        self._records = struct.Struct("".join(records)).unpack_from  # each record's data
        self.size = struct.calcsize("".join(records))
        self._heads = tuple(header + bytes([_WALL_TIME_FIELD]) for header, _, _, _ in shapes)
        self._tails = tuple(tail + bytes([_SIMPLE_VALUE_FIELD]) for _, _, tail, _ in shapes)
        self._keys = tuple(key for _, _, _, key in shapes)
        self._steps = _Steps()
        count = len(shapes)
        self._pack_lanes = struct.Struct(f"<{count}Q").pack
        self._lanes_bytes = _LANE_BYTES * count - _FOOTER_BYTES  # the last lane's high half: 0
        self._low17, self._high15, self._u32s, self._deltas = (
            int.from_bytes(struct.pack("<Q", mask) * count, "little")
            for mask in (0x1FFFF, 0xFFFE0000, _U32, _MASK_DELTA))

    def decode(self, data: bytes, pos: int, points: list[ScalarPoint]) -> int:
        """Decode runs from `pos` on while each matches whole; returns where the first run
        that does not (or is cut) starts."""
        last = len(data) - self.size
        while pos <= last:
            fields = self._fields(data, pos)
            if (fields[_HEAD::_STRIDE] != self._heads or fields[_TAIL::_STRIDE] != self._tails
                    or not self._crcs_match(data, pos, fields[_FOOTER::_STRIDE])):
                return pos
            values = fields[_VALUE::_STRIDE]
            # float32s, however many, cannot add up to an infinity in a double: the sum is
            # finite exactly when every value is
            if not _is_finite(sum(values)):
                return pos
            try:
                steps = list(map(self._steps.__getitem__, fields[_STEP::_STRIDE]))
            except KeyError:
                return pos
            points += zip(self._keys, steps, values, fields[_WALL::_STRIDE], strict=True)
            pos += self.size
        return pos

    def _crcs_match(self, data: bytes, pos: int, footers: tuple[bytes, ...]) -> bool:
        """Whether each record's masked CRC32C is its footer. The CRCs are masked all at once,
        as the 64-bit lanes of one integer: masked_crc32c's rotation and addition never carry
        a bit from one lane into the next. The footers are laid out the same way, each
        followed by four zero bytes."""
        raw = int.from_bytes(self._pack_lanes(*map(_crc32c_value, self._records(data, pos))),
                             "little")
        masked = (((raw >> 15) & self._low17) | ((raw << 17) & self._high15)) + self._deltas
        return (masked & self._u32s).to_bytes(self._lanes_bytes, "little") == (
            _LANE_GAP.join(footers))


def _run_follows(shapes: list[_Shape], data: bytes, pos: int) -> bool:
    """Whether the records from `pos` on have the headers and tails of `shapes`, in order. A
    template is made only from a run seen twice, whole: a trainer that writes its tags in a
    changing order does not make (and drop) one template a step."""
    for header, tail_start, tail, _ in shapes:
        if not (data.startswith(header, pos)
                and data.startswith(tail, pos + _HEADER_BYTES + tail_start)):
            return False
        pos += _HEADER_BYTES + tail_start + len(tail) + 5 + _FOOTER_BYTES
    return True


class EventFileParser:
    """Incremental decoder for one event file: feed it the unconsumed bytes, get the points."""

    def __init__(self, key_prefix: str = "", state: dict[str, Any] | None = None) -> None:
        """`key_prefix`: "" at the top of the --tensorboard dir, else the folder and a slash;
        `state`: what `state()` returned for this file before a restart."""
        self._prefix = key_prefix
        self._plugins: dict[str, str] = {}  # tag -> plugin its first value named, or ""
        self._resyncing = False  # inside garbage, looking for the next valid header
        self._keys: dict[bytes, str] = {}  # summary framing + tag bytes (fast path) -> key
        self._template: _Template | None = None  # the last repeating run of scalar events
        if state:
            self._load_state(state)

    def state(self) -> dict[str, Any]:
        """JSON-serialisable; persisted by the caller with the offset it belongs to."""
        return {"version": _STATE_VERSION, "plugins": dict(self._plugins),
                "resyncing": self._resyncing}

    def _load_state(self, state: dict[str, Any]) -> None:
        # A state from another version or a damaged file is not worth a crash: whatever
        # cannot be read is forgotten, at worst some tensor scalars of a tag go unrecognised.
        plugins = state.get("plugins")
        if isinstance(plugins, dict):
            self._plugins = {k: v for k, v in plugins.items()
                             if isinstance(k, str) and isinstance(v, str)}
        self._resyncing = state.get("resyncing") is True

    def parse(self, data: bytes) -> Decoded:
        """Decode the whole records at the start of `data` (the file from the last unconsumed
        offset on); a cut record at the end is left unconsumed to be offered again, grown."""
        data = bytes(data)  # a no-op for bytes; slices of a bytearray could not be looked up
        out = Decoded()
        pos = 0
        while True:
            if self._resyncing:
                pos, found = _resync(data, pos)
                if not found:
                    break
                self._resyncing = False
            with _collector_paused():
                pos = self._decode(data, pos, out)
            if not self._resyncing:
                break
            out.corrupt_records += 1
            pos += 1
        out.consumed = pos
        return out

    def _decode(self, data: bytes, pos: int, out: Decoded) -> int:
        """Decode records from `pos` on: whole runs at a time while they match the learned
        template, one by one where they do not; returns where `_records` stopped."""
        while True:
            if self._template is not None:
                pos = self._template.decode(data, pos, out.points)
            pos, learned = self._records(data, pos, out)
            if not learned:
                return pos

    def _records(self, data: bytes, pos: int, out: Decoded) -> tuple[int, bool]:
        """Decode records one by one from `pos` on; returns where it stopped: at a cut record,
        at the end, at an invalid header (then `_resyncing` is set), or after the first record
        that closed a repeating run of simple scalar events (then True: that run is the new
        `_template`, to be tried from there). The hot loop: kept flat."""
        append = out.points.append
        n = len(data)
        headers = _VALID_HEADERS
        keys = self._keys
        crc32c = _crc32c_value
        unpack_u32 = _unpack_u32
        is_finite = _is_finite
        run: list[_Shape] = []  # the simple scalar events decoded since the last other record
        misses = 0  # runs in a row that did not repeat: after a few, a pause from looking
        resume_at = 0  # where that pause ends
        while True:
            header_end = pos + _HEADER_BYTES
            if header_end > n:
                return pos, False
            header = data[pos:header_end]
            frame = headers.get(header)
            if frame is None:
                frame = _frame_of(header)
                if frame is None:
                    self._resyncing = True
                    return pos, False
                if len(headers) < _MAX_CACHED_HEADERS:
                    headers[header] = frame
            length, wall_and_value = frame
            end = header_end + length
            if end + _FOOTER_BYTES > n:
                return pos, False
            record = data[header_end:end]
            crc = crc32c(record)  # masked inline: this runs for every record
            if (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32 != unpack_u32(data, end)[0]:
                out.corrupt_records += 1
                pos = end + _FOOTER_BYTES
                run.clear()
                continue
            pos = end + _FOOTER_BYTES

            if (wall_and_value is not None and record[0] == _WALL_TIME_FIELD
                    and record[-5] == _SIMPLE_VALUE_FIELD):
                # Perhaps a simple scalar event (see _SIMPLE_EVENT): its step, then its tail.
                if record[9] != _STEP_FIELD:
                    step, tail_start = 0, 9
                elif record[10] < 0x80:
                    step, tail_start = record[10], 11
                elif record[11] < 0x80:
                    step, tail_start = (record[10] & 0x7F) | (record[11] << 7), 12
                elif record[12] < 0x80:  # steps 16,384 to 2,097,151: most of a long run
                    step = (record[10] & 0x7F) | (record[11] & 0x7F) << 7 | record[12] << 14
                    tail_start = 13
                else:
                    step, tail_start = _read_varint(record, 10)
                tail = record[tail_start:-5]
                key = keys.get(tail)
                if key is not None:
                    wall_time, value = wall_and_value(record)
                    if not is_finite(value):
                        out.invalid_values[key] = out.invalid_values.get(key, 0) + 1
                        out.invalid_steps.setdefault(key, step)
                        run.clear()
                        continue
                    append((key, step, value, wall_time))
                    if misses == _MAX_MISSED_REPEATS:  # tags in a changing order: a pause
                        if pos < resume_at:
                            continue
                        misses = 0
                    shape = (header, tail_start, tail, key)
                    if run and (key is run[0][_SHAPE_KEY] or len(run) == _MAX_TEMPLATE_RECORDS):
                        repeat = [*run[1:], shape]  # the run as it starts after this record
                        if shape == run[0] and _run_follows(repeat, data, pos):
                            self._template = _Template(repeat)
                            return pos, True
                        misses += 1  # not a repeat: a new run starts here
                        resume_at = pos + _LEARNING_PAUSE_BYTES
                        run.clear()
                    run.append(shape)
                    continue
                self._learn_simple_tail(tail)
            run.clear()
            if not self._decode_event(record, out):
                out.corrupt_records += 1

    def _learn_simple_tail(self, tail: bytes) -> None:
        """Remember the key of a simple scalar event's tail once it is proven well formed."""
        if len(self._keys) >= _MAX_CACHED_KEYS or len(tail) < _SIMPLE_TAIL_BYTES:
            return
        summary_len, value_len, tag_len = tail[1], tail[3], tail[5]
        if (tail[0:5:2] != b"\x2a\x0a\x0a" or summary_len >= 0x80 or tag_len != len(tail) - 6
                or value_len != tag_len + 7 or summary_len != value_len + 2):
            return
        try:
            self._keys[tail] = self._prefix + tail[6:].decode("utf-8")
        except UnicodeDecodeError:
            return  # protobuf rejects it too: the general path counts it corrupt

    def _decode_event(self, record: bytes, out: Decoded) -> bool:
        """The general path: any event, through the protobuf runtime. False: undecodable."""
        try:
            event = schema.Event.FromString(record)
        except DecodeError:
            return False
        if not event.HasField("summary"):
            return True
        for value in event.summary.value:
            tag: str = value.tag
            kind = value.WhichOneof("value")
            plugin = self._plugin(tag, kind, value)
            if kind == "simple_value":
                self._emit(out, tag, event.step, value.simple_value, event.wall_time)
            elif kind == "tensor" and plugin == SCALARS_PLUGIN:
                number = _tensor_scalar(value.tensor)
                if number is not None:
                    self._emit(out, tag, event.step, number, event.wall_time)
            elif (value.metadata.plugin_data.plugin_name == HPARAMS_PLUGIN
                  and not _read_hparams(value.metadata.plugin_data.content, out)):
                out.corrupt_records += 1  # the record's other values still count
        return True

    def _plugin(self, tag: str, kind: str | None, value: Any) -> str:
        """The tag's plugin, by TensorBoard's rule: the one its first value names (none if that
        value has no metadata); a simple_value always counts as `scalars`."""
        known = self._plugins.get(tag)
        if known is None:
            if kind == "simple_value":
                known = SCALARS_PLUGIN
            else:
                known = value.metadata.plugin_data.plugin_name
            self._plugins[tag] = known
        return known

    def _emit(self, out: Decoded, tag: str, step: int, value: float, wall_time: float) -> None:
        key = self._prefix + tag
        if _is_finite(value):
            out.points.append((key, step, value, wall_time))
        else:
            out.invalid_values[key] = out.invalid_values.get(key, 0) + 1
            out.invalid_steps.setdefault(key, step)


def folder_parsers(folder: Path) -> Callable[[Path, dict[str, Any]], Parser]:
    """The parser of each event file under `folder`: its keys named from the path below it."""
    return lambda path, state: EventFile(key_prefix(path.parent.relative_to(folder)), state)


def key_prefix(relative: Path) -> str:
    """The prefix of the keys of an event file in the folder `relative` to the --tensorboard
    folder: its path with `/` after it ("" at the top). A last folder named after the time,
    where torch's and tensorboardX's add_hparams write (`<logdir>/<time.time()>/`), is left
    out: it names no run, and would make a new key of every metric at every call."""
    parts = list(relative.parts)
    if parts and _TIME_NAMED.fullmatch(parts[-1]):
        parts.pop()
    return "".join(f"{part}/" for part in parts if part != ".")


class EventFile:
    """The TensorBoard event-file decoder seen as a file parser: scalars become points."""

    def __init__(self, key_prefix: str, state: dict[str, Any]) -> None:
        self._decoder = EventFileParser(key_prefix, state)

    def parse(self, data: bytes, now: float) -> Parsed:
        decoded = self._decoder.parse(data)
        points = [{"key": key, "step": step, "value": value, "ts": iso_ts(wall_time)}
                  for key, step, value, wall_time in decoded.points]
        parsed = Parsed(consumed=decoded.consumed, points=points, hparams=decoded.hparams,
                        records=len(points), skipped=decoded.corrupt_records,
                        invalid=decoded.invalid_values)
        parsed.invalid_steps = decoded.invalid_steps
        return parsed

    def quiet(self, data: bytes, now: float, final: bool = False) -> Parsed:
        return Parsed(consumed=0)  # a record still being written is waited for

    def state(self) -> dict[str, Any]:
        return self._decoder.state()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while records decode: a point is a new tuple, none is ever
    in a cycle, and the collector ran every 700 of them, a fifth of the decoding time. One call
    is bounded (a slice of the file), so garbage elsewhere waits at most that long."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _resync(data: bytes, pos: int) -> tuple[int, bool]:
    """From `pos`, the offset of the next valid header: (offset, True); or (offset, False):
    every header before that offset is invalid and the ones after cannot be judged yet.

    A length up to MAX_RECORD_BYTES has four zero high bytes, which random bytes almost never
    have: a C `find` for them skips to the candidates, and only candidates get a CRC, each
    distinct one once. A run of zeros (a file preallocated, or left zero-filled by a crash) is
    jumped over whole."""
    n = len(data)
    find = data.find
    rejected: set[bytes] = set()
    while True:
        high = find(_ZERO_HIGH_HALF, pos + 4)
        if high < 0:
            return max(pos, n - 7), False  # no later offset up to n - 8 has a zero high half
        pos = high - 4
        header = data[pos:pos + _HEADER_BYTES]
        if len(header) < _HEADER_BYTES:
            return pos, False
        if header in rejected:
            pos += 1
        elif header == _ALL_ZERO_HEADER:
            run_end = _NON_ZERO_BYTE.search(data, pos)
            pos = max(pos + 1, (run_end.start() if run_end else n) - _HEADER_BYTES + 1)
        elif header in _VALID_HEADERS or _record_length(header) is not None:
            return pos, True
        else:
            if len(rejected) < _MAX_CACHED_HEADERS:
                rejected.add(header)
            pos += 1


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at `pos` as int64, and the offset after it; (0, 0) if malformed."""
    number = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            break
        byte = data[pos]
        number |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            number &= 2**64 - 1
            return (number - 2**64 if number >= 2**63 else number), pos
    return 0, 0


def _half(bits: int) -> float:
    value: float = struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]
    return value


def _bfloat16(bits: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]
    return value


# dtype -> (struct format of one element in tensor_content, repeated field, element -> number)
_Convert = Callable[[Any], float]
_DTYPES: dict[int, tuple[str, str, _Convert]] = {
    schema.DT_FLOAT: ("<f", "float_val", float),
    schema.DT_DOUBLE: ("<d", "double_val", float),
    schema.DT_INT32: ("<i", "int_val", float),
    schema.DT_UINT8: ("<B", "int_val", float),
    schema.DT_INT16: ("<h", "int_val", float),
    schema.DT_INT8: ("<b", "int_val", float),
    schema.DT_UINT16: ("<H", "int_val", float),
    schema.DT_INT64: ("<q", "int64_val", float),
    schema.DT_UINT32: ("<I", "uint32_val", float),
    schema.DT_UINT64: ("<Q", "uint64_val", float),
    schema.DT_BOOL: ("<?", "bool_val", float),
    schema.DT_HALF: ("<H", "half_val", _half),
    schema.DT_BFLOAT16: ("<H", "half_val", _bfloat16),
}


def _tensor_scalar(tensor: Any) -> float | None:
    """The number in a one-element tensor, from tensor_content or the dtype's repeated field;
    None for any other dtype or shape."""
    if any(dim.size != 1 for dim in tensor.tensor_shape.dim):
        return None
    spec = _DTYPES.get(tensor.dtype)
    if spec is None:
        return None
    fmt, field_name, convert = spec
    content: bytes = tensor.tensor_content
    if content:
        if len(content) != struct.calcsize(fmt):
            return None
        return convert(struct.unpack(fmt, content)[0])
    values: Sequence[Any] = getattr(tensor, field_name)
    return convert(values[0]) if len(values) == 1 else None


def _read_hparams(content: bytes, out: Decoded) -> bool:
    """Merge a session-start record's hparams into `out.hparams`. False: undecodable."""
    try:
        data = schema.HParamsPluginData.FromString(content)
    except DecodeError:
        return False
    if not data.HasField("session_start_info"):
        return True  # the experiment and session-end records carry no values
    params = out.hparams if out.hparams is not None else {}
    for name, value in data.session_start_info.hparams.items():
        _flatten(name, value, params, out.invalid_values)
    out.hparams = params
    return True


def _flatten(key: str, value: Any, params: dict[str, HParamValue],
             invalid: dict[str, int]) -> None:
    """One google.protobuf.Value into dotted scalars: a struct's fields as `key.field`, a
    list's items as `key.0`, `key.1`...; null is skipped (`/hparams` takes scalars only);
    an integral number is sent as an int (the Value kind has only doubles, and `32.0` is not
    how anyone wrote a batch size); NaN and infinities are counted, never sent."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number: float = value.number_value
        if not _is_finite(number):
            invalid[key] = invalid.get(key, 0) + 1
        elif number.is_integer() and abs(number) <= _MAX_EXACT_INT:
            params[key] = int(number)
        else:
            params[key] = number
    elif kind == "string_value":
        params[key] = value.string_value
    elif kind == "bool_value":
        params[key] = value.bool_value
    elif kind == "struct_value":
        for name, item in value.struct_value.fields.items():
            _flatten(f"{key}.{name}", item, params, invalid)
    elif kind == "list_value":
        for index, item in enumerate(value.list_value.values):
            _flatten(f"{key}.{index}", item, params, invalid)
