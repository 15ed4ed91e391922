"""The integration tier's scenarios where a real kubelet runs the pods (opt-in: `pytest --e2e`,
`make test-e2e`; requirements and knobs in tests/e2e/conftest.py).

create -> Running -> Succeeded, a failing target restarted then Failed, suspend/resume, delete
with garbage collection of every child. The target is a shell command in a small public image.
"""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from tests.e2e.conftest import TIMEOUT, E2EEnv
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

# PID 1 in a container ignores SIGTERM without a handler: exit promptly when the pod is deleted.
RUN_UNTIL_STOPPED = ["sh", "-c", "trap 'exit 143' TERM; while true; do sleep 1; done"]


def test_create_runs_and_succeeds(e2e: E2EEnv) -> None:
    # long enough that Running is observed (polled every 0.1 s), short enough for CI
    e2e.create(e2e.manifest("e2e-ok", {"command": ["sh", "-c", "sleep 15; exit 0"]}))
    pods = e2e.wait_pods("e2e-ok", 2)
    assert {p["spec"]["containers"][0]["name"] for p in pods} == {"target"}
    st = e2e.wait_phase("e2e-ok", "Running")
    assert st["ready"] == "2/2" and st["startTime"]
    st = e2e.wait_phase("e2e-ok", "Succeeded")
    assert st["ranks"]["succeeded"] == 2 and st["completionTime"] and st["restarts"] == 0
    env_of = {e["name"]: e.get("value") for e in pods[1]["spec"]["containers"][0]["env"]}
    assert env_of["NODE_RANK"] == "1" and env_of["WORLD_SIZE"] == "2"
    assert env_of["MASTER_ADDR"] == f"e2e-ok-0.e2e-ok.{e2e.ns}.svc"


def test_failing_target_restarts_the_gang_then_fails(e2e: E2EEnv) -> None:
    e2e.create(e2e.manifest("e2e-fail", {"command": ["sh", "-c", "exit 3"],
                                          "runPolicy": {"maxRestarts": 1, "backoffSeconds": 1}}))
    st = e2e.wait_phase("e2e-fail", "Failed")
    assert st["restarts"] == 1 and st["restartGeneration"] == 1
    assert e2e.condition("e2e-fail", "Failed")["reason"] == "BackoffLimitExceeded"
    assert "exited with code 3" in st["lastFailure"]


def test_suspend_deletes_the_pods_and_resume_recreates_them(e2e: E2EEnv) -> None:
    e2e.create(e2e.manifest("e2e-sus", {"command": RUN_UNTIL_STOPPED}))
    e2e.wait_phase("e2e-sus", "Running")
    e2e.patch_spec("e2e-sus", {"suspend": True})
    e2e.wait_phase("e2e-sus", "Suspended")
    wait_for(lambda: not e2e.core.list_namespaced_pod(e2e.ns, label_selector="spectrain.io/job-name=e2e-sus").items,
             TIMEOUT, interval=0.5, what="the suspended job's pods terminated")
    e2e.core.read_namespaced_config_map("e2e-sus-config", e2e.ns)  # the rest is kept
    e2e.patch_spec("e2e-sus", {"suspend": False})
    e2e.wait_phase("e2e-sus", "Running")
    assert e2e.condition("e2e-sus", "Suspended")["status"] == "False"
    assert e2e.status("e2e-sus")["restarts"] == 0


def test_delete_garbage_collects_every_child(e2e: E2EEnv) -> None:
    e2e.create(e2e.manifest("e2e-del", {"command": RUN_UNTIL_STOPPED}))
    e2e.wait_phase("e2e-del", "Running")
    e2e.custom.delete_namespaced_custom_object("spectrain.io", "v1alpha1", e2e.ns, "spectrainjobs", "e2e-del")
    wait_for(lambda: e2e.job("e2e-del") is None, TIMEOUT, interval=0.5, what="the job deleted")

    def gone(read: object, name: str) -> bool:
        try:
            read(name, e2e.ns)  # type: ignore[operator]
            return False
        except ApiException as exc:
            return exc.status == 404
    wait_for(lambda: gone(e2e.core.read_namespaced_config_map, "e2e-del-config")
             and gone(e2e.core.read_namespaced_service, "e2e-del")
             and gone(e2e.core.read_namespaced_service_account, "e2e-del-status")
             and gone(e2e.rbac.read_namespaced_role, "e2e-del-status")
             and not e2e.core.list_namespaced_pod(e2e.ns, label_selector="spectrain.io/job-name=e2e-del").items,
             TIMEOUT, interval=0.5, what="garbage collection of every child")
