"""Exit code 2 (configuration error) against a real kube-apiserver (1.20), the test playing the
kubelet: a target that exits 2 with a termination message fails the job at once (Failed,
reason ConfigError, the message in the condition, no restart); a failurePolicy rule on exit code 2
still wins; a drafter's exit 2 never fails the job."""

from __future__ import annotations

import pytest

from tests.integration.operator_harness import Env, env_fixture  # noqa: F401  (the env fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

CONFIG_LINE = ("configuration error: spec.target.data.batchSize: 6 must be a multiple of "
               "spec.target.parallelism.microbatches (4); each microbatch takes batchSize / microbatches sequences")


def test_target_exit_2_fails_the_job_with_config_error_and_no_restart(env: Env) -> None:
    env.create(env.manifest("ce1", {"runPolicy": {"maxRestarts": 3, "backoffSeconds": 1}}))
    pods = env.wait_pods("ce1", 2, generation=0)
    for p in pods:
        for c in p["spec"]["containers"] + p["spec"].get("initContainers", []):
            assert c["terminationMessagePolicy"] == "FallbackToLogsOnError", c["name"]
    env.run_pods("ce1", pods)
    env.wait_phase("ce1", "Running")
    env.exit_pod("ce1-1", 2, message=CONFIG_LINE)
    st = env.wait_phase("ce1", "Failed")
    failed = env.condition("ce1", "Failed")
    assert failed is not None and failed["status"] == "True" and failed["reason"] == "ConfigError", failed
    assert failed["message"].startswith("ce1-1: target exited with code 2") and CONFIG_LINE in failed["message"]
    assert st["restarts"] == 0 and st["restartGeneration"] == 0 and st["completionTime"]
    assert CONFIG_LINE in st["lastFailure"]
    # not restarted: the running rank is deleted, the failed pod kept for its logs, nothing recreated
    wait_for(lambda: [p["metadata"]["name"] for p in env.pods("ce1")] == ["ce1-1"], 30, interval=0.1,
             what="the running rank deleted, the failed one kept")
    assert env.pods("ce1")[0]["metadata"]["uid"] == pods[1]["metadata"]["uid"]
    assert env.status("ce1")["restarts"] == 0
    # the Events follow the status write of the same pass
    failed_events = wait_for(lambda: [e for e in env.events("ce1") if e["reason"] == "Failed"], 10, interval=0.1,
                             what="the Failed event")
    assert CONFIG_LINE in failed_events[0]["message"]
    assert "TargetFailed" not in [e["reason"] for e in env.events("ce1")], "no restart event"


def test_a_restart_rule_on_exit_2_wins(env: Env) -> None:
    rules = [{"action": "RestartJob", "onExitCodes": {"container": "target", "operator": "In", "values": [2]}}]
    env.create(env.manifest("ce2", {"runPolicy": {"backoffSeconds": 1, "failurePolicy": {"rules": rules}}}))
    pods = env.wait_pods("ce2", 2, generation=0)
    env.run_pods("ce2", pods)
    env.exit_pod("ce2-0", 2, message=CONFIG_LINE)
    env.wait_pods("ce2", 2, generation=1)  # both recreated after the backoff
    st = env.status("ce2")
    assert st["restarts"] == 1 and st["restartsTowardsMax"] == 1 and CONFIG_LINE in st["lastFailure"]
    assert st["phase"] != "Failed" and env.condition("ce2", "Failed") is None


def test_drafter_exit_2_does_not_fail_the_job(env: Env) -> None:
    env.create(env.manifest("ce3"))
    pods = env.wait_pods("ce3", 2)
    env.run_pods("ce3", pods)
    env.wait_phase("ce3", "Running")
    env.set_pod("ce3-0", "Running", {"running": {}}, ready=True,
                drafter={"restartCount": 1, "lastState": {"terminated": {
                    "exitCode": 2, "reason": "Error", "message": "configuration error: bad drafter settings"}}})
    wait_for(lambda: env.status("ce3").get("drafterFailures") == 1, 10, what="drafter failure counted")
    st = env.status("ce3")
    assert st["phase"] == "Running" and st["restarts"] == 0 and env.condition("ce3", "Failed") is None
