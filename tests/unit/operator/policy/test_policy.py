"""The reconcile policies (spectrain_operator.policy) one by one, as tables: each row is the pods'
state and the job's status, and what the policy makes of them (outcome, plan, status fields).

Pods are written as one short state per node, node 0 first:

| state | the pod |
|---|---|
| pending | created, not scheduled |
| scheduled | bound to a node, containers starting |
| gated | held by Kueue's admission gate |
| running | Running and Ready |
| exit:N | the target terminated with code N (phase Succeeded for 0, else Failed) |
| config | the target exited 2 (configuration error) with its error line |
| drafter:N | running; the drafter sidecar crashed N times (exit 1) |
| peer | running; the drafter's last exit was EXIT_PEER_FRAME |
| evicted | running, deleted, with Kueue's TerminationTarget condition |
| deleted | running, deleted, no condition |
| stale | a pod of the previous restart generation, still running |
| old | the same, being deleted |
| - | no pod for that node |
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from spectrain_api.names import EXIT_PEER_FRAME
from spectrain_operator import builders, scheduling, spec
from spectrain_operator.policy import failures, lifecycle, progress, restart
from spectrain_operator.policy.context import Context
from spectrain_operator.policy.plan import Outcome

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
EARLIER = "2026-01-01T11:59:00Z"
Obj = dict[str, Any]


def job(status: Obj | None = None, **spec_overrides: Any) -> Obj:
    m = {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob",
         "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1},
         "spec": {"target": {"image": "img", "nodes": 2, "parallelism": {"data": 2}}, **spec_overrides}}
    out = spec.defaulted(m)
    out["status"] = {"phase": "Running", "podsCreated": True, "startTime": "2026-01-01T11:59:00Z", **(status or {})}
    return out


def _terminated(code: int, message: str = "") -> Obj:
    return {"exitCode": code, "reason": "Error" if code else "Completed", "finishedAt": "2026-01-01T11:59:59Z",
            **({"message": message} if message else {})}


def make_pod(j: Obj, node: int, state: str, gen: int) -> Obj:
    kind, _, arg = state.partition(":")
    p, _ = builders.pod(j, node, generation=gen - 1 if kind in ("old", "stale") else gen)
    running_target = {"name": "target", "restartCount": 0, "state": {"running": {}}}
    status: Obj = {"phase": "Running", "containerStatuses": [running_target],
                   "conditions": [{"type": "Ready", "status": "True"}]}
    p["spec"]["nodeName"] = "node-a"
    if kind in ("pending", "gated", "scheduled"):
        status = {"phase": "Pending"}
        if kind != "scheduled":
            del p["spec"]["nodeName"]
        if kind == "gated":
            p["spec"]["schedulingGates"] = [{"name": scheduling.KUEUE_SCHEDULING_GATE}]
    elif kind in ("exit", "config"):
        code = 2 if kind == "config" else int(arg)
        message = "configuration error: spec.target.data.batchSize: 6 is too small" if kind == "config" else ""
        status = {"phase": "Failed" if code else "Succeeded",
                  "containerStatuses": [{"name": "target", "restartCount": 0,
                                         "state": {"terminated": _terminated(code, message)}}]}
    elif kind in ("drafter", "peer"):
        code, restarts = (EXIT_PEER_FRAME, 1) if kind == "peer" else (1, int(arg))
        status["initContainerStatuses"] = [{"name": "drafter", "restartCount": restarts, "state": {"running": {}},
                                            "lastState": {"terminated": _terminated(code)}}]
    elif kind in ("evicted", "deleted", "old"):
        p["metadata"]["deletionTimestamp"] = EARLIER
        if kind == "evicted":
            status["conditions"].append({"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvicted",
                                         "message": "Preempted to accommodate a workload"})
    p["status"] = status
    return p


def context(j: Obj, states: tuple[str, ...], now: datetime = NOW) -> Context:
    gen = int((j.get("status") or {}).get("restartGeneration") or 0)
    pods = [make_pod(j, node, state, gen) for node, state in enumerate(states) if state != "-"]
    return Context.of(j, pods, now)


def rule(action: str, code: int) -> Obj:
    return {"failurePolicy": {"rules": [{"action": action,
                                         "onExitCodes": {"container": "target", "operator": "In", "values": [code]}}]}}


def check(ctx: Context, outcome: Outcome | None, expected: tuple[str, str] | None, plan: Obj) -> None:
    assert (None if outcome is None else (outcome.phase, outcome.reason)) == expected
    for key, value in plan.items():
        actual = ctx.status.get(key[len("status."):]) if key.startswith("status.") else getattr(ctx.plan, key)
        assert actual == value, f"{key}: {actual!r} != {value!r}"


# ------------------------------------------------------------------------- lifecycle gates

LIFECYCLE = [
    # (id, gate, status, spec overrides, pods, (phase, reason) or None, plan / status expectations)
    ("succeeded stays", lifecycle.stay_terminal, {"phase": "Succeeded", "completionTime": EARLIER}, {},
     ("-", "-"), ("Succeeded", "Succeeded"), {"delete_pods": [], "status.completionTime": EARLIER}),
    ("failed stays, its running pods go", lifecycle.stay_terminal, {"phase": "Failed"}, {},
     ("exit:1", "running"), ("Failed", "Failed"), {"delete_pods": ["j-1"], "status.completionTime": "2026-01-01T12:00:00Z"}),
    ("running is not terminal", lifecycle.stay_terminal, {}, {}, ("running", "running"), None, {}),
    ("past the deadline", lifecycle.past_deadline, {}, {"runPolicy": {"activeDeadlineSeconds": 30}},
     ("running", "exit:0"), ("Failed", "DeadlineExceeded"), {"delete_pods": ["j-0"], "status.restartAt": None}),
    ("within the deadline", lifecycle.past_deadline, {}, {"runPolicy": {"activeDeadlineSeconds": 600}},
     ("running", "running"), None, {}),
    ("a suspended job has no deadline", lifecycle.past_deadline, {},
     {"runPolicy": {"activeDeadlineSeconds": 30}, "suspend": True}, ("running", "running"), None, {}),
    ("not started: no deadline", lifecycle.past_deadline, {"startTime": None},
     {"runPolicy": {"activeDeadlineSeconds": 30}}, ("-", "-"), None, {}),
    ("suspend deletes every live pod", lifecycle.suspended, {}, {"suspend": True}, ("running", "exit:0"),
     ("Suspended", "Suspended"), {"delete_pods": ["j-0", "j-1"], "status.podsCreated": False, "status.startTime": None}),
    ("not suspended", lifecycle.suspended, {}, {}, ("running", "running"), None, {}),
    ("every target exited 0", lifecycle.succeeded, {}, {}, ("exit:0", "exit:0"),
     ("Succeeded", "Completed"), {"delete_pods": [], "status.completionTime": "2026-01-01T12:00:00Z"}),
    ("one target still running", lifecycle.succeeded, {}, {}, ("exit:0", "running"), None, {}),
    ("a node without a pod", lifecycle.succeeded, {}, {}, ("exit:0", "-"), None, {}),
]


@pytest.mark.parametrize("gate,status,overrides,pods,expected,plan", [r[1:] for r in LIFECYCLE],
                         ids=[r[0] for r in LIFECYCLE])
def test_lifecycle_gates(gate: Any, status: Obj, overrides: Obj, pods: tuple[str, ...],
                         expected: tuple[str, str] | None, plan: Obj) -> None:
    ctx = context(job(status, **overrides), pods)
    check(ctx, gate(ctx), expected, plan)


@pytest.mark.parametrize("prev,errors,expected", [
    ("Running", ["spec.target.nodes: must be >= 1"], ("Failed", "SpecInvalid")),
    ("Failed", ["spec.target.nodes: must be >= 1"], ("Failed", "InvalidSpec")),
])
def test_spec_errors_fail_the_job_and_keep_a_failed_ones_reason(prev: str, errors: list[str],
                                                                 expected: tuple[str, str]) -> None:
    j = job({"phase": prev, "conditions": [{"type": "Failed", "status": "True" if prev == "Failed" else "False",
                                            "reason": "X", "message": "x"}]})
    ctx = context(j, ("running", "exit:1"))
    check(ctx, lifecycle.spec_invalid(ctx, errors), expected, {"delete_pods": ["j-0"]})
    assert ctx.conds.is_true("SpecInvalid")


@pytest.mark.parametrize("phase,status,overrides,plan", [
    ("Succeeded", {"completionTime": "2026-01-01T11:58:00Z"}, {"runPolicy": {"ttlSecondsAfterFinished": 60}},
     {"delete_job": True}),
    ("Succeeded", {"completionTime": "2026-01-01T11:59:30Z"}, {"runPolicy": {"ttlSecondsAfterFinished": 60}},
     {"delete_job": False, "requeue_after": 30.0}),
    ("Failed", {"completionTime": EARLIER}, {}, {"delete_job": False, "requeue_after": None}),
    ("Running", {}, {"runPolicy": {"activeDeadlineSeconds": 600}}, {"delete_job": False, "requeue_after": 540.0}),
])
def test_ttl_and_deadline_requeues(phase: str, status: Obj, overrides: Obj, plan: Obj) -> None:
    ctx = context(job(status, **overrides), ("-", "-"))
    lifecycle.expire(ctx, phase)
    check(ctx, None, None, plan)


# ------------------------------------------------------------------------- failures of the current pods

FAILURES = [
    # (id, status, spec overrides, pods, own drafter failures, (phase, reason) or None, expectations)
    ("all running", {}, {}, ("running", "running"), {}, None, {"delete_pods": []}),
    ("a target failure restarts the gang", {}, {}, ("running", "exit:1"), {},
     ("Restarting", "TargetFailed"),
     {"delete_pods": ["j-0", "j-1"], "generation": 1, "requeue_after": 10.0,
      "status.restarts": 1, "status.restartsTowardsMax": 1, "status.restartAt": "2026-01-01T12:00:10Z"}),
    ("the second counted restart backs off twice as long", {"restarts": 1, "restartsTowardsMax": 1}, {},
     ("exit:1", "running"), {}, ("Restarting", "TargetFailed"), {"requeue_after": 20.0, "status.restarts": 2}),
    ("past maxRestarts", {"restartsTowardsMax": 3}, {}, ("running", "exit:1"), {},
     ("Failed", "BackoffLimitExceeded"), {"delete_pods": ["j-0"], "status.restarts": 0}),
    ("exit 2 is a configuration error", {}, {}, ("config", "running"), {},
     ("Failed", "ConfigError"), {"delete_pods": ["j-1"]}),
    ("a rule on exit 2 wins", {}, {"runPolicy": rule("RestartJob", 2)}, ("config", "running"), {},
     ("Restarting", "TargetFailed"), {"status.restartsTowardsMax": 1}),
    ("FailJob", {}, {"runPolicy": rule("FailJob", 42)}, ("running", "exit:42"), {},
     ("Failed", "FailedByPolicy"), {"delete_pods": ["j-0"]}),
    ("RestartJobIgnoreMax past maxRestarts", {"restartsTowardsMax": 3}, {"runPolicy": rule("RestartJobIgnoreMax", 42)},
     ("exit:42", "running"), {}, ("Restarting", "TargetFailed"),
     {"status.restartsTowardsMax": 3, "status.restarts": 1, "status.drafterDisabled": False}),
    ("RestartWithoutDrafter", {}, {"runPolicy": rule("RestartWithoutDrafter", 42)}, ("exit:42", "running"), {},
     ("Restarting", "TargetFailed"), {"status.drafterDisabled": True, "status.drafterDisabledGeneration": 0}),
    ("a drafter crash is ignored", {}, {}, ("drafter:1", "running"), {0: 1}, None,
     {"status.drafterDisabled": False, "events": []}),
    ("a drafter past maxFailures is disabled in place", {}, {}, ("running", "drafter:3"), {1: 3}, None,
     {"status.drafterDisabled": True, "status.drafterDisabledGeneration": 0, "delete_pods": []}),
    ("peer-frame exits do not count", {}, {}, ("running", "drafter:3"), {1: 0}, None,
     {"status.drafterDisabled": False}),
    ("the first node's failure decides", {}, {"runPolicy": rule("FailJob", 42)}, ("exit:1", "exit:42"), {},
     ("Restarting", "TargetFailed"), {}),
]


@pytest.mark.parametrize("status,overrides,pods,own,expected,plan", [r[1:] for r in FAILURES],
                         ids=[r[0] for r in FAILURES])
def test_failures(status: Obj, overrides: Obj, pods: tuple[str, ...], own: dict[int, int],
                  expected: tuple[str, str] | None, plan: Obj) -> None:
    ctx = context(job(status, **overrides), pods)
    check(ctx, failures.handle(ctx, own), expected, plan)
    if ctx.status["drafterDisabled"] and expected is None:
        assert ctx.conds.reason("DrafterDegraded") == "TooManyFailures"
        assert [e.reason for e in ctx.plan.events] == ["DrafterDegraded"]


def test_an_unusable_rule_fails_the_job_as_spec_invalid() -> None:
    j = job()  # a rule the schema refuses: decide must fail the job, not raise
    j["spec"]["runPolicy"]["failurePolicy"] = {"rules": [{"action": "Retry", "onExitCodes": {"values": [1]}}]}
    ctx = context(j, ("exit:1", "running"))
    outcome = failures.handle(ctx, {})
    assert outcome is not None and (outcome.phase, outcome.reason) == ("Failed", "SpecInvalid")
    assert ctx.plan.delete_pods == ["j-0", "j-1"]


# ------------------------------------------------------------------------- restarts: backoff, vanished pods

RESTARTS = [
    # (id, policy, status, pods, (phase, reason) or None, expectations)
    ("backoff pending: old pods go first", restart.wait_backoff,
     {"restartAt": "2026-01-01T12:00:05Z", "restartGeneration": 1}, ("stale", "old"),
     ("Restarting", "Backoff"), {"delete_pods": ["j-0"], "requeue_after": 5.0, "create_nodes": []}),
    ("backoff over", restart.wait_backoff, {"restartAt": EARLIER}, ("-", "-"), None, {"status.restartAt": None}),
    ("no backoff", restart.wait_backoff, {}, ("running", "running"), None, {"status.restartAt": None}),
    ("a created pod was deleted", restart.replace_missing, {}, ("running", "deleted"),
     ("Restarting", "PodDeleted"),
     {"delete_pods": ["j-0"], "requeue_after": 0.0, "status.restartsTowardsMax": 0, "status.restartAt": None,
      "status.lastFailure": "pod(s) j-1 disappeared (deleted or evicted)"}),
    ("Kueue evicted the pod group", restart.replace_missing, {}, ("evicted", "evicted"),
     ("Restarting", "PodEvicted"),
     {"status.lastFailure": "pod(s) j-0, j-1 evicted (WorkloadEvicted): Preempted to accommodate a workload",
      "generation": 1}),
    ("not created yet", restart.replace_missing, {"podsCreated": False}, ("-", "-"), None, {"delete_pods": []}),
    ("every pod there", restart.replace_missing, {}, ("running", "running"), None, {}),
]


@pytest.mark.parametrize("policy,status,pods,expected,plan", [r[1:] for r in RESTARTS],
                         ids=[r[0] for r in RESTARTS])
def test_restarts(policy: Any, status: Obj, pods: tuple[str, ...], expected: tuple[str, str] | None,
                  plan: Obj) -> None:
    ctx = context(job(status), pods)
    check(ctx, policy(ctx), expected, plan)


def test_backoff_counts_restarts_of_its_own_kind() -> None:
    assert [restart.backoff_seconds(10, n) for n in (0, 1, 2, 3)] == [0.0, 10.0, 20.0, 40.0]
    assert restart.backoff_seconds(10, 100) == restart.MAX_BACKOFF_S
    assert restart.backoff_seconds(0, 5) == 0.0


# ------------------------------------------------------------------------- pods coming up

PROGRESS = [
    # (id, status, pods, (phase, reason), expectations)
    ("a new job creates every pod", {"podsCreated": False, "startTime": None}, ("-", "-"),
     ("Pending", "PodsCreated"),
     {"create_nodes": [0, 1], "status.podsCreated": True, "status.startTime": "2026-01-01T12:00:00Z"}),
    ("a replacement waits for its node's old pod", {"podsCreated": False, "restartGeneration": 1}, ("old", "-"),
     ("Pending", "PodsCreated"), {"create_nodes": [1], "requeue_after": 1.0, "status.podsCreated": False}),
    ("all running", {}, ("running", "running"), ("Running", "AllRanksRunning"), {"delete_pods": []}),
    ("one done, one running", {}, ("exit:0", "running"), ("Running", "AllRanksRunning"), {}),
    ("scheduled, starting", {}, ("scheduled", "running"), ("Starting", "Starting"), {}),
    ("gated by Kueue", {}, ("gated", "gated"), ("Pending", "Queued"), {}),
    ("unscheduled", {}, ("pending", "scheduled"), ("Pending", "Unscheduled"), {}),
]


@pytest.mark.parametrize("status,pods,expected,plan", [r[1:] for r in PROGRESS], ids=[r[0] for r in PROGRESS])
def test_pods_coming_up(status: Obj, pods: tuple[str, ...], expected: tuple[str, str], plan: Obj) -> None:
    ctx = context(job(status), pods)
    check(ctx, progress.come_up(ctx), expected, plan)


@pytest.mark.parametrize("pods,phase,queued", [
    (("gated", "gated"), "Pending", "True"),
    (("gated", "gated"), "Failed", None),
    (("running", "running"), "Running", None),
])
def test_queued_condition(pods: tuple[str, ...], phase: str, queued: str | None) -> None:
    ctx = context(job(), pods)
    progress.mark_queued(ctx, phase)
    assert (ctx.conds.items.get("Queued") or {}).get("status") == queued


def test_ranks_count_the_current_pods() -> None:
    ctx = context(job(), ("running", "exit:3"))
    assert progress.ranks(ctx.pods.current, 2) == {"desired": 2, "ready": 1, "running": 1, "succeeded": 0,
                                                   "failed": 1}
