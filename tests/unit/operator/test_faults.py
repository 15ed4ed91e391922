"""Fault classification from pod status (drafter vs target vs MPS loss) and failurePolicy actions."""

from __future__ import annotations

from typing import Any

import pytest

from spectrain_api.verdict import SupervisorVerdict
from spectrain_operator import faults
from spectrain_operator.faults import PodFault, action_for, classify_pod

pytestmark = pytest.mark.unit

T0 = "2026-11-29T12:00:00Z"
T1 = "2026-11-29T12:00:01Z"
T5 = "2026-11-29T12:00:05Z"
T_LATE = "2026-11-29T12:10:00Z"


def term(code: int, at: str = T1, reason: str = "Error", message: str = "") -> dict:
    t: dict[str, Any] = {"exitCode": code, "reason": reason, "finishedAt": at}
    if message:
        t["message"] = message
    return t


def status(name: str, *, state: dict | None = None, last: dict | None = None, restarts: int = 0) -> dict:
    return {"name": name, "state": state or {"running": {"startedAt": T0}},
            "lastState": last or {}, "restartCount": restarts}


def pod(target: dict | None = None, drafter: dict | None = None, mps: dict | None = None,
        phase: str = "Running", **extra: Any) -> dict:
    inits = [s for s in (mps, drafter) if s is not None]
    st: dict[str, Any] = {"phase": phase, "containerStatuses": [target or status("target")],
                          "initContainerStatuses": inits, **extra}
    return {"metadata": {"name": "demo-0"}, "status": st}


def job(rules: list[dict] | None = None, max_failures: int = 3) -> dict:
    return {"metadata": {"name": "demo"},
            "spec": {"drafter": {"maxFailures": max_failures},
                     "runPolicy": {"failurePolicy": {"rules": rules or []}}}}


def rule(action: str, container: str, values: list[int], operator: str = "In") -> dict:
    return {"action": action, "onExitCodes": {"container": container, "operator": operator, "values": values}}


# ------------------------------------------------------------------------------ classification


def test_healthy_and_succeeded_pods_have_no_fault() -> None:
    assert classify_pod(pod(drafter=status("drafter"))) is None
    done = pod(status("target", state={"terminated": term(0, T1, "Completed")}),
               status("drafter", state={"terminated": term(143, T1)}), phase="Succeeded")
    assert classify_pod(done) is None, "a sidecar stopped at the target's end is shutdown, not a fault"


def test_target_fault() -> None:
    f = classify_pod(pod(status("target", state={"terminated": term(42, T1)}), status("drafter")))
    # restarts: terminations so far, this one included (restartCount 0: not restarted yet)
    assert f == PodFault("target", 42, "TargetFailed", f.message if f else "", restarts=1)
    assert f is not None and "code 42" in f.message


def test_target_oom() -> None:
    f = classify_pod(pod(status("target", state={"terminated": term(137, T1, "OOMKilled")})))
    assert f is not None and (f.container, f.reason, f.exit_code) == ("target", "TargetOOMKilled", 137)


def test_drafter_fault_while_target_runs() -> None:
    d = status("drafter", state={"waiting": {"reason": "CrashLoopBackOff"}}, last={"terminated": term(1, T1)},
               restarts=2)
    f = classify_pod(pod(drafter=d))
    assert f is not None
    # restartCount 2 plus the crash in back-off, which the kubelet counts only once it restarts it
    assert (f.container, f.exit_code, f.reason, f.restarts) == ("drafter", 1, "DrafterFailed", 3)


def test_drafter_oom() -> None:
    d = status("drafter", last={"terminated": term(137, T1, "OOMKilled")}, restarts=1)
    f = classify_pod(pod(drafter=d))
    assert f is not None and f.reason == "DrafterOOMKilled"


def test_drafter_clean_exit_is_not_a_fault() -> None:
    assert classify_pod(pod(drafter=status("drafter", last={"terminated": term(0, T1, "Completed")}))) is None


def test_mps_loss_caused_by_the_drafter() -> None:
    t = status("target", state={"terminated": term(86, T5, message="CUDA error: cudaErrorMpsClientTerminated")})
    d = status("drafter", last={"terminated": term(139, T1)}, restarts=1)
    f = classify_pod(pod(t, d))
    assert f is not None
    assert (f.container, f.reason, f.exit_code, f.caused_by_drafter) == ("mps", "MPSServerLost", 139, True)


def test_mps_loss_in_the_same_second_attributed_by_collateral_message() -> None:
    t = status("target", state={"terminated": term(1, T1, message="RuntimeError: CUDA error: "
                                                  "cudaErrorMpsClientTerminated")})
    d = status("drafter", state={"terminated": term(86, T1, message="CUDA error: an illegal memory access")})
    f = classify_pod(pod(t, d))
    assert f is not None and f.container == "mps" and f.caused_by_drafter and f.exit_code == 86


def test_mps_loss_not_attributable() -> None:
    t = status("target", state={"terminated": term(86, T1)})
    d = status("drafter", state={"terminated": term(86, T1)})
    f = classify_pod(pod(t, d))
    assert f is not None and f.container == "mps" and not f.caused_by_drafter and f.exit_code == 86


def test_unrelated_drafter_crash_long_before_is_a_target_fault() -> None:
    t = status("target", state={"terminated": term(86, T_LATE)})
    d = status("drafter", last={"terminated": term(86, T1)}, restarts=1)
    f = classify_pod(pod(t, d))
    assert f is not None and f.container == "target"


def test_non_gpu_exits_together_are_not_mps_loss() -> None:
    t = status("target", state={"terminated": term(1, T5, message="ValueError: bad batch")})
    d = status("drafter", last={"terminated": term(1, T1)}, restarts=1)
    f = classify_pod(pod(t, d))
    assert f is not None and f.container == "target"


def test_mps_daemon_lost() -> None:
    m = status("mps-daemon", last={"terminated": term(1, T1)}, restarts=1)
    t = status("target", state={"terminated": term(86, T5)})
    f = classify_pod(pod(t, status("drafter"), m))
    assert f is not None and (f.container, f.reason, f.exit_code) == ("mps", "MPSDaemonLost", 1)
    assert "target exited with code 86" in f.message


def test_mps_daemon_stopped_at_shutdown_is_not_a_fault() -> None:
    m = status("mps-daemon", state={"terminated": term(0, T5)})
    t = status("target", state={"terminated": term(0, T1, "Completed")})
    assert classify_pod(pod(t, None, m, phase="Succeeded")) is None


def test_evicted_pod_without_exit_code() -> None:
    p = {"metadata": {}, "status": {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"}}
    f = classify_pod(p)
    assert f is not None and (f.container, f.exit_code, f.reason) == ("target", faults.EXIT_UNKNOWN, "PodFailed")
    assert "Evicted" in f.message


def test_pod_being_deleted_has_no_fault() -> None:
    p = pod(status("target", state={"terminated": term(143, T1)}))
    p["metadata"]["deletionTimestamp"] = T1
    assert classify_pod(p) is None


@pytest.mark.parametrize(("verdict", "expected"), [
    (SupervisorVerdict("mps-by-drafter", 86, 2, False, 139, None), ("mps", 139, "MPSServerLost", True)),
    (SupervisorVerdict("mps-daemon", 86, 0, False, None, 1), ("mps", 1, "MPSDaemonLost", False)),
    (SupervisorVerdict("mps", 86, 1, False, 86, None), ("mps", 86, "MPSServerLost", False)),
    (SupervisorVerdict("target", 3, 0, False, None, None), ("target", 3, "TargetFailed", False)),
])
def test_single_container_supervisor_verdict(verdict: SupervisorVerdict, expected: tuple) -> None:
    code = verdict.target_exit_code or 0
    t = status("target", state={"terminated": term(code, T1, message=verdict.to_json())})
    f = classify_pod(pod(t))
    assert f is not None
    assert (f.container, f.exit_code, f.reason, f.caused_by_drafter) == expected


def test_single_container_success_verdict() -> None:
    v = SupervisorVerdict("success", 0, 1, False, 1, None)
    t = status("target", state={"terminated": term(0, T1, "Completed", message=v.to_json())})
    assert classify_pod(pod(t, phase="Succeeded")) is None


# ------------------------------------------------------------------------------ actions


def test_target_default_is_restart_job() -> None:
    assert action_for(PodFault("target", 1, "TargetFailed", ""), job()) == "RestartJob"


def test_first_matching_rule_wins() -> None:
    rules = [rule("FailJob", "target", [42]), rule("RestartJobIgnoreMax", "target", [42, 43]),
             rule("RestartWithoutDrafter", "target", [0, 42], operator="NotIn")]
    j = job(rules)
    assert action_for(PodFault("target", 42, "TargetFailed", ""), j) == "FailJob"
    assert action_for(PodFault("target", 43, "TargetFailed", ""), j) == "RestartJobIgnoreMax"
    assert action_for(PodFault("target", 86, "TargetFailed", ""), j) == "RestartWithoutDrafter"


def test_rules_for_the_other_container_do_not_match() -> None:
    j = job([rule("FailJob", "drafter", [1])])
    assert action_for(PodFault("target", 1, "TargetFailed", ""), j) == "RestartJob"


def test_unknown_exit_ignores_rules() -> None:
    j = job([rule("FailJob", "target", [0], operator="NotIn")])
    assert action_for(PodFault("target", faults.EXIT_UNKNOWN, "PodFailed", ""), j) == "RestartJob"


def test_drafter_faults_without_rules_ignore_then_disable_the_drafter_in_place() -> None:
    j = job(max_failures=3)
    assert action_for(PodFault("drafter", 1, "DrafterFailed", "", restarts=2), j) == "Ignore"
    assert action_for(PodFault("drafter", 1, "DrafterFailed", "", restarts=3), j) == faults.DISABLE_DRAFTER
    assert faults.disable_reason(PodFault("drafter", 1, "DrafterFailed", "", restarts=3), j) == "TooManyFailures"
    assert faults.DISABLE_DRAFTER not in faults.ACTIONS, "a default only: rules cannot name it"


# (rules, exit code, own failures, maxFailures) -> action: a drafter fault restarts the target only
# where a rule asks for a restart, and never spends the target's restart budget.
@pytest.mark.parametrize(("rules", "code", "restarts", "max_failures", "expected"), [
    ([], 1, 0, 3, "Ignore"),
    ([], 1, 2, 3, "Ignore"),
    ([], 1, 3, 3, "DisableDrafter"),
    ([], 137, 9, 3, "DisableDrafter"),                     # OOM-killed alike
    ([], 2, 5, 3, "DisableDrafter"),                       # a drafter's configuration error alike
    ([], 1, 0, 0, "DisableDrafter"),                       # maxFailures 0: the first crash
    ([], 87, 50, 3, "Ignore"),                             # EXIT_PEER_FRAME: never the drafter's own
    ([rule("FailJob", "drafter", [87])], 87, 50, 3, "Ignore"),   # ... whatever the rules say
    ([rule("FailJob", "drafter", [1])], 1, 0, 3, "DisableDrafter"),
    ([rule("RestartWithoutDrafter", "drafter", [1])], 1, 0, 3, "DisableDrafter"),
    ([rule("RestartJob", "drafter", [1])], 1, 0, 3, "RestartJobIgnoreMax"),
    ([rule("RestartJobIgnoreMax", "drafter", [1])], 1, 0, 3, "RestartJobIgnoreMax"),
    ([rule("FailJob", "drafter", [1])], 3, 3, 3, "DisableDrafter"),   # no rule matches: maxFailures
    ([rule("FailJob", "target", [1])], 1, 0, 3, "Ignore"),            # a target rule does not match
])
def test_drafter_fault_actions(rules: list[dict], code: int, restarts: int, max_failures: int,
                               expected: str) -> None:
    j = job(rules, max_failures=max_failures)
    assert action_for(PodFault("drafter", code, "DrafterFailed", "", restarts=restarts), j) == expected


@pytest.mark.parametrize(("rule_action", "reason"), [("FailJob", "FailJob"),
                                                     ("RestartWithoutDrafter", "RestartWithoutDrafter")])
def test_disable_reason_names_the_rule(rule_action: str, reason: str) -> None:
    j = job([rule(rule_action, "drafter", [1])])
    assert faults.disable_reason(PodFault("drafter", 1, "DrafterFailed", ""), j) == reason


def test_mps_loss_caused_by_drafter_follows_a_drafter_rule() -> None:
    fault = PodFault("mps", 139, "MPSServerLost", "", caused_by_drafter=True)
    assert action_for(fault, job()) == "RestartJob"
    assert action_for(fault, job([rule("RestartWithoutDrafter", "drafter", [139, 86])])) == "RestartWithoutDrafter"
    assert action_for(fault, job([rule("FailJob", "drafter", [139])])) == "RestartWithoutDrafter"


def test_other_mps_losses() -> None:
    j = job([rule("FailJob", "target", [86])])
    assert action_for(PodFault("mps", 1, "MPSDaemonLost", ""), j) == "RestartJob"
    assert action_for(PodFault("mps", 86, "MPSServerLost", ""), j) == "FailJob"


def test_bad_rules_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"rules\[0\]\.action"):
        action_for(PodFault("target", 1, "TargetFailed", ""), job([{"action": "Explode"}]))
    with pytest.raises(ValueError, match=r"onExitCodes\.operator"):
        action_for(PodFault("target", 1, "TargetFailed", ""), job([rule("FailJob", "target", [1], "Maybe")]))




# ------------------------------------------------------------------------------ exit 2: configuration errors

CONFIG_LINE = ("configuration error: spec.target.data.batchSize: 6 must be a multiple of "
               "spec.target.parallelism.microbatches (4)")


def test_target_config_error_fails_the_job_with_the_workloads_line() -> None:
    f = classify_pod(pod(status("target", state={"terminated": term(2, T1, message=CONFIG_LINE)}), status("drafter")))
    assert f is not None and (f.container, f.exit_code, f.reason) == ("target", 2, "TargetFailed")
    assert CONFIG_LINE in f.message
    assert action_for(f, job()) == faults.CONFIG_ERROR == "ConfigError"
    assert faults.CONFIG_ERROR not in faults.ACTIONS, "a default only: rules cannot name it"


def test_config_error_line_from_a_log_tail_and_truncated() -> None:
    # FallbackToLogsOnError: no message written, the kubelet put the log's tail there
    tail = f"loading config\n[spectrain-target] {CONFIG_LINE}\nexiting\n"
    f = classify_pod(pod(status("target", state={"terminated": term(2, T1, message=tail)})))
    assert f is not None and f.message.endswith(f"[spectrain-target] {CONFIG_LINE}")
    long = "configuration error: " + "x" * 5000
    f = classify_pod(pod(status("target", state={"terminated": term(2, T1, message=long)})))
    assert f is not None and "configuration error: xxx" in f.message
    assert len(f.message) < faults.MAX_ERROR_LINE_CHARS + 100 and f.message.endswith("...")


@pytest.mark.parametrize("rules,expected", [
    ([rule("RestartJob", "target", [2])], "RestartJob"),
    ([rule("RestartJobIgnoreMax", "target", [0], operator="NotIn")], "RestartJobIgnoreMax"),
    ([{"action": "FailJob"}], "FailJob"),                    # no onExitCodes: matches every fault
    ([rule("RestartJob", "target", [1])], "ConfigError"),    # rules that do not match exit 2
    ([rule("RestartJob", "drafter", [2])], "ConfigError"),
])
def test_a_user_rule_matching_exit_2_wins(rules: list[dict], expected: str) -> None:
    assert action_for(PodFault("target", 2, "TargetFailed", CONFIG_LINE), job(rules)) == expected


def test_drafter_config_error_never_fails_the_job() -> None:
    # The drafter semantics, exit 2 included: Ignore (the kubelet restarts the sidecar) until
    # maxFailures, then the drafter is disabled in place; a drafter rule never fails the job.
    d = status("drafter", state={"waiting": {"reason": "CrashLoopBackOff"}},
               last={"terminated": term(2, T1, message="configuration error: SPECTRAIN_DRAFTER_SETTINGS is not JSON")},
               restarts=1)
    f = classify_pod(pod(drafter=d))
    assert f is not None and (f.container, f.exit_code, f.reason) == ("drafter", 2, "DrafterFailed")
    assert "SPECTRAIN_DRAFTER_SETTINGS" in f.message
    assert action_for(f, job(max_failures=3)) == "Ignore"
    assert action_for(PodFault("drafter", 2, "DrafterFailed", "", restarts=3), job(max_failures=3)) \
        == "DisableDrafter"
    assert action_for(f, job([rule("FailJob", "drafter", [2])])) == "DisableDrafter"


def test_single_container_verdict_carries_the_targets_config_error() -> None:
    v = SupervisorVerdict("target", 2, 0, False, None, None, target_message=CONFIG_LINE)
    f = classify_pod(pod(status("target", state={"terminated": term(2, T1, message=v.to_json())})))
    assert f is not None and (f.container, f.exit_code) == ("target", 2) and CONFIG_LINE in f.message
    assert action_for(f, job()) == "ConfigError"
