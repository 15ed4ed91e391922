"""Gang scheduling by the real Coscheduling plugin of sigs.k8s.io/scheduler-plugins (its
kube-scheduler built by `make kube-binaries`, run by tests/integration/coscheduling.py as a second
scheduler) on the current server, with kwok's fake GPU nodes (tests/integration/fake_cluster.py)
and the operator: a SpecTrainJob with `scheduling.gang.provider: SchedulerPlugins` and
`schedulerName` set to that scheduler; the operator makes its PodGroup (minMember = nodes).

The job has 3 pods of 1 nvidia.com/gpu each and may only use nodes of its own (a label in its
nodeSelector, a taint only it tolerates), 2 of them with 1 GPU each: any 2 of its pods fit, the
third does not. All or none:
- no pod is bound: the scheduler places two pods, holds them at Permit for the rest of the group,
  and once the third is found unschedulable rejects the whole PodGroup (its FailedScheduling
  events say so), again and again; the job stays Pending;
- a third such node is added: the same three pods are bound together and kwok runs them; the job
  is Running. (Either at once, or at the scheduler's flush of its unschedulable pool, 20 s here:
  see tests/integration/coscheduling.py for why a new node does not always wake the gang.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration import coscheduling as cs
from tests.integration.fake_cluster import TOLERATION, cluster_fixture  # noqa: F401
from tests.integration.kubeapi import KubeAPI, KubeBinariesMissing
from tests.integration.operator_harness import Env, start_env
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

JOB = "gang"
NODES = 3            # pods of the job (= the PodGroup's minMember)
# the event of a pod that fitted a node and waited at Permit, sent back when the group was rejected
HELD_BACK = "optimistic rejection in PostFilter."
STEP = 90.0          # deadline per expected outcome (operator + scheduler + kwok, 2 busy cores)


@dataclass
class Gang:
    env: Env
    sched: cs.Coscheduling
    kube: KubeAPI
    label: tuple[str, str]          # the gang nodes' label, in the job's nodeSelector
    taint: dict[str, str]           # the gang nodes' own taint, tolerated by the job only

    def node_name(self, i: int) -> str:
        return f"{self.env.ns}-gpu-{i}"


@pytest.fixture(scope="module")
def gang(cluster: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gang]:
    try:
        sched = cs.Coscheduling(cluster, tmp_path_factory.mktemp("coscheduling"))
    except KubeBinariesMissing as exc:
        pytest.fail(str(exc), pytrace=False)  # as the `kube` fixture: `make test` builds it first
    sched.start()  # installs the PodGroup CRD before the operator may create PodGroups
    env = start_env(cluster, tmp_path_factory.mktemp("gang-operator"))
    g = Gang(env, sched, cluster, ("spectrain.io/gang-test", env.ns),
             {"key": "spectrain.io/gang-test", "value": env.ns, "effect": "NoSchedule"})
    try:
        yield g
    finally:
        env.operator.stop()
        sched.stop()
        for i in range(NODES):
            cluster.delete({"apiVersion": "v1", "kind": "Node", "metadata": {"name": g.node_name(i)}})


# ---------------------------------------------------------------- helpers

def _add_gpu_node(g: Gang, i: int) -> None:
    """A kwok node with 1 GPU that only the gang job can use (the suite's other pods tolerate
    the fake-node taint, not this one)."""
    node = g.kube.fake_node(g.node_name(i), gpus=1, labels=dict([g.label]))
    node["spec"]["taints"].append(dict(g.taint))
    g.kube.apply(node)


def _schedulable(g: Gang, names: list[str]) -> bool:
    """Ready, and no taint left but the fake-node and gang ones (the node-lifecycle controller
    has lifted the not-ready taint)."""
    ours = {g.kube.FAKE_NODE_TAINT["key"], g.taint["key"]}
    for name in names:
        n = g.kube.get("v1", "Node", name) or {}
        conds = (n.get("status") or {}).get("conditions") or []
        taints = (n.get("spec") or {}).get("taints") or []
        if not any(c["type"] == "Ready" and c["status"] == "True" for c in conds) \
                or any(t["key"] not in ours for t in taints):
            return False
    return True


def _events(g: Gang, pod: str) -> list[dict[str, Any]]:
    """`pod`'s events from the second scheduler (reported under its profile's name)."""
    return [e for e in g.env.events(pod)
            if cs.SCHEDULER_NAME in (e.get("reportingComponent"), (e.get("source") or {}).get("component"))]


def _await(g: Gang, what: str, cond: Any, timeout: float = STEP) -> Any:
    def check() -> Any:
        g.env.operator.check_alive()
        g.sched.check_alive()
        return cond()
    try:
        return wait_for(check, timeout, interval=0.2, what=what)
    except TimeoutError as exc:
        pods = {p["metadata"]["name"]: (p["spec"].get("nodeName"), p["status"].get("phase"))
                for p in g.env.pods(JOB)}
        events = {n: [(e["reason"], e.get("message", "")[:200]) for e in _events(g, n)][-3:] for n in pods}
        raise AssertionError(f"{exc}\njob: {json.dumps(g.env.status(JOB))[:800]}\npods: {pods}\n"
                             f"scheduler events: {events}\noperator:\n{g.env.operator.log_tail(15)}\n"
                             f"scheduler-plugins:\n{g.sched.log_tail(25)}") from None


# ---------------------------------------------------------------- the test

def test_a_gang_is_bound_all_at_once_or_not_at_all(gang: Gang) -> None:
    g = gang
    for i in range(NODES - 1):
        _add_gpu_node(g, i)
    _await(g, "the gang's 2 nodes schedulable", lambda: _schedulable(g, [g.node_name(i) for i in range(NODES - 1)]))

    g.env.create(g.env.manifest(JOB, {
        "target": {"nodes": NODES, "parallelism": {"data": NODES, "pipeline": 1, "microbatches": 2}},
        "gpuSharing": {"mode": "SingleContainer", "gpusPerNode": 1},
        "scheduling": {"schedulerName": cs.SCHEDULER_NAME, "gang": {"provider": "SchedulerPlugins"},
                       "nodeSelector": dict([g.label]),
                       "tolerations": [TOLERATION, {**g.taint, "operator": "Equal"}]},
    }))
    pg = _await(g, "the operator's PodGroup", lambda: cs.pod_group(g.env.ns, JOB, g.kube))
    assert pg["spec"]["minMember"] == NODES
    pods = g.env.wait_pods(JOB, NODES, timeout=STEP)
    uids = {p["metadata"]["uid"] for p in pods}
    for p in pods:
        assert p["spec"]["schedulerName"] == cs.SCHEDULER_NAME
        assert p["metadata"]["labels"][cs.POD_GROUP_LABEL] == JOB

    # --- 2 GPUs for 3 pods: the scheduler rejects the whole group, binds none -----------------
    rejected = f"PodGroup {g.env.ns}/{JOB} gets rejected"

    def gang_rejected() -> tuple[str, str] | None:
        """(the pod the group was rejected for, a pod that fitted but was sent back with it)."""
        msgs = {p["metadata"]["name"]: [e.get("message", "") for e in _events(g, p["metadata"]["name"])
                                        if e["reason"] == "FailedScheduling"] for p in pods}
        culprit = next((n for n, ms in msgs.items() if any(rejected in m for m in ms)), None)
        held = next((n for n, ms in msgs.items() if any(m.endswith(HELD_BACK) for m in ms)), None)
        return (culprit, held) if culprit and held else None

    culprit, held = _await(g, "the scheduler rejecting the PodGroup (FailedScheduling events)", gang_rejected)
    now = g.env.pods(JOB)
    assert {p["metadata"]["uid"] for p in now} == uids, "the same pods: none failed or was replaced"
    assert all(not p["spec"].get("nodeName") and p["status"].get("phase") == "Pending" for p in now), \
        f"no pod of the gang is bound while the group does not fit: {[(p['metadata']['name'], p['spec'].get('nodeName')) for p in now]}"
    assert not any(e["reason"] == "Scheduled" for p in now for e in _events(g, p["metadata"]["name"])), \
        "no pod was ever bound"
    st = g.env.status(JOB)
    assert st.get("phase") == "Pending", st

    # --- a third GPU node: all three bound together, kwok runs them ---------------------------
    _add_gpu_node(g, NODES - 1)

    def all_running() -> list[dict[str, Any]] | None:
        ps = g.env.pods(JOB)
        ok = len(ps) == NODES and all(p["spec"].get("nodeName") and p["status"].get("phase") == "Running" for p in ps)
        return ps if ok and g.env.status(JOB).get("phase") == "Running" else None

    running = _await(g, "all 3 pods bound and Running, the job Running", all_running)
    assert {p["metadata"]["uid"] for p in running} == uids, "the pods that waited are the ones bound"
    assert sorted(p["spec"]["nodeName"] for p in running) == [g.node_name(i) for i in range(NODES)], \
        "one pod per 1-GPU node"
    _await(g, f"a Scheduled event from {cs.SCHEDULER_NAME} for each pod",
           lambda: all(any(e["reason"] == "Scheduled" for e in _events(g, p["metadata"]["name"])) for p in running))
