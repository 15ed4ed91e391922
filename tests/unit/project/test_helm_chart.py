"""The operator chart: strict lint, rendering with default and non-default values, every rendered
manifest validated against the Kubernetes 1.34 schemas, values.yaml documented key by key, and
the CRDs in the chart byte-identical to the top-level crds/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "spectrain-operator"
KUBE_VERSION = "1.34"
RELEASE, NAMESPACE = "spectrain", "spectrain-system"
# CRDs the chart owns itself; everything else in crds/ is a copy of the top-level crds/.
CHART_OWNED_CRDS: set[str] = set()
# Prometheus Operator kinds beside the ServiceMonitor the chart may render (opt-in).
MONITORING_CRD_KINDS = {"PodMonitor", "PrometheusRule"}

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},   # a namespaced install watching the release namespace
    "cluster-wide": {"clusterWide": True},
    "ha": {"replicaCount": 2, "leaderElection": {"leaseDurationSeconds": 10}, "api": {"qps": 50, "burst": 80}},
    "namespaced-ha": {"replicaCount": 3, "watchNamespaces": ["team-a", "team-b"]},
    "everything": {
        "replicaCount": 2,
        "clusterWide": True,
        "image": {"repository": "registry.internal/spectrain/operator",
                  "digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "fullnameOverride": "stj-op",
        "serviceAccount": {"name": "stj-sa", "annotations": {"iam.example.org/role": "x"}},
        "features": {"dra": True, "gangProviders": ["SchedulerPlugins", "Volcano"], "kueue": True},
        "logging": {"format": "plain", "level": "debug"},
        "metrics": {"port": 9102, "service": {"port": 8443, "annotations": {"prometheus.io/scrape": "true"}},
                    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "extraEnv": [{"name": "FOO", "value": "bar"}],
        "podAnnotations": {"a": "b"}, "podLabels": {"team": "ml"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "minimal": {"metrics": {"enabled": False}, "leaderElection": {"enabled": False}, "logging": {"level": "verbose"}},
    "no-network-policy": {"networkPolicy": {"enabled": False}},
    "monitoring": {
        "metrics": {"serviceMonitor": {"enabled": True}},
        "jobMetrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "alerts": {"enabled": True, "labels": {"release": "prom"},
                   "runbookBaseUrl": "https://git.example.com/platform/spectrain/blob/main/docs/operations.md"},
        "dashboards": {"enabled": True},
    },
    "monitoring-custom": {
        "fullnameOverride": "stj-op",
        "metrics": {"enabled": False},
        "jobMetrics": {"podMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "5s",
                                      "namespaceSelector": {"matchNames": ["team-a"]}}},
        "alerts": {"enabled": True, "harvestLow": {"threshold": 0.5, "for": "1h", "severity": "info"},
                   "targetSlowdown": {"factor": 1.1, "baselineRange": "7d", "for": "1h", "severity": "warning"}},
        "dashboards": {"enabled": True, "namespace": "monitoring", "label": {"key": "dash", "value": "yes"},
                       "annotations": {"grafana_folder": "SpecTrain"}},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in out.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return out[f"{CHART.name}/templates/NOTES.txt"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def aggregated(role: dict[str, Any]) -> bool:
    """A ClusterRole that adds SpecTrainJobs to the default admin/edit/view roles (not the operator's)."""
    return any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in role["metadata"].get("labels", {}))


def operator_roles(docs: list[dict[str, Any]], kind: str = "ClusterRole") -> list[dict[str, Any]]:
    return [r for r in by_kind(docs, kind) if not aggregated(r)]


def operator_cluster_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = operator_roles(docs)
    return role


def leader_election(role: dict[str, Any]) -> bool:
    return bool(role["metadata"]["name"].endswith("-leader-election"))


def operator_namespaced_roles(docs: list[dict[str, Any]], kind: str = "Role") -> list[dict[str, Any]]:
    """The operator's Roles (RoleBindings) in the watched namespaces, not the leader-election one."""
    return [r for r in by_kind(docs, kind) if not leader_election(r)]


def operator_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's rules: its ClusterRole's (clusterWide) or its Roles' (the same in each namespace)."""
    roles = operator_roles(docs) or operator_namespaced_roles(docs)
    assert roles and all(r["rules"] == roles[0]["rules"] for r in roles)
    return list(roles[0]["rules"])


def chart_crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    schemas = {}
    for f in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(f.read_text()):
            for v in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = v["schema"]["openAPIV3Schema"]
    return schemas


# ------------------------------------------------------------------------------------ lint
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_strict_is_clean(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 1] == [], report


def test_lint_reports_a_broken_template(tmp_path: Path) -> None:
    """The lint gate can fail: a copy of the chart with an unknown helper is an error."""
    import shutil

    broken = tmp_path / CHART.name
    shutil.copytree(CHART, broken)
    (broken / "templates" / "broken.yaml").write_text('{{ include "no-such-helper" . }}\n')
    report = helm.lint(broken, strict=True)
    assert report["errors"], report


def test_chart_declares_kube_version() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    from spectrain_operator.kube import MIN_SERVER_VERSION

    # the operator refuses older servers at start: the chart says the same
    assert meta["kubeVersion"] == ">={}.{}.0-0".format(*MIN_SERVER_VERSION) == ">=1.29.0-0"
    assert meta["apiVersion"] == "v2"


# ------------------------------------------------------------------------------------ render + validate
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_manifest_validates(variant: str) -> None:
    docs = render(VARIANTS[variant])
    assert docs
    crd_schemas = chart_crd_schemas()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in crd_schemas:
            jsonschema.validate(doc, crd_schemas[key])
        elif doc["kind"] == "ServiceMonitor":
            _check_service_monitor(doc, docs)
        elif doc["kind"] in MONITORING_CRD_KINDS:
            # no schema for monitoring.coreos.com offline: tests/unit/project/test_monitoring.py checks them
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["metadata"]["namespace"] == NAMESPACE
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _check_service_monitor(sm: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """No schema for monitoring.coreos.com offline: check it selects the metrics Service and port."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = one(docs, "Service")
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}


@pytest.mark.parametrize("crd_file", sorted(p.name for p in (CHART / "crds").glob("*.yaml")))
def test_crds_validate(crd_file: str) -> None:
    docs = [d for d in yaml.safe_load_all((CHART / "crds" / crd_file).read_text()) if d]
    assert docs
    for d in docs:
        kubernetes_validate.validate(d, KUBE_VERSION, strict=True)


def test_validation_catches_a_bad_manifest() -> None:
    """The schema check can fail: a typo'd field of a rendered Deployment is rejected."""
    dep = one(render({}), "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSION, strict=True)


# ------------------------------------------------------------------------------------ what renders
def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_default_deployment_is_hardened() -> None:
    docs = render({})
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = _container(docs)
    assert c["command"] == ["python", "-m", "spectrain_operator"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    assert set(c["resources"]["limits"]) == {"cpu", "memory"}
    # The kubelet probes exactly what kopf serves.
    liveness = [a for a in c["args"] if a.startswith("--liveness=")]
    assert liveness == ["--liveness=http://0.0.0.0:8080/healthz"]
    probe = c["livenessProbe"]["httpGet"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}[probe["port"]]
    assert (port, probe["path"]) == (8080, "/healthz")
    assert "--standalone" in c["args"]
    assert "--log-format=json" in c["args"] and "--metrics-port=9090" in c["args"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert not by_kind(docs, "PodDisruptionBudget")
    assert not [r for r in by_kind(docs, "Role") if leader_election(r)]   # no Lease with one replica
    # monitoring objects (ServiceMonitor, PodMonitor, PrometheusRule, dashboard ConfigMap) are opt-in;
    # the ClusterRoles are the aggregate-to-edit/view ones (test_spectrainjobs_join_the_default_user_roles);
    # the admission policy keeps the job pods to their reports (test_the_status_policy_guards_...)
    assert {d["kind"] for d in docs} == {"Deployment", "ServiceAccount", "ClusterRole", "Role", "RoleBinding",
                                         "Service", "NetworkPolicy", "ValidatingAdmissionPolicy",
                                         "ValidatingAdmissionPolicyBinding"}
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == sa


def test_default_install_is_namespaced_to_the_release_namespace() -> None:
    """The default watches the release namespace only: a Role + RoleBinding there, the operator
    started with --namespace=<release namespace>, and none of its rules cluster-wide."""
    docs = render({})
    assert not operator_roles(docs) and not by_kind(docs, "ClusterRoleBinding")
    (role,) = by_kind(docs, "Role")
    (binding,) = by_kind(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    # the same rules a cluster-wide install grants in every namespace
    assert role["rules"] == operator_cluster_role(render(VARIANTS["cluster-wide"]))["rules"]
    args = _container(docs)["args"]
    assert [a for a in args if a.startswith(("--namespace", "--all-namespaces"))] == [f"--namespace={NAMESPACE}"]
    assert f"Watching: namespace {NAMESPACE} only" in notes({})


def test_cluster_wide_is_an_opt_in() -> None:
    """clusterWide: true renders the ClusterRole + ClusterRoleBinding and watches every namespace."""
    docs = render(VARIANTS["cluster-wide"])
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    crb = one(docs, "ClusterRoleBinding")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    assert crb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                              "name": operator_cluster_role(docs)["metadata"]["name"]}
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    args = _container(docs)["args"]
    assert "--all-namespaces" in args and not [a for a in args if a.startswith("--namespace")]
    assert "Watching: all namespaces" in notes(VARIANTS["cluster-wide"])


@pytest.mark.parametrize("values", [
    {"clusterWide": True, "watchNamespaces": ["team-a", "team-b"]},
    {"clusterWide": True, "watchNamespaces": ["team-a"], "rbac": {"create": False}},   # the Deployment fails too
])
def test_cluster_wide_and_watch_namespaces_exclude_each_other(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    message = str(err.value)
    assert "clusterWide: true and watchNamespaces: [team-a" in message
    assert "Set clusterWide=false" in message and "watchNamespaces=[]" in message


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_operator_cli_accepts_the_rendered_args(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Deployment's args and env are what `python -m spectrain_operator` parses."""
    from spectrain_operator.__main__ import parse_args

    c = _container(render(VARIANTS[variant]))
    fields = {"metadata.namespace": NAMESPACE, "metadata.name": "op-0"}   # what the kubelet resolves
    for e in c.get("env", []):
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            monkeypatch.setenv(e["name"], fields[e["valueFrom"]["fieldRef"]["fieldPath"]])
    args = parse_args(c["args"])
    assert args.liveness.endswith("/healthz")
    values = VARIANTS[variant]
    if "--leader-elect" in c["args"]:
        assert args.leader_elect and args.lease_name == "spectrain-operator"
        assert args.lease_namespace == NAMESPACE
        assert args.lease_duration == values.get("leaderElection", {}).get("leaseDurationSeconds", 15)
    else:
        assert args.standalone
    assert (args.qps, args.burst) == (values.get("api", {}).get("qps", 200), values.get("api", {}).get("burst", 400))
    assert args.log_format in ("json", "plain")
    if values.get("clusterWide"):
        assert args.all_namespaces and args.namespace == []
    else:
        assert args.namespace == (values.get("watchNamespaces") or [NAMESPACE]) and not args.all_namespaces


def test_lease_identities_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    from spectrain_operator.__main__ import identity

    monkeypatch.setenv("POD_ID", "op-0")
    ids = {identity() for _ in range(20)}
    assert len(ids) == 20 and all(i.startswith("op-0_") for i in ids)


def test_ha_renders_pdb_lease_role_and_rules() -> None:
    docs = render(VARIANTS["ha"])
    c = _container(docs)
    assert one(docs, "Deployment")["spec"]["replicas"] == 2
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert "--leader-elect" in c["args"] and "--standalone" not in c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SPECTRAIN_LEASE_NAME"] == "spectrain-operator" and env["SPECTRAIN_LEASE_DURATION"] == "10"
    assert (env["SPECTRAIN_API_QPS"], env["SPECTRAIN_API_BURST"]) == ("50", "80")
    assert "POD_ID" in env and "SPECTRAIN_OPERATOR_NAMESPACE" in env
    (role,) = [r for r in by_kind(docs, "Role") if leader_election(r)]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["spectrain-operator"],
         "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if leader_election(b)]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # the operator's own Role (the release namespace, the default) has no Lease rule, and neither
    # has the ClusterRole of a cluster-wide HA install
    assert not any("leases" in r["resources"] for r in operator_rules(docs))
    assert not any("leases" in r["resources"]
                   for r in operator_rules(render({**VARIANTS["ha"], "clusterWide": True})))
    anti = one(docs, "Deployment")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"]


def test_watch_selected_namespaces_has_no_cluster_scope() -> None:
    docs = render(VARIANTS["namespaced-ha"])
    assert not operator_roles(docs) and not by_kind(docs, "ClusterRoleBinding")
    roles = by_kind(docs, "Role")
    # a Role per watched namespace, and the leader-election Role in the release namespace
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["spectrain-system", "team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "RoleBinding")) == \
        ["spectrain-system", "team-a", "team-b"]
    for r in roles:
        leases = [rule for rule in r["rules"] if "leases" in rule["resources"]]
        assert bool(leases) == (r["metadata"]["namespace"] == "spectrain-system")
    args = _container(docs)["args"]
    assert [a for a in args if a.startswith(("--namespace", "--all-namespaces"))] == \
        ["--namespace=team-a", "--namespace=team-b"]   # exactly these: the release namespace is not added
    assert "Watching: namespaces team-a, team-b" in notes(VARIANTS["namespaced-ha"])


def test_features_add_only_their_rules() -> None:
    def groups(values: dict[str, Any]) -> set[str]:
        return {g for r in operator_rules(render(values)) for g in r["apiGroups"]}

    base = groups({})
    assert base == {"spectrain.io", "", "rbac.authorization.k8s.io", "networking.k8s.io"}
    assert groups({"features": {"dra": True}}) - base == {"resource.k8s.io"}
    assert groups({"features": {"gangProviders": ["Volcano"]}}) - base == {"scheduling.volcano.sh"}
    assert groups({"features": {"gangProviders": ["SchedulerPlugins"]}}) - base == {"scheduling.x-k8s.io"}

    def verbs(values: dict[str, Any], resource: str) -> set[str]:
        return {v for r in operator_rules(render(values)) if resource in r["resources"] for v in r["verbs"]}

    # The operator changes no pod: `patch` on pods only for Kueue's pod groups (features.kueue).
    assert verbs({}, "pods") == {"create", "list", "watch", "delete"}
    assert verbs({"features": {"kueue": True}}, "pods") - verbs({}, "pods") == {"patch"}


def test_no_wildcards_in_rbac() -> None:
    for variant in VARIANTS.values():
        for role in by_kind(render(variant), "ClusterRole") + by_kind(render(variant), "Role"):
            for rule in role["rules"]:
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule


@pytest.mark.parametrize(("image", "expected"), [
    ({}, "example.org/spectrain/operator:0.1.0"),   # the chart's appVersion as the tag
    ({"tag": "0.1.1"}, "example.org/spectrain/operator:0.1.1"),
    # A digest pins the exact image; it wins over a tag set beside it (a tag can be re-pushed).
    ({"repository": "registry.internal/spectrain/operator", "tag": "0.1.1", "digest": "sha256:" + "0f" * 32},
     "registry.internal/spectrain/operator@sha256:" + "0f" * 32),
])
def test_image_reference_by_tag_or_digest(image: dict[str, str], expected: str) -> None:
    assert _container(render({"image": image}))["image"] == expected


def test_everything_variant_applies_overrides() -> None:
    docs = render(VARIANTS["everything"])
    c = _container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert c["image"] == "registry.internal/spectrain/operator@sha256:" + "ab" * 32
    assert pod["serviceAccountName"] == "stj-sa" == one(docs, "ServiceAccount")["metadata"]["name"]
    assert one(docs, "Deployment")["metadata"]["name"] == "stj-op"
    assert {"name": "metrics", "containerPort": 9102, "protocol": "TCP"} in c["ports"]
    assert "--metrics-port=9102" in c["args"]
    assert one(docs, "Service")["spec"]["ports"][0]["port"] == 8443
    assert one(docs, "ServiceMonitor")["metadata"]["labels"]["release"] == "prom"
    assert "--debug" in c["args"] and "--log-format=plain" in c["args"]
    assert {"name": "FOO", "value": "bar"} in c["env"]
    assert pod["tolerations"][0]["key"] == "dedicated"


def _policy_ports(policy: dict[str, Any]) -> dict[int, list[dict[str, Any]] | None]:
    """port -> the peers allowed on it (None: any source)."""
    out: dict[int, list[dict[str, Any]] | None] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            out[port["port"]] = rule.get("from")
    return out


def test_operator_network_policy_opens_only_its_two_ports() -> None:
    docs = render({})
    policy = one(docs, "NetworkPolicy")
    pod = one(docs, "Deployment")["spec"]["template"]
    # It selects exactly the operator's pods...
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["podSelector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # ...and opens exactly the ports its container serves: metrics from every namespace, health from anywhere.
    served = {p["containerPort"] for p in _container(docs)["ports"]}
    assert _policy_ports(policy) == {9090: [{"namespaceSelector": {}}], 8080: None}
    assert set(_policy_ports(policy)) == served
    # Overrides: other ports follow the values, narrowed peers are rendered as given.
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    nodes = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    docs = render({"metrics": {"port": 9102}, "liveness": {"port": 8081},
                   "networkPolicy": {"metricsFrom": monitoring, "healthFrom": nodes}})
    assert _policy_ports(one(docs, "NetworkPolicy")) == {9102: monitoring, 8081: nodes}
    # No metrics: no metrics port; turned off: no policy.
    assert _policy_ports(one(render(VARIANTS["minimal"]), "NetworkPolicy")) == {8080: None}
    assert not by_kind(render(VARIANTS["no-network-policy"]), "NetworkPolicy")


def test_operator_may_create_network_policies_and_nothing_more_on_them() -> None:
    """create, and get for the owner check on a 409 (kube.Kube.create): no update, patch or delete."""
    for variant in ("default", "cluster-wide", "namespaced-ha"):
        for role in operator_roles(render(VARIANTS[variant])) + by_kind(render(VARIANTS[variant]), "Role"):
            if role["metadata"]["name"].endswith("-leader-election"):
                continue
            rules = [r for r in role["rules"] if "networking.k8s.io" in r["apiGroups"]]
            assert rules == [{"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                              "verbs": ["create", "get"]}], role["metadata"]


def test_minimal_variant_has_no_metrics_objects() -> None:
    docs = render(VARIANTS["minimal"])
    assert not by_kind(docs, "Service") and not by_kind(docs, "ServiceMonitor")
    c = _container(docs)
    assert "--verbose" in c["args"]
    assert "--metrics-port=0" in c["args"]
    assert [p["name"] for p in c["ports"]] == ["healthz"]


def test_notes_mention_the_essentials() -> None:
    text = notes(VARIANTS["ha"])
    assert "spectrain-spectrain-operator" in text and "leader Lease" in text and "crds/" in text


@pytest.mark.parametrize("bad", [
    {"replicaCount": 0},
    {"replicaCount": "two"},
    {"unknownKey": 1},
    {"features": {"gangProviders": ["Kueue"]}},
    {"watchNamespaces": ["Not_A_Namespace"]},
    {"clusterWide": "yes"},
    {"logging": {"format": "xml"}},
    {"podSecurityContext": {"runAsNonRoot": False}},
    {"image": {"digest": "latest"}},
    {"networkPolicy": {"enabled": "yes"}},
    {"networkPolicy": {"metricsFrom": [{"namespaceSelectorr": {}}]}},
    {"features": {"kueue": "yes"}},
    {"statusPolicy": {"enabled": "yes"}},
    {"statusPolicy": {"enable": True}},
])
def test_values_schema_rejects(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        render(bad)


# ------------------------------------------------------------------------------------ values.yaml docs
KEY_RE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_.-]+):(?:\s|$)")


def undocumented_keys(text: str) -> list[str]:
    """Keys of a values.yaml with no `# --` comment on the line(s) right above them."""
    lines = text.splitlines()
    missing, stack = [], []
    for n, line in enumerate(lines):
        m = KEY_RE.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, m["key"])]
        j = n - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1  # continuation lines of a multi-line comment
        if j < 0 or not lines[j].strip().startswith("# --") or len(lines[j]) - len(lines[j].lstrip()) != indent:
            missing.append(".".join(k for _, k in stack))
    return missing


def test_every_values_key_has_a_comment() -> None:
    text = (CHART / "values.yaml").read_text()
    assert undocumented_keys(text) == []
    # ...and the check sees every key there is.
    def count(node: Any) -> int:
        return sum(1 + count(v) for v in node.values()) if isinstance(node, dict) else 0

    assert len([ln for ln in text.splitlines() if KEY_RE.match(ln)]) == count(yaml.safe_load(text))


def test_comment_check_catches_an_undocumented_key() -> None:
    text = "# -- documented\na: 1\nb:\n  # -- nested ok\n  c: 2\n  d: 3\n"
    assert undocumented_keys(text) == ["b", "b.d"]


def test_values_schema_covers_every_top_level_key() -> None:
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    jsonschema.validate(values, schema)


# ------------------------------------------------------------------------------------ CRD copies
def test_crds_in_chart_are_byte_identical_copies() -> None:
    top = sorted((ROOT / "crds").glob("*.yaml"))
    assert top, "no CRDs in crds/ (scripts/gen.py writes them)"
    for src in top:
        copy = CHART / "crds" / src.name
        assert copy.exists(), f"{copy} missing: run `python scripts/gen.py`"
        assert copy.read_bytes() == src.read_bytes(), f"{copy} differs from {src}: run `python scripts/gen.py`"
    extra = {p.name for p in (CHART / "crds").glob("*")} - {p.name for p in top}
    assert extra == CHART_OWNED_CRDS


def test_spectrainjobs_join_the_default_user_roles() -> None:
    """Whoever may edit a namespace may run SpecTrainJobs in it, whoever may view it may read them
    (aggregation to admin/edit/view, as Kubeflow Trainer and JobSet ship); off on request."""
    docs = render({})
    roles = {r["metadata"]["name"].rsplit("-", 1)[1]: r for r in by_kind(docs, "ClusterRole") if aggregated(r)}
    edit, view = roles["edit"], roles["view"]
    assert edit["metadata"]["name"] == one(docs, "Deployment")["metadata"]["name"] + "-edit"
    labels = edit["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete", "patch", "update"} <= set(edit["rules"][0]["verbs"])
    assert edit["rules"][1] == {"apiGroups": ["spectrain.io"], "resources": ["spectrainjobs/status"], "verbs": ["get"]}
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in view["rules"])
    # SpecTrainJobs only: no pods, secrets or anything the operator creates for a job
    assert {res for r in edit["rules"] + view["rules"] for res in r["resources"]} == {"spectrainjobs", "spectrainjobs/status"}
    assert not [r for r in by_kind(render({"rbac": {"aggregateToDefaultRoles": False}}), "ClusterRole") if aggregated(r)]


def test_the_status_policy_guards_every_status_field_but_the_reports() -> None:
    """The pods may write status.reports only: one validation per other field of the CRD's status
    (generated from it, so a new field is guarded too), matched to the job's own ServiceAccount."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import crd_def

    (policy,) = by_kind(render({}), "ValidatingAdmissionPolicy")
    (binding,) = by_kind(render({}), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["spectrainjobs/status"]
    guarded = [re.match(r"status\.(\w+) is the operator's", v["message"]).group(1)  # type: ignore[union-attr]
               for v in policy["spec"]["validations"]]
    assert guarded == [f for f in crd_def.status_schema()["properties"] if f != "reports"]
    assert "+ '-status'" in policy["spec"]["matchConditions"][0]["expression"]
    assert not by_kind(render({"statusPolicy": {"enabled": False}}), "ValidatingAdmissionPolicy")
