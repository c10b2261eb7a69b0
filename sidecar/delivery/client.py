"""The ingest client, and each route's delivery policy as data (docs/ingest.md#delivery-policies).

`IngestClient.post` makes one attempt and classifies the answer; `IngestClient.deliver` applies a
route's policy (how often to retry, how long to wait) around it. Neither raises on a network or
HTTP failure: the caller reads the returned `Answer` and decides (split, dead-letter, drop).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import json
import ssl
import time
from collections.abc import Awaitable, Callable
from datetime import UTC
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import orjson

from sidecar.aio import wait_set
from sidecar.delivery.transport import Transport, TransportError, TransportFailure
from sidecar.log import Throttle, format_duration, log
from sidecar.masking import add_secret

A = TypeVar("A")  # an attempt's answer, as `retried` retries it

MAX_REASON_CHARS = 300  # of a refusal's body, in messages and `sidecar check`


class Guarantee(enum.Enum):
    """What a route promises about a payload handed to it."""

    # retried while its buffer has room, then the oldest dropped and counted
    BEST_EFFORT = "best-effort"
    STRICT = "strict"  # persisted first, delivered in order, retried until acknowledged
    AT_LEAST_ONCE = "at-least-once"  # retried and spooled until acknowledged


class RoutePolicy(NamedTuple):
    """How one route is delivered."""

    path: str
    guarantee: Guarantee
    max_attempts: int | None  # None: until acknowledged
    first_backoff_s: float
    max_backoff_s: float
    timeout_s: float
    # the disk spool's cap, for a route that spills (pipeline.py's documents); None: its own
    spool_max_bytes: int | None = None
    # what the route's payloads are, as the message of a refused token names them
    carries: str = "data"
    # its payloads are documents, one a request, spooled while the ingest is away (pipeline.py)
    documents: bool = False
    # past half its spool, every other payload is dropped to keep room for the rest
    thinned: bool = False
    # its items are text: the characters given up on count too (Prometheus)
    text_items: bool = False
    # a route of the ingest's (`path` under the endpoint); False: a request to another server,
    # retried by the same rules, `path` saying where it goes
    of_ingest: bool = True


HARDWARE_SPOOL_BYTES = 64 << 20  # smaller than the others' so that samples are thinned first

ROUTES: dict[str, RoutePolicy] = {
    "lifecycle": RoutePolicy(
        path="/lifecycle", guarantee=Guarantee.STRICT, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0),
    "logs": RoutePolicy(
        path="/logs", guarantee=Guarantee.BEST_EFFORT, max_attempts=None,
        first_backoff_s=0.2, max_backoff_s=1.0, timeout_s=10.0, text_items=True),
    # the crash tail
    "logs/tail": RoutePolicy(
        path="/logs", guarantee=Guarantee.STRICT, max_attempts=None,
        first_backoff_s=0.2, max_backoff_s=1.0, timeout_s=10.0,
        carries="the command's last output", text_items=True),
    "metrics": RoutePolicy(
        path="/metrics", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0),
    "hparams": RoutePolicy(
        path="/hparams", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0),
    "hardware": RoutePolicy(
        path="/hardware", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0,
        spool_max_bytes=HARDWARE_SPOOL_BYTES, documents=True, thinned=True),
    "environment": RoutePolicy(
        path="/environment", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0, documents=True),
    "environment/nodes": RoutePolicy(
        path="/environment/nodes", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0, documents=True),
    # a round's chunks, from its file (sources/files/validation.py): the file's offset waits
    # for them, so a restart posts a round not acknowledged again, and no other
    "validation": RoutePolicy(
        path="/validation", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0, carries="validation rounds"),
    "artifact": RoutePolicy(
        path="/artifact", guarantee=Guarantee.STRICT, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0),
    # a GET: the signed URL a checkpoint's file is uploaded to (delivery/upload.py)
    # scores a harness produced outside the platform: a route of the ingest's that the sidecar
    # posts none of yet; its row keeps the local ingest's routes (commands/ingest_checks.py) whole
    "benchmark": RoutePolicy(
        path="/benchmark", guarantee=Guarantee.AT_LEAST_ONCE, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0, carries="benchmark scores"),
    "artifact/upload-url": RoutePolicy(
        path="/artifact/upload-url", guarantee=Guarantee.STRICT, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0,
        carries="the checkpoint being uploaded"),
    # not the ingest's: a checkpoint's file sent to the URL artifact/upload-url signed
    # (delivery/upload.py), the object store's answers read by delivery/put.py
    "artifact/put": RoutePolicy(
        path="the signed URL", guarantee=Guarantee.STRICT, max_attempts=None,
        first_backoff_s=0.5, max_backoff_s=30.0, timeout_s=30.0,
        carries="the checkpoint being uploaded", of_ingest=False),
}

CONNECT_TIMEOUT_S = 5.0
DRAIN_BACKOFF_S = 0.5
MAX_RETRY_AFTER_S = 300.0
MAX_CONNECTIONS = 8
# Upper bounds of the buckets of one attempt's duration (/metrics' request duration histogram).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Verdict(enum.Enum):
    """What an answer means for the payload (the table of docs/ingest.md#answers)."""

    ACCEPTED = "accepted"  # any 2xx
    RETRY = "retry"  # refused, reset, timeout, 5xx, 429
    TOO_LARGE = "too-large"  # 413: split and retry the halves
    AUTH = "auth"  # 401/403: token rejected, keep the data
    REJECTED = "rejected"  # other 4xx: permanent, dead-letter it
    REDIRECT = "redirect"  # 3xx: never followed, it would carry the token elsewhere


RETRYABLE = frozenset({Verdict.RETRY, Verdict.AUTH, Verdict.REDIRECT})


class Answer(NamedTuple):
    """The outcome of one attempt."""

    verdict: Verdict
    status: int | None = None
    retry_after_s: float | None = None
    detail: str = ""
    reason: str = ""  # what the ingest's body said about a refusal, bounded, no token in it
    failure: TransportFailure | None = None  # why no answer came, when none did
    body: bytes = b""  # what an accepted request was answered (a GET's document)

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.ACCEPTED


class _Spell:
    """A route's failed attempts since its last accepted payload, and whether one was said."""

    __slots__ = ("attempts", "auth", "said", "since")

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.attempts = 0
        self.auth = False  # a 401/403 among them: the token, not the connection
        self.said = False  # a failure of the spell was said (an ERROR, a WARNING, a drop)


class _Cause:
    """Why attempts fail now, across routes (the token, the network, TLS, an HTTP status): said
    once with the routes it hits, again when it changes, and its end once."""

    __slots__ = ("answer", "attempts", "key", "noted", "routes", "said", "since")

    def __init__(self, key: str, answer: Answer) -> None:
        self.key = key
        self.answer = answer  # the first failure of it, for the message
        self.since = time.monotonic()
        self.attempts = 0
        self.routes: dict[str, None] = {}  # the routes it hit, in the order they failed
        self.said = False
        self.noted = False  # a sender said what it gave up for it: its end is said too

    @property
    def paths(self) -> str:
        """The routes as the ingest names them, comma-separated: the prefix of its messages."""
        return ", ".join(dict.fromkeys(ROUTES[route].path for route in self.routes))

    @property
    def names(self) -> str:
        """The routes as a message's `route` field names them: the paths without their slash."""
        return ", ".join(dict.fromkeys(ROUTES[route].path[1:] for route in self.routes))


def cause_of(answer: Answer) -> str:
    """What a failed attempt failed of, the same for every route it hits: "token", "redirect
    to ...", the transport's failure kind, the HTTP status, "timeout"."""
    if answer.verdict is Verdict.AUTH:
        return "token"
    if answer.verdict is Verdict.REDIRECT:
        return answer.detail
    if answer.failure is not None:
        return f"transport:{answer.failure.value}"
    if answer.status is not None:
        return f"http:{answer.status}"
    return answer.detail or "no answer"


# How long the first failure of a cause waits for the other routes it hits before it is said:
# they fail within moments of each other (each route posts on its own clock), and one message
# naming them all reads as the one cause it is.
CAUSE_GATHER_S = 1.0


class RouteStats:
    """Counters of one route, for the status endpoint and the shutdown summary."""

    __slots__ = ("accepted", "dropped", "dropped_chars", "failures", "last_failure",
                 "last_success", "latency_counts", "latency_sum_s", "requests", "retries")

    def __init__(self) -> None:
        self.requests = 0
        self.accepted = 0
        self.failures = 0
        self.retries = 0
        self.dropped = 0  # items given up on (chunks of text, for /logs)
        self.dropped_chars = 0  # the characters of those, on a route that carries text
        self.last_success: float | None = None
        self.last_failure = ""
        # attempts by the first of LATENCY_BUCKETS_S their duration fits, the last: longer
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum_s = 0.0

    def observe_latency(self, seconds: float) -> None:
        """Count one attempt that took `seconds`, answered or not."""
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.latency_sum_s += seconds

    @property
    def trouble(self) -> str:
        """Why a payload of this route is still unacknowledged, for a message: never empty."""
        if self.last_failure:
            return self.last_failure
        return "the ingest has not answered yet" if self.requests else "nothing was sent yet"


def json_body(doc: Any) -> bytes:
    """`doc` as a request body: orjson, several times the standard module's speed on the bulk
    path; the standard module for the rare value orjson refuses (an integer beyond 64 bits, a
    lone surrogate from an odd environment), so that no payload fails to encode."""
    try:
        return orjson.dumps(doc)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(doc, separators=(",", ":")).encode()


def classify(status: int, retry_after: str | None) -> Answer:
    """Map an HTTP status (and Retry-After header) to what the sidecar does about it."""
    if 200 <= status < 300:
        return Answer(Verdict.ACCEPTED, status)
    if 300 <= status < 400:
        return Answer(Verdict.REDIRECT, status, detail="redirect not followed")
    if status == 413:
        return Answer(Verdict.TOO_LARGE, status)
    if status in (401, 403):
        return Answer(Verdict.AUTH, status, detail="token rejected")
    if status in (429, 503):
        return Answer(Verdict.RETRY, status, parse_retry_after(retry_after))
    if 400 <= status < 500:
        return Answer(Verdict.REJECTED, status)
    return Answer(Verdict.RETRY, status)


def refusal_reason(body: bytes, token: str) -> str:
    """The ingest's own words about a refusal: the `error` (or `message`, `detail`) of a JSON
    body, else its text; on one line, at most MAX_REASON_CHARS, the token masked."""
    text = body[:MAX_REASON_CHARS * 4].decode("utf-8", "replace")
    with contextlib.suppress(ValueError):
        doc = json.loads(body)  # at most transport.MAX_ANSWER_BYTES
        if isinstance(doc, dict):
            text = next((v for k in ("error", "message", "detail") if isinstance(
                v := doc.get(k), str)), text)
    text = " ".join(text.split())
    if token:
        text = text.replace(token, "***")
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 1] + "…"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds to wait: delta-seconds (ASCII digits) or an HTTP date; None when
    absent or malformed (`²`, `-5`, `1e9`, empty), as if not there (docs/ingest.md#answers)."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    from email.utils import parsedate_to_datetime  # a date is rare: not paid for at start-up

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now = time.time() if now is None else now
    return min(max(when.timestamp() - now, 0.0), MAX_RETRY_AFTER_S)


class IngestClient:
    """The ingest endpoint's client: auth headers, no redirects, timeouts, counters."""

    def __init__(self, endpoint: str, token_headers: tuple[str, ...],
                 read_token: Callable[[], str], ca_file: Path | None = None) -> None:
        self.endpoint = endpoint
        self.token_headers = token_headers
        self.read_token = read_token
        # loaded when the client is made: see load_ca_file
        self._ssl = load_ca_file(ca_file) if ca_file is not None else None
        self.stats: dict[str, RouteStats] = {}
        self._transport: Transport | None = None
        self._ready = asyncio.Event()
        self._token = ""
        self._throttle = Throttle()
        self._hurry = asyncio.Event()
        self._spells: dict[str, _Spell] = {}  # per route, while its payloads fail
        self._accepted = 0  # payloads the ingest took, all routes together
        # what the failed attempts were: "token" (401/403) or "other"
        self._refusals: set[str] = set()
        self.answered = asyncio.Event()  # an attempt of any route has had its outcome
        self._cause: _Cause | None = None  # why attempts fail now, said or about to be
        self._gathering: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """Read the token and make the keep-alive transport; call once from the event loop."""
        self._use_token(self.read_token())
        self._transport = Transport(self.endpoint, self._ssl, max_connections=MAX_CONNECTIONS,
                                    connect_timeout_s=CONNECT_TIMEOUT_S)
        self._ready.set()

    async def close(self) -> None:
        """Say a failure still gathering its routes, and close the transport's connections."""
        self._say_cause()
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    def route_stats(self, route: str) -> RouteStats:
        return self.stats.setdefault(route, RouteStats())

    async def post(self, route: str, body: bytes, query: str = "") -> Answer:
        """One attempt to POST `body` to `route` (a GET of `route?query` when `query` is
        given); never raises (but for a cancellation): a network or HTTP failure, or anything
        unexpected, is an Answer to retry."""
        await self._ready.wait()  # a sender may be started before the transport is
        assert self._transport is not None
        policy = ROUTES[route]
        stats = self.route_stats(route)
        stats.requests += 1
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self._token}"}
        headers.update(dict.fromkeys(self.token_headers, self._token))
        started = time.monotonic()
        try:
            reply = await self._transport.post(
                policy.path + (f"?{query}" if query else ""), body, headers, policy.timeout_s,
                method="GET" if query else "POST")
            answer = classify(reply.status, reply.headers.get("retry-after"))
            if answer.ok:
                answer = answer._replace(body=reply.body)
            else:
                answer = answer._replace(reason=refusal_reason(reply.body, self._token))
            if answer.verdict is Verdict.REDIRECT:
                target = urlsplit(reply.headers.get("location", ""))
                answer = Answer(Verdict.REDIRECT, reply.status,
                                detail=f"redirect to {target.scheme}://{target.netloc} "
                                "not followed: it would carry the token elsewhere")
        except TransportError as exc:
            answer = Answer(Verdict.RETRY, detail=str(exc), failure=exc.kind)
        except TimeoutError:
            answer = Answer(Verdict.RETRY, detail="timed out")
        except Exception as exc:  # a bug here, or in h11, must not end a sender
            answer = Answer(Verdict.RETRY, detail=f"unexpected {exc.__class__.__name__}")
            if self._throttle.admit(f"{route}:unexpected") is not None:
                log.error("%s: a request failed unexpectedly (%s: %s); it is retried",
                          policy.path, exc.__class__.__name__, exc,
                          extra={"route": policy.path[1:]})
        stats.observe_latency(time.monotonic() - started)
        self._account(route, stats, answer)
        return answer

    def _account(self, route: str, stats: RouteStats, answer: Answer) -> None:
        self.answered.set()
        if answer.ok:
            stats.accepted += 1
            stats.last_success = time.time()
            self._accepted += 1
            self._end_spell(route)
            return
        self._refusals.add("token" if answer.verdict is Verdict.AUTH else "other")
        if answer.verdict in (Verdict.RETRY, Verdict.AUTH, Verdict.REDIRECT):
            spell = self._spells.setdefault(route, _Spell())
            spell.attempts += 1
            spell.auth = spell.auth or answer.verdict is Verdict.AUTH
        stats.failures += 1
        stats.last_failure = answer.detail or f"HTTP {answer.status}" + (
            f": {answer.reason}" if answer.reason else "")
        if answer.verdict is Verdict.AUTH:
            self._reread_token()
        if answer.verdict is Verdict.REJECTED:
            self._rejected_once_a_minute(route, answer)
        else:
            self._failed_for(route, answer)

    def gave_up(self, route: str) -> None:
        """A payload of `route` was given up (best-effort), and its sender said so: the
        route's recovery is said too, when it comes."""
        self._said(route)
        if self._cause is not None and route in self._cause.routes:
            self._cause.noted = True

    def _said(self, route: str) -> None:
        spell = self._spells.get(route)  # none for a payload refused for good (400, 413)
        if spell is not None:
            spell.said = True

    def _end_spell(self, route: str) -> None:
        """A route takes payloads again: when the cause it failed of was said, its end is said
        once, for every route it hit (a token accepted again on one is accepted on all)."""
        self._spells.pop(route, None)
        cause = self._cause
        if cause is None or route not in cause.routes:
            return
        self._cause = None
        for hit in cause.routes:
            spell = self._spells.get(hit)
            if spell is not None:  # its spell goes on, but not its cause: its end is said
                spell.said = False
        if not (cause.said or cause.noted):
            return
        what = "accepts the token again" if cause.key == "token" else "is reachable again"
        log.info("%s: the ingest %s after %s and %d failed attempt%s; delivery goes on",
                 cause.paths, what, format_duration(time.monotonic() - cause.since),
                 cause.attempts, "" if cause.attempts == 1 else "s", extra={"route": cause.names})

    @property
    def failing(self) -> list[str]:
        """The routes (as the ingest names them) whose last attempts failed, and were said or
        are about to be."""
        about = self._cause.routes if self._cause is not None else {}
        return list(dict.fromkeys(ROUTES[route].path for route, spell in self._spells.items()
                                  if spell.said or route in about))

    @property
    def never_accepted(self) -> str | None:
        """When no payload of this client was ever accepted and every attempt was refused for
        the token (401/403): what they were, for a message; else None. A refused connection,
        a reset, a timeout or a 5xx is transient (an ingest restarting): it may yet answer
        (docs/ingest.md#answers)."""
        if self._accepted or self._refusals != {"token"}:
            return None
        return "HTTP 401/403 (the token was rejected)"

    def _reread_token(self) -> None:
        try:
            self._use_token(self.read_token())
        except Exception as exc:  # a missing file now is reported, the old token kept
            log.error("re-reading the token after a 401/403 failed: %s", exc)

    def _use_token(self, token: str) -> None:
        """Send `token` from now on; it is masked wherever the old one was, and so is the old."""
        add_secret(token)
        self._token = token

    def _rejected_once_a_minute(self, route: str, answer: Answer) -> None:
        """A payload refused for good (a poison payload): the route itself is fine."""
        held = self._throttle.admit(f"{route}:{answer.verdict.value}")
        if held is None:
            return
        more = f" ({held} more since the last message)" if held else ""
        log.error("%s: HTTP %s: the ingest rejected the payload permanently%s%s",
                  ROUTES[route].path, answer.status,
                  f" ({answer.reason})" if answer.reason else "", more,
                  extra={"route": ROUTES[route].path[1:]})

    def _failed_for(self, route: str, answer: Answer) -> None:
        """Count a failed attempt under its cause: a new cause gathers, for CAUSE_GATHER_S, the
        routes it hits, then is said once for all of them; the same cause again is said at most
        once a minute, with the routes hit since."""
        key = cause_of(answer)
        cause = self._cause
        if cause is None or cause.key != key:
            self._say_cause()  # the cause changed: the old one, if still gathering, is said
            cause = self._cause = _Cause(key, answer)
            self._gathering = asyncio.get_running_loop().call_later(
                CAUSE_GATHER_S, self._say_cause)
        cause.attempts += 1
        cause.routes[route] = None
        if cause.said:
            self._said(route)
            if self._gathering is None and self._throttle.admit(f"cause:{key}") is not None:
                self._say(cause, f" ({cause.attempts} failed attempts so far)")

    def _say_cause(self) -> None:
        """Say the cause gathering its routes, unless it ended first, or was said under a
        minute ago (a flapping ingest is said once a minute, and so is its end)."""
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
        cause = self._cause
        if cause is None or cause.said or self._throttle.admit(f"cause:{cause.key}") is None:
            return
        self._say(cause, "")

    def _say(self, cause: _Cause, more: str) -> None:
        cause.said = True
        for route in cause.routes:
            self._said(route)  # and so will be its end: as often as it is
        answer = cause.answer
        if answer.verdict is Verdict.AUTH:
            log.error("%s: HTTP %s: the ingest rejected the token; %s%s", cause.paths,
                      answer.status, _kept(list(cause.routes)), more, extra={"route": cause.names})
        elif answer.verdict is Verdict.REDIRECT:
            log.error("%s: HTTP %s: %s%s", cause.paths, answer.status, answer.detail, more,
                      extra={"route": cause.names})
        elif answer.failure is TransportFailure.TLS:  # a certificate does not mend by waiting
            log.error("%s: the ingest cannot be spoken to over TLS: %s; what they carry is "
                      "kept and retried; a certificate this node does not trust needs --ca-file "
                      "(SIDECAR_CA_FILE), a port serving plain HTTP an http:// endpoint; "
                      "`sidecar check` names the cause%s", cause.paths, answer.detail, more,
                      extra={"route": cause.names})
        else:
            log.warning("%s: the ingest did not take a payload (%s); it is kept and retried "
                        "with backoff%s; `sidecar check` probes the endpoint from this node",
                        cause.paths, answer.detail or f"HTTP {answer.status}", more,
                        extra={"route": cause.names})

    async def deliver(self, route: str, body: bytes,
                      give_up: Callable[[], bool] | None = None, query: str = "") -> Answer:
        """POST with the route's retry policy; returns the final answer (accepted or given up).
        `give_up`, asked after each failed attempt: True ends the retries there (the /logs
        buffer behind the payload is full). The retry machinery is set up only once the first
        attempt failed: it cost more CPU per request than the request itself on the bulk /logs
        path."""
        policy = ROUTES[route]
        first = await self.post(route, body, query)
        if first.ok or not _retryable(policy, first) or policy.max_attempts == 1:
            return first
        answer: Answer = await retried(
            policy, first, lambda: self.post(route, body, query),
            retryable=lambda a: _retryable(policy, a), told_s=lambda a: a.retry_after_s,
            sleep=self._sleep, give_up=give_up,
            on_retry=lambda _: self._count_retry(route))
        return answer

    def _count_retry(self, route: str) -> None:
        self.route_stats(route).retries += 1

    def hurry(self) -> None:
        """Shutdown began: backoff waits end now and stay short (Retry-After still holds)."""
        self._hurry.set()

    async def _sleep(self, seconds: float, told: bool) -> None:
        """Between attempts. A wait a Retry-After told is honoured whole; a backoff wait ends
        when the drain begins, and is at most DRAIN_BACKOFF_S during it, so a long backoff
        grown during a flapping outage cannot outlast --drain-timeout."""
        if told:
            await asyncio.sleep(seconds)
        elif self._hurry.is_set():
            await asyncio.sleep(min(seconds, DRAIN_BACKOFF_S))
        else:
            await wait_set(self._hurry, seconds)


def _kept(routes: list[str]) -> str:
    """What becomes of the payloads of `routes` while the token is refused."""
    dropped = [r for r in routes if ROUTES[r].guarantee is Guarantee.BEST_EFFORT]
    kept = [r for r in routes if r not in dropped]
    said = []
    if kept:
        what = ROUTES[kept[0]].carries if len(kept) == 1 else "what they carry"
        said.append(f"{what} is kept and delivery retried")
    if dropped:
        whose = "the command's" if kept else "this"
        said.append(f"{whose} output is dropped and counted "
                    "(/logs is best-effort); later output is sent once the token is accepted")
    return "; ".join(said)


async def retried(policy: RoutePolicy, first: A, again: Callable[[], Awaitable[A]], *,
                  retryable: Callable[[A], bool], told_s: Callable[[A], float | None],
                  sleep: Callable[[float, bool], Awaitable[None]],
                  give_up: Callable[[], bool] | None = None,
                  on_retry: Callable[[A], None] | None = None) -> A:
    """`again()` until an answer is not `retryable`, under `policy`: its attempts, and between
    them retry_wait's backoff, or what the answer's Retry-After (`told_s`) said. `first` is the
    attempt already made (tenacity is imported only once one failed: most runs never retry).
    `sleep(seconds, told)` waits; `give_up()`, asked after each failed attempt, ends the retries
    there; `on_retry(answer)` is told of each failed attempt that is tried again. Returns the
    last answer; an exception of `again` ends the retries and is raised."""
    if not retryable(first) or policy.max_attempts == 1:
        return first
    from tenacity import AsyncRetrying, RetryCallState, retry_if_result

    made: list[A] = [first]
    last: list[A] = [first]

    async def attempt() -> A:
        answer = made.pop() if made else await again()
        last[0] = answer
        return answer

    def stop(state: RetryCallState) -> bool:
        return ((policy.max_attempts is not None and state.attempt_number >= policy.max_attempts)
                or (give_up is not None and give_up()))

    def wait(state: RetryCallState) -> float:
        return retry_wait(policy, state.attempt_number, told_s(last[0]))

    async def pause(seconds: float) -> None:
        await sleep(seconds, told_s(last[0]) is not None)

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            on_retry(last[0])

    retrying = AsyncRetrying(stop=stop, wait=wait, retry=retry_if_result(retryable), sleep=pause,
                             before_sleep=before_sleep,
                             retry_error_callback=lambda state: last[0])
    answer: A = await retrying(attempt)
    return answer


def retry_wait(policy: RoutePolicy, failed: int, retry_after_s: float | None = None) -> float:
    """Seconds to wait after the `failed`-th failed attempt. Full jitter: a random time between
    0 and the exponential backoff (first_backoff_s doubled each time, at most max_backoff_s).
    After an answer that said Retry-After: never shorter than told, and spread over up to half
    as long again (at least first_backoff_s), so that the nodes an overloaded ingest sent away
    at once do not all come back in the same instant."""
    # only once an attempt failed: its import costs a start-up more than it answers (test_footprint)
    import random

    if retry_after_s is not None:
        return retry_after_s + random.uniform(0.0, max(retry_after_s / 2, policy.first_backoff_s))
    ceiling = policy.first_backoff_s * 2.0 ** min(max(failed - 1, 0), 64)
    return random.uniform(0.0, min(ceiling, policy.max_backoff_s))


def _retryable(policy: RoutePolicy, answer: Answer) -> bool:
    """Whether a failed attempt is tried again under the route's policy."""
    if policy.guarantee is Guarantee.BEST_EFFORT:
        return answer.verdict is Verdict.RETRY
    return answer.verdict in RETRYABLE


def load_ca_file(path: Path) -> ssl.SSLContext:
    """The default TLS context plus the CA bundle in `path` (--ca-file); ValueError saying why
    when it is missing, unreadable or holds no PEM certificate."""
    context = ssl.create_default_context()
    try:
        context.load_verify_locations(cafile=str(path))
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or exc.__class__.__name__})") from None
    except ssl.SSLError as exc:
        raise ValueError(f"not a PEM CA bundle ({exc.reason or exc})") from None
    return context
