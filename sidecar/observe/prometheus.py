"""The status snapshot as Prometheus text, for the status endpoint's /metrics.

Imported at the first scrape, not with the endpoint: a sidecar nobody scrapes does not carry
prometheus-client (about 1 MB resident).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from sidecar import __version__
from sidecar.delivery.client import LATENCY_BUCKETS_S, ROUTES

if TYPE_CHECKING:
    from sidecar.observe.endpoint import StatusSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST


def exposition(snapshot: Callable[[], StatusSnapshot]) -> Callable[[], bytes]:
    """A renderer of one fresh snapshot per call, in the Prometheus text format."""
    registry = CollectorRegistry()
    registry.register(_SnapshotCollector(snapshot))
    # The sidecar's own CPU time, memory and open files (process_*), from /proc/self.
    ProcessCollector(registry=registry)
    return lambda: generate_latest(registry)


# Each row: snapshot field, metric name (the _total suffix added for counters), help text.
_ROUTE_COUNTERS = (
    ("requests", "sidecar_route_requests", "POST attempts to the ingest"),
    ("accepted", "sidecar_route_accepted", "requests the ingest acknowledged (2xx)"),
    ("failures", "sidecar_route_failures", "attempts that failed (network, 3xx, 4xx, 5xx)"),
    ("retries", "sidecar_route_retries", "attempts that were retries after a backoff"),
    ("dropped", "sidecar_route_dropped", "items given up on (points, chunks of text...)"),
)
_TEXT_ROUTES = frozenset(name for name, policy in ROUTES.items() if policy.text_items)
_ROUTE_GAUGES = (
    ("queue_depth", "sidecar_route_queue_depth", "payloads waiting in memory"),
    ("spool_bytes", "sidecar_route_spool_bytes", "bytes waiting in the on-disk spool"),
)
_SOURCE_COUNTERS = (
    ("bytes_read", "sidecar_source_read_bytes", "bytes read from the source"),
    ("lines_read", "sidecar_source_read_lines", "lines or records read from the source"),
    ("points", "sidecar_source_points", "metric points produced"),
    ("invalid", "sidecar_source_invalid", "NaN or infinite values and JSONL lines that give no "
     "point, counted and not sent"),
    ("skipped", "sidecar_source_skipped", "unparseable lines or corrupt records skipped"),
)


class _SnapshotCollector:
    """A prometheus-client collector that reads one fresh snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from _run_metrics(snap)
        yield from _route_metrics(snap)
        yield from _source_metrics(snap)
        yield from _diagnosis_metrics(snap)
        yield from _checkpoint_metrics(snap)
        yield from _upload_metrics(snap)


def _run_metrics(snap: StatusSnapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily("sidecar_info", "the running sidecar; always 1",
                             labels=["run_id", "node", "mode", "version"])
    info.add_metric([snap.run_id, snap.node, snap.mode, __version__], 1)
    yield info
    yield GaugeMetricFamily("sidecar_offline", "1 when reporting is off (ENABLED=0)",
                            value=int(snap.offline))
    yield GaugeMetricFamily("sidecar_ready", "1 once the ingest accepted a request, or offline",
                            value=int(snap.ready))
    yield GaugeMetricFamily("sidecar_start_time_seconds", "when the sidecar started, epoch s",
                            value=snap.started_at)
    if snap.sampler_duration_s is not None:
        yield GaugeMetricFamily("sidecar_sampler_duration_seconds",
                                "how long the last hardware sample took",
                                value=snap.sampler_duration_s)
    yield CounterMetricFamily("sidecar_lifecycle_events_recorded",
                              "lifecycle events recorded", value=len(snap.lifecycle_recorded))
    yield GaugeMetricFamily("sidecar_lifecycle_events_pending",
                            "lifecycle events not yet acknowledged",
                            value=len(snap.lifecycle_pending))
    restarts = CounterMetricFamily("sidecar_task_restarts",
                                   "times a supervised task failed and was restarted",
                                   labels=["task"])
    for task, count in sorted(snap.task_restarts.items()):
        restarts.add_metric([task], count)
    yield restarts


def _route_metrics(snap: StatusSnapshot) -> Iterator[Metric]:
    for attr, name, doc in _ROUTE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["route"])
        for route in snap.routes:
            counter.add_metric([route.route], getattr(route, attr))
        yield counter
    for attr, name, doc in _ROUTE_GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=["route"])
        for route in snap.routes:
            gauge.add_metric([route.route], getattr(route, attr))
        yield gauge
    dropped_chars = CounterMetricFamily("sidecar_route_dropped_characters",
                                        "characters of the text given up on (logs)",
                                        labels=["route"])
    for route in snap.routes:
        if route.route in _TEXT_ROUTES:
            dropped_chars.add_metric([route.route], route.dropped_chars)
    yield dropped_chars
    yield _latency_histogram(snap)
    when = GaugeMetricFamily("sidecar_route_last_success_timestamp_seconds",
                             "when the ingest last acknowledged this route, epoch s",
                             labels=["route"])
    age = GaugeMetricFamily("sidecar_route_last_success_age_seconds",
                            "seconds since the ingest last acknowledged this route",
                            labels=["route"])
    for route in snap.routes:
        if route.last_success is not None:
            when.add_metric([route.route], route.last_success)
            age.add_metric([route.route], max(snap.taken_at - route.last_success, 0.0))
    yield when
    yield age


def _latency_histogram(snap: StatusSnapshot) -> Metric:
    histogram = HistogramMetricFamily("sidecar_route_request_duration_seconds",
                                      "how long one attempt took, answered or not",
                                      labels=["route"])
    for route in snap.routes:
        counts = list(route.latency_counts) or [0] * (len(LATENCY_BUCKETS_S) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        histogram.add_metric([route.route], buckets, sum_value=route.latency_sum_s)
    return histogram


def _source_metrics(snap: StatusSnapshot) -> Iterator[Metric]:
    for attr, name, doc in _SOURCE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["source", "kind"])
        for source in snap.sources:
            counter.add_metric([source.name, source.kind], getattr(source, attr))
        yield counter


def _diagnosis_metrics(snap: StatusSnapshot) -> Iterator[Metric]:
    seen = CounterMetricFamily("sidecar_signature_seen", "lines of the command's output that "
                               "matched a failure signature", labels=["signature"])
    for name, count in snap.signatures.items():
        seen.add_metric([name], count)
    yield seen
    yield GaugeMetricFamily("sidecar_trainer_stalled_seconds", "how long the command has printed "
                            "nothing and made no new metric step, past --stall-after; 0 when it "
                            "is not stalled", value=snap.stalled_s)
    if snap.failure is not None:
        failure = GaugeMetricFamily(
            "sidecar_run_failure_info", "the failed run's likely cause; always 1",
            labels=["cause", "signature", "exit_status", "node", "rank"])
        failure.add_metric([str(snap.failure.get(key, "")) for key in (
            "cause", "signature", "exit_status", "node", "rank")], 1)
        yield failure


def _upload_metrics(snap: StatusSnapshot) -> Iterator[Metric]:
    """Checkpoint uploads (docs/checkpoints.md#uploads): what went, what was refused, what
    is left of those under way."""
    if not snap.upload_totals:
        return
    for key, name, what in (
            ("bytes", "sidecar_upload_bytes", "checkpoint bytes the object store took"),
            ("files", "sidecar_upload_files", "checkpoint files the object store took"),
            ("refused", "sidecar_upload_refused", "checkpoints refused for good (dead-lettered)")):
        counter = CounterMetricFamily(name, what)
        counter.add_metric([], snap.upload_totals.get(key, 0))
        yield counter
    left = GaugeMetricFamily("sidecar_upload_pending_bytes",
                             "bytes of the checkpoints under way not yet sent")
    left.add_metric([], sum(u.bytes - u.bytes_sent for u in snap.uploads))
    yield left


def _checkpoint_metrics(snap: StatusSnapshot) -> Iterator[Metric]:
    """Each --checkpoints folder's checkpoints by state, and what was never registered."""
    if not snap.checkpoints:
        return
    held = GaugeMetricFamily("sidecar_checkpoints", "checkpoints in a --checkpoints folder, by "
                             "state (registered, waiting, skipped)", labels=["folder", "state"])
    not_posted = CounterMetricFamily("sidecar_checkpoints_not_posted", "complete checkpoints "
                                     "not posted: a local path in a container, with no "
                                     "--artifact-uri mapping", labels=["folder"])
    deleted = CounterMetricFamily("sidecar_checkpoints_deleted_before_complete",
                                  "checkpoints deleted (rotated away) before they were "
                                  "complete; never registered", labels=["folder"])
    aliases = GaugeMetricFamily("sidecar_checkpoint_aliases", "last.ckpt and symbolic links "
                                "passed over as aliases", labels=["folder"])
    for folder in snap.checkpoints:
        for state, count in (("registered", len(folder.registered)),
                             ("waiting", len(folder.waiting)), ("skipped", len(folder.skipped))):
            held.add_metric([folder.folder, state], count)
        not_posted.add_metric([folder.folder], folder.not_posted)
        deleted.add_metric([folder.folder], folder.deleted_before_complete)
        aliases.add_metric([folder.folder], folder.aliases)
    yield from (held, not_posted, deleted, aliases)
