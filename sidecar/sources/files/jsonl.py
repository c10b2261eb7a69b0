"""JSONL metric logs -> /metrics points (docs/ingest.md#jsonl).

Each complete line is one JSON object. `{"key", "value"}` is one point; any other object is a
record whose numeric leaves become points, nested keys joined with `/`. A line that cannot give
a point (not JSON, not an object, no number in it, a step no point can carry) is counted as
invalid, and the first of each file is said in one WARNING naming the line, what is wrong with it
and the fix: an empty chart is always explained. A last line without its newline waits.

A record's step is its own (the first step field it has); one without takes the step of the last
record before it that had one, and before any had one, the count of such records: 0, 1, 2, ...
The same rule holds for every line of a file (both forms), and the first record whose step is
not its own says so once, at INFO.

One key given twice in a record (`{"a/b": 1, "a": {"b": 2}}`: both are `a/b`) sends the first in
the line's order; the others are counted as invalid.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sidecar.log import log
from sidecar.records import iso_ts
from sidecar.sources.base import Parsed

STEP_FIELDS = ("step", "global_step", "_step", "iteration")
TIME_FIELDS = ("ts", "timestamp", "_timestamp", "time")
MAX_LINE_BYTES = 16 << 20  # a longer line is skipped and counted rather than held in memory
MIN_STEP, MAX_STEP = -(1 << 63), (1 << 63) - 1  # a step is a signed 64-bit integer
SHOWN_LINE_CHARS = 60  # of a bad line, quoted in its WARNING
SHOWN_KEYS = 3  # of the keys holding NaN or infinite values, named in a file's diagnosis
EXAMPLE_RECORD = '{"step": 1, "loss": 0.5}'


class JsonlParser:
    """Parses one JSONL file; `line` is the 0-based number of the next line; `counted` the
    records without a step before any with one; `step` the last step a record gave (None:
    none yet).

    `source` (the file's name) given, the first line that cannot give a point is said in a
    WARNING, and the first record whose step is not its own at INFO; either way `problem`
    holds what was wrong with the first bad line, for `sidecar check` and `silence()`."""

    def __init__(self, line: int = 0, source: str = "", counted: int = 0,
                 step: int | None = None) -> None:
        self.line = line
        self.source = source
        self.counted = counted
        self.step = step
        self.problem = ""  # the first bad line: its number, what is wrong, the fix
        self.lines = 0  # records read by this parser (blank lines aside)
        self.points = 0  # points it gave
        self.not_finite = 0  # NaN or infinite values it met, never sent
        self.not_finite_keys: list[str] = []  # the first SHOWN_KEYS keys holding them
        self.first_not_finite = ""  # the first of them: its key, step and line
        self._skipping = False  # inside an over-long line, dropping it up to its newline
        self._step_said = False

    @classmethod
    def resume(cls, state: dict[str, Any], source: str = "") -> JsonlParser:
        step = state.get("step")
        return cls(line=int(state.get("line", 0)), source=source,
                   counted=int(state.get("counted", 0)),
                   step=step if isinstance(step, int) else None)

    def state(self) -> dict[str, Any]:
        return {"line": self.line, "counted": self.counted, "step": self.step}

    def silence(self, held: int) -> str:
        """Why this file gave no point so far, `held` bytes of it not parsed yet (a line
        without its newline): the same diagnosis `sidecar check` gives."""
        if self.problem:
            return f"{self.lines} line{'s' if self.lines != 1 else ''} read; {self.problem}"
        if self.not_finite:
            keys = ", ".join(repr(key) for key in self.not_finite_keys)
            return (f"only NaN or infinite values ({keys}), which are never sent; the first: "
                    f"{self.first_not_finite}")
        if held:
            return (f"its last {held} bytes have no newline yet: a line is read once it ends "
                    "with one (write '\\n' after each record and flush the file)")
        return "no line written to it yet"

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
                self._skipping, out.consumed = True, len(data)
                self._bad(out, _too_long())
            return out
        read_ts = iso_ts(now)
        for raw in data[out.consumed:end].split(b"\n")[:-1]:
            if len(raw) > MAX_LINE_BYTES:
                out.records += 1
                self.lines += 1
                self._bad(out, _too_long())
            else:
                self._line(raw, read_ts, out)
            self.line += 1
        out.consumed = end
        return out

    def _bad(self, out: Parsed, what: str) -> None:
        """The current line (or a value of it) cannot be sent, for the reason `what`: counted,
        and the first of the file said."""
        out.unusable += 1
        if self.problem:
            return
        self.problem = f"line {self.line + 1}: {what}"
        if self.source:
            log.warning("--jsonl %s: %s; each such line is counted as invalid (said for the "
                        "first of this file)", self.source, self.problem,
                        extra={"source": "jsonl", "path": self.source})

    def _line(self, raw: bytes, read_ts: str, out: Parsed) -> None:
        if not raw.strip():
            return
        out.records += 1
        self.lines += 1
        try:
            obj = json.loads(raw)
        except RecursionError:
            self._bad(out, "nested too deeply to read")
            return
        except ValueError as exc:  # not JSON (or not UTF-8)
            self._bad(out, _not_json(raw, exc))
            return
        if not isinstance(obj, dict):
            self._bad(out, f"a JSON {_kind(obj)}, not an object; each line should be one "
                      f"object, as in {EXAMPLE_RECORD}")
            return
        ts = _time_of(obj) or read_ts
        step = self._step_of(obj, out)
        if step is None:
            return
        if "key" in obj and _is_number(obj.get("value")):
            if not isinstance(obj["key"], str) or not obj["key"]:
                self._bad(out, f"\"key\" is {json.dumps(obj['key'])[:SHOWN_LINE_CHARS]}, not a "
                          "metric name")
            else:
                self._point(out, obj["key"], step, obj["value"], ts)
            return
        seen: set[str] = set()
        for key, value in _leaves(obj, top=True):
            if key in seen:
                self._bad(out, f"the key {key!r} is given twice (nested and with a slash, as "
                          "in {\"a/b\": 1, \"a\": {\"b\": 2}}); the first is sent")
                continue
            seen.add(key)
            self._point(out, key, step, value, ts)
        if not seen:
            self._bad(out, _no_number(obj))

    def _step_of(self, obj: dict[str, Any], out: Parsed) -> int | None:
        """The record's step by the file's one rule (the module docstring); None: its step
        field holds no step (said and counted)."""
        for name in STEP_FIELDS:
            if _is_number(obj.get(name)) and not isinstance(obj[name], bool):
                found = _integer(obj[name])
                if found is None:
                    self._bad(out, _bad_step(name, obj[name]))
                else:
                    self.step = found
                return found
        if self.step is not None:
            self._say_step("take the step of the last record before them that had one", self.step)
            return self.step
        step, self.counted = self.counted, self.counted + 1
        self._say_step("are counted, 0, 1, 2, ... (until a record gives a step; then they take "
                       "the last one given)", step)
        return step

    def _say_step(self, rule: str, step: int) -> None:
        if self._step_said or not self.source:
            return
        self._step_said = True
        log.info("--jsonl %s: line %d has no step (a number in %s): records without one %s; "
                 "this one is step %d (said once for this file)", self.source, self.line + 1,
                 _either(STEP_FIELDS), rule, step, extra={"source": "jsonl", "path": self.source})

    def _point(self, out: Parsed, key: str, step: int, value: Any, ts: str) -> None:
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float
            number = math.inf
        if not math.isfinite(number):
            out.invalid[key] = out.invalid.get(key, 0) + 1
            out.invalid_steps.setdefault(key, step)
            if not self.not_finite:
                self.first_not_finite = f"{key!r} at step {step} (line {self.line + 1})"
            self.not_finite += 1
            if len(self.not_finite_keys) < SHOWN_KEYS and key not in self.not_finite_keys:
                self.not_finite_keys.append(key)
            return
        self.points += 1
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
    """`value` as a step: an integer (or an integral float) a signed 64-bit integer holds."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int) and MIN_STEP <= value <= MAX_STEP:
        return value
    return None


def _either(names: tuple[str, ...]) -> str:
    """`a, b or c`."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _too_long() -> str:
    return f"longer than {MAX_LINE_BYTES >> 20} MiB; is this file JSONL, one record a line?"


def _bad_step(name: str, value: Any) -> str:
    shown = json.dumps(value)[:SHOWN_LINE_CHARS]
    return (f"{name!r} is {shown}, which is no step: a step is a whole number within the signed "
            "64-bit range")


def _kind(obj: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(obj), "number")


def _not_json(raw: bytes, exc: ValueError) -> str:
    """What is wrong with a line json.loads refused, and the likely fix."""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return "not UTF-8 text; is this file JSONL?"
    shown = text if len(text) <= SHOWN_LINE_CHARS else text[:SHOWN_LINE_CHARS] + "..."
    quote = min((i for i in (text.find("'"), text.find('"')) if i >= 0), default=-1)
    if text.startswith("{") and quote >= 0 and text[quote] == "'":
        return (f"single quotes: a Python dict ({shown}); write json.dumps(record), not "
                "print(record) or str(record)")
    if not text.startswith(("{", "[")):
        return (f"not JSON ({shown}); a plain-text log goes to --log, metrics to --jsonl as one "
                f"JSON object a line, as in {EXAMPLE_RECORD}")
    return f"not JSON ({exc}: {shown}); write each record with json.dumps"


def _no_number(obj: dict[str, Any]) -> str:
    """Why a record gave no point, and the fix."""
    quoted = [key for key, value in obj.items() if isinstance(value, str) and _numeric(value)]
    if quoted:
        return (f"no number in it: {quoted[0]!r} is the string {obj[quoted[0]]!r}; write "
                "numbers unquoted (float(value), or value.item() for a tensor)")
    if any(key in STEP_FIELDS or key in TIME_FIELDS for key in obj):
        return (f"no number in it but its step or time (keys: {', '.join(list(obj)[:5])}); a "
                f"metric needs a value of its own, as in {EXAMPLE_RECORD}")
    return (f"no number in it (keys: {', '.join(list(obj)[:5]) or 'none'}): only numbers and "
            "booleans become points; strings, lists and nulls are ignored")


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
