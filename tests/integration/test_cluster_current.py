"""The current server as a small cluster: the real kube-scheduler, kwok's fake kubelets on fake GPU
nodes (nvidia.com/gpu capacity, and DRA ResourceSlices for their GPUs so the scheduler allocates
claims), and the CRD's CEL rules enforced by the server.

- every file in examples/ and examples/invalid/ is accepted or refused by the server (a dry-run
  create) exactly as `spectrain validate` says without its semantic checks (which only the operator
  and the workloads make);
- a job of each gpuSharing mode, its pods as the builders make them, is admitted in a namespace that
  enforces Pod Security "restricted", scheduled onto the fake nodes by kube-scheduler, run by kwok,
  and reaches Running; the pods of every example are admitted there too (a dry-run create), while a
  pod without the operator's securityContext is refused (the server does enforce the level);
- a job's NetworkPolicy, read back from the server, selects exactly the job's pods and opens exactly
  their metrics ports to other namespaces.

The fake nodes carry a NoSchedule taint that only these jobs tolerate: every other pod of the
suite stays unscheduled, so the tests that play the kubelet (exit codes, restarts) are undisturbed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from spectrain_operator import builders
from spectrain_operator import spec as specmod
from tests.integration.fake_cluster import DRA_DRIVER, GPUS_PER_NODE, NODES, TOLERATION, cluster_fixture  # noqa: F401
from tests.integration.kubeapi import KubeAPI
from tests.integration.operator_harness import GROUP, PLURAL, VERSION, Env, apply_crd, start_env
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# The namespace label of Pod Security admission (on by default since Kubernetes 1.25).
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}


@pytest.fixture(scope="module", name="env")
def restricted_env(kube: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The operator's namespace enforces Pod Security "restricted": every job below must be admitted there."""
    if kube.flavor != "current":
        pytest.skip("Pod Security admission needs Kubernetes >= 1.25 (SPECTRAIN_KUBE=current)")
    env = start_env(kube, tmp_path_factory.mktemp("operator"), namespace_labels=RESTRICTED)
    try:
        yield env
    finally:
        env.operator.stop()


def _raw_pod(kube: KubeAPI, ns: str, name: str) -> dict[str, Any]:
    core = client.CoreV1Api(kube.api_client())
    return dict(json.loads(core.read_namespaced_pod(name, ns, _preload_content=False).data))


def _wait_running(kube: KubeAPI, ns: str, name: str, timeout: float = 60) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        pod = _raw_pod(kube, ns, name)
        return pod if (pod.get("status") or {}).get("phase") == "Running" else None
    try:
        return wait_for(running, timeout, interval=0.2, what=f"pod {ns}/{name} Running")
    except TimeoutError as exc:
        pod = _raw_pod(kube, ns, name)
        raise AssertionError(f"{exc}: nodeName={pod['spec'].get('nodeName')} status={json.dumps(pod.get('status'))[:1500]}\n"
                             f"scheduler:\n{kube.log_tail('kube-scheduler', 15)}\nkwok:\n{kube.log_tail('kwok', 15)}") from None


def test_fake_nodes_offer_gpus_and_dra_devices(cluster: KubeAPI) -> None:
    for node in NODES:
        n = cluster.get("v1", "Node", node)
        assert n is not None and n["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS_PER_NODE)
        sl = cluster.get("resource.k8s.io/v1", "ResourceSlice", f"{node}-{DRA_DRIVER}")
        assert sl is not None and len(sl["spec"]["devices"]) == GPUS_PER_NODE


def test_a_gpu_pod_is_scheduled_onto_a_fake_node_and_run_by_kwok(cluster: KubeAPI) -> None:
    ns = f"sched-{uuid.uuid4().hex[:6]}"
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu", "namespace": ns},
                   "spec": {"tolerations": [TOLERATION],
                            "containers": [{"name": "c", "image": "img:1",
                                            "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}})
    # more GPUs than any node has: never scheduled
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big", "namespace": ns},
                   "spec": {"tolerations": [TOLERATION],
                            "containers": [{"name": "c", "image": "img:1",
                                            "resources": {"limits": {"nvidia.com/gpu": str(GPUS_PER_NODE + 1)}}}]}})
    pod = _wait_running(cluster, ns, "gpu")
    assert pod["spec"]["nodeName"] in NODES
    assert pod["status"]["containerStatuses"][0]["state"].get("running") is not None
    wait_for(lambda: any(c["type"] == "PodScheduled" and c["reason"] == "Unschedulable"
                         for c in _raw_pod(cluster, ns, "too-big").get("status", {}).get("conditions") or []),
             30, interval=0.2, what="too-big to be found Unschedulable")
    assert not _raw_pod(cluster, ns, "too-big")["spec"].get("nodeName")


# gpuSharing mode -> gpusPerNode (= target.procsPerNode when > 0)
MODES = {"None": 0, "SingleContainer": 1, "PodLocalMPS": 1, "DRA": 1}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_job_of_each_gpu_sharing_mode_is_scheduled_and_reaches_running(cluster: KubeAPI, env: Env, mode: str) -> None:
    name = f"gs-{mode.lower()}"
    env.create(env.manifest(name, {"gpuSharing": {"mode": mode, "gpusPerNode": MODES[mode]},
                                   "scheduling": {"tolerations": [TOLERATION]}}))
    pods = env.wait_pods(name, 2)
    for p in pods:
        _wait_running(cluster, env.ns, p["metadata"]["name"])
    env.wait_phase(name, "Running", timeout=60)
    nodes = set()
    for p in env.pods(name):
        nodes.add(p["spec"]["nodeName"])
        statuses = {c["name"]: c for c in p["status"].get("containerStatuses", []) + p["status"].get("initContainerStatuses", [])}
        assert statuses["target"]["state"].get("running") is not None, statuses
        for c in p["spec"].get("initContainers", []):  # native sidecars (drafter, MPS daemon): running
            if c.get("restartPolicy") == "Always":
                assert statuses[c["name"]]["state"].get("running") is not None, (c["name"], statuses)
        if mode == "DRA":
            claim_status = p["status"]["resourceClaimStatuses"][0]
            claim = env.kube.get("resource.k8s.io/v1", "ResourceClaim", claim_status["resourceClaimName"], env.ns)
            results = claim["status"]["allocation"]["devices"]["results"]
            assert [(r["driver"], r["pool"]) for r in results] == [(DRA_DRIVER, p["spec"]["nodeName"])], results
            assert {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} in [
                {k: r[k] for k in ("resource", "name", "uid")} for r in claim["status"]["reservedFor"]]
        elif mode != "None":
            target = next(c for c in p["spec"]["containers"] if c["name"] == "target")
            assert target["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert nodes <= set(NODES)


# ------------------------------------------------------------------ CEL enforced by the server

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd_namespace(kube: KubeAPI) -> Iterator[str]:
    if not kube.enforces_cel:
        pytest.skip(f"{kube.version_info['gitVersion']} does not evaluate CEL rules")
    apply_crd(kube)
    ns = f"examples-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_behaves_server_side_as_spectrain_validate_says(kube: KubeAPI, crd_namespace: str,
                                                                     path: Path) -> None:
    custom = client.CustomObjectsApi(kube.api_client())
    for doc in specmod.load_manifests(path):
        doc = dict(doc)
        doc["metadata"] = {**(doc.get("metadata") or {}), "namespace": crd_namespace}
        # what the API server can check: schema + CEL (semantic checks belong to operator and workloads)
        offline = specmod.validate(doc, semantic=False)
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, crd_namespace, PLURAL, doc, dry_run="All")
        except ApiException as exc:
            assert exc.status == 422, exc.body
            assert offline, f"{path.name}: refused by the server, valid for `spectrain validate`: {exc.body[:600]}"
            message = json.loads(exc.body)["message"]
            # each offline error names a field and says what is wrong; the server says the same rule
            assert any(_same_rule(e, message) for e in offline), (offline, message)
            continue
        assert not offline, f"{path.name}: accepted by the server, refused by `spectrain validate`: {offline}"
        if path.parent.name == "invalid":  # then only the semantic checks refuse it: the operator does
            assert specmod.validate(doc), f"{path.name} is in examples/invalid but nothing refuses it"


def _same_rule(offline_error: str, server_message: str) -> bool:
    """The server's message carries the offline error's rule message, or names its field."""
    field, _, what = offline_error.partition(": ")
    return (bool(what) and what[:40] in server_message) or (bool(field) and field.split("[")[0] in server_message)


def test_the_server_enforces_the_immutability_rules(kube: KubeAPI, crd_namespace: str) -> None:
    """Transition rules (oldSelf) need a stored object: target and drafter are immutable."""
    custom = client.CustomObjectsApi(kube.api_client())
    doc = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    doc["metadata"] = {"name": "immutable", "namespace": crd_namespace}
    custom.create_namespaced_custom_object(GROUP, VERSION, crd_namespace, PLURAL, doc)
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object(GROUP, VERSION, crd_namespace, PLURAL, "immutable",
                                              {"spec": {"target": {"steps": doc["spec"]["target"]["steps"] + 1}}})
    assert exc.value.status == 422 and "spec.target is immutable" in exc.value.body, exc.value.body
    assert specmod.validate({**doc, "spec": {**doc["spec"], "target": {**doc["spec"]["target"], "steps": 1}}},
                            old=doc, semantic=False)


# ------------------------------------------------------------------ Pod Security "restricted"

POD_EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples" / "byo").glob("*.yaml"))


def _rendered_pods(path: Path, ns: str) -> list[dict[str, Any]]:
    pods = []
    for doc in specmod.load_manifests(path):
        doc["metadata"] = {**(doc.get("metadata") or {}), "namespace": ns}
        pods += [o for o in builders.render(specmod.defaulted(doc)) if o["kind"] == "Pod"]
    return pods


def _create_pod(kube: KubeAPI, ns: str, pod: dict[str, Any]) -> None:
    client.CoreV1Api(kube.api_client()).create_namespaced_pod(ns, pod, dry_run="All")


def test_the_restricted_namespace_refuses_a_pod_without_the_operators_security_context(kube: KubeAPI,
                                                                                        env: Env) -> None:
    # The control for the test below: the server enforces the level, so a pod as the builders made
    # them before Pod Security was in the API (no securityContext anywhere) is refused, naming what fails.
    (pod, *_) = _rendered_pods(ROOT / "examples" / "demo.yaml", env.ns)
    _create_pod(kube, env.ns, pod)
    pod["spec"].pop("securityContext")
    for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        c.pop("securityContext")
    with pytest.raises(ApiException) as exc:
        _create_pod(kube, env.ns, pod)
    assert exc.value.status == 403, exc.value.body
    message = json.loads(exc.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message, message
    for what in ("allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true",
                 "seccompProfile"):
        assert what in message, (what, message)


@pytest.mark.parametrize("path", POD_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_examples_pods_are_admitted_under_restricted(kube: KubeAPI, env: Env, path: Path) -> None:
    pods = _rendered_pods(path, env.ns)
    assert pods
    for name in {p["spec"]["priorityClassName"] for p in pods if p["spec"].get("priorityClassName")}:
        # the Priority admission plugin refuses a pod naming a class that does not exist
        kube.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                    "value": 1000})
    for pod in pods:
        _create_pod(kube, env.ns, pod)  # a 403 here names the violated check


# ------------------------------------------------------------------ the job's NetworkPolicy

def _selected(env: Env, selector: dict[str, Any]) -> set[str]:
    labels = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    assert set(selector) == {"matchLabels"}, selector
    return {p.metadata.name for p in env.core.list_namespaced_pod(env.ns, label_selector=labels).items}


def test_the_jobs_network_policy_selects_exactly_its_pods_and_ports(env: Env) -> None:
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    env.create(env.manifest("np", {"target": {"procsPerNode": 2, "parallelism": {"data": 2, "pipeline": 2,
                                                                                  "microbatches": 2}},
                                   "networkPolicy": {"metricsFrom": monitoring}}))
    env.create(env.manifest("np-off", {"networkPolicy": {"enabled": False}}))
    pods = env.wait_pods("np", 2)
    env.wait_pods("np-off", 2)
    networking = client.NetworkingV1Api(env.kube.api_client())
    policy = json.loads(networking.read_namespaced_network_policy("np", env.ns, _preload_content=False).data)
    with pytest.raises(ApiException) as exc:
        networking.read_namespaced_network_policy("np-off", env.ns)
    assert exc.value.status == 404
    job = env.job("np") or {}
    assert policy["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    # The policy's selector, as the server evaluates it, picks this job's pods and no other's.
    names = {p["metadata"]["name"] for p in pods}
    assert _selected(env, spec["podSelector"]) == names
    own, metrics = spec["ingress"]
    # Every port from the job's own pods (the same selector: c10d, drafter exchange, gloo/NCCL links)...
    assert own == {"from": [{"podSelector": spec["podSelector"]}]}
    assert _selected(env, own["from"][0]["podSelector"]) == names
    # ...and from metricsFrom's namespaces exactly the ports the pods serve metrics on (each process:
    # its container's SPECTRAIN_METRICS_PORT + its local rank), none of the c10d or drafter ports.
    assert metrics["from"] == [{"namespaceSelector": monitoring}]
    containers = [c for p in pods for c in p["spec"]["containers"] + p["spec"].get("initContainers", [])]
    served = {int(e["value"]) + rank for c in containers for e in c["env"] if e["name"] == "SPECTRAIN_METRICS_PORT"
              for rank in range(2)}
    assert {(r["protocol"], r["port"]) for r in metrics["ports"]} == {("TCP", port) for port in served}
    declared = {(c["name"], port["name"]): port["containerPort"] for c in containers for port in c.get("ports", [])}
    metric_names = (builders.TARGET_METRICS_PORT_NAME, builders.DRAFTER_METRICS_PORT_NAME)
    assert {v for (c, name), v in declared.items() if name.startswith(metric_names)} == served
    assert {v for (c, name), v in declared.items() if not name.startswith(metric_names)} == {
        builders.MASTER_PORT, builders.DRAFTER_PORT, builders.DRAFTER_PORT + 1}
    assert not served & {builders.MASTER_PORT, builders.DRAFTER_PORT, builders.DRAFTER_PORT + 1}
