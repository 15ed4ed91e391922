"""The Grafana dashboard of the chart (helm/spectrain-operator/dashboards/spectrain.json), built from
code so every panel's query is reviewed as code and `make verify` (scripts/gen.py) catches a stale
file. No Grafana library: the JSON model below is the small subset of Grafana's dashboard schema
the panels use (timeseries, stat, row), which every Grafana >= 9 reads.

Series labels (docs/operations.md, Monitoring): the job pods' series carry `namespace`, `job_name`
and `pod` (the chart's PodMonitor relabels them from the pod) and `rank` (the process); the
operator's series carry the operator pod's `namespace` and `pod`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

UID = "spectrain"
TITLE = "SpecTrain"
FILE_NAME = "spectrain.json"     # the chart's dashboards/<FILE_NAME>, the ConfigMap's key
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's schema version of the model below (Grafana 10/11 migrate older models on load, never newer).
SCHEMA_VERSION = 39
GRID_WIDTH = 24                  # Grafana's grid is 24 columns wide
PANEL_HEIGHT = 8

# The job selector every job panel applies: the template variables, each multi-valued.
JOB = 'namespace=~"$namespace", job_name=~"$job_name"'
RANK = f'{JOB}, rank=~"$rank"'
PER_RANK = "job_name, rank"      # the legend's identity of one process


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = GRID_WIDTH // 2


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def _harvest_fraction(by: str) -> str:
    # Drafter work inside idle windows over the target's idle time, both as rates: an upper bound
    # of `spectrain report`'s effective harvest, which counts only work that reaches the export.
    return (f"{rate('spectrain_drafter_harvested_seconds_total', RANK, by)}\n"
            f"/ {rate('spectrain_target_idle_seconds_total', RANK, by)}")


def _rate(series: str) -> str:
    return f"rate({series}[$__rate_interval])"


def _total(series: str) -> str:
    return series


def effective_harvest(f: Any = _total) -> str:
    """`spectrain report`'s effective harvest (report/harvest.py) per job: per rank, its window work
    that reached the export, i.e. the larger of its own count of work in combined versions and the
    coordinator's count for it (which holds the last round, combined after the members stopped),
    times the share of its busy time that was inside windows; summed over ranks, over the target's
    idle time. `f` is `_total` (counters since the processes started: the run so far) or `_rate`."""
    per_rank = "namespace, job_name, rank"

    def by_rank(metric: str) -> str:
        return f"sum by ({per_rank}) ({f(metric + '{' + RANK + '}')})"

    # the coordinator's series are labelled with its own rank and the member's as member_rank
    coordinator = (f"sum by ({per_rank}) (label_replace({f('spectrain_drafter_export_work_seconds_total{' + JOB + '}')}, "
                   '"rank", "$1", "member_rank", "(.+)"))')
    credited = (f"max by ({per_rank}) (\n"
                f'    label_replace({by_rank("spectrain_drafter_combined_work_seconds_total")}, "count", "member", "", "")\n'
                f'  or label_replace({coordinator}, "count", "coordinator", "", ""))')
    share = (f"clamp_max({by_rank('spectrain_drafter_harvested_seconds_total')}\n"
             f"  / {by_rank('spectrain_drafter_busy_seconds_total')}, 1)")
    return (f"sum by (namespace, job_name) (\n  {credited}\n  * on ({per_rank}) {share})\n"
            f"/ sum by (namespace, job_name) ({f('spectrain_target_idle_seconds_total{' + JOB + '}')})")


ROWS: tuple[Row, ...] = (
    Row("Harvest: idle time the drafter uses", (
        Panel("Idle vs harvested seconds per second, by kind",
              "The target's idle window time (solid) and the drafter's work inside it, per job, rank and "
              "window kind. The gap is idle time left unused.",
              (Query(rate("spectrain_target_idle_seconds_total", RANK, f"{PER_RANK}, kind"),
                     "idle {{job_name}} r{{rank}} {{kind}}"),
               Query(rate("spectrain_drafter_harvested_seconds_total", RANK, f"{PER_RANK}, kind"),
                     "harvested {{job_name}} r{{rank}} {{kind}}")), unit="s"),
        Panel("Harvest fraction (harvested / idle) and effective harvest",
              "Share of the target's idle time the drafter worked in, per rank (alert SpecTrainHarvestLow "
              "watches the job's figure), and per job the share whose work reached a combined version, "
              "i.e. the export (`spectrain report`'s effective harvest; jobs with a drafter fleet).",
              (Query(_harvest_fraction(PER_RANK), "{{job_name}} r{{rank}}"),
               Query(effective_harvest(_rate), "effective {{job_name}}")), unit="percentunit"),
        Panel("Effective harvest of the run",
              "`spectrain report`'s effective harvest from the counters since the processes started: the "
              "share of the target's idle time whose drafter work reached the export (jobs with a drafter "
              "fleet). A restarted process starts its counters again.",
              (Query(effective_harvest(), "{{job_name}}"),), unit="percentunit", kind="stat"),
        Panel("Drafters by state",
              "Drafter processes per state (Waiting, Active, Degraded, Disabled). Degraded or Disabled "
              "fires SpecTrainDrafterDegraded.",
              (Query(f"sum by (job_name, state) (spectrain_drafter_state{{{RANK}}})",
                     "{{job_name}} {{state}}"),)),
        Panel("Window overrun (p99)",
              "How far the drafter's last task in a worked window ran past the window's end: time the "
              "target may have waited.",
              (Query(f'max by ({PER_RANK}) (spectrain_drafter_overrun_seconds{{{RANK}, quantile="0.99"}})',
                     "{{job_name}} r{{rank}}"),), unit="s"),
    )),
    Row("Drafter quality", (
        Panel("Acceptance length",
              "Tokens accepted per verification at the drafter's last check (k drafted + 1 at best).",
              (Query(f"max by ({PER_RANK}) (spectrain_drafter_acceptance_length{{{RANK}}})",
                     "{{job_name}} r{{rank}}"),)),
        Panel("Exported and combined versions",
              "The newest exported drafter version and the newest combined fleet version. A flat export "
              "line while harvest goes on fires SpecTrainExportStalled.",
              (Query(f"max by ({PER_RANK}) (spectrain_drafter_exported_version{{{RANK}}})",
                     "exported {{job_name}} r{{rank}}"),
               Query(f"max by ({PER_RANK}) (spectrain_drafter_combined_version{{{RANK}}})",
                     "combined {{job_name}} r{{rank}}"))),
        Panel("Samples per second",
              "Samples the drafter trained on, and samples that reached it by source (its ring, its peers).",
              (Query(rate("spectrain_drafter_samples_trained_total", RANK, PER_RANK),
                     "trained {{job_name}} r{{rank}}"),
               Query(rate("spectrain_drafter_samples_received_total", RANK, f"{PER_RANK}, source"),
                     "received {{job_name}} r{{rank}} {{source}}"))),
        Panel("Exports held back",
              "Candidate exports the gate kept from LATEST, by cause: below_latest (under LATEST re-measured on "
              "the same held-back samples), below_floor (under spec.drafter.export.minAcceptance), non_finite, "
              "unmeasured, version_reused.",
              (Query(f"sum by ({PER_RANK}, cause) (increase(spectrain_drafter_exports_rejected_total{{{RANK}}}"
                     "[$__rate_interval]))", "{{job_name}} r{{rank}} {{cause}}"),)),
    )),
    Row("Drafter exchange", (
        Panel("Exchange traffic",
              "Bytes per second of the drafters' fleet channel, by direction.",
              (Query(rate("spectrain_drafter_exchange_bytes_total", RANK, f"{PER_RANK}, direction"),
                     "{{job_name}} r{{rank}} {{direction}}"),), unit="Bps"),
        Panel("Rejected items and dropped frames",
              "Items from peers refused by a check, by cause (any cause but not_ready, a start-up race, means a "
              "broken or hostile peer: SpecTrainExchangeRejected), and frames dropped at the bandwidth cap or a full inbox.",
              (Query(f"sum by ({PER_RANK}, cause) (increase(spectrain_drafter_exchange_rejected_total{{{RANK}}}"
                     "[$__rate_interval]))", "rejected {{job_name}} r{{rank}} {{cause}}"),
               Query(f"sum by ({PER_RANK}) (increase(spectrain_drafter_exchange_frames_dropped_total{{{RANK}}}"
                     "[$__rate_interval]))", "dropped {{job_name}} r{{rank}}"))),
    )),
    Row("Target training", (
        Panel("Step time",
              "Wall time of the target's last step, per rank. SpecTrainTargetSlowdown compares its 30 min "
              "average with the job's best hour of the past day.",
              (Query(f"max by ({PER_RANK}) (spectrain_target_step_seconds{{{RANK}}})",
                     "{{job_name}} r{{rank}}"),), unit="s"),
        Panel("Tokens per second",
              "Tokens per second of the target's last step, per rank.",
              (Query(f"sum by ({PER_RANK}) (spectrain_target_tokens_per_second{{{RANK}}})",
                     "{{job_name}} r{{rank}}"),)),
    )),
    Row("Operator", (
        Panel("Reconciles per second",
              "Reconcile passes by result. Only the active replica reconciles.",
              (Query("sum by (namespace, result) (rate(spectrain_reconciles_total[$__rate_interval]))",
                     "{{namespace}} {{result}}"),), unit="ops"),
        Panel("Reconcile errors per second",
              "Errors while reconciling, by kind (exception class, or `event`). SpecTrainReconcileErrors "
              "fires on any.",
              (Query("sum by (namespace, kind) (rate(spectrain_reconcile_errors_total[$__rate_interval]))",
                     "{{namespace}} {{kind}}"),), unit="ops"),
        Panel("Reconcile latency",
              "Duration of one reconcile pass, p50 and p99.",
              tuple(Query(f"histogram_quantile({q}, sum by (namespace, le) "
                          "(rate(spectrain_reconcile_duration_seconds_bucket[$__rate_interval])))",
                          f"{{{{namespace}}}} p{round(q * 100)}") for q in (0.5, 0.99)), unit="s"),
        Panel("API calls per second",
              "Requests the operator makes to the Kubernetes API, by verb.",
              (Query("sum by (namespace, verb) (rate(spectrain_api_calls_total[$__rate_interval]))",
                     "{{namespace}} {{verb}}"),), unit="reqps"),
        Panel("SpecTrainJobs by phase",
              "SpecTrainJobs the operator knows, by phase (max over replicas: a standby knows the same jobs "
              "or none).",
              (Query("max by (phase) (spectrain_jobs)", "{{phase}}"),), kind="stat", width=GRID_WIDTH),
    )),
)


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"var-{name}"}, "definition": query,
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def templating() -> list[dict[str, Any]]:
    # namespace -> job_name -> rank, each narrowed by the ones before; the target's step gauge is
    # the one series every process of every job has.
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        _variable("namespace", "Namespace", "label_values(spectrain_target_step, namespace)"),
        _variable("job_name", "Job", 'label_values(spectrain_target_step{namespace=~"$namespace"}, job_name)'),
        _variable("rank", "Rank", f"label_values(spectrain_target_step{{{JOB}}}, rank)"),
    ]


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    return {"id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
            "gridPos": {"h": PANEL_HEIGHT, "w": p.width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}} if p.kind == "timeseries" else {},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q.expr,
                         "legendFormat": q.legend, "range": True}
                        for i, q in enumerate(p.queries)]}


def panels() -> list[dict[str, Any]]:
    """Rows and their panels laid out left to right, a new line when the grid is full."""
    out: list[dict[str, Any]] = []
    y = 0
    for row in ROWS:
        out.append({"id": len(out) + 1, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                    "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
        y += 1
        x = 0
        for p in row.panels:
            if x + p.width > GRID_WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            out.append(_panel(p, len(out) + 1, x, y))
            x += p.width
        y += PANEL_HEIGHT
    return out


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID, "title": TITLE, "tags": ["spectrain"], "editable": True, "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION, "version": 1, "refresh": "1m", "timezone": "",
        "time": {"from": "now-6h", "to": "now"}, "annotations": {"list": []}, "links": [],
        "description": "SpecTrainJobs: idle time vs drafter harvest, drafter quality and exchange, target "
                       "step time, operator health. Panels and alerts: docs/operations.md, Monitoring.",
        "templating": {"list": templating()},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


__all__ = ["FILE_NAME", "ROWS", "dashboard", "render"]
