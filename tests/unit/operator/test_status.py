"""status.decide: the lifecycle as a pure function of (job, pods, now)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from spectrain_api.names import REPORT_DRAFTER, REPORT_POD, REPORT_PROGRESS, STATUS_REPORTS
from spectrain_operator import builders, spec
from spectrain_operator import pods as podlib
from spectrain_operator import status as st

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def job(status: dict[str, Any] | None = None, **spec_overrides: Any) -> dict[str, Any]:
    m = {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob",
         "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1},
         "spec": {"target": {"image": "img", "nodes": 2, "parallelism": {"data": 2}}, **spec_overrides}}
    out = spec.defaulted(m)
    if status is not None:
        out["status"] = status
    return out


def pod(j: dict[str, Any], node: int, gen: int = 0, phase: str = "Pending", target: dict[str, Any] | None = None,
        drafter: dict[str, Any] | None = None, annotations: dict[str, str] | None = None,
        ready: bool = False) -> dict[str, Any]:
    p, _ = builders.pod(j, node, generation=gen)
    p["metadata"]["uid"] = f"uid-{node}-{gen}"
    status: dict[str, Any] = {"phase": phase}
    if target is not None:
        status["containerStatuses"] = [{"name": "target", "restartCount": 0, **target}]
    if drafter is not None:
        status["initContainerStatuses"] = [{"name": "drafter", **drafter}]
    if ready:
        status["conditions"] = [{"type": "Ready", "status": "True"}]
    p["status"] = status
    if annotations:
        p["metadata"]["annotations"] = annotations
    return p


def running(j: dict[str, Any], gen: int = 0, **kw: Any) -> list[dict[str, Any]]:
    return [pod(j, n, gen, "Running", target={"state": {"running": {}}}, ready=True, **kw) for n in range(2)]


def exited(code: int) -> dict[str, Any]:
    return {"state": {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed",
                                     "finishedAt": "2026-01-01T11:59:59Z"}}}


def created_status(**extra: Any) -> dict[str, Any]:
    return {"phase": "Running", "podsCreated": True, "startTime": st.fmt_time(NOW - timedelta(minutes=1)), **extra}


def cond(plan: st.Plan, type_: str) -> dict[str, Any] | None:
    return next((c for c in plan.status["conditions"] if c["type"] == type_), None)


# ------------------------------------------------------------------------- creation and running

def test_new_job_creates_every_pod() -> None:
    plan = st.decide(job(), [], NOW)
    assert plan.create_nodes == [0, 1] and plan.delete_pods == []
    assert plan.status["phase"] == "Pending" and plan.status["podsCreated"] is True
    assert plan.status["startTime"] == st.fmt_time(NOW) and plan.status["observedGeneration"] == 1
    assert cond(plan, "Created")["status"] == "True"
    assert cond(plan, "CheckpointEphemeral")["status"] == "True"
    assert plan.status["ranks"] == {"desired": 2, "ready": 0, "running": 0, "succeeded": 0, "failed": 0}


def test_replayed_pass_creates_nothing_twice() -> None:
    j = job()
    first = st.decide(j, [], NOW)
    j["status"] = first.status
    pods = [pod(j, n) for n in first.create_nodes]
    again = st.decide(j, pods, NOW)
    assert again.create_nodes == [] and again.delete_pods == []
    assert again.status == first.status or again.status["phase"] == "Pending"


def test_all_running_is_running_with_ready_counts() -> None:
    j = job(created_status(phase="Pending"))
    plan = st.decide(j, running(j), NOW)
    assert plan.status["phase"] == "Running" and plan.status["ready"] == "2/2"
    assert cond(plan, "Running")["status"] == "True"
    assert [e.reason for e in plan.events] == ["Running"]
    # steady state: nothing to do, no new event
    j["status"] = plan.status
    again = st.decide(j, running(j), NOW + timedelta(seconds=5))
    assert again.events == [] and again.create_nodes == [] and again.delete_pods == []
    assert again.status == plan.status


def test_scheduled_but_not_running_is_starting() -> None:
    j = job(created_status(phase="Pending"))
    pods = [pod(j, n) for n in range(2)]
    for p in pods:
        p["spec"]["nodeName"] = "node-a"
    assert st.decide(j, pods, NOW).status["phase"] == "Starting"
    unscheduled = [pod(j, n) for n in range(2)]
    assert st.decide(j, unscheduled, NOW).status["phase"] == "Pending"


# ------------------------------------------------------------------------- failures and restarts

def test_target_failure_restarts_the_whole_job_with_backoff() -> None:
    j = job(created_status())
    pods = running(j)
    pods[1]["status"]["containerStatuses"][0].update(exited(1))
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Restarting"
    assert sorted(plan.delete_pods) == ["j-0", "j-1"]
    assert plan.status["restarts"] == 1 and plan.status["restartsTowardsMax"] == 1
    assert plan.status["restartGeneration"] == 1 and plan.status["podsCreated"] is False
    assert plan.status["restartAt"] == st.fmt_time(NOW + timedelta(seconds=10))
    assert plan.requeue_after == 10
    assert "j-1" in plan.status["lastFailure"]
    assert any(e.type == "Warning" for e in plan.events)

    # during the backoff: wait, delete leftovers, create nothing
    j["status"] = plan.status
    wait = st.decide(j, pods, NOW + timedelta(seconds=3))
    assert wait.status["phase"] == "Restarting" and wait.create_nodes == []
    assert wait.requeue_after == pytest.approx(7)
    # backoff over, old pods gone: the new generation is created
    go = st.decide(j, [], NOW + timedelta(seconds=11))
    assert go.create_nodes == [0, 1] and go.generation == 1 and "restartAt" not in go.status
    # old pods of generation 0 still terminating under the same names: wait for them
    j2 = job(dict(plan.status, restartAt=None))
    old = [dict(p, metadata=dict(p["metadata"], deletionTimestamp="2026-01-01T12:00:00Z")) for p in pods]
    blocked = st.decide(j2, old, NOW + timedelta(seconds=11))
    assert blocked.create_nodes == [] and blocked.requeue_after == 1.0


def test_backoff_is_exponential_and_capped() -> None:
    assert [st.backoff_seconds(10, n) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert st.backoff_seconds(10, 40) == st.MAX_BACKOFF_S
    assert st.backoff_seconds(0, 3) == 0


def test_max_restarts_reached_fails_the_job() -> None:
    j = job(created_status(restarts=3, restartsTowardsMax=3, restartGeneration=3))
    pods = running(j, gen=3)
    pods[0]["status"]["containerStatuses"][0].update(exited(1))
    pods[0]["status"]["phase"] = "Failed"
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Failed"
    assert cond(plan, "Failed")["reason"] == "BackoffLimitExceeded"
    assert plan.status["completionTime"] == st.fmt_time(NOW)
    assert plan.delete_pods == ["j-1"]  # the still-running pod; the failed one is kept for its logs


@pytest.mark.parametrize("action,phase,towards_max,drafter_off", [
    ("FailJob", "Failed", 0, False),
    ("RestartJob", "Restarting", 1, False),
    ("RestartJobIgnoreMax", "Restarting", 0, False),
    ("RestartWithoutDrafter", "Restarting", 1, True),
])
def test_failure_policy_rules(action: str, phase: str, towards_max: int, drafter_off: bool) -> None:
    rules = [{"action": action, "onExitCodes": {"container": "target", "operator": "In", "values": [42]}}]
    j = job(created_status(), runPolicy={"failurePolicy": {"rules": rules}})
    pods = running(j)
    pods[0]["status"]["containerStatuses"][0].update(exited(42))
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == phase
    assert plan.status["restartsTowardsMax"] == towards_max
    assert plan.status["drafterDisabled"] is drafter_off and plan.drafter_disabled is drafter_off
    if action == "FailJob":
        assert cond(plan, "Failed")["reason"] == "FailedByPolicy"
    if drafter_off:
        assert cond(plan, "DrafterDegraded")["status"] == "True"
    # a code the rule does not match falls back to RestartJob
    pods[0]["status"]["containerStatuses"][0].update(exited(3))
    other = st.decide(j, pods, NOW)
    assert other.status["phase"] == "Restarting" and other.status["restartsTowardsMax"] == 1


CONFIG_LINE = ("configuration error: spec.target.data.batchSize: 6 must be a multiple of "
               "spec.target.parallelism.microbatches (4)")


def config_exit(message: str = CONFIG_LINE) -> dict[str, Any]:
    out = exited(2)
    out["state"]["terminated"]["message"] = message
    return out


def test_target_config_error_fails_the_job_without_a_restart() -> None:
    j = job(created_status())
    pods = running(j)
    pods[1]["status"]["containerStatuses"][0].update(config_exit())
    pods[1]["status"]["phase"] = "Failed"
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Failed"
    failed = cond(plan, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "ConfigError"
    assert failed["message"].startswith("j-1: target exited with code 2") and CONFIG_LINE in failed["message"]
    assert plan.status["restarts"] == 0 and plan.status["restartsTowardsMax"] == 0
    assert plan.status["restartGeneration"] == 0 and plan.create_nodes == []
    assert plan.delete_pods == ["j-0"]  # the still-running rank; the failed pod is kept for its logs
    assert CONFIG_LINE in plan.status["lastFailure"]
    assert plan.status["completionTime"] == st.fmt_time(NOW)
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "Failed")]
    assert CONFIG_LINE in plan.events[0].message
    # terminal: the next pass changes nothing and restarts nothing
    j["status"] = plan.status
    again = st.decide(j, pods, NOW + timedelta(seconds=30))
    assert again.status["phase"] == "Failed" and again.status["restarts"] == 0 and again.create_nodes == []


def test_a_rule_on_exit_2_wins_over_config_error() -> None:
    rules = [{"action": "RestartJob", "onExitCodes": {"container": "target", "operator": "In", "values": [2]}}]
    j = job(created_status(), runPolicy={"failurePolicy": {"rules": rules}})
    pods = running(j)
    pods[0]["status"]["containerStatuses"][0].update(config_exit())
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Restarting"
    assert plan.status["restarts"] == 1 and plan.status["restartsTowardsMax"] == 1
    assert cond(plan, "Failed") is None and CONFIG_LINE in plan.status["lastFailure"]


def test_drafter_config_error_keeps_the_job_running() -> None:
    j = job(created_status())
    pods = running(j, drafter={"restartCount": 1, "state": {"running": {}},
                               "lastState": {"terminated": {"exitCode": 2, "reason": "Error",
                                                            "message": "configuration error: bad drafter"}}})
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Running" and plan.delete_pods == []
    assert plan.status["drafterFailures"] == 1 and cond(plan, "Failed") is None


def test_drafter_crash_never_fails_or_restarts_the_job() -> None:
    j = job(created_status())
    pods = running(j, drafter={"restartCount": 1, "state": {"running": {}},
                               "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}})
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Running" and plan.delete_pods == []
    assert plan.status["drafterFailures"] == 1 and plan.status["drafterDisabled"] is False


def crashed(restarts: int, code: int = 1, at: str = "2026-01-01T11:59:00Z") -> dict[str, Any]:
    return {"restartCount": restarts, "state": {"running": {}},
            "lastState": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": at}}}


def test_drafter_past_max_failures_is_disabled_in_place() -> None:
    j = job(created_status(restarts=0), drafter={"maxFailures": 1})
    pods = running(j, drafter=crashed(2))
    plan = st.decide(j, pods, NOW)
    assert plan.status["drafterDisabled"] is True and plan.status["drafterDisabledGeneration"] == 0
    degraded = cond(plan, "DrafterDegraded")
    assert degraded["status"] == "True" and degraded["reason"] == "TooManyFailures"
    assert "disabled in place" in degraded["message"] and "maxFailures 1" in degraded["message"]
    assert plan.status["drafter"]["state"] == "Degraded"
    # the target is untouched: nothing deleted, no restart, still Running
    assert plan.status["phase"] == "Running" and plan.delete_pods == [] and plan.create_nodes == []
    assert plan.status["restarts"] == 0 and plan.status["restartsTowardsMax"] == 0
    assert plan.status["restartGeneration"] == 0
    # the running sidecars read status.drafterDisabled; pods of this generation built later carry the
    # annotation at creation
    assert plan.drafter_off == "TooManyFailures"
    assert plan.drafter_disabled is False, "the current generation keeps its sidecars (idle)"
    # each rank's failure is announced, then the disable
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "DrafterFailed")] * 2 + [
        ("Warning", "DrafterDegraded")]
    # idempotent: the next pass changes nothing and posts nothing
    j["status"] = plan.status
    again = st.decide(j, pods, NOW + timedelta(seconds=5))
    assert again.events == [] and again.delete_pods == [] and again.status["drafterDisabled"] is True
    assert again.status["phase"] == "Running" and again.status["restarts"] == 0


@pytest.mark.parametrize("rule_action,restarted", [
    ("FailJob", False), ("RestartWithoutDrafter", False), ("RestartJob", True), ("RestartJobIgnoreMax", True)])
def test_drafter_rules_disable_in_place_or_restart_without_spending_the_budget(rule_action: str,
                                                                              restarted: bool) -> None:
    rules = [{"action": rule_action, "onExitCodes": {"container": "drafter", "operator": "In", "values": [1]}}]
    j = job(created_status(), runPolicy={"failurePolicy": {"rules": rules}})
    plan = st.decide(j, running(j, drafter=crashed(1)), NOW)
    assert plan.status["restartsTowardsMax"] == 0
    if restarted:   # a rule asking for a restart keeps its meaning (not counted against maxRestarts)
        assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
        assert plan.status["drafterDisabled"] is False
    else:
        assert plan.status["phase"] == "Running" and plan.status["restarts"] == 0 and plan.delete_pods == []
        assert plan.status["drafterDisabled"] is True and plan.drafter_off == rule_action
        assert cond(plan, "DrafterDegraded")["reason"] == rule_action


def test_after_an_in_place_disable_the_next_restart_builds_pods_without_the_drafter() -> None:
    degraded = [{"type": "DrafterDegraded", "status": "True", "reason": "TooManyFailures", "message": "x",
                 "lastTransitionTime": st.fmt_time(NOW)}]
    j = job(created_status(drafterDisabled=True, drafterDisabledGeneration=0, conditions=degraded))
    pods = running(j)
    pods[0]["status"]["containerStatuses"][0].update(exited(1))
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Restarting" and plan.generation == 1
    assert plan.drafter_disabled is True and plan.drafter_off == ""
    # pods of the disabled generation created later (say their predecessors were still terminating)
    j = job(created_status(drafterDisabled=True, drafterDisabledGeneration=2, restartGeneration=2,
                           podsCreated=False, conditions=degraded))
    plan = st.decide(j, [], NOW)
    assert plan.create_nodes == [0, 1] and plan.drafter_disabled is False and plan.drafter_off == "TooManyFailures"
    # a status of an older operator (no generation): the drafter is off in every generation
    j = job(created_status(drafterDisabled=True, podsCreated=False))
    plan = st.decide(j, [], NOW)
    assert plan.drafter_disabled is True and plan.drafter_off == ""


def test_peer_frame_exits_are_counted_apart_from_the_drafters_own_failures() -> None:
    j = job(created_status(), drafter={"maxFailures": 2})
    seen = []

    def step(restarts: int, code: int, at: str) -> st.Plan:
        pods = running(j)
        pods[0]["status"]["initContainerStatuses"] = [{"name": "drafter", **crashed(restarts, code, at)}]
        plan = st.decide(j, pods, NOW)
        j["status"] = plan.status
        seen.append([e.reason for e in plan.events if e.reason.startswith("Drafter")])
        return plan

    plan = step(1, 87, "2026-01-01T11:00:00Z")
    assert plan.status["drafterPeerFailures"] == 1 and plan.status["drafterFailures"] == 0
    plan = step(1, 87, "2026-01-01T11:00:00Z")          # the same exit seen again: counted once
    assert plan.status["drafterPeerFailures"] == 1
    for n in (2, 3, 4):                                  # more peer frames: past maxFailures in restarts...
        plan = step(n, 87, f"2026-01-01T11:0{n}:00Z")
    assert plan.status["drafterPeerFailures"] == 4 and plan.status["drafterFailures"] == 0
    assert plan.status["drafterDisabled"] is False and plan.status["phase"] == "Running"   # ...never disabled
    assert plan.status["drafterPeerFrames"] == {"0": {"count": 4, "last": "2026-01-01T11:04:00Z"}}
    plan = step(5, 1, "2026-01-01T11:10:00Z")            # own failures: 5 restarts - 4 peer frames
    assert plan.status["drafterFailures"] == 1 and plan.status["drafterDisabled"] is False
    plan = step(6, 1, "2026-01-01T11:11:00Z")
    assert plan.status["drafterFailures"] == 2 and plan.status["drafterDisabled"] is True
    assert plan.status["drafterPeerFailures"] == 4 and plan.status["restarts"] == 0
    assert seen[:2] == [["DrafterPeerFrame"], []] and seen[-2:] == [["DrafterFailed"], ["DrafterFailed", "DrafterDegraded"]]


# A drafter crash as a real kubelet reports it: first state.terminated (the dead container's
# containerID, finishedAt) with restartCount unchanged, then state.waiting CrashLoopBackOff with the
# crash in lastState, still unchanged; restartCount rises only when the kubelet restarts the
# sidecar, after a back-off of up to 5 min.
CRASH_AT = "2026-01-01T11:59:30Z"


def kubelet_crash(code: int = 1, at: str = CRASH_AT, container: str = "a" * 64) -> dict[str, Any]:
    return {"exitCode": code, "reason": "Error", "message": "RuntimeError: CUDA out of memory",
            "startedAt": "2026-01-01T11:58:00Z", "finishedAt": at, "containerID": f"containerd://{container}"}


def crash_shapes(restarts: int, crash: dict[str, Any], before: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The drafter's status through one crash: terminated, back-off, restarted."""
    last = {"lastState": {"terminated": before}} if before else {"lastState": {}}
    return [{"restartCount": restarts, "state": {"terminated": crash}, **last},
            {"restartCount": restarts, "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                             "message": "back-off 10s restarting failed container"}},
             "lastState": {"terminated": crash}},
            {"restartCount": restarts + 1, "state": {"running": {"startedAt": "2026-01-01T11:59:45Z"}},
             "lastState": {"terminated": crash}}]


def drafter_pass(j: dict[str, Any], drafter_status: dict[str, Any], node: int = 0,
                 target: dict[str, Any] | None = None) -> st.Plan:
    pods = running(j)
    pods[node]["status"]["initContainerStatuses"] = [{"name": "drafter", **drafter_status}]
    if target is not None:
        pods[node]["status"]["containerStatuses"][0].update(target)
    plan = st.decide(j, pods, NOW)
    j["status"] = plan.status
    return plan


def test_a_drafter_crash_counts_once_from_the_pass_that_first_sees_it() -> None:
    j = job(created_status(), drafter={"maxFailures": 3})
    failed = []
    for shape in crash_shapes(0, kubelet_crash()):
        plan = drafter_pass(j, shape)
        assert plan.status["drafterFailures"] == 1, shape   # not 0 before the restart, not 2 after it
        failed.append([e for e in plan.events if e.reason == "DrafterFailed"])
        assert plan.status["phase"] == "Running" and plan.status["drafterDisabled"] is False
    assert [len(f) for f in failed] == [1, 0, 0], "one Event per failure, when it is first seen"
    event = failed[0][0]
    assert event.type == "Warning"
    assert event.message.startswith("j-0: ") and "code 1 (Error)" in event.message
    assert "CUDA out of memory" in event.message and "1 of maxFailures 3" in event.message


@pytest.mark.parametrize("shape", [0, 1], ids=["terminated", "CrashLoopBackOff"])
def test_the_max_failures_th_crash_disables_the_drafter_in_the_pass_that_first_sees_it(shape: int) -> None:
    j = job(created_status(drafterPeerFrames={"0": {"count": 0, "last": "2026-01-01T11:50:00Z"}}),
            drafter={"maxFailures": 3})
    second = kubelet_crash(at="2026-01-01T11:50:00Z", container="b" * 64)
    plan = drafter_pass(j, crash_shapes(2, kubelet_crash(), second)[shape])
    assert plan.status["drafterFailures"] == 3
    assert plan.status["drafterDisabled"] is True and cond(plan, "DrafterDegraded")["reason"] == "TooManyFailures"
    assert [e.reason for e in plan.events] == ["DrafterFailed", "DrafterDegraded"]
    assert "3 of maxFailures 3" in plan.events[0].message
    assert plan.status["phase"] == "Running" and plan.delete_pods == []


def test_a_drafter_crash_at_the_end_of_the_job_is_counted_and_a_shutdown_stop_is_not() -> None:
    done = {"state": {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": "2026-01-01T11:59:50Z"}}}
    j = job(created_status(), drafter={"maxFailures": 3})
    # crashed 20 s before the target finished; the kubelet never restarted it
    plan = drafter_pass(j, crash_shapes(0, kubelet_crash())[1], target=done)
    assert plan.status["drafterFailures"] == 1 and [e.reason for e in plan.events].count("DrafterFailed") == 1
    # stopped by the kubelet after the target ended: no failure
    j = job(created_status(), drafter={"maxFailures": 3})
    stopped = {"restartCount": 0, "state": {"terminated": kubelet_crash(143, "2026-01-01T11:59:51Z")}}
    plan = drafter_pass(j, stopped, target=done)
    assert plan.status["drafterFailures"] == 0 and "DrafterFailed" not in [e.reason for e in plan.events]


def test_a_peer_frame_exit_not_yet_restarted_is_no_own_failure() -> None:
    j = job(created_status(), drafter={"maxFailures": 1})
    for shape in crash_shapes(0, kubelet_crash(87)):
        plan = drafter_pass(j, shape)
        assert plan.status["drafterFailures"] == 0 and plan.status["drafterPeerFailures"] == 1
        assert plan.status["drafterDisabled"] is False


def test_forged_drafter_bookkeeping_is_ignored() -> None:
    j = job(created_status(drafterDisabledGeneration="x", drafterPeerFailures=-3,
                           drafterPeerFrames={"0": {"count": "9", "last": 1}, "7": {"count": 1, "last": ""},
                                              "1": {"count": 2, "last": "t"}, "a": 5}))
    plan = st.decide(j, running(j), NOW)
    assert "drafterDisabledGeneration" not in plan.status and plan.status["drafterPeerFailures"] == 0
    assert plan.status["drafterPeerFrames"] == {"1": {"count": 2, "last": "t"}}   # only the well-formed rank


def test_pod_deleted_by_someone_else_is_a_restart_not_counted_against_max() -> None:
    j = job(created_status(restartsTowardsMax=3, restarts=3))
    pods = running(j)[:1]
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 4
    assert plan.status["restartsTowardsMax"] == 3 and "restartAt" not in plan.status
    assert plan.delete_pods == ["j-0"]
    j["status"] = plan.status
    again = st.decide(j, [], NOW)
    assert again.create_nodes == [0, 1] and again.generation == 1


def test_pods_of_older_generations_are_deleted() -> None:
    j = job(created_status(restartGeneration=2))
    pods = running(j, gen=2) + [pod(j, 0, gen=1, phase="Running")]
    pods[-1]["metadata"]["name"] = "j-0-stale"
    plan = st.decide(j, pods, NOW)
    assert plan.delete_pods == ["j-0-stale"] and plan.status["phase"] == "Running"


# ------------------------------------------------------------------------- Kueue pod groups

QUEUED = {"kueue.x-k8s.io/queue-name": "lq"}


def test_a_replacement_waits_until_the_old_pod_of_its_node_stopped() -> None:
    """Kueue keeps a pod that ended (its finalizer) until a replacement exists, so a queued job's
    replacements take the other name (objects.pod_object_name); they are still created only
    once the old pod no longer runs: two pods of one rank never run at once."""
    j = job(created_status(restartGeneration=1, podsCreated=False))
    j["metadata"]["labels"] = dict(QUEUED)
    old = running(j, gen=0)
    for p in old:  # deleted by the restart, still running: its kubelet has not stopped it yet
        p["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:59Z"
        p["spec"]["nodeName"] = "node-a"
    plan = st.decide(j, old, NOW)
    assert plan.create_nodes == [] and plan.requeue_after == 1.0 and plan.force_delete_pods == []
    old[0]["status"]["phase"] = "Failed"  # node 0's kubelet stopped it; Kueue still holds it
    plan = st.decide(j, old, NOW)
    assert plan.create_nodes == [0]
    assert builders.pod(j, 0, generation=1)[0]["metadata"]["name"] == "j-0-r" != old[0]["metadata"]["name"]


def test_a_pod_on_a_lost_node_is_force_deleted_once_well_past_its_grace_period() -> None:
    """The taint manager deletes the pods of an unreachable node; nothing but that node's kubelet
    would remove them, and the replacements need their names: the operator stops waiting
    FORCE_DELETE_AFTER_S after their deletionTimestamp (a live kubelet removes a pod seconds after
    it), and only then."""
    from spectrain_operator.policy.restart import FORCE_DELETE_AFTER_S

    j = job(created_status())
    pods = running(j)
    lost = pods[1]
    lost["spec"]["nodeName"] = "node-b"
    due = NOW + timedelta(seconds=30)          # evicted now, with a 30 s grace period
    lost["metadata"]["deletionTimestamp"] = st.fmt_time(due)
    lost["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                         "reason": "DeletionByTaintManager",
                                         "message": "Taint manager: deleting due to NoExecute taint"})
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["lastFailure"].startswith("pod(s) j-1 evicted")
    assert plan.force_delete_pods == [] and plan.requeue_after == 0.0    # the restart looks again at once
    j["status"] = plan.status
    plan = st.decide(j, pods, due + timedelta(seconds=FORCE_DELETE_AFTER_S - 1))
    assert plan.force_delete_pods == [] and plan.create_nodes == []
    assert plan.requeue_after == pytest.approx(1.0)
    plan = st.decide(j, pods, due + timedelta(seconds=FORCE_DELETE_AFTER_S))
    assert plan.force_delete_pods == ["j-1"] and plan.create_nodes == []
    (ev,) = [e for e in plan.events if e.reason == "PodForceDeleted"]
    assert ev.type == "Warning" and "node-b" in ev.message and "j-1" in ev.message
    j["status"] = plan.status
    plan = st.decide(j, [], due + timedelta(seconds=FORCE_DELETE_AFTER_S + 1))   # both gone: the new gang
    assert plan.force_delete_pods == [] and plan.create_nodes == [0, 1]


def test_a_pod_group_evicted_by_kueue_restarts_with_kueues_reason() -> None:
    j = job(created_status())
    j["metadata"]["labels"] = dict(QUEUED)
    pods = running(j)
    for p in pods:  # what Kueue does to a preempted pod group: a condition, then a delete
        p["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:00Z"
        p["status"]["conditions"].append({"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvicted",
                                          "message": "Preempted to accommodate a workload due to prioritization"})
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restartsTowardsMax"] == 0
    assert plan.status["lastFailure"] == ("pod(s) j-0, j-1 evicted (WorkloadEvicted): Preempted to accommodate "
                                          "a workload due to prioritization")
    assert [e.reason for e in plan.events][0] == "PodEvicted"


def test_gated_pods_are_queued() -> None:
    j = job(created_status())
    j["metadata"]["labels"] = dict(QUEUED)
    pods = [pod(j, n) for n in range(2)]
    for p in pods:
        p["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Pending"
    assert [e.message for e in plan.events] == ["waiting for Kueue to admit the pod group (LocalQueue lq)"]
    assert cond(plan, "Queued")["status"] == "True"
    j["status"] = plan.status
    for p in pods:  # admitted: ungated and scheduled
        p["spec"]["schedulingGates"] = []
        p["spec"]["nodeName"] = "n"
    assert cond(st.decide(j, pods, NOW), "Queued")["reason"] == "Admitted"


# ------------------------------------------------------------------------- suspend, success, deadline, TTL

def test_suspend_deletes_pods_and_resume_recreates_them() -> None:
    j = job(created_status(), suspend=True)
    plan = st.decide(j, running(j), NOW)
    assert plan.status["phase"] == "Suspended" and sorted(plan.delete_pods) == ["j-0", "j-1"]
    assert cond(plan, "Suspended")["status"] == "True" and "startTime" not in plan.status
    assert plan.create_nodes == []
    resumed = job(plan.status)
    plan2 = st.decide(resumed, [], NOW + timedelta(minutes=5))
    assert plan2.create_nodes == [0, 1] and cond(plan2, "Suspended")["status"] == "False"
    assert plan2.status["startTime"] == st.fmt_time(NOW + timedelta(minutes=5))


def test_all_targets_exit_zero_is_succeeded_and_terminal() -> None:
    j = job(created_status())
    pods = [pod(j, n, phase="Succeeded", target=exited(0)) for n in range(2)]
    plan = st.decide(j, pods, NOW)
    assert plan.status["phase"] == "Succeeded" and cond(plan, "Succeeded")["status"] == "True"
    assert plan.status["ranks"]["succeeded"] == 2 and plan.delete_pods == []
    j["status"] = plan.status
    later = st.decide(j, [], NOW + timedelta(hours=1))  # pods gone later: still Succeeded, nothing recreated
    assert later.status["phase"] == "Succeeded" and later.create_nodes == []


def test_succeeded_waits_for_the_pods_to_finish_so_the_drafters_last_export_is_in() -> None:
    """The targets exited 0 but the kubelet is still stopping the drafter sidecars (their final
    combine, export and report): Running; Succeeded once the pods have finished."""
    j = job(created_status())
    shutting_down = [pod(j, n, phase="Running", target=exited(0), drafter={"state": {"running": {}}})
                     for n in range(2)]
    plan = st.decide(j, shutting_down, NOW)
    assert plan.status["phase"] == "Running" and cond(plan, "Succeeded") is None, plan.status
    j["status"] = plan.status
    finished = [pod(j, n, phase="Succeeded", target=exited(0)) for n in range(2)]
    finished[1] = pod(j, 1, phase="Running", target=exited(0), drafter={"state": {"running": {}}})
    assert st.decide(j, finished, NOW).status["phase"] == "Running"
    finished[1] = pod(j, 1, phase="Succeeded", target=exited(0))
    assert st.decide(j, finished, NOW).status["phase"] == "Succeeded"


def test_a_job_whose_drafter_never_trained_says_so_once() -> None:
    """Succeeded with the drafter on and 0 s harvested (every drafter waited for target weights that
    never came): condition DrafterNeverTrained naming each rank's state, and one Warning Event."""
    j = job(created_status())
    pods = [pod(j, n, phase="Succeeded", target=exited(0)) for n in range(2)]
    waiting = json.dumps({"state": "Waiting", "reason": "NoTargetWeights", "harvestedSeconds": 0.0})
    j["status"][STATUS_REPORTS] = reports(pods, n0={REPORT_DRAFTER: waiting}, n1={REPORT_DRAFTER: waiting})
    plan = st.decide(j, pods, NOW)
    c = cond(plan, "DrafterNeverTrained")
    assert plan.status["phase"] == "Succeeded" and c is not None and c["status"] == "True"
    assert c["reason"] == "NoTargetWeights" and "rank 1: Waiting/NoTargetWeights" in c["message"]
    assert [e.reason for e in plan.events if e.type == "Warning"] == ["DrafterNeverTrained"]
    j["status"] = {**plan.status, STATUS_REPORTS: j["status"][STATUS_REPORTS]}
    again = st.decide(j, pods, NOW + timedelta(seconds=5))
    assert cond(again, "DrafterNeverTrained")["status"] == "True"
    assert not [e for e in again.events if e.reason == "DrafterNeverTrained"], "one Event, not one per pass"


def test_never_trained_takes_only_a_bounded_plain_reason_from_the_pods_reports() -> None:
    """status.reports is written by the job's containers: what reaches the condition is bounded."""
    j = job(created_status())
    pods = [pod(j, n, phase="Succeeded", target=exited(0)) for n in range(2)]
    hostile = json.dumps({"state": {"x": 1}, "reason": "No Ring/<script>" * 200, "harvestedSeconds": 0})
    j["status"][STATUS_REPORTS] = reports(pods, n0={REPORT_DRAFTER: hostile}, n1={REPORT_DRAFTER: hostile})
    c = cond(st.decide(j, pods, NOW), "DrafterNeverTrained")
    assert c is not None and c["reason"].isalnum() and len(c["reason"]) <= 128
    assert len(c["message"]) <= 2000


def test_a_job_whose_drafter_harvested_or_was_off_has_no_never_trained_condition() -> None:
    j = job(created_status())
    pods = [pod(j, n, phase="Succeeded", target=exited(0)) for n in range(2)]
    worked = json.dumps({"state": "Waiting", "reason": "Stopped", "harvestedSeconds": 3.5})
    j["status"][STATUS_REPORTS] = reports(pods, n0={REPORT_DRAFTER: worked})
    assert cond(st.decide(j, pods, NOW), "DrafterNeverTrained") is None
    off = job(created_status(), drafter={"enabled": False})
    assert cond(st.decide(off, [pod(off, n, phase="Succeeded", target=exited(0)) for n in range(2)], NOW),
                "DrafterNeverTrained") is None


def test_one_target_done_one_running_is_still_running() -> None:
    j = job(created_status())
    pods = running(j)
    pods[0] = pod(j, 0, phase="Succeeded", target=exited(0))
    assert st.decide(j, pods, NOW).status["phase"] == "Running"


def test_ttl_after_finished() -> None:
    done = {"phase": "Succeeded", "completionTime": st.fmt_time(NOW)}
    keep = st.decide(job(done, runPolicy={"ttlSecondsAfterFinished": 60}), [], NOW + timedelta(seconds=20))
    assert not keep.delete_job and keep.requeue_after == pytest.approx(40)
    gone = st.decide(job(done, runPolicy={"ttlSecondsAfterFinished": 60}), [], NOW + timedelta(seconds=61))
    assert gone.delete_job
    never = st.decide(job(done), [], NOW + timedelta(days=9))
    assert not never.delete_job and never.requeue_after is None


def test_active_deadline() -> None:
    j = job(created_status(), runPolicy={"activeDeadlineSeconds": 120})
    ok = st.decide(j, running(j), NOW)
    assert ok.status["phase"] == "Running" and ok.requeue_after == pytest.approx(60)
    late = st.decide(j, running(j), NOW + timedelta(seconds=61))
    assert late.status["phase"] == "Failed" and cond(late, "Failed")["reason"] == "DeadlineExceeded"
    assert sorted(late.delete_pods) == ["j-0", "j-1"]


def test_spec_errors_fail_with_spec_invalid_and_create_nothing() -> None:
    plan = st.decide(job(), [], NOW, ["spec.target.parallelism.pipeline: 3 stages do not divide ..."])
    assert plan.status["phase"] == "Failed" and plan.create_nodes == []
    c = cond(plan, "SpecInvalid")
    assert c["status"] == "True" and c["message"].startswith("spec.target.parallelism.pipeline")


# ------------------------------------------------------------------------- status path and hostile input

def reports(pods: list[dict[str, Any]], **by_node: dict[str, str]) -> dict[str, Any]:
    """status.reports as the pods' podstatus writes it: {uid: {pod, progress?, drafter?}}."""
    return {pods[int(n[1:])]["metadata"]["uid"]: {REPORT_POD: pods[int(n[1:])]["metadata"]["name"], **r}
            for n, r in by_node.items()}


def test_progress_and_drafter_from_the_pods_reports() -> None:
    j = job(created_status())
    prog = json.dumps({"step": 120, "totalSteps": 1000, "loss": 3.21, "tokensPerSecond": 1850.0,
                       "updatedAt": "2026-01-01T11:59:00Z"})
    d0 = json.dumps({"state": "Active", "harvestedSeconds": 20.0, "harvestEfficiency": 0.8,
                     "acceptanceLength": 2.0,
                     "exportsRejectedByCause": {"below_latest": 3, "below_floor": 1, "unknown": 5,
                                                "non_finite": -2, "unmeasured": True, "version_reused": 1.5}})
    artifact = f"{builders.export_dir(j)}/v3"      # from the exporting (last) rank's pod
    d1 = json.dumps({"state": "Waiting", "harvestedSeconds": 21.7, "harvestEfficiency": 0.92, "artifact": artifact,
                     "combineAdjustedByCause": {"work_capped": 4, "outlier_clipped": 2**40, "weight_capped": 1,
                                                "made_up": 9}})
    pods = running(j)
    j["status"][STATUS_REPORTS] = reports(pods, n0={REPORT_PROGRESS: prog, REPORT_DRAFTER: d0},
                                          n1={REPORT_DRAFTER: d1})
    plan = st.decide(j, pods, NOW)
    assert plan.status["progress"] == {"step": 120, "totalSteps": 1000, "loss": 3.21,
                                       "tokensPerSecond": 1850.0, "updatedAt": "2026-01-01T11:59:00Z"}
    d = plan.status["drafter"]
    assert d["state"] == "Active" and d["activeRanks"] == 1
    assert d["harvestedSeconds"] == pytest.approx(41.7) and d["harvestEfficiency"] == pytest.approx(0.86)
    assert d["acceptanceLength"] == 2.0 and d["artifact"] == artifact and d["reportFieldsRefused"] == 0
    # the gate's rejections by cause: known causes, non-negative integers only
    assert d["exportsRejectedByCause"] == {"below_latest": 3, "below_floor": 1, "non_finite": 0, "unmeasured": 0,
                                           "version_reused": 0}
    # the robust combine's adjustments by cause (the coordinator's report), read the same way
    assert d["combineAdjustedByCause"] == {"work_capped": 4, "outlier_clipped": 0, "weight_capped": 1}
    assert cond(plan, "DrafterActive")["status"] == "True"
    assert STATUS_REPORTS not in plan.status, "the reports are the pods': the operator never writes them back"


def test_reports_of_an_earlier_pod_or_naming_another_pod_are_not_read() -> None:
    j = job(created_status())
    pods = running(j)
    prog = json.dumps({"step": 9})
    # a report under a UID no current pod has (the pod of that name before a restart), and one under
    # rank 0's UID that names another pod: neither is rank 0's progress
    j["status"][STATUS_REPORTS] = {"uid-0-old": {REPORT_POD: "j-0", REPORT_PROGRESS: prog},
                                   "uid-0-0": {REPORT_POD: "j-1", REPORT_PROGRESS: prog}}
    assert st.decide(j, pods, NOW).status["progress"] == {"step": 0, "totalSteps": j["spec"]["target"]["steps"]}
    assert podlib.stale_reports(j["status"], pods) == ["uid-0-old"]
    assert podlib.stale_reports({}, pods) == [] and podlib.stale_reports({STATUS_REPORTS: "x"}, pods) == []


@pytest.mark.parametrize("raw", ["{not json", "[1,2]", '{"step": "many", "loss": NaN}',
                                 '{"step": -5, "loss": Infinity, "tokensPerSecond": true}', "x" * 100000, 7, None])
def test_hostile_reports_are_ignored_not_fatal(raw: Any) -> None:
    j = job(created_status())
    pods = running(j)
    j["status"][STATUS_REPORTS] = reports(pods, n0={REPORT_PROGRESS: raw, REPORT_DRAFTER: raw})
    plan = st.decide(j, pods, NOW)
    p = plan.status["progress"]
    assert isinstance(p["step"], int) and p["step"] >= 0
    assert p.get("loss") is None or isinstance(p["loss"], float)
    json.dumps(plan.status, allow_nan=False)  # always valid JSON for the API server


@pytest.mark.parametrize("garbage", [
    {"phase": "Exploded", "restarts": "many", "conditions": "nope", "restartAt": 12, "podsCreated": "yes"},
    {"phase": None, "restarts": -4, "conditions": [1, {"type": 3}, {"type": "X", "status": "Maybe"}]},
    {"startTime": "yesterday", "completionTime": {}, "progress": [], "drafter": "x", "lastFailure": 7},
    {"restartGeneration": 10**20, "drafterFailures": True},
    {"reports": "x"}, {"reports": {"u": 5, "v": {"pod": 3, "progress": {}}}},
])
def test_status_written_by_a_user_never_crashes(garbage: dict[str, Any]) -> None:
    j = job(garbage)
    plan = st.decide(j, [], NOW)
    assert plan.status["phase"] in st.PHASES
    json.dumps(plan.status, allow_nan=False)
