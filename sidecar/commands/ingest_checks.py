"""What the ingest accepts, route by route, checked as docs/ingest.md describes it: each route's
body, field by field, refused with a status and a reason naming the field (`Rejected`). The local
ingest (`sidecar receive`, receive.py) runs these checks on every request; its routes are the
client's (delivery/client.py's ROUTES), and a route without a check here fails at import.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sidecar.delivery.client import ROUTES
from sidecar.records import MAX_POINTS_PER_REQUEST

LIFECYCLE_EVENTS = ("starting", "running", "succeeded", "failed")
ARTIFACT_KINDS = ("checkpoint", "hf_export", "eval_report", "merged_model")
MAX_SINGLE_PUT_BYTES = 5 * 10**9  # one PUT of an object store (S3's limit)
_MAX_SHOWN_CHARS = 40  # how much of an offending value a rejection reason quotes


class Rejected(Exception):
    """A request answered with an error status and a reason, and counted as rejected."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers or {}


class Reset(Exception):
    """A request whose connection is aborted without an answer."""


# ---------------------------------------------------------------------------------------------
# Field checks: each returns the field's value or raises Rejected(400) naming the field.


def described(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = json.dumps(value)
    return text if len(text) <= _MAX_SHOWN_CHARS else text[: _MAX_SHOWN_CHARS - 3] + "..."


def _invalid(path: str, expected: str, value: Any) -> Rejected:
    return Rejected(400, f"{path} must be {expected}, got {described(value)}")


def _field(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        raise Rejected(400, f"{where}{name} is required")
    return obj[name]


def text_field(obj: dict[str, Any], name: str, where: str = "") -> str:
    value = _field(obj, name, where)
    if not isinstance(value, str) or not value:
        raise _invalid(where + name, "a non-empty string", value)
    return value


def _integer(obj: dict[str, Any], name: str, where: str = "") -> int:
    value = _field(obj, name, where)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid(where + name, "an integer", value)
    return value


def _is_number(value: Any) -> bool:
    # Finiteness is enforced by the parser, which refuses NaN, Infinity and overflowing floats.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(obj: dict[str, Any], name: str, where: str = "") -> float:
    value = _field(obj, name, where)
    if not _is_number(value):
        raise _invalid(where + name, "a finite number", value)
    return float(value)


def _timestamp(obj: dict[str, Any], name: str, where: str = "") -> str:
    value = _field(obj, name, where)
    expected = "an ISO-8601 time with a timezone"
    if not isinstance(value, str):
        raise _invalid(where + name, expected, value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise _invalid(where + name, expected, value) from None
    if parsed.utcoffset() is None:
        raise Rejected(400, f"{where}{name} has no timezone: {described(value)}")
    return value


def _choice(obj: dict[str, Any], name: str, choices: tuple[str, ...]) -> str:
    value = _field(obj, name, "")
    if value not in choices:
        raise _invalid(name, "one of " + ", ".join(choices), value)
    return str(value)


def _array(obj: dict[str, Any], name: str, *, non_empty: bool = False) -> list[Any]:
    value = _field(obj, name, "")
    if not isinstance(value, list):
        raise _invalid(name, "an array", value)
    if non_empty and not value:
        raise Rejected(400, f"{name} must not be empty")
    return value


def _objects(items: list[Any], name: str) -> list[dict[str, Any]]:
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise _invalid(f"{name}[{index}]", "an object", item)
    return items


# ---------------------------------------------------------------------------------------------
# Per-route body checks (after run_id): one function per route, registered in CHECKS.


def _check_lifecycle(body: dict[str, Any]) -> None:
    _choice(body, "event", LIFECYCLE_EVENTS)
    _timestamp(body, "ts")


def _check_logs(body: dict[str, Any]) -> None:
    for index, chunk in enumerate(_array(body, "chunks")):
        if not isinstance(chunk, str):
            raise _invalid(f"chunks[{index}]", "a string", chunk)
    eof = _field(body, "eof", "")
    if eof is True:
        raise Rejected(400, "eof is set by the platform; send false")
    if eof is not False:
        raise _invalid("eof", "false", eof)


def _check_metrics(body: dict[str, Any]) -> None:
    points = _objects(_array(body, "points", non_empty=True), "points")
    if len(points) > MAX_POINTS_PER_REQUEST:
        raise Rejected(
            400, f"points has {len(points)} items, at most {MAX_POINTS_PER_REQUEST} per request"
        )
    for index, point in enumerate(points):
        where = f"points[{index}]."
        text_field(point, "key", where)
        _integer(point, "step", where)
        _number(point, "value", where)
        _timestamp(point, "ts", where)


def _check_hparams(body: dict[str, Any]) -> None:
    params = _field(body, "params", "")
    if not isinstance(params, dict):
        raise _invalid("params", "an object", params)
    for key, value in params.items():
        if value is not None and not isinstance(value, str | bool) and not _is_number(value):
            raise _invalid(f"params.{key}", "a string, number, boolean or null", value)


def _check_hardware(body: dict[str, Any]) -> None:
    text_field(body, "node")
    for index, point in enumerate(_objects(_array(body, "points", non_empty=True), "points")):
        where = f"points[{index}]."
        text_field(point, "key", where)
        _number(point, "value", where)
        _timestamp(point, "ts", where)


def _check_environment_nodes(body: dict[str, Any]) -> None:
    _objects(_array(body, "nodes", non_empty=True), "nodes")


def _check_validation(body: dict[str, Any]) -> None:
    _integer(body, "step")
    for index, sample in enumerate(_objects(_array(body, "samples"), "samples")):
        where = f"samples[{index}]."
        for name in ("user", "assistant"):
            if not isinstance(_field(sample, name, where), str):
                raise _invalid(where + name, "a string", sample[name])
        _number(sample, "reward", where)
        if "extra" in sample and not isinstance(sample["extra"], dict):
            raise _invalid(where + "extra", "an object", sample["extra"])
    _number(body, "avg_reward")
    # left out when the samples have no correctness field
    if "accuracy" in body and not 0 <= _number(body, "accuracy") <= 1:
        raise _invalid("accuracy", "a number from 0 to 1", body["accuracy"])
    total = _integer(body, "total_chunks")
    if total < 1:
        raise _invalid("total_chunks", "an integer, 1 or more", total)
    index = _integer(body, "chunk_index")
    if not 0 <= index < total:
        raise _invalid("chunk_index", f"an integer from 0 to total_chunks - 1 ({total - 1})",
                       index)


def _check_artifact(body: dict[str, Any]) -> None:
    _choice(body, "kind", ARTIFACT_KINDS)
    text_field(body, "path")
    text_field(body, "format")
    for name in ("step", "size_bytes"):  # step is left out when unknown
        if name in body and (_integer(body, name) < 0):
            raise _invalid(name, "an integer, 0 or more", body[name])


def _check_upload_url(body: dict[str, Any]) -> None:
    name = text_field(body, "name")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise Rejected(400, f"name must be a relative, /-separated path, got {described(name)}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise Rejected(400, f"name holds a control character: {described(name)}")
    size = _integer(body, "size_bytes")
    if size < 0:
        raise _invalid("size_bytes", "an integer, 0 or more", size)
    if size > MAX_SINGLE_PUT_BYTES:
        raise Rejected(400, f"size_bytes {size} is above the {MAX_SINGLE_PUT_BYTES} bytes one "
                       "PUT may carry (EntityTooLarge)")


def _check_nothing(body: dict[str, Any]) -> None:
    """Routes whose body is any object carrying run_id."""


@dataclass(frozen=True)
class RouteCheck:
    check: Callable[[dict[str, Any]], None]
    items_field: str | None = None  # the batch a 413 splits and the summary counts
    # its items are text: their UTF-8 bytes count in the summary's log bytes
    text_items: bool = False
    # the answer says how many items were inserted
    answers_inserted: bool = False
    # its bodies are chunks of rounds (chunk_index of total_chunks, by step): rounds are counted
    rounds: bool = False


# Each route's check, by its name as the ingest's path spells it.
_BY_NAME: dict[str, RouteCheck] = {
    "lifecycle": RouteCheck(_check_lifecycle),
    "logs": RouteCheck(_check_logs, "chunks", text_items=True),
    "metrics": RouteCheck(_check_metrics, "points", answers_inserted=True),
    "hparams": RouteCheck(_check_hparams),
    "hardware": RouteCheck(_check_hardware, "points"),
    "environment": RouteCheck(_check_nothing),
    "environment/nodes": RouteCheck(_check_environment_nodes, "nodes"),
    "validation": RouteCheck(_check_validation, "samples", rounds=True),
    "artifact": RouteCheck(_check_artifact),
    "benchmark": RouteCheck(_check_nothing),
    # a GET whose query is the body: the signed URL a checkpoint's file is uploaded to
    "artifact/upload-url": RouteCheck(_check_upload_url),
}
# The client's routes (ROUTES), each with its check: a route added there without one here fails
# here, at import, naming it.
_NAMES = tuple(dict.fromkeys(policy.path[1:] for policy in ROUTES.values()
                             if policy.of_ingest))
if _unchecked := [name for name in _NAMES if name not in _BY_NAME]:
    raise LookupError(f"route(s) {', '.join(_unchecked)} of delivery/client.py's ROUTES have no "
                      "check of their body in commands/ingest_checks.py's _BY_NAME")
CHECKS: dict[str, RouteCheck] = {name: _BY_NAME[name] for name in _NAMES}
QUERY_ROUTES = frozenset({"artifact/upload-url"})
ROUTE_NAMES = tuple(CHECKS)


def item_count(route: str, body: dict[str, Any]) -> int:
    items_field = CHECKS[route].items_field
    items = body.get(items_field) if items_field else None
    return len(items) if isinstance(items, list) else 0


# ---------------------------------------------------------------------------------------------
# Parsing and auth.


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (non-finite values are never sent)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise Rejected(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _invalid("body", "a JSON object", body)
    return body
