"""The chart's monitoring: the PodMonitor selects the ports the operator's pods declare, every alert
and every dashboard query names only metrics the code defines (the set is read from the metric
modules, not written here), each alert has its runbook section, and the dashboard file is the one
scripts/dashboard.py builds. No promtool here: the expressions' syntax and behaviour are checked
against a real Prometheus in the integration tier (tests/integration/test_monitoring_prometheus.py)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from spectrain_api.names import DRAFTER_STATES
from spectrain_operator import builders, objects
from spectrain_operator import spec as specmod
from tests.unit.project.test_helm_chart import CHART, NAMESPACE, VARIANTS, by_kind, notes, one, render

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import dashboard  # noqa: E402

MONITORING = VARIANTS["monitoring"]
OPERATIONS_MD = ROOT / "docs" / "operations.md"
# Prometheus' own series the rules may name (scrape health).
PROMETHEUS_SERIES = {"up"}
ALERTS = {"SpecTrainDrafterDegraded", "SpecTrainExchangeRejected", "SpecTrainHarvestLow", "SpecTrainTargetSlowdown",
          "SpecTrainExportStalled", "SpecTrainOperatorDown", "SpecTrainReconcileErrors"}


# ------------------------------------------------------------------------------------ metric names
def _sample_names(family: Any) -> set[str]:
    """The series names a family exposes (prometheus-client's family name drops `_total`)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "summary": ["_sum", "_count"]}
    return {family.name + s for s in suffixes.get(family.type, [""])}


def _families(collectors: Iterable[Any]) -> set[str]:
    return {n for c in collectors for fam in c.collect() for n in _sample_names(fam)}


def operator_metrics() -> set[str]:
    from spectrain_operator import metrics

    return _families(v for v in vars(metrics).values() if isinstance(v, prometheus_client.metrics.MetricWrapperBase))


def target_metrics(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The families the target's endpoint registers, taken from the registry it would serve."""
    from spectrain_workloads import metrics, metrics_endpoint

    served: list[Any] = []
    monkeypatch.setattr(metrics_endpoint, "Endpoint", lambda registry, port: served.append(registry))
    metrics._Prometheus(port=1, rank=0)
    (registry,) = served
    return _families([registry])


def drafter_metrics() -> set[str]:
    """Every counter and gauge the collector can emit (those with a summary key appear only once the
    summary has it; overrun and state always)."""
    from spectrain_workloads.drafter import prometheus as dp

    return ({f"{dp.PREFIX}{n}_total" for n in dp._HELP} | {dp.PREFIX + n for n in dp._GAUGES}
            | _families([dp.DrafterCollector(rank=0)]))


@pytest.fixture(scope="module")
def known_metrics() -> set[str]:
    with pytest.MonkeyPatch.context() as mp:
        return operator_metrics() | target_metrics(mp) | drafter_metrics()


def test_the_metric_sets_are_read_from_the_code(known_metrics: set[str]) -> None:
    assert {"spectrain_reconciles_total", "spectrain_reconcile_duration_seconds_bucket", "spectrain_jobs",
            "spectrain_target_step_seconds", "spectrain_target_idle_seconds_total",
            "spectrain_drafter_harvested_seconds_total", "spectrain_drafter_exchange_rejected_total",
            "spectrain_drafter_state", "spectrain_drafter_overrun_seconds", "spectrain_drafter_acceptance_length",
            } <= known_metrics
    assert all(n.startswith("spectrain_") for n in known_metrics)


# PromQL words that are neither metrics nor functions.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left after dropping strings, label
    matchers, ranges and grouping clauses that are not functions (followed by `(`) or keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    return {m[1] for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", e)
            if not m[2] and m[1].lower() not in _KEYWORDS}


def test_metric_names_finds_metrics_and_only_them() -> None:
    assert metric_names('sum by (job_name, le) (rate(spectrain_x_total{a="b", c=~"$d"}[$__rate_interval]))\n'
                        '/ on (a) group_left (b) max(spectrain_y) > 1.05 * min_over_time(z[1h:5m]) '
                        'unless absent(up{job="x"} == 1)') == {"spectrain_x_total", "spectrain_y", "z", "up"}
    # the check can fail: a misspelt metric is not a known one
    assert metric_names("rate(spectrain_drafter_harvest_seconds_total[5m])") == {
        "spectrain_drafter_harvest_seconds_total"}


def _states(expr: str) -> set[str]:
    return {s for m in re.finditer(r'\bstate=~?"([^"]*)"', expr) for s in m[1].split("|")}


# ------------------------------------------------------------------------------------ chart: on / off
def test_monitoring_is_off_by_default() -> None:
    kinds = {d["kind"] for d in render({})}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ServiceMonitor", "ConfigMap"}


def test_monitoring_on_renders_pod_monitor_rule_and_dashboard() -> None:
    docs = render(MONITORING)
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"):
        assert one(docs, kind)["metadata"]["namespace"] == NAMESPACE
    assert one(docs, "PodMonitor")["metadata"]["labels"]["release"] == "prom"
    assert one(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "prom"
    text = notes(MONITORING)
    assert "PodMonitor" in text and "PrometheusRule" in text and "grafana_dashboard=1" in text
    assert "Monitoring" not in notes({})


# ------------------------------------------------------------------------------------ PodMonitor
def _job(example: str, procs: int, mode: str | None = None) -> dict[str, Any]:
    job = specmod.load_manifests(ROOT / "examples" / example)[0]
    job["metadata"].setdefault("namespace", "team-a")
    job["spec"]["target"]["procsPerNode"] = procs
    if mode:
        job["spec"]["gpuSharing"]["mode"] = mode
    return specmod.apply_defaults(job)


def _keep_regex(endpoint: dict[str, Any]) -> re.Pattern[str]:
    (keep,) = [r for r in endpoint["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    return re.compile(keep["regex"])          # Prometheus anchors relabel regexes: fullmatch below


@pytest.mark.parametrize(("example", "procs", "mode"), [
    ("demo.yaml", 1, None), ("demo.yaml", 2, None), ("demo.yaml", 64, None),
    ("gpu-dra.yaml", 4, "SingleContainer"), ("gpu-dra.yaml", 4, "PodLocalMPS"),
])
def test_pod_monitor_scrapes_exactly_the_metrics_ports(example: str, procs: int, mode: str | None) -> None:
    pm = one(render(MONITORING), "PodMonitor")
    job = _job(example, procs, mode)
    pod, _ = builders.pod(job, 0)
    assert pm["spec"]["selector"] == {"matchExpressions": [{"key": objects.LABEL_JOB, "operator": "Exists"}]}
    assert objects.LABEL_JOB in pod["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
             for p in c.get("ports", [])}
    target_ep, drafter_ep = pm["spec"]["podMetricsEndpoints"]
    scraped = {role: {ports[n] for n in ports if _keep_regex(ep).fullmatch(n)}
               for role, ep in (("target", target_ep), ("drafter", drafter_ep))}
    assert scraped["target"] == set(builders.target_metrics_ports(job))
    assert scraped["drafter"] == {builders.DRAFTER_METRICS_PORT + i for i in range(procs)}
    assert scraped["target"] | scraped["drafter"] == set(builders.metrics_ports(job))
    assert all(len(n) <= 15 for n in ports)


def test_pod_monitor_puts_job_namespace_and_pod_on_every_series() -> None:
    pm = one(render(MONITORING), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    job_meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", objects.LABEL_JOB)
    for ep in pm["spec"]["podMetricsEndpoints"]:
        relabel = {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"] if r["action"] == "replace"}
        assert relabel == {"job_name": [job_meta], "namespace": ["__meta_kubernetes_namespace"],
                           "pod": ["__meta_kubernetes_pod_name"]}
        assert (ep["interval"], ep["scrapeTimeout"], ep["path"]) == ("30s", "10s", "/metrics")
    custom = one(render(VARIANTS["monitoring-custom"]), "PodMonitor")
    # matchNames replaces the default `any: true`, which would otherwise win over it
    assert custom["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert {ep["interval"] for ep in custom["spec"]["podMetricsEndpoints"]} == {"15s"}


# ------------------------------------------------------------------------------------ alerts
def _rules(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rule = one(render(values), "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return {re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+\s+(.*)$", markdown, re.M)}


def test_every_alert_names_only_existing_metrics(known_metrics: set[str]) -> None:
    rules = _rules(MONITORING)
    assert set(rules) == ALERTS
    for name, r in rules.items():
        used = metric_names(r["expr"])
        assert used and used <= known_metrics | PROMETHEUS_SERIES, (name, used - known_metrics)
        assert _states(r["expr"]) <= set(DRAFTER_STATES), name


def test_every_alert_has_its_texts_and_runbook_section() -> None:
    anchors = _anchors(OPERATIONS_MD.read_text())
    base = MONITORING["alerts"]["runbookBaseUrl"] + "#"
    assert all("runbook_url" not in r["annotations"] for r in _rules(VARIANTS["monitoring-custom"]).values())
    for name, r in _rules(MONITORING).items():
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], name
        assert ann["runbook_url"] == base + name.lower(), name
        assert name.lower() in anchors, f"docs/operations.md has no section {name}"
        assert r["labels"]["severity"] in {"critical", "warning", "info"}


def test_alert_thresholds_come_from_the_values() -> None:
    rules = _rules(VARIANTS["monitoring-custom"])
    assert ") < 0.5" in rules["SpecTrainHarvestLow"]["expr"] and rules["SpecTrainHarvestLow"]["for"] == "1h"
    assert "_total[1h]))" in rules["SpecTrainHarvestLow"]["expr"]
    assert "> 1.1 *" in rules["SpecTrainTargetSlowdown"]["expr"] and "[7d:10m]" in rules["SpecTrainTargetSlowdown"]["expr"]
    assert rules["SpecTrainHarvestLow"]["labels"]["severity"] == "info"
    # no operator metrics, no operator alerts
    assert not {"SpecTrainOperatorDown", "SpecTrainReconcileErrors"} & set(rules)


def test_operator_alerts_watch_the_service_monitors_job() -> None:
    docs = render(MONITORING)
    svc = one(docs, "Service")["metadata"]["name"]
    rules = _rules(MONITORING)
    selector = f'job="{svc}", namespace="{NAMESPACE}"'
    assert rules["SpecTrainOperatorDown"]["expr"] == f"absent(up{{{selector}}} == 1)"
    assert selector in rules["SpecTrainReconcileErrors"]["expr"]
    # the ServiceMonitor's targets get the Service's name as `job` (Prometheus Operator's default)
    assert "jobLabel" not in one(docs, "ServiceMonitor")["spec"]


# ------------------------------------------------------------------------------------ dashboard
DASHBOARD_FILE = CHART / "dashboards" / dashboard.FILE_NAME


def _panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD_FILE.read_text())["panels"] if p["type"] != "row"]


def test_dashboard_file_is_the_generated_one() -> None:
    """What `make verify` checks: scripts/gen.py wrote the file from scripts/dashboard.py."""
    assert DASHBOARD_FILE.read_text() == dashboard.render(), "stale: run `python scripts/gen.py`"


def test_dashboard_is_valid_grafana_json() -> None:
    model = json.loads(DASHBOARD_FILE.read_text())
    assert model["uid"] == dashboard.UID and model["schemaVersion"] >= 36
    assert [v["name"] for v in model["templating"]["list"]] == ["datasource", "namespace", "job_name", "rank"]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in model["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= dashboard.GRID_WIDTH
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']} overlaps another"
        cells |= mine
    for p in _panels():
        assert p["title"] and p["description"] and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_every_dashboard_query_names_only_existing_metrics(known_metrics: set[str]) -> None:
    model = json.loads(DASHBOARD_FILE.read_text())
    for p in _panels():
        for t in p["targets"]:
            used = metric_names(t["expr"])
            assert used and used <= known_metrics, (p["title"], used - known_metrics)
            assert _states(t["expr"]) <= set(DRAFTER_STATES)
    for v in model["templating"]["list"][1:]:
        (metric,) = re.findall(r"label_values\((\w+)", v["query"]["query"])
        assert metric in known_metrics


def test_dashboard_covers_the_panels_operations_needs() -> None:
    used = {n for p in _panels() for t in p["targets"] for n in metric_names(t["expr"])}
    assert {"spectrain_target_idle_seconds_total", "spectrain_drafter_harvested_seconds_total",
            "spectrain_drafter_acceptance_length", "spectrain_drafter_exported_version",
            "spectrain_drafter_combined_version", "spectrain_drafter_exchange_bytes_total",
            "spectrain_drafter_exchange_rejected_total", "spectrain_target_step_seconds",
            "spectrain_target_tokens_per_second", "spectrain_drafter_state", "spectrain_reconciles_total",
            "spectrain_reconcile_errors_total", "spectrain_reconcile_duration_seconds_bucket",
            "spectrain_jobs"} <= used
    # the job panels follow the template variables
    for p in _panels():
        for t in p["targets"]:
            if "spectrain_target_" in t["expr"] or "spectrain_drafter_" in t["expr"]:
                assert 'job_name=~"$job_name"' in t["expr"] and 'rank=~"$rank"' in t["expr"], p["title"]


def test_dashboard_config_map_carries_the_file_and_sidecar_label() -> None:
    cm = one(render(MONITORING), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {dashboard.FILE_NAME: DASHBOARD_FILE.read_text().rstrip("\n")}
    json.loads(cm["data"][dashboard.FILE_NAME])
    custom = one(render(VARIANTS["monitoring-custom"]), "ConfigMap")
    assert custom["metadata"]["namespace"] == "monitoring" and custom["metadata"]["labels"]["dash"] == "yes"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "SpecTrain"}
    assert not by_kind(render({"dashboards": {"enabled": False}}), "ConfigMap")
