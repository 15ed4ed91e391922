"""The operator against a real kube-apiserver (1.20): children, status, failures, restarts, suspend,
deadline, TTL, garbage collection, idempotency and operator restarts. The test plays the kubelet."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.integration.operator_harness import ROOT, Env, env_fixture  # noqa: F401  (the env fixture)
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
    assert role.rules[0].resource_names == ["c1-0", "c1-1"] and role.rules[0].verbs == ["patch"]
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


def test_running_progress_and_drafter_from_annotations(env: Env) -> None:
    env.create(env.manifest("r1"))
    pods = env.wait_pods("r1", 2)
    env.run_pods("r1", pods)
    env.annotate_pod("r1-0", {"spectrain.io/progress": json.dumps({"step": 7, "loss": 2.5, "tokensPerSecond": 99.0}),
                              "spectrain.io/drafter": json.dumps({"state": "Active", "harvestedSeconds": 1.5,
                                                                  "harvestEfficiency": 0.5})})
    env.wait_phase("r1", "Running")
    st = wait_for(lambda: (s := env.status("r1")).get("progress", {}).get("step") == 7 and s, 10,
                  what="progress from the annotation")
    assert st["progress"]["loss"] == 2.5 and st["ready"] == "2/2"
    assert st["drafter"]["state"] == "Active" and st["drafter"]["harvestedSeconds"] == 1.5
    assert [e["reason"] for e in env.events("r1")].count("Running") == 1


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
                                        "data": {"batchSize": 6}}}, False),
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
