"""JSONL metric logs -> /metrics points (CONTRACT 5, JSONL).

Each complete line is one JSON object. `{"key", "value"}` is one point; any other object is a
record whose numeric leaves become points, nested keys joined with `/`. A line that is not JSON,
or not an object, is skipped and counted. A last line without its newline waits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sidecar.records import iso_ts
from sidecar.sources.base import Parsed

STEP_FIELDS = ("step", "global_step", "_step", "iteration")
TIME_FIELDS = ("ts", "timestamp", "_timestamp", "time")
MAX_LINE_BYTES = 16 << 20  # a longer line is skipped and counted rather than held in memory


class JsonlParser:
    """Parses one JSONL file; `line` is the 0-based number of the next line (the default step)."""

    def __init__(self, line: int = 0) -> None:
        self.line = line
        self._skipping = False  # inside an over-long line, dropping it up to its newline

    @classmethod
    def resume(cls, state: dict[str, Any]) -> JsonlParser:
        return cls(line=int(state.get("line", 0)))

    def state(self) -> dict[str, Any]:
        return {"line": self.line}

    def quiet(self, data: bytes, now: float, final: bool = False) -> Parsed:
        return Parsed(consumed=0)  # never send half a line

    def parse(self, data: bytes, now: float) -> Parsed:
        out = Parsed(consumed=0)
        end = data.rfind(b"\n") + 1
        if self._skipping:
            first = data.find(b"\n")
            if first < 0:
                out.consumed = len(data)
                return out
            self._skipping = False
            self.line += 1
            out.consumed = first + 1
        if end <= out.consumed:
            if len(data) - out.consumed > MAX_LINE_BYTES:
                self._skipping, out.consumed, out.skipped = True, len(data), 1
            return out
        read_ts = iso_ts(now)
        for raw in data[out.consumed:end].split(b"\n")[:-1]:
            if len(raw) > MAX_LINE_BYTES:
                out.records += 1
                out.skipped += 1
            else:
                self._line(raw, read_ts, out)
            self.line += 1
        out.consumed = end
        return out

    def _line(self, raw: bytes, read_ts: str, out: Parsed) -> None:
        if not raw.strip():
            return
        out.records += 1
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
            out.skipped += 1
            return
        if not isinstance(obj, dict):
            out.skipped += 1
            return
        ts = _time_of(obj) or read_ts
        if "key" in obj and _is_number(obj.get("value")):
            step = _integer(obj.get("step", 0))
            if not isinstance(obj["key"], str) or not obj["key"] or step is None:
                out.skipped += 1
                return
            _point(out, obj["key"], step, obj["value"], ts)
            return
        step = next((s for s in (_integer(obj[f]) for f in STEP_FIELDS if f in obj)
                     if s is not None), self.line)
        for key, value in _leaves(obj, top=True):
            _point(out, key, step, value, ts)


def _point(out: Parsed, key: str, step: int, value: Any, ts: str) -> None:
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not math.isfinite(number):
        out.invalid[key] = out.invalid.get(key, 0) + 1
        return
    out.points.append({"key": key, "step": step,
                       "value": int(value) if isinstance(value, bool) else value, "ts": ts})


def _leaves(obj: dict[str, Any], top: bool, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Numeric and boolean leaves as (slash/joined/key, value); step and time fields skipped."""
    for key, value in obj.items():
        if (top and (key in STEP_FIELDS or key in TIME_FIELDS)) or not key:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, False, name + "/")
        elif _is_number(value):
            yield name, value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float)  # bool is an int: booleans count, as 0/1


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _time_of(obj: dict[str, Any]) -> str | None:
    """The record's own time as ISO-8601 UTC: epoch seconds or ISO-8601 (UTC without a zone)."""
    for name in TIME_FIELDS:
        value = obj.get(name)
        try:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return iso_ts(float(value))
            if isinstance(value, str):
                when = datetime.fromisoformat(value)
                if when.tzinfo is None:
                    when = when.replace(tzinfo=UTC)
                return when.astimezone(UTC).isoformat()
        except (ValueError, OverflowError, OSError):  # not a time, or beyond what one can be
            continue
    return None
