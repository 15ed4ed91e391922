"""SpecTrainJobs queued by the real Kueue (its manager built by `make kube-binaries`, run by
tests/integration/kueue.py) on the current server, with kube-scheduler and kwok's fake GPU nodes
(tests/integration/fake_cluster.py) and the operator: its pods, as the builders make them, are one
Kueue plain-pod group (the `pod` integration).

One ClusterQueue with 2 GPUs (one flavor whose node label the fake nodes carry), a LocalQueue, and
two WorkloadPriorityClasses; every job asks for 2 nodes x 1 GPU, so one job fills the queue.

- queued while the quota is taken (pods gated, Workload pending), admitted when it frees up: the
  pods get the flavor's node selector, are scheduled and run; finished jobs give the quota back;
- preempted by a higher-priority job (Kueue evicts the pod group) and resumed when that one is
  done (replacement pods, admitted again); a restart of the operator's own keeps the admission;
- a job that fails, and a job that is deleted, give their quota back (the operator marks their
  pod group finished for Kueue) instead of holding it with pods Kueue keeps Terminating.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration import kueue as kq
from tests.integration.fake_cluster import TOLERATION, cluster_fixture  # noqa: F401
from tests.integration.kubeapi import KubeAPI
from tests.integration.operator_harness import GROUP, LABEL_JOB, PLURAL, VERSION, Env, start_env
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

QUEUE, FLAVOR, CQ = "gpus", "fake-gpu", "gpus-cq"
FLAVOR_LABEL = {"type": "kwok"}  # what fake_cluster's nodes carry
LOW, HIGH = ("low", 100), ("high", 1000)
STEP = 60.0  # deadline per expected outcome (Kueue + scheduler + kwok + operator, 2 busy cores)


@dataclass
class Queued:
    env: Env
    kueue: kq.Kueue
    kube: KubeAPI


@pytest.fixture(scope="module")
def queued(cluster: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queued]:
    env = start_env(cluster, tmp_path_factory.mktemp("kueue-operator"), dict([kq.NAMESPACE_LABEL]))
    cluster.start_controller_manager()  # after the CRD: the garbage collector deletes deleted jobs' pods
    kueue = kq.Kueue(cluster, tmp_path_factory.mktemp("kueue"))
    try:
        kueue.start()
        cluster.apply(kq.resource_flavor(FLAVOR, FLAVOR_LABEL))
        cluster.apply(kq.cluster_queue(CQ, FLAVOR, {"cpu": "64", "memory": "256Gi", "nvidia.com/gpu": "2"}))
        cluster.apply(kq.local_queue(env.ns, QUEUE, CQ))
        for name, value in (LOW, HIGH):
            cluster.apply(kq.workload_priority_class(name, value))
        yield Queued(env, kueue, cluster)
    finally:
        env.operator.stop()
        kueue.stop()


# ---------------------------------------------------------------- helpers

def _create(q: Queued, name: str, priority: str, **spec: Any) -> None:
    m = q.env.manifest(name, {"gpuSharing": {"mode": "SingleContainer", "gpusPerNode": 1},
                              "scheduling": {"tolerations": [TOLERATION]}, **spec})
    m["metadata"]["labels"] = {kq.QUEUE_LABEL: QUEUE, kq.PRIORITY_LABEL: priority}
    q.env.create(m)


def _all_pods(q: Queued, name: str) -> list[dict[str, Any]]:
    """Every pod of the job, terminating ones included (env.pods leaves those out)."""
    data = q.env.core.list_namespaced_pod(q.env.ns, label_selector=f"{LABEL_JOB}={name}", _preload_content=False).data
    return sorted(json.loads(data)["items"], key=lambda p: p["metadata"]["name"])


def _workload(q: Queued, name: str) -> dict[str, Any]:
    """The pod group's Workload: Kueue names it after the group (= the job)."""
    return q.kube.get(kq.API, "Workload", name, q.env.ns) or {}


def _cond(wl: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (wl.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def _await(q: Queued, what: str, cond: Any, timeout: float = STEP) -> Any:
    def check() -> Any:
        q.env.operator.check_alive()
        q.kueue.check_alive()
        return cond()
    try:
        return wait_for(check, timeout, interval=0.2, what=what)
    except TimeoutError as exc:
        jobs = {n: q.env.status(n).get("phase") for n in ("first", "second", "victim", "boss", "doomed", "next")}
        raise AssertionError(f"{exc}\njobs: {jobs}\nworkloads: "
                             f"{[(w, [(c['type'], c['status'], c.get('reason')) for c in (_workload(q, w).get('status') or {}).get('conditions') or []]) for w in jobs]}\n"
                             f"operator:\n{q.env.operator.log_tail(15)}\nkueue:\n{q.kueue.log_tail(10)}") from None


def _running(q: Queued, name: str, generation: int) -> list[dict[str, Any]]:
    """Wait for the job's phase Running with both pods of `generation` running on fake nodes."""
    def ok() -> list[dict[str, Any]] | None:
        pods = [p for p in q.env.pods(name) if p["metadata"]["labels"]["spectrain.io/restart-generation"] == str(generation)]
        if q.env.status(name).get("phase") == "Running" and len(pods) == 2 \
                and all(p["status"].get("phase") == "Running" for p in pods):
            return pods
        return None
    return _await(q, f"{name} Running (generation {generation})", ok)  # type: ignore[no-any-return]


def _gated(pod: dict[str, Any]) -> bool:
    return {"name": kq.ADMISSION_GATE} in (pod["spec"].get("schedulingGates") or [])


def _finish(q: Queued, name: str) -> None:
    """Every target exits 0 (the test plays the end of training): the job Succeeds, Kueue finishes
    its Workload and frees the quota."""
    for p in q.env.pods(name):
        q.env.exit_pod(p["metadata"]["name"], 0)
    q.env.wait_phase(name, "Succeeded", timeout=STEP)
    _await(q, f"{name}'s Workload Finished", lambda: _cond(_workload(q, name), "Finished").get("status") == "True")


def _delete(q: Queued, name: str) -> None:
    q.env.custom.delete_namespaced_custom_object(GROUP, VERSION, q.env.ns, PLURAL, name)


# ---------------------------------------------------------------- tests

def test_a_job_waits_in_the_queue_and_is_admitted_onto_the_flavor_when_quota_frees(queued: Queued) -> None:
    q = queued
    _create(q, "first", LOW[0])
    pods = _running(q, "first", 0)
    wl = _workload(q, "first")
    assert _cond(wl, "Admitted")["status"] == "True"
    assert wl["spec"]["priority"] == LOW[1], "the WorkloadPriorityClass reached Kueue through the pods"
    assert [ps["count"] for ps in wl["spec"]["podSets"]] == [2], "both ranks are one pod set of one Workload"
    for p in pods:
        assert p["spec"]["nodeSelector"] == FLAVOR_LABEL, "Kueue put the flavor's node label on the pod"
        assert kq.FINALIZER in p["metadata"]["finalizers"] and not p["spec"].get("schedulingGates")

    _create(q, "second", LOW[0])  # the quota is taken: queued
    _await(q, "second's Workload pending for quota", lambda: _cond(_workload(q, "second"), "QuotaReserved").get(
        "reason") == "Pending" and "insufficient" in _cond(_workload(q, "second"), "QuotaReserved")["message"])
    waiting = q.env.wait_pods("second", 2)
    assert all(_gated(p) and not p["spec"].get("nodeName") for p in waiting)
    queued_cond = _await(q, "second's condition Queued", lambda: q.env.condition("second", "Queued"))
    assert queued_cond["status"] == "True" and "LocalQueue gpus" in queued_cond["message"]
    assert q.env.status("second")["phase"] == "Pending"

    _finish(q, "first")
    for p in _running(q, "second", 0):  # admitted now: the same pods, ungated, on the flavor
        assert p["metadata"]["name"] in {w["metadata"]["name"] for w in waiting}
        assert p["spec"]["nodeSelector"] == FLAVOR_LABEL
    assert q.env.condition("second", "Queued")["status"] == "False"
    _finish(q, "second")


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_after_it(queued: Queued) -> None:
    q = queued
    _create(q, "victim", LOW[0])
    first = _running(q, "victim", 0)
    assert [p["metadata"]["name"] for p in first] == ["victim-0", "victim-1"]

    _create(q, "boss", HIGH[0])
    _running(q, "boss", 0)
    wl = _workload(q, "victim")
    assert _cond(wl, "Preempted")["status"] == "True" and _cond(wl, "QuotaReserved")["status"] == "False"
    # Kueue ended the victim's pods; the operator made replacements (the other names: Kueue keeps
    # the old pods until they exist), gated until Kueue admits the group again
    st = _await(q, "victim Pending with its replacements queued", lambda: (s := q.env.status("victim")).get(
        "phase") == "Pending" and s)
    assert st["restarts"] == 1 and st["restartsTowardsMax"] == 0, st
    assert "evicted (" in st["lastFailure"] and "Preempted" in st["lastFailure"], st["lastFailure"]
    replacements = q.env.wait_pods("victim", 2, generation=1)
    assert [p["metadata"]["name"] for p in replacements] == ["victim-0-r", "victim-1-r"]
    assert all(_gated(p) for p in replacements)

    _finish(q, "boss")
    resumed = _running(q, "victim", 1)
    assert all(p["spec"]["nodeSelector"] == FLAVOR_LABEL for p in resumed)
    _await(q, "the preempted pods finalized by Kueue and gone",
           lambda: [p["metadata"]["name"] for p in _all_pods(q, "victim")] == ["victim-0-r", "victim-1-r"])
    admitted_at = _cond(_workload(q, "victim"), "Admitted")["lastTransitionTime"]

    # a restart of the operator's own (a target failed): new pods, the same admission
    q.env.exit_pod("victim-0-r", 1)
    again = _running(q, "victim", 2)
    assert [p["metadata"]["name"] for p in again] == ["victim-0", "victim-1"]
    wl = _workload(q, "victim")
    assert _cond(wl, "Admitted")["status"] == "True" and _cond(wl, "Admitted")["lastTransitionTime"] == admitted_at
    assert q.env.status("victim")["restarts"] == 2

    _delete(q, "victim")  # gives the quota back, and its pods go
    _await(q, "victim's pods gone", lambda: not _all_pods(q, "victim"))


def test_a_failed_job_gives_its_quota_back(queued: Queued) -> None:
    q = queued
    _create(q, "doomed", LOW[0], runPolicy={"maxRestarts": 0, "backoffSeconds": 0})
    _running(q, "doomed", 0)
    _create(q, "next", LOW[0])
    _await(q, "next queued", lambda: _cond(_workload(q, "next"), "QuotaReserved").get("reason") == "Pending")

    q.env.exit_pod("doomed-0", 1)
    q.env.wait_phase("doomed", "Failed", timeout=STEP)
    _await(q, "doomed's Workload Finished", lambda: _cond(_workload(q, "doomed"), "Finished").get("status") == "True")
    # the failed rank's pod stays (its logs), marked done by the operator, released by Kueue
    left = _await(q, "doomed's pods released by Kueue", lambda: (pods := _all_pods(q, "doomed")) and all(
        kq.FINALIZER not in (p["metadata"].get("finalizers") or []) for p in pods) and pods)
    assert [p["metadata"]["name"] for p in left] == ["doomed-0"]
    assert left[0]["metadata"]["annotations"][kq.RETRIABLE_ANNOTATION] == "false"
    _running(q, "next", 0)
    _delete(q, "next")
    _delete(q, "doomed")
    _await(q, "every pod gone", lambda: not _all_pods(q, "next") and not _all_pods(q, "doomed"))
