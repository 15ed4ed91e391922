"""Faults with real containers, on one job of examples/demo.yaml (its own 180 steps; the faults
below land in its first ~60): the kubelet's own restarts of the drafter native sidecar, a SIGKILLed
operator leader, and `kubectl delete stj` with the real garbage collector.

1. The drafter process of one pod is SIGKILLed `drafter.maxFailures` times (each time once the
   kubelet has restarted it): the operator disables the drafter in place (DrafterDegraded,
   status.drafterDisabled), the target containers are never restarted, the pods are the same pods,
   and the target's steps go on to the end.
2. The operator's leader is SIGKILLed mid-job: the other replica takes over and the job finishes.
3. `kubectl delete stj` removes every child: nothing owned by the job or labelled with its name
   is left.

And on a job of its own, a node lost mid-job (its kubelet, containerd and containers killed at
once): a gang restart from the last checkpoint on the node left, then completion.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from spectrain_api.config import DrafterSpec
from spectrain_operator.builders import LABEL_GENERATION
from tests.cluster.stack import Stack
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

NAME = "faults"
JOB_TIMEOUT_S = 900.0
MAX_FAILURES = DrafterSpec.max_failures
CHILD_KINDS = ("pod", "service", "configmap", "secret", "serviceaccount", "role", "rolebinding",
               "networkpolicy", "persistentvolumeclaim")


def _drafter_status(pod: Any) -> Any:
    """The drafter native sidecar's status (an init container with restartPolicy Always)."""
    return next(c for c in pod.status.init_container_statuses or [] if c.name == "drafter")


def _step(stack: Stack) -> int:
    return int((stack.status(NAME).get("progress") or {}).get("step") or 0)


def test_drafter_crashes_disable_it_in_place_and_the_job_outlives_its_operator(stack: Stack) -> None:
    m = stack.example("demo.yaml")
    m["metadata"]["name"] = NAME
    claim = m["spec"]["target"]["checkpoint"]["claimName"] = f"{NAME}-run"
    stack.claim(claim)
    stack.apply(m)
    stack.wait_phase(NAME, "Running", 300)
    wait_for(lambda: _step(stack) > 0, 300, 0.5, "the target stepping")
    uids = {p.metadata.name: p.metadata.uid for p in stack.pods(NAME)}
    victim = f"{NAME}-0"

    # 1. the drafter killed maxFailures times, each time after the kubelet restarted it
    for crash in range(MAX_FAILURES):
        def running_again(crash: int = crash) -> Any:
            c = _drafter_status(stack.core.read_namespaced_pod(victim, stack.ns))
            return c if c.restart_count == crash and c.state.running else None
        c = wait_for(running_again, 360, 0.2, f"the drafter running after {crash} crashes")
        stack.cluster.kill_container(stack.core.read_namespaced_pod(victim, stack.ns).spec.node_name,
                                     c.container_id)
    wait_for(lambda: stack.status(NAME).get("drafterDisabled"), 300, 0.5, "the drafter disabled")
    st = stack.status(NAME)
    why = stack.describe(NAME)
    assert st["phase"] == "Running" and st["drafterFailures"] >= MAX_FAILURES, why
    degraded = stack.condition(NAME, "DrafterDegraded")
    assert degraded and degraded["status"] == "True", why
    assert sum(1 for e in stack.events(NAME) if e.reason == "DrafterFailed") >= 1, why
    step_at_disable = _step(stack)
    wait_for(lambda: _step(stack) > step_at_disable, 120, 0.5, "the target stepping on after the disable")

    # 2. the operator's leader killed mid-job
    _, failover_s = stack.kill_leader()
    assert stack.status(NAME)["phase"] == "Running", "the job ended before its operator was killed"
    st = stack.wait_phase(NAME, "Succeeded", JOB_TIMEOUT_S)
    print(f"leader failover mid-job {failover_s:.1f} s; drafter disabled at step {step_at_disable}")
    pods = stack.pods(NAME)
    assert {p.metadata.name: p.metadata.uid for p in pods} == uids, "a pod was replaced"
    for p in pods:
        (target,) = [c for c in p.status.container_statuses if c.name == "target"]
        assert target.restart_count == 0 and target.state.terminated.exit_code == 0, target
    assert st["progress"]["step"] == st["progress"]["totalSteps"] == m["spec"]["target"]["steps"], st["progress"]
    assert st["restarts"] == 0, st
    assert st["drafterDisabled"] and st["drafter"]["state"] == "Degraded", st["drafter"]

    # 3. kubectl delete stj removes every child
    uid = stack.job(NAME)["metadata"]["uid"]
    stack.kubectl("-n", stack.ns, "delete", "stj", NAME, "--wait=true", timeout=120)
    wait_for(lambda: not _children(stack, uid), 120, 0.5, f"{NAME}'s children gone")


def _children(stack: Stack, uid: str) -> list[str]:
    """Objects of the namespace owned by the job (uid) or labelled with its name."""
    out = json.loads(stack.kubectl("-n", stack.ns, "get", ",".join(CHILD_KINDS), "-o", "json"))
    left = []
    for o in out["items"]:
        md = o["metadata"]
        owned = any(r.get("uid") == uid for r in md.get("ownerReferences") or [])
        if owned or (md.get("labels") or {}).get("spectrain.io/job-name") == NAME:
            left.append(f"{o['kind']}/{md['name']}")
    return left


LOST = "nodeloss"
LOSS_CHECKPOINT_EVERY = 20
LOSS_STEPS = 120
# The job tolerates a lost node this long before the taint manager evicts its pod (Kubernetes adds
# 300 s when a pod sets nothing): what a team whose ranks cannot wait sets in spec.scheduling.
NODE_LOSS_TOLERATION_S = 5


def test_a_lost_node_restarts_the_gang_from_its_checkpoint_on_the_node_left(stack: Stack) -> None:
    """One node's kubelet, containerd and containers killed at once mid-job: the operator restarts
    the gang (its rank left fails on the lost peer, or the taint manager evicts the lost pod once
    the Node is NotReady), force-deletes the pod whose kubelet will never confirm it, and the new
    generation resumes from the last checkpoint on the node left and runs to the end."""
    m = stack.example("demo.yaml")
    m["metadata"]["name"] = LOST
    t = m["spec"]["target"]
    t["steps"], t["checkpoint"]["everySteps"] = LOSS_STEPS, LOSS_CHECKPOINT_EVERY
    claim = t["checkpoint"]["claimName"] = f"{LOST}-run"
    m["spec"]["scheduling"] = {"tolerations": [
        {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": NODE_LOSS_TOLERATION_S} for taint in ("unreachable", "not-ready")]}
    volume = stack.claim(claim)
    stack.apply(m)
    stack.wait_phase(LOST, "Running", 300)
    # a checkpoint every rank holds, and the job still short of its next one
    wait_for(lambda: all(list(volume.glob(f"target/rank-{r}/step-*")) for r in (0, 1)), 300, 0.2,
             "the first checkpoint of both ranks")
    pods = {p.metadata.name: p for p in stack.pods(LOST)}
    lost_node = pods[f"{LOST}-1"].spec.node_name
    left = next(n for n in stack.cluster.nodes if n != lost_node)
    old_uids = {p.metadata.uid for p in pods.values()}
    stack.cluster.stop_node(lost_node)
    try:
        st = stack.wait_phase(LOST, "Succeeded", JOB_TIMEOUT_S)
        why = stack.describe(LOST)
        reasons = [e.reason for e in stack.events(LOST)]
        # Whichever comes first restarts the gang: the rank left sees its peer's connections reset
        # (the killed processes' sockets; TargetFailed, counted against maxRestarts) or, where
        # nothing reaches it, the taint manager evicts the lost pod (PodEvicted, not counted). The
        # lost pod's kubelet never confirms its deletion either way: it is force-deleted.
        assert st["restarts"] == 1, why
        assert {"PodEvicted", "TargetFailed"} & set(reasons) and "PodForceDeleted" in reasons, (reasons, why)
        new = stack.pods(LOST)
        assert {p.metadata.uid for p in new}.isdisjoint(old_uids), "an old pod is still the job's"
        assert {p.spec.node_name for p in new} == {left}, [p.spec.node_name for p in new]
        assert all(p.metadata.labels[LABEL_GENERATION] == "1" for p in new)
        # resumed, not started over: the new rank 0's first step follows a checkpoint
        log = stack.logs(f"{LOST}-0", "target")
        first = re.search(r"\] step (\d+)/", log)
        assert first, log[-2000:]
        resumed_from = int(first.group(1)) - 1
        assert resumed_from > 0 and resumed_from % LOSS_CHECKPOINT_EVERY == 0, log[-2000:]
        assert st["progress"]["step"] == LOSS_STEPS, st["progress"]
        print(f"node {lost_node} lost; the gang resumed from step {resumed_from} on {left}")
    finally:
        stack.cluster.start_node(lost_node)
