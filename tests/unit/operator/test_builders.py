"""builders.py: the children of a SpecTrainJob, exactly as API.md and docs/contracts.md describe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from spectrain_api import names
from spectrain_api.config import from_manifest
from spectrain_api.rules import check_spec
from spectrain_operator import access, builders, objects, spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def job(**spec_overrides: Any) -> dict[str, Any]:
    m = spec.load_manifests(ROOT / "examples" / "demo.yaml")[0]
    m["metadata"]["namespace"] = "ns1"
    m["spec"].update(spec_overrides)
    return spec.defaulted(m)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def by_kind(objs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def test_children_names_labels_and_order() -> None:
    objs = builders.render(job())
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("ServiceAccount", "demo-status"), ("Role", "demo-status"), ("RoleBinding", "demo-status"),
        ("ConfigMap", "demo-config"), ("Service", "demo"), ("NetworkPolicy", "demo"), ("Pod", "demo-0"),
        ("Pod", "demo-1")]
    for o in objs:
        assert o["metadata"]["labels"][builders.LABEL_JOB] == "demo"
        assert o["metadata"]["namespace"] == "ns1"
        assert "ownerReferences" not in o["metadata"]


def test_owner_references_when_the_job_has_a_uid() -> None:
    j = job()
    j["metadata"]["uid"] = "1234"
    for o in builders.render(j):
        assert o["metadata"]["ownerReferences"][0] == {
            "apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "name": "demo", "uid": "1234",
            "controller": True}


def test_pod_layout_target_and_native_sidecar_drafter() -> None:
    pods = by_kind(builders.render(job()))["Pod"]
    p = pods[1]
    s = p["spec"]
    assert s["restartPolicy"] == "Never"
    assert s["hostname"] == "demo-1" and s["subdomain"] == "demo"
    assert s["serviceAccountName"] == "demo-status"
    (target,) = s["containers"]
    (drafter,) = s["initContainers"]
    assert target["name"] == "target" and target["command"] == ["spectrain-target"]
    assert drafter["name"] == "drafter" and drafter["restartPolicy"] == "Always"
    assert drafter["command"] == ["spectrain-drafter"]
    assert drafter["image"] == target["image"] == "example.org/spectrain/workloads:0.1.0"
    vols = {v["name"]: v for v in s["volumes"]}
    assert vols["ring"] == {"name": "ring", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}
    assert vols["run"] == {"name": "run", "persistentVolumeClaim": {"claimName": "demo-run"}}   # the example's shared run volume
    assert vols["config"]["configMap"]["name"] == "demo-config"
    shared = {"/etc/spectrain": "config", "/var/run/spectrain/ring": "ring", "/var/run/spectrain/run": "run"}
    assert {m["mountPath"]: m["name"] for m in target["volumeMounts"]} == shared
    assert {m["mountPath"]: m["name"] for m in drafter["volumeMounts"]} == {
        **shared, "/var/run/spectrain/run/drafter": "run", "/etc/spectrain/podinfo": "podinfo",
        "/etc/spectrain/fleet-key": "fleet-key", "/etc/spectrain/fleet-identity": "fleet-identity"}
    assert p["metadata"]["labels"][builders.LABEL_NODE] == "1"
    assert p["metadata"]["labels"][builders.LABEL_GENERATION] == "0"


def test_torchrun_and_spectrain_env() -> None:
    j = job()
    j["spec"]["target"].update(nodes=2, procsPerNode=2)
    j["spec"]["target"]["parallelism"].update(data=2, pipeline=2)
    j["spec"]["target"]["env"] = [{"name": "EXTRA", "value": "1"}]
    p, _ = builders.pod(j, 1)
    env = env_of(p["spec"]["containers"][0])
    assert env["RANK"] == "2" and env["NODE_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29500"
    assert env["MASTER_ADDR"] == "demo-0.demo.ns1.svc"
    assert env["SPECTRAIN_CONFIG"] == "/etc/spectrain/config.json"
    assert env["SPECTRAIN_RING_DIR"] == "/var/run/spectrain/ring"
    assert env["SPECTRAIN_RUN_DIR"] == "/var/run/spectrain/run"
    assert env["SPECTRAIN_EXPORT_DIR"] == "/var/run/spectrain/run/drafter"
    assert env["SPECTRAIN_JOB_NAME"] == "demo" and env["SPECTRAIN_DRAFTER_ENABLED"] == "1"
    assert env["SPECTRAIN_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["SPECTRAIN_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # what every container's listeners bind (the target's rendezvous store, metrics): never 0.0.0.0
    for c in p["spec"]["containers"] + p["spec"].get("initContainers", []):
        assert {e["name"]: e.get("valueFrom") for e in c["env"]}["SPECTRAIN_POD_IP"] == \
            {"fieldRef": {"fieldPath": "status.podIP"}}, c["name"]
    assert p["spec"]["containers"][0]["env"][-1] == {"name": "EXTRA", "value": "1"}  # user env appended


def test_drafters_reach_each_other_through_the_headless_service() -> None:
    j = job()
    j["spec"]["target"].update(nodes=2, procsPerNode=2)
    j["spec"]["target"]["parallelism"].update(data=2, pipeline=2)
    p, _ = builders.pod(j, 1)
    drafter = p["spec"]["initContainers"][0]
    assert env_of(drafter)["SPECTRAIN_DRAFTER_PEERS"] == "demo-0.demo.ns1.svc:29600,demo-1.demo.ns1.svc:29600"
    assert [(q["name"], q["containerPort"]) for q in drafter["ports"]] == [
        ("drafter", 29600), ("drafter-1", 29601), ("dmetrics", 9464), ("dmetrics-1", 9465)]
    assert "SPECTRAIN_DRAFTER_PEERS" not in env_of(p["spec"]["containers"][0])     # the target never talks to it
    svc = builders.service(j)
    assert {"name": "drafter", "port": 29600, "targetPort": 29600, "protocol": "TCP"} in svc["spec"]["ports"]


@pytest.mark.parametrize("how", ["spec", "restart"])
def test_drafter_omitted_when_disabled(how: str) -> None:
    j = job()
    if how == "spec":
        j["spec"]["drafter"]["enabled"] = False
    p, _ = builders.pod(j, 0, drafter_disabled=how == "restart")
    assert "initContainers" not in p["spec"]
    assert env_of(p["spec"]["containers"][0])["SPECTRAIN_DRAFTER_ENABLED"] == "0"


def test_claims_checkpoint_export_and_read_only_data() -> None:
    j = job()
    j["spec"]["target"]["checkpoint"]["claimName"] = "ckpt"
    j["spec"]["drafter"]["export"] = {"claimName": "models", "path": "drafters/v1"}
    j["spec"]["target"]["data"]["source"] = "pvc://corpus/text/en"
    p, _ = builders.pod(j, 0)
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert vols["run"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert vols["export"]["persistentVolumeClaim"] == {"claimName": "models"}
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": "corpus", "readOnly": True}
    target = p["spec"]["containers"][0]
    mounts = {m["name"]: m for m in target["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/var/run/spectrain/data/corpus", "readOnly": True}
    assert mounts["export"]["mountPath"] == "/var/run/spectrain/export"
    assert env_of(target)["SPECTRAIN_EXPORT_DIR"] == "/var/run/spectrain/export/drafters/v1"
    assert "data" not in {m["name"] for m in p["spec"]["initContainers"][0]["volumeMounts"]}
    assert spec.claims(j["spec"]) == [("spec.target.checkpoint.claimName", "ckpt"),
                                      ("spec.drafter.export.claimName", "models"),
                                      ("spec.target.data.source", "corpus")]


def _run_mounts(c: dict[str, Any]) -> list[tuple[str, str | None, bool]]:
    """(mountPath, subPath, readOnly) of a container's mounts of the run volume."""
    return [(m["mountPath"], m.get("subPath"), bool(m.get("readOnly"))) for m in c["volumeMounts"]
            if m["name"] == "run"]


RUN = builders.RUN_DIR
TARGET_RUN = [(RUN, None, False)]
DRAFTER_RUN = [(RUN, None, True), (f"{RUN}/drafter", "drafter", False)]


@pytest.mark.parametrize("mode", ["None", "DRA", "PodLocalMPS", "SingleContainer"])
@pytest.mark.parametrize(("export", "extra"), [
    ({}, []),                                                             # default path "drafter"
    ({"path": "drafter/exports"}, []),                                    # under drafter/: covered
    ({"path": "./models/./eagle"}, [(f"{RUN}/models/eagle", "models/eagle", False)]),   # its own, normalized
    ({"claimName": "models", "path": "eagle"}, []),                       # on its own volume
])
def test_the_drafter_writes_only_its_own_directories_of_the_run_volume(mode: str, export: dict[str, str],
                                                                       extra: list[Any]) -> None:
    """The drafter (bytes from peers) mounts the run volume read-only, plus read-write subPaths for
    drafter/ and an export path of its own; the target's mount is unchanged. SingleContainer: one
    container runs both, so it keeps the target's read-write mount and none of the drafter's."""
    j = job(gpuSharing={"mode": mode, "gpusPerNode": 0 if mode == "None" else 1})
    j["spec"]["drafter"]["export"].update(export)
    assert spec.validate(j) == []
    for pod in by_kind(builders.render(j))["Pod"]:
        cs = {c["name"]: c for c in _containers(pod)}
        assert _run_mounts(cs["target"]) == TARGET_RUN
        if mode == "SingleContainer":
            assert "drafter" not in cs
            continue
        assert _run_mounts(cs["drafter"]) == DRAFTER_RUN + extra
        # each read-write subPath is mounted where it lies in the volume (its mount point exists in
        # the read-only mount: the kubelet made the subPath directory)
        assert all(path == f"{RUN}/{sub}" for path, sub, _ in _run_mounts(cs["drafter"]) if sub)
        if "mps-daemon" in cs:
            assert _run_mounts(cs["mps-daemon"]) == []
    if export.get("claimName"):
        export_mounts = [m for m in cs["target"]["volumeMounts"] if m["name"] == "export"]
        assert export_mounts == [{"name": "export", "mountPath": builders.EXPORT_DIR}]


@pytest.mark.parametrize("path", [".", "target", "./target/x", "metrics", "progress.json", "tokenizer.json"])
def test_an_export_path_of_the_targets_on_the_run_volume_is_refused_with_its_field(path: str) -> None:
    j = job()
    j["spec"]["drafter"]["export"]["path"] = path
    errors = spec.validate(j)
    assert len(errors) == 1 and errors[0].startswith("spec.drafter.export.path:"), errors
    assert "spec.drafter.export.claimName" in errors[0]
    assert check_spec(from_manifest(j)) == errors               # the workloads refuse it at start too
    j["spec"]["drafter"]["export"]["claimName"] = "models"      # its own volume: any relative path
    assert spec.validate(j) == []


def test_an_hf_models_claim_is_mounted_read_only_beside_the_datas() -> None:
    j = job()
    j["spec"]["target"]["model"] = {"path": "pvc://models/llama-3.2-1b"}
    j["spec"]["target"]["data"]["source"] = "pvc://corpus/text/en"
    p, _ = builders.pod(j, 0)
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": "corpus", "readOnly": True}
    mounts = {m["name"]: m for m in p["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/var/run/spectrain/data/models", "readOnly": True}
    assert ("spec.target.model.path", "models") in spec.claims(j["spec"])
    j["spec"]["target"]["model"] = {"path": "pvc://corpus/llama"}     # one claim for both: mounted once
    p, _ = builders.pod(j, 0)
    assert [v["name"] for v in p["spec"]["volumes"] if "persistentVolumeClaim" in v] == ["run", "data"]
    (cm,) = by_kind(builders.render(j))["ConfigMap"]        # the workloads read the path from here
    assert json.loads(cm["data"][builders.CONFIG_KEY])["spec"]["target"]["model"]["path"] == "pvc://corpus/llama"


def test_status_rbac_is_its_own_job_s_status_only() -> None:
    kinds = by_kind(builders.render(job()))
    (role,) = kinds["Role"]
    assert role["rules"] == [
        {"apiGroups": ["spectrain.io"], "resources": ["spectrainjobs/status"], "verbs": ["patch"],
         "resourceNames": ["demo"]},
        {"apiGroups": ["spectrain.io"], "resources": ["spectrainjobs"], "verbs": ["get"], "resourceNames": ["demo"]}]
    pod = next(p for p in kinds["Pod"])
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["SPECTRAIN_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["SPECTRAIN_JOB_NAME"]["value"] == "demo"
    (binding,) = kinds["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-status", "namespace": "ns1"}]
    assert binding["roleRef"]["name"] == "demo-status"


def test_headless_service_selects_the_job_pods() -> None:
    (svc,) = by_kind(builders.render(job()))["Service"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {builders.LABEL_JOB: "demo"}


def test_config_map_is_the_defaulted_manifest_the_workloads_read() -> None:
    from spectrain_api import config

    j = job()
    (cm,) = by_kind(builders.render(j))["ConfigMap"]
    data = json.loads(cm["data"]["config.json"])
    assert data["spec"] == j["spec"]
    cfg = config.from_manifest(data)
    assert cfg.name == "demo" and cfg.namespace == "ns1"
    assert cfg.target.parallelism.pipeline == 2 and cfg.target.parallelism.microbatches == 4
    assert cfg.target.steps == j["spec"]["target"]["steps"]
    assert cfg.target.checkpoint.every_steps == j["spec"]["target"]["checkpoint"]["everySteps"]


def test_render_is_deterministic_and_pure() -> None:
    j = job()
    before = json.dumps(j, sort_keys=True)
    assert builders.render(j) == builders.render(j)
    assert json.dumps(j, sort_keys=True) == before


def test_generation_label_and_selected_nodes() -> None:
    pods, _ = builders.pods(job(), generation=3, nodes=[1])
    assert [p["metadata"]["name"] for p in pods] == ["demo-1"]
    assert pods[0]["metadata"]["labels"][builders.LABEL_GENERATION] == "3"


def test_gpu_and_scheduling_extras_are_created_once_per_job() -> None:
    j = spec.defaulted(spec.load_manifests(ROOT / "examples" / "gpu-dra.yaml")[0])
    objs = builders.render(j)
    extras = [o for o in objs if o["kind"] not in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                                   "Service", "NetworkPolicy", "Pod")]
    assert sorted(o["kind"] for o in extras) == ["PodGroup", "ResourceClaimTemplate"]
    for o in extras:
        assert o["metadata"]["labels"][builders.LABEL_JOB] == "gpu-dra"
    assert objs[-1]["kind"] == "Pod"


@pytest.mark.parametrize("example", ["demo.yaml", "demo-rl.yaml", "pretrain-dp.yaml", "async-pipeline.yaml"])
def test_rendered_objects_pass_kubernetes_schemas(example: str) -> None:
    j = spec.defaulted(spec.load_manifests(ROOT / "examples" / example)[0])
    for obj in builders.render(j):
        kubernetes_validate.validate(obj, "1.34", strict=True)


def test_target_and_drafter_fall_back_to_their_logs_for_the_termination_message() -> None:
    # The workloads write their fatal error line there (a config error reaches Failed/ConfigError).
    for p in by_kind(builders.render(job()))["Pod"]:
        (target,) = p["spec"]["containers"]
        (drafter,) = p["spec"]["initContainers"]
        assert target["terminationMessagePolicy"] == drafter["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert "terminationMessagePath" not in target  # the kubelet's default, /dev/termination-log


# ------------------------------------------------------------------------------ the drafter fleet's contract


def test_fleet_key_secret_is_owned_opaque_and_holds_64_hex_chars() -> None:
    import base64

    j = job()
    j["metadata"]["uid"] = "u-1"
    raw = bytes(range(32))
    secret = access.fleet_key_secret(j, objects.fleet_key_name(j), raw)
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert secret["metadata"]["name"] == "demo-fleet-key" == objects.fleet_key_name(j)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True
    text = base64.b64decode(secret["data"]["key"]).decode()
    assert text == raw.hex() and len(text) == 64 and text == text.lower()
    with pytest.raises(ValueError, match="32 random bytes"):
        access.fleet_key_secret(j, objects.fleet_key_name(j), b"short")
    objs = builders.children(j, fleet_key=raw)
    assert [o["kind"] for o in objs][-1] == "Secret"
    assert "Secret" not in [o["kind"] for o in builders.children(j)]          # no key given: none rendered
    j["spec"]["drafter"]["enabled"] = False
    assert "Secret" not in [o["kind"] for o in builders.children(j, fleet_key=raw)]  # no drafter: no key


def test_only_the_drafter_gets_the_key_identity_and_control_file() -> None:
    j = job()
    j["metadata"]["uid"] = "u-1"
    p, _ = builders.pod(j, 1, generation=3)
    (target,) = p["spec"]["containers"]
    (drafter,) = p["spec"]["initContainers"]
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert vols["fleet-key"] == {"name": "fleet-key", "secret": {"secretName": "demo-fleet-key", "defaultMode": 0o400}}
    # the pod's own identity of its restart generation: node 1, generation 3
    assert vols["fleet-identity"] == {"name": "fleet-identity", "secret": {"secretName": "demo-fleet-id-3-1",
                                                                          "defaultMode": 0o400}}
    assert objects.fleet_identity_name(j, 1, 3) == "demo-fleet-id-3-1"
    assert vols["podinfo"] == {"name": "podinfo", "downwardAPI": {"items": [
        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}}
    mounts = {m["name"]: m for m in drafter["volumeMounts"]}
    assert mounts["fleet-key"] == {"name": "fleet-key", "mountPath": "/etc/spectrain/fleet-key", "readOnly": True}
    assert mounts["podinfo"] == {"name": "podinfo", "mountPath": "/etc/spectrain/podinfo", "readOnly": True}
    assert mounts["fleet-identity"] == {"name": "fleet-identity", "mountPath": "/etc/spectrain/fleet-identity",
                                        "readOnly": True}
    env = env_of(drafter)
    assert env[names.ENV_FLEET_IDENTITY_FILE] == "/etc/spectrain/fleet-identity/identity.key"
    assert env[names.ENV_FLEET_PEERS_FILE] == "/etc/spectrain/fleet-identity/peers.json"
    assert env[names.ENV_FLEET_KEY_FILE] == "/etc/spectrain/fleet-key/key"
    assert env[names.ENV_JOB_UID] == "u-1" and env[names.ENV_RESTART_GENERATION] == "3"
    assert env[names.ENV_POD_IPS] == {"fieldRef": {"fieldPath": "status.podIPs"}}
    assert env[names.ENV_DRAFTER_CONTROL] == "/etc/spectrain/podinfo/annotations"
    # the target: none of it
    assert {"fleet-key", "fleet-identity", "podinfo"}.isdisjoint(m["name"] for m in target["volumeMounts"])
    assert not {names.ENV_FLEET_KEY_FILE, names.ENV_FLEET_IDENTITY_FILE, names.ENV_FLEET_PEERS_FILE, names.ENV_JOB_UID, names.ENV_POD_IPS,
                names.ENV_DRAFTER_CONTROL, names.ENV_RESTART_GENERATION} & set(env_of(target))
    # no drafter: no key volume at all
    off, _ = builders.pod(j, 1, drafter_disabled=True)
    assert {"fleet-key", "fleet-identity", "podinfo"}.isdisjoint(v["name"] for v in off["spec"]["volumes"])


@pytest.mark.parametrize("change", ["policy Off", "exchange off", "one rank"])
def test_no_fleet_no_identity_secret_minted_or_mounted(change: str) -> None:
    """A job whose drafters never exchange (activation Off, exchange disabled, a single rank) gets no
    identity: the reconciler mints none (fleet_runs) and its pods mount none, yet keep the key."""
    j = job()
    assert builders.fleet_runs(j)
    if change == "policy Off":
        j["spec"]["drafter"]["activation"]["policy"] = names.OFF
    elif change == "exchange off":
        j["spec"]["drafter"]["exchange"]["enabled"] = False
    else:
        j["spec"]["target"].update(nodes=1, procsPerNode=1)
    assert not builders.fleet_runs(j) and builders.drafter_runs(j)
    p, _ = builders.pod(j, 0, generation=1)
    (drafter,) = p["spec"]["initContainers"]
    assert "fleet-identity" not in {v["name"] for v in p["spec"]["volumes"]} | {m["name"] for m in drafter["volumeMounts"]}
    assert {"fleet-key", "podinfo"} <= {v["name"] for v in p["spec"]["volumes"]}
    assert not {names.ENV_FLEET_IDENTITY_FILE, names.ENV_FLEET_PEERS_FILE} & set(env_of(drafter))


def test_drafter_disabled_in_place_keeps_the_sidecar_and_annotates_the_pod() -> None:
    p, _ = builders.pod(job(), 0, drafter_off="TooManyFailures")
    assert [c["name"] for c in p["spec"]["initContainers"]] == ["drafter"]
    assert p["metadata"]["annotations"] == {names.ANNOTATION_DRAFTER_DISABLED: "TooManyFailures"}
    assert "annotations" not in builders.pod(job(), 0)[0]["metadata"]
    # the next generation after a disable: no sidecar, nothing to annotate
    gone, _ = builders.pod(job(), 0, drafter_disabled=True, drafter_off="TooManyFailures")
    assert "initContainers" not in gone["spec"] and "annotations" not in gone["metadata"]


@pytest.mark.parametrize("resources,memory", [
    ({}, builders.DRAFTER_MEMORY_LIMIT),
    ({"limits": {"cpu": "2"}}, builders.DRAFTER_MEMORY_LIMIT),
    ({"limits": {"memory": "2Gi"}}, "2Gi"),                      # a user value wins
    ({"requests": {"memory": "4Gi"}}, builders.DRAFTER_MEMORY_LIMIT),
    ({"requests": {"memory": "16Gi"}}, "16Gi"),                  # never below the request
])
def test_drafter_memory_limit_defaults(resources: dict[str, Any], memory: str) -> None:
    j = job()
    j["spec"]["drafter"]["resources"] = resources
    p, _ = builders.pod(j, 0)
    drafter = p["spec"]["initContainers"][0]
    assert drafter["resources"]["limits"]["memory"] == memory
    assert "memory" not in (p["spec"]["containers"][0]["resources"].get("limits") or {})
    assert j["spec"]["drafter"]["resources"] == resources      # the job is not mutated


def test_no_default_drafter_memory_limit_in_single_container_mode() -> None:
    # the drafter runs inside the target's container there: no container of its own to cap
    j = job()
    j["spec"]["gpuSharing"] = {"mode": "SingleContainer", "gpusPerNode": int(j["spec"]["target"]["procsPerNode"])}
    j["spec"]["target"]["resources"] = {"limits": {"memory": "16Gi"}}
    p, _ = builders.pod(j, 0)
    assert p["spec"]["containers"][0]["resources"]["limits"]["memory"] == "16Gi"


# ---------------------------------------------------------------- Pod Security and NetworkPolicy

def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["containers"] + pod["spec"].get("initContainers", [])


@pytest.mark.parametrize("mode", ["None", "DRA", "PodLocalMPS", "SingleContainer"])
def test_every_container_is_restricted_by_default(mode: str) -> None:
    gpus = 0 if mode == "None" else 1
    for pod in by_kind(builders.render(job(gpuSharing={"mode": mode, "gpusPerNode": gpus})))["Pod"]:
        psc = pod["spec"]["securityContext"]
        assert psc == {"runAsNonRoot": True, "runAsUser": names.IMAGE_UID, "runAsGroup": names.IMAGE_GID,
                       "fsGroup": names.IMAGE_GID, "fsGroupChangePolicy": "OnRootMismatch",
                       "seccompProfile": {"type": "RuntimeDefault"}}
        container_names = [c["name"] for c in _containers(pod)]
        assert container_names == {"None": ["target", "drafter"], "DRA": ["target", "drafter"],
                         "PodLocalMPS": ["target", "mps-daemon", "drafter"], "SingleContainer": ["target"]}[mode]
        for c in _containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            # nothing on a container undoes the pod's user and seccomp profile
            assert sc.get("runAsUser", psc["runAsUser"]) == names.IMAGE_UID
            assert "runAsNonRoot" not in sc and "seccompProfile" not in sc and "privileged" not in sc


def test_security_overrides_replace_their_defaults_field_by_field() -> None:
    j = job(podSecurityContext={"runAsUser": 2000, "fsGroup": 3000,
                                "seccompProfile": {"type": "Localhost", "localhostProfile": "spectrain.json"}})
    j["spec"]["target"]["securityContext"] = {"readOnlyRootFilesystem": True,
                                              "capabilities": {"add": ["NET_BIND_SERVICE"]}}
    j["spec"]["drafter"]["securityContext"] = {"runAsUser": 2001}
    pod = by_kind(builders.render(j))["Pod"][0]
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": names.IMAGE_GID, "fsGroup": 3000,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "Localhost", "localhostProfile": "spectrain.json"}}
    target, drafter = pod["spec"]["containers"][0], pod["spec"]["initContainers"][0]
    assert target["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                         "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
    assert drafter["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                          "runAsUser": 2001}
    # the spec is not mutated by the overlay
    assert j["spec"]["target"]["securityContext"]["capabilities"] == {"add": ["NET_BIND_SERVICE"]}


def test_network_policy_selects_the_jobs_pods_and_opens_only_metrics_to_others() -> None:
    j = job(networkPolicy={"metricsFrom": {"matchLabels": {"team": "obs"}}})
    j["spec"]["target"].update(procsPerNode=2, parallelism={"data": 2, "pipeline": 2, "microbatches": 2})
    j["metadata"]["uid"] = "u1"
    objs = by_kind(builders.render(j))
    (policy,) = objs["NetworkPolicy"]
    assert policy["metadata"]["name"] == "demo" and policy["metadata"]["ownerReferences"][0]["uid"] == "u1"
    own = {"matchLabels": {builders.LABEL_JOB: "demo"}}
    assert policy["spec"]["podSelector"] == own and policy["spec"]["policyTypes"] == ["Ingress"]
    for pod in objs["Pod"]:
        assert own["matchLabels"].items() <= pod["metadata"]["labels"].items()
    same_job, metrics = policy["spec"]["ingress"]
    assert same_job == {"from": [{"podSelector": own}]}  # every port: c10d, drafter, gloo/NCCL peer links
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]
    # Each process serves its container's SPECTRAIN_METRICS_PORT + local rank; the targets declare theirs.
    served = {int(env_of(c)["SPECTRAIN_METRICS_PORT"]) + rank for pod in objs["Pod"] for c in _containers(pod)
              for rank in range(2)}
    assert served == {p["port"] for p in metrics["ports"]} == set(builders.metrics_ports(j))
    assert {p["protocol"] for p in metrics["ports"]} == {"TCP"}
    # ...and every one is a declared, named container port (what a PodMonitor selects by).
    declared = {(c["name"], p["name"]): p["containerPort"] for pod in objs["Pod"] for c in _containers(pod)
                for p in c["ports"] if p["containerPort"] in served}
    t, d = builders.TARGET_METRICS_PORT, builders.DRAFTER_METRICS_PORT
    assert declared == {("target", "metrics"): t, ("target", "metrics-1"): t + 1,
                        ("drafter", "dmetrics"): d, ("drafter", "dmetrics-1"): d + 1}
    assert set(declared.values()) == served
    # target and drafter processes share the pod's network namespace: their ranges never overlap
    assert len(served) == 2 * 2
    assert builders.DRAFTER_METRICS_PORT >= builders.TARGET_METRICS_PORT + spec.crd()["spec"]["versions"][0][
        "schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["target"]["properties"]["procsPerNode"]["maximum"]
    # The default opens metrics to every namespace; disabled, there is no policy at all.
    assert by_kind(builders.render(job()))["NetworkPolicy"][0]["spec"]["ingress"][1]["from"] == [{"namespaceSelector": {}}]
    assert "NetworkPolicy" not in by_kind(builders.render(job(networkPolicy={"enabled": False})))
