"""The operator against a real kube-apiserver (1.20): children, status, failures, restarts, suspend,
deadline, TTL, garbage collection, idempotency and operator restarts. The test plays the kubelet."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from spectrain_api.names import (
    ENV_FLEET_KEY_FILE,
    ENV_JOB_UID,
    ENV_POD_IPS,
    ENV_RESTART_GENERATION,
    EXIT_PEER_FRAME,
    GROUP,
    PLURAL,
    VERSION,
)
from spectrain_operator import builders, objects
from spectrain_operator import spec as specmod
from spectrain_workloads import podstatus
from spectrain_workloads.drafter.control import DrafterControl
from tests.integration.operator_harness import ROOT, Env, env_fixture  # noqa: F401  (the env fixture)
from tests.integration.statuspath import as_pod, request_status
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(timezone.utc)


def test_create_makes_every_child_once_with_owner_references(env: Env) -> None:
    env.create(env.manifest("c1"))
    pods = env.wait_pods("c1", 2)
    st = env.wait_phase("c1", "Pending")
    job = env.job("c1")
    assert job is not None
    uid = job["metadata"]["uid"]
    assert [p["metadata"]["name"] for p in pods] == ["c1-0", "c1-1"]
    cm = env.core.read_namespaced_config_map("c1-config", env.ns)
    assert json.loads(cm.data["config.json"])["spec"]["target"]["steps"] == 10
    svc = env.core.read_namespaced_service("c1", env.ns)
    assert svc.spec.cluster_ip == "None"
    role = env.rbac.read_namespaced_role("c1-status", env.ns)
    assert [(r.resources, r.verbs, r.resource_names) for r in role.rules] == [
        (["spectrainjobs/status"], ["patch"], ["c1"]), (["spectrainjobs"], ["get"], ["c1"])]
    env.rbac.read_namespaced_role_binding("c1-status", env.ns)
    env.core.read_namespaced_service_account("c1-status", env.ns)
    for p in pods:
        assert p["metadata"]["ownerReferences"][0]["uid"] == uid
        assert [c["name"] for c in p["spec"]["containers"]] == ["target"]
        assert [c["name"] for c in p["spec"]["initContainers"]] == ["drafter"]
        ring = next(v for v in p["spec"]["volumes"] if v["name"] == "ring")
        assert ring["emptyDir"]["medium"] == "Memory"
    assert st["observedGeneration"] == job["metadata"]["generation"]
    assert {c["type"] for c in st["conditions"]} >= {"Created", "CheckpointEphemeral"}
    # kopf keeps no bookkeeping on the job (event handlers only): nothing in the status, no
    # annotation, no finalizer (a job can be deleted while no operator runs)
    assert "kopf" not in st
    meta = (env.job("c1") or {})["metadata"]
    assert not meta.get("finalizers"), meta.get("finalizers")
    assert not [k for k in (meta.get("annotations") or {}) if "kopf" in k or k.startswith("spectrain.io/")], \
        meta.get("annotations")


def test_running_progress_and_drafter_from_the_pods_reports(env: Env, tmp_path: Path) -> None:
    """The status path as a pod runs it (podstatus, with a token of the job's status ServiceAccount
    bound to the pod): its reports reach status.progress / status.drafter; the same token may not
    change any pod, nor another job's status."""
    env.create(env.manifest("r1"))
    env.create(env.manifest("r2"))
    pods = env.wait_pods("r1", 2)
    env.wait_pods("r2", 2)
    env.run_pods("r1", pods)
    with as_pod(env.kube, pods[0], tmp_path / "sa"):
        podstatus.report_progress({"step": 7, "loss": 2.5, "tokensPerSecond": 99.0}, flush=True)
        podstatus.report_drafter({"state": "Active", "harvestedSeconds": 1.5, "harvestEfficiency": 0.5,
                                  "exportsRejectedByCause": {"below_latest": 2, "below_floor": 1}}, flush=True)
        env.wait_phase("r1", "Running")
        st = wait_for(lambda: (s := env.status("r1")).get("progress", {}).get("step") == 7
                      and s.get("drafter", {}).get("state") == "Active" and s, 10, what="progress from the report")
        pod_patch = {"metadata": {"annotations": {"x": "y"}}}
        assert request_status("PATCH", f"/api/v1/namespaces/{env.ns}/pods/r1-0", pod_patch) == 403
        other = f"/apis/{GROUP}/{VERSION}/namespaces/{env.ns}/{PLURAL}/r2/status"
        assert request_status("PATCH", other, {"status": {"phase": "Succeeded"}}) == 403
        assert request_status("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{env.ns}/{PLURAL}/r2") == 403
    assert st["progress"]["loss"] == 2.5 and st["ready"] == "2/2"
    assert st["drafter"]["harvestedSeconds"] == 1.5
    # the export gate's rejections by cause, kept by the CRD's status schema (not pruned)
    assert st["drafter"]["exportsRejectedByCause"] == {"below_latest": 2, "below_floor": 1, "non_finite": 0,
                                                       "unmeasured": 0, "version_reused": 0}
    (report,) = st["reports"].values()
    assert st["reports"].keys() == {pods[0]["metadata"]["uid"]} and report["pod"] == "r1-0"
    # the pass posts its Events after writing the status: wait for them, not just the status
    wait_for(lambda: [e["reason"] for e in env.events("r1")].count("Running") == 1, 10, what="the Running Event")


def test_the_chart_s_status_policy_keeps_the_pods_to_their_reports(env: Env, tmp_path: Path) -> None:
    """The chart's ValidatingAdmissionPolicy (helm/.../status-policy.yaml, rendered with the default
    values) in the real apiserver: the job's own ServiceAccount may write status.reports, and a write
    of any field the operator decides with (here restarts and drafterDisabled) is refused."""
    with helm.Chart.load(ROOT / "helm" / "spectrain-operator") as chart:
        out = chart.render({}, name="spectrain", namespace="spectrain-system")
    docs = [d for d in yaml.safe_load_all(out["spectrain-operator/templates/status-policy.yaml"]) if d]
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    env.create(env.manifest("vp"))
    pods = env.wait_pods("vp", 2)
    env.wait_phase("vp", "Pending")
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{env.ns}/{PLURAL}/vp/status"
    try:
        for d in docs:
            env.kube.apply(d)
        with as_pod(env.kube, pods[0], tmp_path / "sa"):
            # the policy is in force once the apiserver's admission has loaded it (each probe a new
            # value: one written before that would make the same value again no change at all)
            probes = iter(range(10**6))
            wait_for(lambda: request_status("PATCH", base, {"status": {"lastFailure": f"probe {next(probes)}"}})
                     == 403, 30, interval=0.2, what="the status policy in force")
            assert request_status("PATCH", base, {"status": {"restarts": 7}}) == 403   # any change of it
            assert request_status("PATCH", base, {"status": {"drafterDisabled": True}}) == 403
            podstatus.report_progress({"step": 5}, flush=True)
            wait_for(lambda: env.status("vp").get("progress", {}).get("step") == 5, 10, what="the report, allowed")
        assert env.status("vp").get("restarts", 0) == 0 and env.status("vp").get("drafterDisabled") is not True
        # the operator itself is not the job's ServiceAccount: its own status writes go on
        env.run_pods("vp", pods)
        env.wait_phase("vp", "Running")
    finally:
        for d in reversed(docs):
            env.kube.delete(d)


def test_target_failure_restarts_the_gang_then_fails_after_max_restarts(env: Env) -> None:
    env.create(env.manifest("f1", {"runPolicy": {"maxRestarts": 1, "backoffSeconds": 1}}))
    pods = env.wait_pods("f1", 2, generation=0)
    env.run_pods("f1", pods)
    env.exit_pod("f1-1", 1)
    pods = env.wait_pods("f1", 2, generation=1)  # both recreated after the backoff
    st = env.status("f1")
    assert st["restarts"] == 1 and "f1-1" in st["lastFailure"]
    env.run_pods("f1", pods)
    env.exit_pod("f1-0", 1)
    st = env.wait_phase("f1", "Failed")
    assert env.condition("f1", "Failed")["reason"] == "BackoffLimitExceeded"
    assert st["completionTime"]
    reasons = [e["reason"] for e in env.events("f1")]
    assert "TargetFailed" in reasons and "Failed" in reasons


def test_fail_job_rule_fails_fast(env: Env) -> None:
    rules = [{"action": "FailJob", "onExitCodes": {"container": "target", "operator": "In", "values": [42]}}]
    env.create(env.manifest("p1", {"runPolicy": {"failurePolicy": {"rules": rules}}}))
    pods = env.wait_pods("p1", 2)
    env.run_pods("p1", pods)
    env.exit_pod("p1-0", 42)
    env.wait_phase("p1", "Failed")
    assert env.condition("p1", "Failed")["reason"] == "FailedByPolicy"
    assert env.status("p1")["restarts"] == 0


def test_restart_without_drafter_recreates_pods_without_the_sidecar(env: Env) -> None:
    rules = [{"action": "RestartWithoutDrafter", "onExitCodes": {"values": [86]}}]
    env.create(env.manifest("d1", {"runPolicy": {"failurePolicy": {"rules": rules}}}))
    pods = env.wait_pods("d1", 2, generation=0)
    env.run_pods("d1", pods)
    env.exit_pod("d1-0", 86)
    pods = env.wait_pods("d1", 2, generation=1)
    for p in pods:
        assert not p["spec"].get("initContainers")
        target_env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
        assert target_env["SPECTRAIN_DRAFTER_ENABLED"] == "0"
    assert env.status("d1")["drafterDisabled"] is True
    assert env.condition("d1", "DrafterDegraded")["status"] == "True"


def test_drafter_crash_does_not_touch_the_target(env: Env) -> None:
    env.create(env.manifest("dc"))
    pods = env.wait_pods("dc", 2)
    env.run_pods("dc", pods)
    env.wait_phase("dc", "Running")
    env.set_pod("dc-0", "Running", {"running": {}}, ready=True,
                drafter={"restartCount": 1, "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}})
    wait_for(lambda: env.status("dc").get("drafterFailures") == 1, 10, what="drafter failure counted")
    assert env.status("dc")["phase"] == "Running" and env.status("dc")["restarts"] == 0
    assert [p["metadata"]["uid"] for p in env.pods("dc")] == [p["metadata"]["uid"] for p in pods]


def drafter_crash(env: Env, pod: str, restarts: int, code: int = 1) -> None:
    """The kubelet's view after the drafter sidecar's `restarts`-th crash (exit `code`): restarted,
    running again, the crash in lastState; the target keeps running."""
    env.set_pod(pod, "Running", {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, ready=True,
                drafter={"restartCount": restarts, "lastState": {"terminated": {
                    "exitCode": code, "reason": "Error", "startedAt": "2026-01-01T00:00:00Z",
                    "finishedAt": f"2026-01-01T00:{restarts:02d}:00Z"}}})


def test_five_drafter_crashes_disable_the_drafter_in_place(env: Env, tmp_path: Path) -> None:
    env.create(env.manifest("dd"))       # drafter.maxFailures: 3 (the default)
    pods = env.wait_pods("dd", 2)
    uids = [p["metadata"]["uid"] for p in pods]
    env.run_pods("dd", pods)
    env.wait_phase("dd", "Running")
    for n in range(1, 6):
        drafter_crash(env, "dd-0", n)
        wait_for(lambda n=n: env.status("dd").get("drafterFailures") == n, 10, what=f"drafter failure {n} counted")
    degraded = wait_for(lambda: (c := env.condition("dd", "DrafterDegraded")) and c["status"] == "True" and c, 10,
                        what="DrafterDegraded")
    assert degraded["reason"] == "TooManyFailures" and "disabled in place" in degraded["message"]
    st = env.status("dd")
    assert st["drafterDisabled"] is True and st["drafterDisabledGeneration"] == 0
    assert st["phase"] == "Running" and st["restarts"] == 0 and st["restartGeneration"] == 0
    assert [p["metadata"]["uid"] for p in env.pods("dd")] == uids, "the target's pods were replaced"
    assert not any((p["metadata"].get("annotations") or {}) for p in env.pods("dd")), "no pod was changed"
    wait_for(lambda: [e["reason"] for e in env.events("dd")].count("DrafterDegraded") == 1, 10,
             what="one DrafterDegraded Event")   # Events follow the status write of their pass
    assert "Restarting" not in [e["reason"] for e in env.events("dd")]
    with as_pod(env.kube, pods[0], tmp_path / "sa"):
        # the sidecars learn it from the job's status (their Role's `get`), as a drafter of generation 0
        assert DrafterControl(None, read_status=podstatus.job_status, generation=0).disabled() is True
        assert DrafterControl(None, read_status=podstatus.job_status, generation=1).disabled() is False
        # the target goes on: its progress still reaches the status
        for step in (3, 7):
            podstatus.report_progress({"step": step, "loss": 1.0}, flush=True)
            wait_for(lambda step=step: env.status("dd").get("progress", {}).get("step") == step, 10,
                     what=f"progress step {step}")
    st = env.status("dd")
    assert st["phase"] == "Running" and st["restarts"] == 0
    assert [p["metadata"]["uid"] for p in env.pods("dd")] == uids
    # the next restart the job needs anyway (a target failure) builds pods without the drafter
    env.exit_pod("dd-1", 1)
    new = env.wait_pods("dd", 2, generation=1)
    for p in new:
        assert not p["spec"].get("initContainers")
        assert {"fleet-key", "podinfo"}.isdisjoint(v["name"] for v in p["spec"]["volumes"])
    assert env.status("dd")["restarts"] == 1
    # the reports of the pods gone are deleted; the new pods' are read
    wait_for(lambda: not env.status("dd").get("reports"), 10, what="the old pods' reports deleted")
    with as_pod(env.kube, new[0], tmp_path / "sa"):
        podstatus.report_progress({"step": 8}, flush=True)
        wait_for(lambda: env.status("dd").get("progress", {}).get("step") == 8, 10, what="the new pod's report")


def test_peer_frame_crashes_are_counted_apart(env: Env) -> None:
    env.create(env.manifest("pf", {"drafter": {"maxFailures": 1}}))
    pods = env.wait_pods("pf", 2)
    env.run_pods("pf", pods)
    env.wait_phase("pf", "Running")
    for n in (1, 2, 3):
        drafter_crash(env, "pf-1", n, code=EXIT_PEER_FRAME)
        wait_for(lambda n=n: env.status("pf").get("drafterPeerFailures") == n, 10, what=f"peer frame {n} counted")
    st = env.status("pf")
    assert st["drafterFailures"] == 0 and st["drafterDisabled"] is False and st["restarts"] == 0
    assert env.condition("pf", "DrafterDegraded") is None
    wait_for(lambda: [e["reason"] for e in env.events("pf")].count("DrafterPeerFrame") == 3, 10,
             what="three DrafterPeerFrame Events")   # Events follow the status write of their pass
    drafter_crash(env, "pf-1", 4)        # the drafter's own first failure: past maxFailures 1
    wait_for(lambda: env.status("pf").get("drafterDisabled") is True, 10, what="drafter disabled")
    assert env.status("pf")["drafterFailures"] == 1 and env.status("pf")["drafterPeerFailures"] == 3


def test_a_drafter_crash_counts_and_is_announced_before_the_kubelet_restarts_it(env: Env) -> None:
    """A real kubelet shows a crash as state.terminated, then state.waiting CrashLoopBackOff with it
    in lastState, and raises restartCount only at the restart (after a back-off of up to 5 min):
    the crash counts, with a DrafterFailed Event, from the first of these; the maxFailures-th
    disables the drafter before any restart."""
    env.create(env.manifest("dk", {"drafter": {"maxFailures": 2},
                                   "target": {"parallelism": {"data": 2, "pipeline": 1}}}))
    pods = env.wait_pods("dk", 2)
    env.run_pods("dk", pods)
    env.wait_phase("dk", "Running")

    def crash(n: int) -> dict[str, Any]:
        return {"exitCode": 1, "reason": "Error", "message": f"RuntimeError: crash {n}",
                "startedAt": "2026-01-01T00:00:00Z", "finishedAt": f"2026-01-01T00:0{n}:00Z",
                "containerID": f"containerd://{n:064d}"}

    def drafter(shape: dict[str, Any]) -> None:
        env.set_pod("dk-0", "Running", {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, ready=True,
                    drafter=shape)

    def announced() -> list[str]:
        return [e["message"] for e in env.events("dk") if e["reason"] == "DrafterFailed"]

    drafter({"restartCount": 0, "state": {"terminated": crash(1)}})
    wait_for(lambda: env.status("dk").get("drafterFailures") == 1, 10, what="the crash counted before its restart")
    (event,) = wait_for(announced, 10, what="a DrafterFailed Event")
    assert event.startswith("dk-0: ") and "code 1 (Error): RuntimeError: crash 1" in event, event
    assert "failure 1 of maxFailures 2" in event, event
    drafter({"restartCount": 0, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": crash(1)}})
    drafter({"restartCount": 1, "state": {"running": {"startedAt": "2026-01-01T00:01:10Z"}},
             "lastState": {"terminated": crash(1)}})
    drafter({"restartCount": 1, "state": {"terminated": crash(2)}, "lastState": {"terminated": crash(1)}})
    wait_for(lambda: env.status("dk").get("drafterDisabled") is True, 10, what="the 2nd crash disabling the drafter")
    st = env.status("dk")
    assert st["drafterFailures"] == 2, "the first crash was counted once through all its shapes"
    assert st["phase"] == "Running" and st["restarts"] == 0
    wait_for(lambda: len(announced()) == 2, 10, what="a DrafterFailed Event per crash")
    assert "failure 2 of maxFailures 2" in sorted(announced())[-1]
    wait_for(lambda: [e["reason"] for e in env.events("dk")].count("DrafterDegraded") == 1, 10,
             what="one DrafterDegraded Event")


def test_fleet_key_secret_created_once_and_mounted_only_into_the_drafter(env: Env) -> None:
    env.create(env.manifest("fk", {"runPolicy": {"backoffSeconds": 0}}))
    pods = env.wait_pods("fk", 2, generation=0)
    job = env.job("fk")
    assert job is not None
    secret = env.core.read_namespaced_secret("fk-fleet-key", env.ns)
    assert secret.type == "Opaque" and list(secret.data) == ["key"]
    key = base64.b64decode(secret.data["key"]).decode()
    assert len(key) == 64 and all(ch in "0123456789abcdef" for ch in key)
    (owner,) = secret.metadata.owner_references
    assert owner.uid == job["metadata"]["uid"] and owner.controller is True
    for p in pods:   # the apiserver accepted every volume, mount and fieldRef (status.podIPs in env)
        (drafter,) = p["spec"]["initContainers"]
        (target,) = p["spec"]["containers"]
        env_of = {e["name"]: e.get("value", e.get("valueFrom")) for e in drafter["env"]}
        assert env_of[ENV_JOB_UID] == job["metadata"]["uid"] and env_of[ENV_RESTART_GENERATION] == "0"
        assert env_of[ENV_POD_IPS] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIPs"}}
        assert {m["name"] for m in drafter["volumeMounts"]} >= {"fleet-key", "podinfo"}
        assert {"fleet-key", "podinfo"}.isdisjoint(m["name"] for m in target["volumeMounts"])
        assert ENV_FLEET_KEY_FILE not in {e["name"] for e in target["env"]}
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        assert vols["fleet-key"]["secret"] == {"secretName": "fk-fleet-key", "defaultMode": 0o400}
        assert "memory" in drafter["resources"]["limits"]
    # a restart: new pods of generation 1, the same Secret (created once, never rotated)
    env.run_pods("fk", pods)
    env.exit_pod("fk-0", 1)
    for p in env.wait_pods("fk", 2, generation=1):
        drafter_env = {e["name"]: e.get("value") for e in p["spec"]["initContainers"][0]["env"]}
        assert drafter_env[ENV_RESTART_GENERATION] == "1"
    again = env.core.read_namespaced_secret("fk-fleet-key", env.ns)
    assert again.metadata.uid == secret.metadata.uid and again.data == secret.data
    assert again.metadata.resource_version == secret.metadata.resource_version


def test_suspend_deletes_pods_keeps_the_rest_and_resume_recreates(env: Env) -> None:
    env.create(env.manifest("s1"))
    env.wait_pods("s1", 2)
    env.patch_spec("s1", {"suspend": True})
    env.wait_phase("s1", "Suspended")
    env.wait_pods("s1", 0)
    env.core.read_namespaced_config_map("s1-config", env.ns)  # kept
    env.core.read_namespaced_service("s1", env.ns)
    env.patch_spec("s1", {"suspend": False})
    env.wait_pods("s1", 2)
    env.wait_phase("s1", "Pending")
    assert env.condition("s1", "Suspended")["status"] == "False"
    assert env.status("s1")["restarts"] == 0


def test_pod_deleted_by_someone_else_is_recreated_and_counted(env: Env) -> None:
    env.create(env.manifest("x1"))
    env.wait_pods("x1", 2, generation=0)
    wait_for(lambda: env.status("x1").get("podsCreated") is True, 10, what="status podsCreated")
    env.core.delete_namespaced_pod("x1-1", env.ns)
    env.wait_pods("x1", 2, generation=1)
    st = env.status("x1")
    assert st["restarts"] == 1 and st["restartsTowardsMax"] == 0


def test_success_then_ttl_deletes_the_job_and_gc_its_children(env: Env) -> None:
    from kubernetes import watch

    env.kube.start_controller_manager()
    ttl = 2
    env.create(env.manifest("ok1", {"runPolicy": {"ttlSecondsAfterFinished": ttl}}))
    pods = env.wait_pods("ok1", 2)
    job = env.job("ok1")
    assert job is not None
    since = job["metadata"]["resourceVersion"]
    env.run_pods("ok1", pods)
    for p in pods:
        env.exit_pod(p["metadata"]["name"], 0)
    # Every change of the job since `since`, replayed by a watch: Succeeded is only visible for
    # about `ttl` seconds, which polling under load can miss entirely.
    changes: list[tuple[str, dict]] = []
    deleted_at = None
    for ev in watch.Watch().stream(env.custom.list_namespaced_custom_object, "spectrain.io", "v1alpha1", env.ns,
                                   "spectrainjobs", field_selector="metadata.name=ok1", resource_version=since,
                                   timeout_seconds=30):
        changes.append((ev["type"], ev["object"]))
        if ev["type"] == "DELETED":
            deleted_at = datetime.now(timezone.utc)   # no finalizer: the delete takes effect at once
            break
    env.operator.check_alive()
    assert changes and changes[-1][0] == "DELETED", \
        f"TTL did not delete the job: {[(t, o.get('status', {}).get('phase')) for t, o in changes]}\n" \
        f"{env.operator.log_tail()}"
    succeeded = next(o for _, o in changes if (o.get("status") or {}).get("phase") == "Succeeded")
    assert succeeded["status"]["ranks"]["succeeded"] == 2
    finished = parse_time(succeeded["status"]["completionTime"])
    assert deleted_at is not None and deleted_at >= finished + timedelta(seconds=ttl), \
        "deleted before ttlSecondsAfterFinished passed"
    assert "TTLExpired" in [e["reason"] for e in env.events("ok1")]

    def children_gone() -> bool:
        try:
            env.core.read_namespaced_config_map("ok1-config", env.ns)
            return False
        except ApiException as exc:
            return exc.status == 404
    # the controller-manager discovers the CRD at its 30 s resync, then collects within a second
    wait_for(lambda: children_gone() and not env.pods("ok1"), 75, interval=0.5, what="GC of the children")


def test_active_deadline_fails_the_job(env: Env) -> None:
    env.create(env.manifest("dl", {"runPolicy": {"activeDeadlineSeconds": 2}}))
    env.wait_pods("dl", 2)
    env.wait_phase("dl", "Failed", timeout=20)
    assert env.condition("dl", "Failed")["reason"] == "DeadlineExceeded"
    env.wait_pods("dl", 0)


def test_semantic_and_cel_only_errors_fail_with_spec_invalid_and_no_children(env: Env) -> None:
    for name, spec, cel_rule in [
        ("inv-layers", {"target": {"image": "i", "nodes": 3, "parallelism": {"pipeline": 3, "microbatches": 3},
                                        "data": {"batchSize": 6}}, "drafter": {"enabled": False}}, False),
        ("inv-cel", {"target": {"image": "i", "nodes": 3, "parallelism": {"data": 1, "pipeline": 2}}}, True),
    ]:
        if cel_rule and env.kube.enforces_cel:  # the server refuses it; 1.20 has no CEL: the operator does
            with pytest.raises(ApiException) as exc:
                env.create(env.manifest(name, spec))
            assert exc.value.status == 422 and "spec.target.parallelism" in exc.value.body, exc.value.body
            continue
        env.create(env.manifest(name, spec))
        env.wait_phase(name, "Failed")
        c = env.condition(name, "SpecInvalid")
        assert c and c["status"] == "True" and c["message"].startswith("spec.target.parallelism"), c
        assert env.pods(name) == []
        with pytest.raises(ApiException):
            env.core.read_namespaced_config_map(f"{name}-config", env.ns)


def test_missing_pvc_is_spec_invalid(env: Env) -> None:
    env.create(env.manifest("pvc1", {"target": {"image": "i", "nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 2},
                                                "checkpoint": {"claimName": "nope"}}}))
    env.wait_phase("pvc1", "Failed")
    assert "spec.target.checkpoint.claimName" in env.condition("pvc1", "SpecInvalid")["message"]
    assert env.pods("pvc1") == []


@pytest.mark.parametrize("example", ["missing-image", "zero-nodes", "unknown-mode", "wrong-type", "empty-kinds",
                                     "export-path-escapes", "name-too-long", "duplicate-kinds"])
def test_schema_level_invalid_examples_are_rejected_at_apply_time(env: Env, example: str) -> None:
    m = yaml.safe_load((ROOT / "examples" / "invalid" / f"{example}.yaml").read_text())
    m["metadata"]["namespace"] = env.ns
    with pytest.raises(ApiException) as exc:
        env.create(m)
    assert exc.value.status == 422


def test_examples_are_accepted(env: Env) -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        m = yaml.safe_load(path.read_text())
        m["metadata"]["namespace"] = env.ns
        m["metadata"]["name"] = "ex-" + m["metadata"]["name"]
        m["spec"]["suspend"] = True  # accepted and stored; nothing to run here
        env.create(m)
        env.wait_phase(m["metadata"]["name"], "Suspended")


def test_operator_restart_midway_resumes_without_duplicates(env: Env) -> None:
    env.create(env.manifest("h1"))
    pods = env.wait_pods("h1", 2)
    uids = [p["metadata"]["uid"] for p in pods]
    env.operator.kill()  # SIGKILL: no goodbye
    env.run_pods("h1", pods)  # the world moves on while the operator is down
    env.create(env.manifest("h2"))
    env.operator.start()
    env.wait_phase("h1", "Running")
    env.wait_pods("h2", 2)
    assert [p["metadata"]["uid"] for p in env.pods("h1")] == uids  # nothing recreated
    assert env.status("h1")["restarts"] == 0


def test_replayed_triggers_create_nothing_twice(env: Env) -> None:
    env.create(env.manifest("i1"))
    pods = env.wait_pods("i1", 2)
    uids = sorted(p["metadata"]["uid"] for p in pods)
    # touch the job and its pods many times: every touch is a watch event and a reconcile pass
    for i in range(5):
        env.custom.patch_namespaced_custom_object("spectrain.io", "v1alpha1", env.ns, "spectrainjobs", "i1",
                                                  {"metadata": {"labels": {"touch": str(i)}}})
        for p in pods:
            env.annotate_pod(p["metadata"]["name"], {"touch": str(i)})
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # observe for a while: nothing may change
        assert sorted(p["metadata"]["uid"] for p in env.pods("i1")) == uids
        time.sleep(0.2)
    assert env.status("i1")["restarts"] == 0
    assert [e["reason"] for e in env.events("i1")].count("Pending") == 1


def _drafter_report(env: Env, pod: dict[str, Any], sa_dir: Path, report: dict[str, Any]) -> None:
    """`pod` writes its drafter report, and it is in the job's status (the write runs on podstatus's
    thread: it must finish while the pod's credentials are in place)."""
    with as_pod(env.kube, pod, sa_dir):
        podstatus.report_drafter(report, flush=True)
        want = json.dumps(report, sort_keys=True)
        wait_for(lambda: json.dumps(json.loads((env.status(pod["metadata"]["labels"][objects.LABEL_JOB]).get(
            "reports", {}).get(pod["metadata"]["uid"]) or {}).get("drafter", "{}")), sort_keys=True) == want,
            20, what=f"{pod['metadata']['name']}'s report in the job's status")


def test_forged_report_fields_are_refused(env: Env, tmp_path: Path) -> None:
    """Each pod writes its drafter report as a compromised container of the job could: the operator
    copies into status.drafter only what spectrain_api.reports accepts (artifact from the exporting
    rank's pod, under the export path; figures in range; a known state), counts the rest and names
    it in a DrafterReportRefused Event."""
    manifest = env.manifest("forge")
    env.create(manifest)
    pods = sorted(env.wait_pods("forge", 2), key=lambda p: p["metadata"]["name"])
    env.run_pods("forge", pods)
    export = builders.export_dir(specmod.defaulted(manifest))
    assert [p["metadata"]["name"] for p in pods] == [objects.pod_name(manifest, n) for n in (0, 1)]
    # rank 0's pod is not the exporting one: its artifact, however well formed, and its forged figures
    _drafter_report(env, pods[0], tmp_path / "sa0", {"state": "Owned", "harvestedSeconds": 1e12, "harvestEfficiency": 7.0,
                                             "acceptanceLength": 1e9, "artifact": f"{export}/v999"})
    # the exporting (last) rank's pod: a real version is taken, a path elsewhere would not be
    _drafter_report(env, pods[1], tmp_path / "sa1", {"state": "Active", "harvestedSeconds": 2.0, "harvestEfficiency": 0.25,
                                             "acceptanceLength": 3.0, "artifact": f"{export}/v3"})
    d = wait_for(lambda: (s := env.status("forge").get("drafter", {})).get("artifact") == f"{export}/v3"
                 and s.get("reportFieldsRefused") == 5 and s, 20, what="status.drafter from the checked reports")
    assert d["state"] == "Active" and d["activeRanks"] == 1
    assert (d["harvestedSeconds"], d["harvestEfficiency"], d["acceptanceLength"]) == (2.0, 0.25, 3.0)
    (event,) = wait_for(lambda: [e for e in env.events("forge") if e["reason"] == "DrafterReportRefused"], 10,
                        what="the DrafterReportRefused Event")
    assert event["type"] == "Warning"
    for field in ("state", "harvestedSeconds", "harvestEfficiency", "acceptanceLength", "artifact"):
        assert f"{pods[0]['metadata']['name']}: {field}=" in event["message"], event["message"]

    _drafter_report(env, pods[1], tmp_path / "sa1", {"state": "Active", "artifact": "/etc/v4"})
    d = wait_for(lambda: (s := env.status("forge").get("drafter", {})).get("reportFieldsRefused") == 6 and s, 20,
                 what="the exporting pod's artifact outside the export path refused")
    assert d["artifact"] == f"{export}/v3", "a refused artifact never replaces the last good one"
