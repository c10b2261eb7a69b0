"""The real receiver (`sidecar.commands.receive`) with faults injected, for tests.

    python -m tests.faulty_ingest [the options of `sidecar receive`]

serves as `sidecar receive` does, and also POST /_control/faults (a Fault as JSON: arm it) and
DELETE /_control/faults (disarm every fault), for a test in another process. In this process a
test arms faults on `Faults` itself (tests/ingest_server.py's `running_ingest` adds it to every
ingest it runs). The faults act through the receiver's `Hooks`, which the shipped command runs
without.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from aiohttp import web

from sidecar.commands.receive import ROUTE_NAMES, Hooks, Rejected, Reset, serve

CONTROL_PATH = "/_control/faults"


@dataclass(frozen=True)
class Fault:
    """One injected misbehaviour of the ingest, for tests; exactly one kind field is set."""

    route: str = "*"  # a route such as "metrics" or "environment/nodes", or "*" for all
    times: int | None = None  # fire only for the next N matching requests; None: until cleared
    status: int | None = None  # answer this status without storing
    retry_after: str | None = None  # with status: the Retry-After header ("2" or an HTTP date)
    too_large_above: int | None = None  # answer 413 when the batch has more items than this
    too_large_over_bytes: int | None = None  # answer 413 when the body is longer (a proxy's limit)
    latency_s: float | None = None  # wait this long before handling (a hang when large)
    # Store, then wait this long before answering: a slow ingest, not a down one (what the
    # client gives up on was stored all the same).
    slow_answer_s: float | None = None
    redirect: str | None = None  # answer 307 with this Location
    reset: bool = False  # abort the connection without an answer
    reject_if_contains: str | None = None  # answer 400 when the raw body contains this

    def __post_init__(self) -> None:
        """Refuse a fault that is malformed or has no kind or several."""
        kinds = [
            self.status is not None,
            self.too_large_above is not None,
            self.too_large_over_bytes is not None,
            self.latency_s is not None,
            self.slow_answer_s is not None,
            self.redirect is not None,
            self.reset is True,
            self.reject_if_contains is not None,
        ]
        if sum(kinds) != 1:
            raise ValueError(
                "a fault needs exactly one of status, too_large_above, too_large_over_bytes, "
                "latency_s, slow_answer_s, redirect, reset, reject_if_contains"
            )
        problems = {
            "route": self.route != "*" and self.route not in ROUTE_NAMES,
            "times": self.times is not None and not _whole(self.times, minimum=1),
            "status": self.status is not None
            and not (_whole(self.status, minimum=200) and self.status <= 599),
            "retry_after": self.retry_after is not None
            and (self.status is None or not isinstance(self.retry_after, str)),
            "too_large_above": self.too_large_above is not None
            and not _whole(self.too_large_above, minimum=0),
            "too_large_over_bytes": self.too_large_over_bytes is not None
            and not _whole(self.too_large_over_bytes, minimum=0),
            "latency_s": self.latency_s is not None and not _seconds(self.latency_s),
            "slow_answer_s": self.slow_answer_s is not None and not _seconds(self.slow_answer_s),
            "redirect": self.redirect is not None
            and not (isinstance(self.redirect, str) and self.redirect),
            "reset": not isinstance(self.reset, bool),
            "reject_if_contains": self.reject_if_contains is not None
            and not (isinstance(self.reject_if_contains, str) and self.reject_if_contains),
        }
        bad = [name for name, wrong in problems.items() if wrong]
        if bad:
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"invalid fault: {shown}")

    @classmethod
    def from_json(cls, data: Any) -> Fault:
        """Build a fault from the control route's JSON body; ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a fault is a JSON object")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(unknown)}")
        return cls(**data)

    def matches(self, route: str) -> bool:
        """Whether this fault applies to a request on this route."""
        return self.route in ("*", route)


def _whole(value: Any, *, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _seconds(value: Any) -> bool:
    """Whether `value` is a finite number of seconds, 0 or more."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and 0 <= value < math.inf)


@dataclass
class _ArmedFault:
    fault: Fault
    remaining: int | None


class Faults(Hooks):
    """The faults armed on one receiver, acting through its hooks; with `control`, also armed
    and cleared over HTTP at CONTROL_PATH."""

    def __init__(self, *, control: bool = False) -> None:
        self._control = control
        self._armed: list[_ArmedFault] = []

    def add(self, fault: Fault) -> None:
        """Arm a fault; faults fire in the order they were added."""
        self._armed.append(_ArmedFault(fault, fault.times))

    def clear(self) -> None:
        """Disarm every fault."""
        self._armed.clear()

    def routes(self) -> list[web.RouteDef]:
        if not self._control:
            return []
        return [web.post(CONTROL_PATH, self._handle_add),
                web.delete(CONTROL_PATH, self._handle_clear)]

    async def arrived(self, route: str, stopping: asyncio.Event) -> None:
        """Faults that act before auth, as a proxy or an overloaded platform would."""
        delay = self._take(route, lambda f: f.latency_s is not None)
        if delay is not None and delay.latency_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay.latency_s)
            if stopping.is_set():
                raise Reset  # a hung request ends with the server, unanswered
        if self._take(route, lambda f: f.reset):
            raise Reset
        redirect = self._take(route, lambda f: f.redirect is not None)
        if redirect is not None and redirect.redirect is not None:
            raise Rejected(307, "injected fault: redirect", {"Location": redirect.redirect})
        status = self._take(route, lambda f: f.status is not None)
        if status is not None and status.status is not None:
            headers = {"Retry-After": status.retry_after} if status.retry_after else {}
            raise Rejected(status.status, f"injected fault: status {status.status}", headers)

    def read(self, route: str, raw: bytes) -> None:
        limit = self._take(
            route,
            lambda f: f.too_large_over_bytes is not None and len(raw) > f.too_large_over_bytes,
        )
        if limit is not None:
            raise Rejected(413, f"a body of {len(raw)} bytes, at most "
                           f"{limit.too_large_over_bytes} accepted")
        if self._take(
            route,
            lambda f: f.reject_if_contains is not None and f.reject_if_contains.encode() in raw,
        ):
            raise Rejected(400, "injected fault: poison payload")

    def parsed(self, route: str, items: int) -> None:
        too_large = self._take(
            route, lambda f: f.too_large_above is not None and items > f.too_large_above
        )
        if too_large is not None:
            raise Rejected(413, f"{items} items, at most {too_large.too_large_above} accepted")

    async def stored(self, route: str, stopping: asyncio.Event) -> None:
        slow = self._take(route, lambda f: f.slow_answer_s is not None)
        if slow is not None and slow.slow_answer_s:
            with contextlib.suppress(TimeoutError):  # the client may leave: it was stored
                await asyncio.wait_for(stopping.wait(), slow.slow_answer_s)

    def _take(self, route: str, fires: Callable[[Fault], bool]) -> Fault | None:
        """The first armed fault for this route that fires, spending one of its times."""
        for armed in self._armed:
            if armed.fault.matches(route) and fires(armed.fault):
                if armed.remaining is not None:
                    armed.remaining -= 1
                    if armed.remaining == 0:
                        self._armed.remove(armed)
                return armed.fault
        return None

    async def _handle_add(self, request: web.Request) -> web.Response:
        try:
            self.add(Fault.from_json(json.loads(await request.read())))
        except (ValueError, TypeError) as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    async def _handle_clear(self, request: web.Request) -> web.Response:
        self.clear()
        return web.json_response({"ok": True})


def main(argv: Sequence[str] | None = None) -> int:
    """`sidecar receive` with `argv`, its faults armed over CONTROL_PATH."""
    from sidecar.cli import build_parser

    args = build_parser().parse_args(["receive", *(sys.argv[1:] if argv is None else argv)])
    return serve(args.dir, host=args.host, port=args.port, token=args.token, run_id=args.run_id,
                 summary=not args.quiet, ready_file=args.ready_file, hooks=Faults(control=True))


if __name__ == "__main__":
    sys.exit(main())
