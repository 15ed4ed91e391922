"""The operator under exactly the chart's RBAC, against a real kube-apiserver.

- `test_default_install_watches_only_the_release_namespace`: the chart's default (a namespaced
  install): a Role + RoleBinding in the release namespace, nothing cluster-wide; the operator runs
  every scenario there, leaves a job in another namespace alone and is never denied a request.
- `test_operator_does_its_job_under_the_rendered_role`: a cluster-wide install (`clusterWide: true`):
  the rendered ServiceAccount, ClusterRole and ClusterRoleBinding are applied as-is; the operator
  runs as that ServiceAccount (a TokenRequest token) with the Deployment's args and env, and every
  scenario passes, in a namespace of its own, with no request denied.
- `test_every_rule_is_needed`: minimality. For each (rule, resource, verb) of the rendered
  ClusterRole (the same rules as the default's Role), that one permission is removed and a fresh
  operator process runs the scenarios:
  some scenario must fail. A scenario fails when an expected outcome does not appear before its
  deadline, or as soon as the apiserver's audit log shows a request of the operator answered 403.
- `test_failover`: two replicas with leader election (rendered with replicaCount 2, clusterWide): exactly one holds
  the coordination.k8s.io Lease and acts, the other does nothing; the leader is SIGKILLed and the
  follower takes the Lease over within the lease duration (plus one retry period) and reconciles.

The tests play the kubelet (there is none): they patch pods/status with container exit codes.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from spectrain_api.names import GROUP, KIND, PLURAL, VERSION
from spectrain_workloads import podstatus
from tests.integration.kubeapi import KubeAPI
from tests.integration.operator_proc import OperatorProcess
from tests.integration.statuspath import as_pod
from tests.unit.project.test_helm_chart import aggregated

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "spectrain-operator"
RELEASE, OP_NS = "spectrain", "spectrain-system"

STEP_TIMEOUT = 20.0  # per expected outcome; a healthy operator needs well under a second


def render(values: dict[str, Any], release: str = RELEASE) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=release, namespace=OP_NS)
    return [d for path, text in out.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def operator_namespaced_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's Roles in its watched namespaces (not the leader-election Role)."""
    return [d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-leader-election")]


def job_body(ns: str, name: str, finalizers: list[str] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": ns, **({"finalizers": finalizers} if finalizers else {})},
        "spec": {"target": {"image": "example.org/spectrain/workloads:0.1.0", "nodes": 1,
                            "procsPerNode": 1, "parallelism": {"data": 1, "pipeline": 1}},
                 "runPolicy": {"maxRestarts": 2, "backoffSeconds": 0}}}
    for key, value in spec.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return body


def chart_crds() -> list[dict[str, Any]]:
    return [c for f in sorted((CHART / "crds").glob("*.yaml")) for c in yaml.safe_load_all(f.read_text()) if c]


# ------------------------------------------------------------------------------------ environment
class Env:
    """The cluster side of an install: CRDs, the operator namespace, rendered RBAC objects."""

    def __init__(self, kube: KubeAPI, tmp: Path, values: dict[str, Any], release: str = RELEASE) -> None:
        self.kube, self.tmp = kube, tmp
        self.docs = render(values, release)
        self.dep = one(self.docs, "Deployment")
        roles = [d for d in self.docs if d["kind"] == "ClusterRole" and not aggregated(d)]
        self.role = roles[0] if roles else {}
        lease_roles = [d for d in self.docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")]
        self.lease_role = lease_roles[0] if lease_roles else {}
        env = {e["name"]: e.get("value") for e in self.dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        self.lease = env.get("SPECTRAIN_LEASE_NAME")
        self.lease_duration = float(env.get("SPECTRAIN_LEASE_DURATION") or 0)
        self.coordination = client.CoordinationV1Api(kube.api_client())
        sa = one(self.docs, "ServiceAccount")["metadata"]["name"]
        self.user = f"system:serviceaccount:{OP_NS}:{sa}"
        self.core = client.CoreV1Api(kube.api_client())
        self.custom = client.CustomObjectsApi(kube.api_client())
        self.authz = client.AuthorizationV1Api(kube.api_client())
        for crd in chart_crds():
            if kube.get(crd["apiVersion"], crd["kind"], crd["metadata"]["name"]) is None:
                kube.apply(crd)
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OP_NS}})
        for ns in sorted({d["metadata"]["namespace"] for d in self.docs if d["kind"] in ("Role", "RoleBinding")}):
            kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        # Everything the chart renders that the 1.20 apiserver knows (not the Deployment: no kubelet).
        for d in self.docs:
            if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
                kube.apply(d)
        self.kubeconfig = kube.kubeconfig_for_service_account(OP_NS, sa)
        self._n = itertools.count()

    def reset_lease(self) -> None:
        """Delete the leader Lease (test hygiene between operator runs, never during a failover): a
        killed holder's Lease would otherwise make the next run wait out its duration."""
        if self.lease:
            try:
                self.coordination.delete_namespaced_lease(self.lease, OP_NS)
            except ApiException as e:
                if e.status != 404:
                    raise

    def lease_spec(self) -> dict[str, Any]:
        try:
            lease = self.coordination.read_namespaced_lease(self.lease, OP_NS)
        except ApiException as e:
            if e.status == 404:
                return {}
            raise
        return dict(client.ApiClient().sanitize_for_serialization(lease.spec) or {})

    def set_rules(self, rules: list[dict[str, Any]]) -> None:
        body = copy.deepcopy(self.role)
        body["rules"] = rules
        rbac = client.RbacAuthorizationV1Api(self.kube.api_client())
        rbac.replace_cluster_role(body["metadata"]["name"], body)

    def set_lease_rules(self, rules: list[dict[str, Any]]) -> None:
        body = copy.deepcopy(self.lease_role)
        body["rules"] = rules
        rbac = client.RbacAuthorizationV1Api(self.kube.api_client())
        rbac.replace_namespaced_role(body["metadata"]["name"], OP_NS, body)

    def allowed(self, verb: str, group: str, resource: str, namespace: str = "default",
                subresource: str = "", name: str = "") -> bool:
        review = self.authz.create_subject_access_review({"spec": {"user": self.user, "groups": [
            "system:serviceaccounts", f"system:serviceaccounts:{OP_NS}", "system:authenticated"],
            "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "name": name,
                                   "subresource": subresource, "namespace": namespace}}})
        return bool(review.status.allowed)

    def operator(self, name: str | None = None, overrides: dict[str, str] | None = None) -> OperatorProcess:
        pod = name or f"op-{next(self._n)}"
        return OperatorProcess(self.dep, self.kubeconfig, self.tmp / f"{pod}.log", pod_name=pod,
                               namespace=OP_NS, overrides=overrides)

    def namespace(self, prefix: str) -> str:
        ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        return ns

    def cleanup_namespace(self, ns: str) -> None:
        """Remove the jobs of a scenario namespace without an operator (they carry no finalizer)."""
        for job in self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
            name = job["metadata"]["name"]
            try:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
            except ApiException as e:
                if e.status != 404:
                    raise
        for pod in self.core.list_namespaced_pod(ns).items:
            try:
                self.core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
            except ApiException as e:
                if e.status != 404:  # already collected with its job
                    raise


# The scenarios of the cluster-wide installs run in namespaces of their own: `clusterWide` opted in.
CLUSTER_VALUES: dict[str, Any] = {"clusterWide": True}
HA_VALUES = {"replicaCount": 2, "leaderElection": {"leaseDurationSeconds": 8}, "clusterWide": True}


@pytest.fixture(name="kube", scope="module")
def own_kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """An apiserver of this module's own: the cluster-wide installs list and reconcile every
    SpecTrainJob in the cluster, and each minimality run starts a fresh operator, so the jobs other
    modules leave behind would be reconciled again by each of them."""
    api = KubeAPI(tmp_path_factory.mktemp("rbac-kube")).start()
    try:
        yield api
    finally:
        api.cleanup()


@pytest.fixture(scope="module")
def envs(kube: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Env]:
    """Three installs side by side, each with its own ServiceAccount: the default (namespaced to the
    release namespace, one replica), cluster-wide (one replica) and cluster-wide HA (Lease rules too)."""
    out = {"default": Env(kube, tmp_path_factory.mktemp("rbac-default"), {}),
           "cluster": Env(kube, tmp_path_factory.mktemp("rbac-cluster"), CLUSTER_VALUES, release="spectrain-cw"),
           "ha": Env(kube, tmp_path_factory.mktemp("rbac-ha"), HA_VALUES, release="spectrain-ha")}
    kube.start_controller_manager()  # after the CRDs are established: GC of job children
    return out


# ------------------------------------------------------------------------------------ scenario steps
class ScenarioFailed(AssertionError):
    pass


class Run:
    """One operator process running scenarios; every wait also watches for denials and crashes."""

    def __init__(self, env: Env, op: OperatorProcess, ns: str) -> None:
        self.env, self.op, self.ns = env, op, ns
        self.since = env.kube.audit_offset()

    def denied(self) -> list[str]:
        return self.env.kube.denials(self.since, self.env.user)

    def expect(self, cond: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if denied := self.denied():
                raise ScenarioFailed(f"{what}: the operator was denied: {denied}")
            if not self.op.alive:
                raise ScenarioFailed(f"{what}: operator exited:\n{self.op.log_tail()}")
            value = cond()
            if value:
                return value
            if time.monotonic() > deadline:
                raise ScenarioFailed(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)

    # --- API helpers (admin)
    def job(self, name: str) -> dict[str, Any] | None:
        try:
            return self.env.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create_job(self, name: str, finalizers: list[str] | None = None, **spec: Any) -> None:
        body = job_body(self.ns, name, finalizers, **spec)
        self.env.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def phase(self, name: str) -> str | None:
        return ((self.job(name) or {}).get("status") or {}).get("phase")

    def pods(self, name: str) -> list[Any]:
        return [p for p in self.env.core.list_namespaced_pod(
            self.ns, label_selector=f"spectrain.io/job-name={name}").items if not p.metadata.deletion_timestamp]

    def exists(self, kind: str, name: str) -> bool:
        read = {"ConfigMap": self.env.core.read_namespaced_config_map,
                "Secret": self.env.core.read_namespaced_secret,
                "Service": self.env.core.read_namespaced_service,
                "ServiceAccount": self.env.core.read_namespaced_service_account,
                "Role": client.RbacAuthorizationV1Api(self.env.kube.api_client()).read_namespaced_role,
                "RoleBinding": client.RbacAuthorizationV1Api(self.env.kube.api_client()).read_namespaced_role_binding}
        try:
            read[kind](name, self.ns)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def events_for(self, name: str) -> list[Any]:
        return self.env.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name},involvedObject.kind=SpecTrainJob").items

    def kubelet(self, pod: Any, phase: str, exit_code: int | None = None) -> None:
        """Play the kubelet: report the target container running, or terminated with `exit_code`."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        state = ({"running": {"startedAt": now}} if exit_code is None else
                 {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                 "startedAt": now, "finishedAt": now}})
        status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if exit_code is None else "False"}],
                  "containerStatuses": [{"name": "target", "ready": exit_code is None, "restartCount": 0,
                                         "image": "example.org/spectrain/workloads:0.1.0", "imageID": "",
                                         "state": state}]}
        self.env.core.patch_namespaced_pod_status(pod.metadata.name, self.ns, {"status": status})


def scenario_lifecycle(r: Run) -> None:
    """Create -> children + pod + status + Event; Running; the pod's progress report (the status path,
    as the pod's ServiceAccount) -> status.progress; target exit 1 -> restart (pod deleted and
    recreated, with the fleet identity Secret of the new restart generation, the old one's deleted);
    exit 0 -> Succeeded; ttlSecondsAfterFinished 0 -> the job is deleted."""
    name = "life"
    # two ranks in the one pod: its drafters form a fleet, so each generation gets its identity
    r.create_job(name, runPolicy={"ttlSecondsAfterFinished": 0},
                 target={"procsPerNode": 2, "parallelism": {"data": 2, "pipeline": 1}})
    pods = r.expect(lambda: r.pods(name), "the job's pod")
    for kind, child in (("ConfigMap", f"{name}-config"), ("Service", name), ("ServiceAccount", f"{name}-status"),
                        ("Role", f"{name}-status"), ("RoleBinding", f"{name}-status")):
        r.expect(lambda kind=kind, child=child: r.exists(kind, child), f"{kind} {child}")
    r.expect(lambda: r.phase(name) in ("Pending", "Starting"), "status.phase Pending/Starting")
    r.expect(lambda: r.events_for(name), "an Event on the job")
    r.kubelet(pods[0], "Running")
    r.expect(lambda: r.phase(name) == "Running", "status.phase Running")
    # the status path under the Role the operator granted (it holds no `patch` on pods)
    with as_pod(r.env.kube, client.ApiClient().sanitize_for_serialization(pods[0]), r.env.tmp / f"sa-{r.ns}"):
        podstatus.report_progress({"step": 3}, flush=True)
        r.expect(lambda: ((r.job(name) or {}).get("status") or {}).get("progress", {}).get("step") == 3,
                 "status.progress from the pod's report")
    r.kubelet(pods[0], "Failed", exit_code=1)
    first_uid = pods[0].metadata.uid
    new = r.expect(lambda: [p for p in r.pods(name) if p.metadata.uid != first_uid], "the restarted pod")
    r.expect(lambda: ((r.job(name) or {}).get("status") or {}).get("restarts") == 1, "status.restarts == 1")
    r.expect(lambda: r.exists("Secret", f"{name}-fleet-id-1-0") and not r.exists("Secret", f"{name}-fleet-id-0-0"),
             "generation 1's fleet identity Secret, generation 0's deleted")
    r.kubelet(new[0], "Succeeded", exit_code=0)
    r.expect(lambda: r.job(name) is None, "Succeeded, then deleted by ttlSecondsAfterFinished 0")


def scenario_suspend(r: Run) -> None:
    """suspend: true deletes the pods and reports Suspended."""
    name = "susp"
    r.create_job(name)
    r.expect(lambda: r.pods(name), "the job's pod")
    r.env.custom.patch_namespaced_custom_object(GROUP, VERSION, r.ns, PLURAL, name, {"spec": {"suspend": True}})
    r.expect(lambda: r.phase(name) == "Suspended" and not r.pods(name), "Suspended with no pods")


def scenario_missing_claim(r: Run) -> None:
    """A checkpoint PVC that does not exist: Failed + SpecInvalid, nothing created."""
    name = "noclaim"
    r.create_job(name, target={"checkpoint": {"claimName": "no-such-claim"}})
    r.expect(lambda: r.phase(name) == "Failed", "Failed for the missing claim")
    conds = {c["type"]: c for c in r.job(name)["status"]["conditions"]}
    assert conds["SpecInvalid"]["status"] == "True" and "no-such-claim" in conds["SpecInvalid"]["message"]
    assert not r.pods(name)


def scenario_delete(r: Run) -> None:
    """Deleting a job while the operator runs: it carries no finalizer, the job goes away."""
    name = "gone"
    r.create_job(name)
    r.expect(lambda: r.pods(name), "the job's pods")
    assert not (r.job(name) or {}).get("metadata", {}).get("finalizers")
    r.env.custom.delete_namespaced_custom_object(GROUP, VERSION, r.ns, PLURAL, name)
    r.expect(lambda: r.job(name) is None, "the deleted job to disappear")


def scenario_upgrade(r: Run) -> None:
    """A job from an operator version that ran kopf timers carries kopf's finalizer; nothing needs
    it any more, so kopf removes it and the job stays deletable without an operator."""
    name = "old"
    r.create_job(name, finalizers=["kopf.zalando.org/KopfFinalizerMarker"])
    r.expect(lambda: r.pods(name), "the job's pods")
    r.expect(lambda: not (r.job(name) or {}).get("metadata", {}).get("finalizers"), "kopf's old finalizer removed")


def startup(r: Run) -> None:
    r.expect(r.op.healthy, "the operator's /healthz", timeout=30)


SCENARIOS = [scenario_lifecycle, scenario_suspend, scenario_missing_claim, scenario_delete, scenario_upgrade]


def run_scenarios(env: Env, label: str, ns: str | None = None) -> tuple[str | None, float]:
    """Run every scenario under one fresh operator (in a fresh namespace unless `ns` is given);
    return (first failure or None, seconds)."""
    ns = ns or env.namespace(f"rbac-{label}"[:50])
    env.reset_lease()
    op = env.operator().start()
    t0 = time.monotonic()
    run = Run(env, op, ns)
    try:
        for scenario in [startup, *SCENARIOS]:
            try:
                scenario(run)
            except (ScenarioFailed, AssertionError) as exc:
                return (f"{scenario.__name__}: {exc}\n--- operator log tail:\n{op.log_tail(25)}",
                        time.monotonic() - t0)
        return None, time.monotonic() - t0
    finally:
        op.stop()
        env.cleanup_namespace(ns)


def permission_atoms(rules: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    return [(i, res, verb) for i, rule in enumerate(rules) for res in rule["resources"] for verb in rule["verbs"]]


def without(rules: list[dict[str, Any]], atom: tuple[int, str, str]) -> list[dict[str, Any]]:
    """`rules` minus one verb on one resource of one rule (the rest of that rule kept)."""
    i, res, verb = atom
    out = []
    for j, rule in enumerate(copy.deepcopy(rules)):
        if j != i:
            out.append(rule)
            continue
        others = [r for r in rule["resources"] if r != res]
        if others:
            out.append({**rule, "resources": others})
        if len(rule["verbs"]) > 1:
            out.append({**rule, "resources": [res], "verbs": [v for v in rule["verbs"] if v != verb]})
    return out


def _split(resource: str) -> tuple[str, str]:
    res, _, sub = resource.partition("/")
    return res, sub


# ------------------------------------------------------------------------------------ tests
def test_chart_crds_apply(kube: KubeAPI, tmp_path: Path) -> None:
    """The chart's CRDs as shipped are accepted by a real apiserver
    and become Established; applied under a temporary group so the shared CRDs stay untouched."""
    for crd in chart_crds():
        group = crd["spec"]["group"]
        test_group = f"crdcheck-{uuid.uuid4().hex[:6]}.{group}"
        crd["spec"]["group"] = test_group
        crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{test_group}"
        kube.apply(crd)  # waits for Established
def test_default_install_watches_only_the_release_namespace(envs: dict[str, Env]) -> None:
    """The chart's default: the operator's rules in a Role + RoleBinding in the release namespace and
    nothing cluster-wide; started with the rendered --namespace=<release namespace>, it reconciles
    every scenario there, never touches a job in another namespace and is never denied a request
    (it does not try to list or watch anywhere else)."""
    env = envs["default"]
    assert env.role == {} and not [d for d in env.docs if d["kind"] == "ClusterRoleBinding"]
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in env.docs if d["kind"] in ("Role", "RoleBinding")) \
        == [("Role", OP_NS), ("RoleBinding", OP_NS)]
    args = env.dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={OP_NS}" in args and "--all-namespaces" not in args
    assert env.allowed("list", GROUP, PLURAL, namespace=OP_NS)
    assert not env.allowed("list", GROUP, PLURAL, namespace="default")
    other = env.namespace("rbac-other")
    env.custom.create_namespaced_custom_object(GROUP, VERSION, other, PLURAL, job_body(other, "elsewhere"))
    since = env.kube.audit_offset()
    try:
        failure, seconds = run_scenarios(env, "default", ns=OP_NS)
        assert failure is None, failure
        # Nothing happened to the job in the other namespace: no status, no pods, no children.
        job = env.custom.get_namespaced_custom_object(GROUP, VERSION, other, PLURAL, "elsewhere")
        assert not job.get("status") and not job["metadata"].get("finalizers"), job
        assert not env.core.list_namespaced_pod(other).items
        assert not env.core.list_namespaced_service(other).items
        assert not env.core.list_namespaced_config_map(other, label_selector="spectrain.io/job-name").items
        assert not any(f"{other}/elsewhere" in log.read_text(errors="replace") for log in env.tmp.glob("*.log"))
        # ...and the operator sent no request outside its namespace, so none was denied.
        events = env.kube.audit_events(since, env.user)
        assert events, "no audit events of the operator"
        assert env.kube.denials(since, env.user) == []
        outside = {(ev.get("verb"), ev.get("requestURI")) for ev in events
                   if (ev.get("objectRef") or {}).get("resource") and (ev.get("objectRef") or {}).get("namespace") != OP_NS}
        assert outside == set(), outside
    finally:
        env.cleanup_namespace(other)
    print(f"default (namespaced) install: all scenarios passed in {OP_NS} in {seconds:.1f}s; "
          f"the job in {other} untouched, no request denied")


@pytest.mark.parametrize("install", ["cluster", "ha"])
def test_operator_does_its_job_under_the_rendered_role(envs: dict[str, Env], install: str) -> None:
    env = envs[install]
    env.set_rules(env.role["rules"])
    failure, seconds = run_scenarios(env, f"full-{install}")
    assert failure is None, failure
    print(f"{install}: all scenarios passed under the rendered ClusterRole in {seconds:.1f}s")


def test_watch_selected_namespaces_install(kube: KubeAPI, tmp_path: Path) -> None:
    """watchNamespaces: only a Role + RoleBinding in the watched namespace, nothing cluster-wide,
    and the operator (started with the rendered --namespace args) does its job there."""
    watched = f"team-{uuid.uuid4().hex[:6]}"
    env = Env(kube, tmp_path, {"watchNamespaces": [watched]}, release="spectrain-ns")
    assert env.role == {} and not [d for d in env.docs if d["kind"] == "ClusterRoleBinding"]
    assert f"--namespace={watched}" in env.dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not env.allowed("list", GROUP, PLURAL, namespace="default")
    failure, seconds = run_scenarios(env, "ns", ns=watched)
    assert failure is None, failure
    print(f"namespaced install: all scenarios passed in {seconds:.1f}s")


def test_every_rule_is_needed(envs: dict[str, Env]) -> None:
    """Minimality over the cluster-wide HA render: its ClusterRole (the rules of the default's Role
    and of the cluster-wide ClusterRole) and the leader-election Role in the release namespace (the
    Lease: create, get and update)."""
    env = envs["ha"]
    rules, lease_rules = env.role["rules"], env.lease_role["rules"]
    (default_role,) = operator_namespaced_roles(envs["default"].docs)
    for same in (default_role["rules"], envs["cluster"].role["rules"]):
        assert {json.dumps(r, sort_keys=True) for r in same} == {json.dumps(r, sort_keys=True) for r in rules}
    atoms = [("cluster", a) for a in permission_atoms(rules)] + [("lease", a) for a in permission_atoms(lease_rules)]
    assert len(atoms) >= 10
    unneeded, report = [], []
    try:
        for where, atom in atoms:
            i, res, verb = atom
            rule = (rules if where == "cluster" else lease_rules)[i]
            group = rule["apiGroups"][0]
            if where == "cluster":
                env.set_rules(without(rules, atom))
            else:
                env.set_lease_rules(without(lease_rules, atom))
            resource, sub = _split(res)
            # RBAC reads roles from an informer: wait until the removal is in force.
            name = (rule.get("resourceNames") or [""])[0]
            namespace = "default" if where == "cluster" else OP_NS
            deadline = time.monotonic() + 10
            while env.allowed(verb, group, resource, namespace=namespace, subresource=sub, name=name):
                assert time.monotonic() < deadline, f"removing {verb} {group}/{res} never took effect"
                time.sleep(0.05)
            failure, seconds = run_scenarios(env, f"{verb}-{resource}")
            report.append(f"{verb:7s} {group or 'core'}/{res}: {seconds:5.1f}s "
                          f"{(failure or 'NO SCENARIO FAILED').splitlines()[0][:140]}")
            if failure is None:
                unneeded.append(f"{verb} {group}/{res}")
            env.set_rules(rules)
            env.set_lease_rules(lease_rules)
    finally:
        env.set_rules(rules)
        env.set_lease_rules(lease_rules)
    print("\n".join(report))
    assert unneeded == [], f"rules no scenario needs (remove them, or add a scenario): {unneeded}"


def _holder(env: Env) -> str:
    """The pod name part of the Lease's holderIdentity (`<pod>_<random>`), '' when none holds it."""
    return str(env.lease_spec().get("holderIdentity") or "").rpartition("_")[0]


def test_failover(envs: dict[str, Env]) -> None:
    ha = envs["ha"]
    ha.set_rules(ha.role["rules"])
    ha.set_lease_rules(ha.lease_role["rules"])
    ha.reset_lease()
    ns = ha.namespace("failover")
    a, b = ha.operator("replica-a").start(), ha.operator("replica-b").start()
    ops = {"replica-a": a, "replica-b": b}
    try:
        a.wait_healthy(30)
        b.wait_healthy(30)
        r = Run(ha, a, ns)
        leader_name = r.expect(lambda: _holder(ha), "one replica to hold the Lease", timeout=30)
        leader, follower = ops[leader_name], ops[next(n for n in ops if n != leader_name)]
        r = Run(ha, leader, ns)
        follower_log_before = len(follower.log())
        r.create_job("before")
        r.expect(lambda: r.pods("before"), "the leader to reconcile a job")
        # the reconciler logs every transition of a job as "<namespace>/<name> <reason>: ..."
        r.expect(lambda: f"{ns}/before " in leader.log(), "the leader's log of the new job")
        assert f"{ns}/before" not in follower.log()[follower_log_before:], "the follower acted on a job"
        assert _holder(ha) == leader_name

        transitions = int(ha.lease_spec().get("leaseTransitions") or 0)
        leader.kill()
        killed_at = time.monotonic()
        r2 = Run(ha, follower, ns)
        r2.expect(lambda: _holder(ha) == follower.pod_name, "the follower to take the Lease over", timeout=30)
        handover = time.monotonic() - killed_at
        r2.create_job("after")
        r2.expect(lambda: r2.pods("after") and r2.phase("after"), "the new leader to reconcile", timeout=30)
        took = time.monotonic() - killed_at
        spec = ha.lease_spec()
        assert int(spec.get("leaseTransitions") or 0) == transitions + 1
        print(f"failover: Lease handed over {handover:.1f}s after SIGKILL of the leader (lease duration "
              f"{ha.lease_duration:.0f}s); the new leader reconciled a new job {took:.1f}s after it")
        # A follower takes over once it has seen no renewal for the lease duration; it notices the
        # last renewal up to one retry period (2/15 of the duration) late.
        assert handover <= ha.lease_duration * (1 + 2 / 15) + 1.0
    finally:
        a.stop()
        b.stop()
        ha.cleanup_namespace(ns)
