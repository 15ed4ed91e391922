"""The chart's monitoring against a real Prometheus and promtool (`make prometheus-binaries`,
scripts/build-prometheus.sh; the test fails, never skips, when they are missing).

- The rendered PrometheusRule's groups pass `promtool check rules`, and `promtool test rules` runs
  tests/monitoring/alerts.test.yaml: every alert fires on synthetic series of its situation and
  stays quiet on healthy ones.
- A short `spectrain run` of the demo (drafters on) and an operator reconciling a SpecTrainJob on
  the real apiserver are scraped every second by Prometheus, with the PodMonitor's own relabelings
  over the meta labels Kubernetes pod discovery would give each port. While the run goes, every
  dashboard panel's query returns series, except those of counters labelled by a cause that
  exists only once something went wrong (HEALTHY_EMPTY). Prometheus evaluates the chart's rules
  itself: each evaluates without error and none fires on the healthy run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spectrain_operator import builders
from spectrain_operator.local_layout import free_port
from spectrain_workloads.report.summary import summarize
from tests.integration.kubeapi import KubeAPI
from tests.integration.operator_harness import start_env
from tests.unit.project.test_helm_chart import NAMESPACE, VARIANTS, one, render
from tests.unit.project.test_monitoring import DASHBOARD_FILE, dashboard, metric_names
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-prometheus.sh"
RULE_TESTS = ROOT / "tests" / "monitoring" / "alerts.test.yaml"
SPECTRAIN = [sys.executable, "-m", "spectrain_operator.cli"]
MONITORING = VARIANTS["monitoring"]

SCRAPE_INTERVAL = "1s"
# Grafana's $__rate_interval; at least two 1 s scrapes in it, and shorter than the run.
RATE_INTERVAL = "30s"
# Dashboard queries allowed to be empty on a healthy run, by the metric that makes them so: a
# counter whose label (the refusal's cause, the error's kind) gets its first value with the first
# refused item or reconcile error, so it has no series until then. The alert rule tests cover them.
HEALTHY_EMPTY = {"spectrain_drafter_exchange_rejected_total", "spectrain_reconcile_errors_total"}
# Long enough that every drafter series (exports, acceptance checks, combined versions) appears
# while the run still goes: a 60-step run of this size has them all from ~9 s of its ~17 s.
RUN_STEPS = 160
NEVER = "0001-01-01"     # a rule's lastEvaluation before its first evaluation (Go's zero time)


# ------------------------------------------------------------------------------------ binaries
def binary(name: str) -> Path:
    """As scripts/build-prometheus.sh --print-bin; fails (never skips) when missing."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin"], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip()) / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"missing {path}: run `make prometheus-binaries` (scripts/build-prometheus.sh)", pytrace=False)
    return path


class _BlockStyle(yaml.SafeDumper):
    """Multi-line strings (the rule expressions) as `|` blocks: the rules file stays readable."""


_BlockStyle.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def write_rules(path: Path) -> list[dict[str, Any]]:
    """The rendered PrometheusRule's spec.groups as a Prometheus rules file at `path`."""
    groups: list[dict[str, Any]] = one(render(MONITORING), "PrometheusRule")["spec"]["groups"]
    path.write_text(yaml.dump({"groups": groups}, Dumper=_BlockStyle, sort_keys=False))
    return groups


def alert_names(groups: list[dict[str, Any]]) -> set[str]:
    return {r["alert"] for g in groups for r in g["rules"]}


# ------------------------------------------------------------------------------------ promtool
def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    groups = write_rules(tmp_path / "rules.yaml")
    res = subprocess.run([binary("promtool"), "check", "rules", "rules.yaml"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(alert_names(groups))} rules found" in res.stdout


def test_every_alert_has_a_firing_and_a_quiet_rule_test() -> None:
    """What alerts.test.yaml must hold for `promtool test rules` to mean something per alert."""
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = alert_names(one(render(MONITORING), "PrometheusRule")["spec"]["groups"])
    assert fires == alerts and quiet == alerts


def test_promtool_rule_tests_pass(tmp_path: Path) -> None:
    write_rules(tmp_path / "rules.yaml")
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)   # rule_files are relative to the test file
    res = subprocess.run([binary("promtool"), "test", "rules", RULE_TESTS.name], cwd=tmp_path,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_the_rule_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """Without its `unless Disabled` clause SpecTrainHarvestLow fires on a job whose drafter is
    disabled: the rule tests must say so."""
    groups = write_rules(tmp_path / "rules.yaml")
    for g in groups:
        for r in g["rules"]:
            if r["alert"] == "SpecTrainHarvestLow":
                r["expr"] = r["expr"].split("\nunless ")[0]
    (tmp_path / "rules.yaml").write_text(yaml.dump({"groups": groups}, Dumper=_BlockStyle, sort_keys=False))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    res = subprocess.run([binary("promtool"), "test", "rules", RULE_TESTS.name], cwd=tmp_path,
                         capture_output=True, text=True)
    assert res.returncode != 0 and "alertname: SpecTrainHarvestLow" in res.stderr, res.stdout + res.stderr


# ------------------------------------------------------------------------------------ Prometheus
class Prometheus:
    """A Prometheus server on 127.0.0.1 with its data in `data_dir`, queried over its HTTP API."""

    def __init__(self, config: Path, data_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_for(self._ready, 60, interval=0.1, what="Prometheus /-/ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; a query Prometheus refuses (parse or evaluation error) fails the test."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: HTTP {exc.code} {exc.read().decode()[:500]}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def prometheus(config: Path, data_dir: Path, log: Path) -> Iterator[Prometheus]:
    server = Prometheus(config, data_dir, log)
    try:
        yield server
    finally:
        server.stop()


def _snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m[0].lower(), key)


def _meta_label(name: str) -> str:
    """Kubernetes discovery's label name for a pod label or annotation key."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(run_dir: Path) -> list[dict[str, Any]]:
    """Static targets for the run's metrics ports, each with the meta labels Kubernetes pod
    discovery gives a declared container port: the pod's name, namespace and labels, the port's
    name (from the pods the builders build, as on a cluster) and whether it is an init container's."""
    job = json.loads((run_dir / "job.json").read_text())
    layout = json.loads((run_dir / "layout.json").read_text())
    pods = {p["metadata"]["name"]: p for p in builders.build_children(job) if p["kind"] == "Pod"}
    targets = []
    for entry in layout["metrics"]:
        pod = pods[entry["pod"]]
        init = [c["name"] for c in pod["spec"].get("initContainers", [])]
        (container,) = [c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
                        if c["name"] == entry["container"]]
        cluster_base = int(next(e["value"] for e in container["env"] if e["name"] == "SPECTRAIN_METRICS_PORT"))
        names = {p["containerPort"]: p["name"] for p in container.get("ports", [])}
        for local_rank, port in enumerate(entry["ports"]):
            labels = {"__meta_kubernetes_namespace": pod["metadata"].get("namespace", "default"),
                      "__meta_kubernetes_pod_name": entry["pod"],
                      "__meta_kubernetes_pod_container_name": entry["container"],
                      "__meta_kubernetes_pod_container_init": str(entry["container"] in init).lower(),
                      "__meta_kubernetes_pod_container_port_name": names[cluster_base + local_rank]}
            labels |= {f"__meta_kubernetes_pod_label_{_meta_label(k)}": v
                       for k, v in pod["metadata"]["labels"].items()}
            targets.append({"targets": [f"127.0.0.1:{port}"], "labels": labels})
    return targets


def scrape_config(run_dir: Path, operator_port: int, rules: Path) -> dict[str, Any]:
    """One scrape job per PodMonitor endpoint (its relabelings, camelCase to Prometheus' own keys)
    over every port of the run, as the Prometheus Operator generates them, and the operator's
    metrics as the ServiceMonitor scrapes it: `job` = the metrics Service's name, in the release's
    namespace (what SpecTrainOperatorDown and SpecTrainReconcileErrors select)."""
    docs = render(MONITORING)
    pm = one(docs, "PodMonitor")
    service = one(docs, "Service")["metadata"]["name"]
    operator_pod = one(docs, "Deployment")["metadata"]["name"] + "-0"
    targets = pod_targets(run_dir)
    jobs: list[dict[str, Any]] = [
        {"job_name": f"podMonitor/{NAMESPACE}/{pm['metadata']['name']}/{i}", "metrics_path": ep["path"],
         "static_configs": targets,
         "relabel_configs": [{_snake(k): v for k, v in r.items()} for r in ep["relabelings"]]}
        for i, ep in enumerate(pm["spec"]["podMetricsEndpoints"])]
    jobs.append({"job_name": service, "static_configs": [{
        "targets": [f"127.0.0.1:{operator_port}"],
        "labels": {"namespace": NAMESPACE, "pod": operator_pod, "service": service}}]})
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL,
                       "evaluation_interval": SCRAPE_INTERVAL},
            "rule_files": [str(rules)], "scrape_configs": jobs}


def fill(expr: str) -> str:
    """A dashboard query with its template variables set to match everything."""
    for var, value in {"$namespace": ".*", "$job_name": ".*", "$rank": ".*",
                       "$__rate_interval": RATE_INTERVAL}.items():
        expr = expr.replace(var, value)
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every panel, the template variables set to match everything."""
    out = []
    for p in json.loads(DASHBOARD_FILE.read_text())["panels"]:
        for t in p.get("targets", []):
            expr = fill(t["expr"])
            assert "$" not in expr.replace('"$1"', ""), (p["title"], expr)    # label_replace's $1 stays
            out.append((p["title"], expr))
    return out


def short_demo(tmp_path: Path) -> Path:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["target"]["steps"] = RUN_STEPS
    job["spec"]["target"]["data"]["seqLen"] = 64
    job["spec"]["target"]["checkpoint"] |= {"everySteps": RUN_STEPS, "keep": 1}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_prometheus_scrapes_a_run_and_the_operator(kube: KubeAPI, tmp_path: Path) -> None:
    queries = dashboard_queries()
    must = [(title, q) for title, q in queries if not metric_names(q) & HEALTHY_EMPTY]
    assert len(queries) - len(must) == len(HEALTHY_EMPTY)    # one panel query each
    rules = tmp_path / "rules.yaml"
    alerts = alert_names(write_rules(rules))

    # the operator, reconciling a job of its own (pods stay Pending: no kubelet) so that its
    # reconcile, API-call and phase series exist
    operator_port = free_port()
    env = start_env(kube, tmp_path, metrics_port=operator_port)
    run_dir, run_log = tmp_path / "run", tmp_path / "run.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        env.create(env.manifest("watched"))
        with open(run_log, "w") as out:
            proc = subprocess.Popen([*SPECTRAIN, "run", str(short_demo(tmp_path)), "--run-dir", str(run_dir), "-q"],
                                    cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                    stderr=subprocess.STDOUT)
        wait_for(lambda: (run_dir / "layout.json").exists() or proc.poll() is not None, 60, interval=0.1,
                 what="the run's layout.json")
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(run_dir, operator_port, rules), sort_keys=False))
        with prometheus(config, tmp_path / "prometheus-data", tmp_path / "prometheus.log") as prom:
            empty: list[tuple[str, str]] = []

            def all_answer() -> bool:
                nonlocal empty
                env.operator.check_alive()
                assert proc.poll() is None, f"the run ended before every panel had data: {empty}\n" \
                                            f"{run_log.read_text()[-3000:]}"
                empty = [(title, q) for title, q in must if not prom.query(q)]
                return not empty

            wait_for(all_answer, 120, interval=0.5, what="series for every dashboard panel query")

            # the labels the dashboard's variables and the alerts group by, on every job series
            for metric in ("spectrain_target_step", "spectrain_drafter_state"):
                series = prom.api("series", **{"match[]": metric})
                assert series and all({"namespace", "job_name", "pod", "rank"} <= set(s) for s in series), series
                assert {s["job_name"] for s in series} == {"demo"}
                assert {s["pod"] for s in series} == {"demo-0", "demo-1"}
            # each relabelled scrape job picked its own role's ports, no port twice
            up = prom.query("up")
            assert all(u["value"][1] == "1" for u in up), up
            assert len(up) == len(pod_targets(run_dir)) + 1

            # the chart's rules, evaluated by this Prometheus: every expression parses and evaluates;
            # on a healthy run none fires. Four are not even true; HarvestLow, TargetSlowdown and
            # ExportStalled may be for a moment (a run of seconds is no half hour of low harvest or
            # hour without exports), and their `for` keeps them pending at most.
            def evaluated() -> list[dict[str, Any]]:
                got = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
                done = len(got) == len(alerts) and not any(r["lastEvaluation"].startswith(NEVER) for r in got)
                return got if done else []

            evaluated_rules = wait_for(evaluated, 30, interval=0.2, what="every rule evaluated once")
            assert {r["name"] for r in evaluated_rules} == alerts
            assert all(r["health"] == "ok" for r in evaluated_rules), [
                (r["name"], r.get("lastError")) for r in evaluated_rules if r["health"] != "ok"]
            firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
            assert not firing, firing
            for name in ("SpecTrainDrafterDegraded", "SpecTrainExchangeRejected", "SpecTrainOperatorDown",
                         "SpecTrainReconcileErrors"):
                (rule,) = [r for r in evaluated_rules if r["name"] == name]
                assert not prom.query(rule["query"]), (name, "is true on a healthy run")

            assert proc.wait(timeout=300) == 0, run_log.read_text()[-3000:]

            # Prometheus and `spectrain report` agree on the run's effective harvest: every process
            # kept its last figures up until scraped (metrics_endpoint.final), and the query counts
            # what the report counts (the coordinator's last round included). The targets are gone,
            # so the query reads each series' last sample.
            report = summarize(run_dir)["effective_harvest_fraction"]
            (series,) = prom.query(fill(dashboard.effective_harvest(lambda s: f"last_over_time({s}[10m])")))
            from_prometheus = float(series["value"][1])
            assert report and abs(from_prometheus - report) <= 0.05 * report, (from_prometheus, report)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        env.operator.stop()
