"""deploy/monitoring/: the Grafana dashboard and the Prometheus alert rules name only series, and
labels, that a real daemon's /metrics serves."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sidecar.observe.address import STATUS_ADDR_FILE
from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, running_ingest, wait_until
from tests.test_status import get

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
DASHBOARD = MONITORING / "sidecar-dashboard.json"
ALERTS = MONITORING / "sidecar-alerts.yaml"
SERIES = re.compile(r"\b((?:sidecar|process)_[a-z0-9_]+)\b")
# Labels Prometheus adds to every series it scrapes, and the histogram's bucket bound.
SCRAPE_LABELS = {"instance", "job", "le"}
# What the panels and rules are about: each must be shown or alerted on.
DASHBOARD_MUST_SHOW = {
    "sidecar_route_accepted_total", "sidecar_route_failures_total",
    "sidecar_route_retries_total", "sidecar_route_dropped_total",
    "sidecar_route_queue_depth", "sidecar_route_spool_bytes", "sidecar_source_read_lines_total",
    "sidecar_source_points_total", "sidecar_source_invalid_total",
    "sidecar_trainer_stalled_seconds", "sidecar_run_failure_info",
    "sidecar_signature_seen_total", "process_cpu_seconds_total",
    "process_resident_memory_bytes"}
ALERTS_MUST_HAVE = {"TrainerStalled", "TrainingRunFailed", "SidecarStrictRouteFailing",
                    "SidecarSpoolFilling"}

# A trainer that writes a metric, prints, and once told to, dies of CUDA out of memory.
TRAINER = """
import json, os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"step": 1, "loss": 0.5}) + "\\n")
print("epoch 1", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.02)
print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr,
      flush=True)
sys.exit(1)
"""


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in doc["panels"] for target in panel.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def labels_named(text: str) -> set[str]:
    """The labels an expression or a template names: in by/on/without/group_left (...), in
    {label="..."} selectors, and as {{ $labels.X }}."""
    found = set(re.findall(r"\$labels\.(\w+)", text))
    for group in re.findall(r"\b(?:by|on|without|group_left|group_right)\s*\(([^)]*)\)", text):
        found |= {name.strip() for name in group.split(",") if name.strip()}
    for selector in re.findall(r"\{([^{}]*)\}", text):
        found |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
    return found


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Every series a real `sidecar run` serves at /metrics, with its label names, scraped
    while a failed run drains (when the failure's own series exists too)."""
    tmp_path = tmp_path_factory.mktemp("monitoring")
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        faults=True) as ingest:
        return _scrape_a_failing_run(ingest, tmp_path)


def _scrape_a_failing_run(ingest: RunningIngest, tmp_path: Path) -> dict[str, set[str]]:
    state, metrics, go = tmp_path / "state", tmp_path / "metrics.jsonl", tmp_path / "go"
    env = platform_env(ingest, state, SIDECAR_STATUS_ADDR="127.0.0.1:0")
    run = Sidecar(["run", "--jsonl", str(metrics), "--hardware-interval", "0",
                   "--drain-timeout", "4", "--", *python_child(TRAINER), str(metrics), str(go)],
                  env, tmp_path / "run")
    text = ""
    try:
        addr_file = state / RUN_ID / STATUS_ADDR_FILE
        wait_until(addr_file.exists, 20, "the run wrote its status address")
        address = addr_file.read_text().strip()
        ingest.wait_for(lambda: ingest.stats.routes["lifecycle"].accepted == 2
                        and ingest.stats.routes["logs"].accepted >= 1
                        and ingest.stats.routes["metrics"].accepted >= 1, 20)
        # The end event hangs, so the drain lasts and the failure can be scraped.
        ingest.add_fault(Fault(route="lifecycle", latency_s=60))
        go.touch()

        def failure_scraped() -> bool:
            nonlocal text
            text = asyncio.run(get(address, "/metrics"))[1]
            return "sidecar_run_failure_info{" in text

        wait_until(failure_scraped, 20, "the failed run's cause at /metrics")
    finally:
        go.touch()
        run.wait(60)
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def test_every_series_the_dashboard_names_is_served(exposed: dict[str, set[str]]) -> None:
    named = {name for expr in dashboard_exprs() for name in SERIES.findall(expr)}
    assert named - set(exposed) == set()
    assert named >= DASHBOARD_MUST_SHOW


def test_every_series_the_alert_rules_name_is_served(exposed: dict[str, set[str]]) -> None:
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} >= ALERTS_MUST_HAVE
    named = {name for rule in rules for name in SERIES.findall(rule["expr"])}
    assert named - set(exposed) == set()


@pytest.mark.parametrize("where", ["dashboard", "alerts"])
def test_every_label_used_is_one_the_series_carry(exposed: dict[str, set[str]],
                                                  where: str) -> None:
    if where == "dashboard":
        texts = [(expr, set(SERIES.findall(expr))) for expr in dashboard_exprs()]
    else:
        texts = [(rule["expr"] + json.dumps(rule.get("annotations", {})),
                  set(SERIES.findall(rule["expr"]))) for rule in alert_rules()]
    for text, series in texts:
        carried = set().union(*(exposed[name] for name in series)) | SCRAPE_LABELS
        assert labels_named(text) - carried == set(), text


def test_the_rules_are_well_formed() -> None:
    for rule in alert_rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_the_dashboard_is_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]
