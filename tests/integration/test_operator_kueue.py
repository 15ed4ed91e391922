"""Kueue against the real apiserver (1.20), the test playing Kueue (design: docs/design.md, "Kueue").

- job integration: Kueue's webhook creates the job suspended; admission writes the flavor's node
  selector and tolerations into the job's pod-set info (spec.scheduling) and unsuspends it;
  preemption suspends it and restores the pod-set info;
- plain-pod integration: Kueue admits the job's pods and adds the flavor to the pods themselves;
  the operator carries that over when it recreates them (status.admittedScheduling).
"""

from __future__ import annotations

import pytest

from tests.integration.operator_harness import Env, env_fixture  # noqa: F401  (the env fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

QUEUE = "kueue.x-k8s.io/queue-name"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _queued(env: Env, name: str, **spec: object) -> dict:
    m = env.manifest(name, dict(spec))
    m["metadata"]["labels"] = {QUEUE: "team-a"}
    return m


def test_job_integration_admission_writes_pod_set_info_and_unsuspends(env: Env) -> None:
    env.create(_queued(env, "kq1", suspend=True))  # as Kueue's webhook leaves a queued job
    env.wait_phase("kq1", "Suspended")
    assert env.pods("kq1") == []
    # admission: the flavor's node labels and tolerations into the pod-set info, then unsuspend
    env.patch_spec("kq1", {"suspend": False, "scheduling": {"nodeSelector": {"cloud.example/flavor": "a100"},
                                                            "tolerations": [GPU_TOLERATION]}})
    pods = env.wait_pods("kq1", 2, generation=0)
    for p in pods:
        assert p["spec"]["nodeSelector"] == {"cloud.example/flavor": "a100"}
        assert GPU_TOLERATION in p["spec"]["tolerations"]
        assert p["metadata"]["labels"][QUEUE] == "team-a"
    env.run_pods("kq1", pods)
    env.exit_pod("kq1-0", 1)  # a restart keeps the admitted flavor: it is in the spec
    for p in env.wait_pods("kq1", 2, generation=1):
        assert p["spec"]["nodeSelector"] == {"cloud.example/flavor": "a100"}
    # preemption: suspend and restore the pod-set info
    env.patch_spec("kq1", {"suspend": True, "scheduling": {"nodeSelector": {"cloud.example/flavor": None},
                                                           "tolerations": []}})
    env.wait_phase("kq1", "Suspended")
    env.wait_pods("kq1", 0)
    assert env.status("kq1")["restarts"] == 1


def test_plain_pod_admission_is_carried_over_when_the_operator_recreates_pods(env: Env) -> None:
    env.create(_queued(env, "kq2", runPolicy={"backoffSeconds": 0}))
    pods = env.wait_pods("kq2", 2, generation=0)
    for p in pods:
        assert p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "kq2"
        assert p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
        # Kueue admits the pod group: it adds the flavor's toleration to each pod (a 1.20 API
        # server allows adding tolerations to a pod; node selectors only on gated pods, 1.27+:
        # tests/unit/test_reconciler.py covers those)
        tolerations = [*(p["spec"].get("tolerations") or []), GPU_TOLERATION]
        env.core.patch_namespaced_pod(p["metadata"]["name"], env.ns, {"spec": {"tolerations": tolerations}})
    # each pod's patch triggers its own pass: wait until a pass has seen both admissions
    recorded = wait_for(lambda: (r := env.status("kq2").get("admittedScheduling")) and len(r) >= 2 and r, 10,
                        what="status.admittedScheduling for both nodes")
    assert [e["node"] for e in recorded] == [0, 1]
    assert all(e["tolerations"] == [GPU_TOLERATION] for e in recorded)
    env.run_pods("kq2", env.pods("kq2"))
    env.exit_pod("kq2-1", 1)
    for p in env.wait_pods("kq2", 2, generation=1):
        own = [t for t in p["spec"]["tolerations"] if t["key"] == "nvidia.com/gpu"]
        assert own == [GPU_TOLERATION], p["spec"]["tolerations"]  # carried over, once
    assert env.status("kq2")["restarts"] == 1
