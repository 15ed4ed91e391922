"""spec.gpuSharing: builder output for every mode, checked structurally and against the
Kubernetes 1.34 and 1.37 OpenAPI schemas (kubernetes-validate, strict: unknown fields fail)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from spectrain_operator import builders, gpu_sharing
from spectrain_operator import spec as specmod
from spectrain_workloads import supervisor

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
K8S_VERSIONS = ("1.34.0", "1.37.0")
CRD_KINDS = {"PodGroup"}  # scheduler CRDs: not in the core schemas


def job_for(mode: str, **gpu: Any) -> dict:
    job = specmod.load_manifests(ROOT / "examples" / "gpu-dra.yaml")[0]
    job["metadata"]["namespace"] = "team-a"
    job["metadata"]["uid"] = "0c1d2e3f-0000-4000-8000-000000000001"
    job["spec"]["gpuSharing"]["mode"] = mode
    if mode == "None":
        job["spec"]["gpuSharing"]["gpusPerNode"] = 0
    job["spec"]["gpuSharing"].update(gpu)
    assert specmod.validate(job) == [], "the fixture job must be a valid SpecTrainJob"
    return specmod.apply_defaults(job)


def render(job: dict, *, drafter_disabled: bool = False) -> tuple[dict, list[dict]]:
    pod, extras = builders.pod(job, 0, drafter_disabled=drafter_disabled)
    return pod, extras


def container(pod: dict, name: str) -> dict:
    spec = pod["spec"]
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name!r} in pod: {[c['name'] for c in spec['containers']]}")


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def mounts(c: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


@pytest.mark.parametrize("mode", gpu_sharing.MODES)
@pytest.mark.parametrize("drafter_disabled", [False, True])
def test_every_object_validates_against_kubernetes_schemas(mode: str, drafter_disabled: bool) -> None:
    job = job_for(mode)
    objs = builders.render(job, drafter_disabled=drafter_disabled)
    checked = 0
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 6


def test_schema_validation_is_not_vacuous() -> None:
    pod, _ = render(job_for("DRA"))
    broken = copy.deepcopy(pod)
    broken["spec"]["resourceClaims"][0]["resourceClaimTemplate"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)
    rct = gpu_sharing.resource_claim_template(job_for("DRA"))
    rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(rct, K8S_VERSIONS[0], strict=True)


def test_dra_claim_template_requests_gpus_with_mps_gpuconfig() -> None:
    job = job_for("DRA")
    pod, extras = render(job)
    rcts = [o for o in extras if o["kind"] == "ResourceClaimTemplate"]
    assert len(rcts) == 1
    rct = rcts[0]
    assert rct["apiVersion"] == "resource.k8s.io/v1"
    assert rct["metadata"]["name"] == "gpu-dra-gpu"
    assert rct["metadata"]["namespace"] == "team-a"
    assert rct["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    devices = rct["spec"]["spec"]["devices"]
    assert devices["requests"] == [{
        "name": "gpus",
        "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 4},
    }]
    (cfg,) = devices["config"]
    assert cfg["requests"] == ["gpus"]
    assert cfg["opaque"]["driver"] == "gpu.nvidia.com"
    params = cfg["opaque"]["parameters"]
    assert params["apiVersion"] == "resource.nvidia.com/v1beta1"
    assert params["kind"] == "GpuConfig"
    assert params["sharing"]["strategy"] == "MPS"
    # the daemon's defaults bound the target too: they must stay uncapped
    assert params["sharing"]["mpsConfig"] == {"defaultActiveThreadPercentage": 100}


def test_dra_pod_shares_one_claim_between_target_and_drafter() -> None:
    pod, _ = render(job_for("DRA"))
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "gpu-dra-gpu"}]
    target, drafter = container(pod, "target"), container(pod, "drafter")
    assert target["resources"]["claims"] == [{"name": "gpu"}]
    assert drafter["resources"]["claims"] == [{"name": "gpu"}]
    assert drafter["restartPolicy"] == "Always"
    assert env(drafter)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert env(drafter)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M,1=6144M,2=6144M,3=6144M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env(target)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env(target)
    assert "nvidia.com/gpu" not in str(target["resources"])  # DRA, not the device plugin
    assert env(target)["SPECTRAIN_GPU_SHARING"] == env(drafter)["SPECTRAIN_GPU_SHARING"] == "DRA"


def test_dra_without_drafter_claims_for_the_target_only() -> None:
    pod, extras = render(job_for("DRA"), drafter_disabled=True)
    assert "initContainers" not in pod["spec"]
    assert container(pod, "target")["resources"]["claims"] == [{"name": "gpu"}]
    assert [o["kind"] for o in extras].count("ResourceClaimTemplate") == 1


def test_dra_custom_device_class() -> None:
    job = job_for("DRA", dra={"deviceClassName": "mps.gpu.example.com"})
    rct = gpu_sharing.resource_claim_template(job)
    assert rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "mps.gpu.example.com"


def test_pod_local_mps_layout() -> None:
    job = job_for("PodLocalMPS", mps={"image": "example.org/mps:1", "runAsUser": 4242})
    pod, extras = render(job)
    assert [o["kind"] for o in extras] == ["PodGroup"]
    inits = pod["spec"]["initContainers"]
    assert [c["name"] for c in inits] == ["mps-daemon", "drafter"], "the daemon must start first"
    daemon, drafter, target = inits[0], inits[1], container(pod, "target")
    assert daemon["image"] == "example.org/mps:1"
    assert daemon["command"] == ["nvidia-cuda-mps-control", "-f"]
    assert daemon["restartPolicy"] == "Always"
    probe = daemon["startupProbe"]["exec"]["command"]
    assert "get_server_list" in " ".join(probe) and "nvidia-cuda-mps-control" in " ".join(probe)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for c in (daemon, drafter, target):
        e = env(c)
        assert e["CUDA_MPS_PIPE_DIRECTORY"] == gpu_sharing.MPS_PIPE_DIR
        assert e["CUDA_MPS_LOG_DIRECTORY"] == gpu_sharing.MPS_LOG_DIR
        m = mounts(c)
        assert m[gpu_sharing.MPS_PIPE_DIR] == "mps-pipe"
        assert m[gpu_sharing.MPS_LOG_DIR] == "mps-log"
        assert m["/dev/shm"] == "dshm"
        assert c["securityContext"]["runAsUser"] == 4242
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes["mps-pipe"] and "emptyDir" in volumes["mps-log"]
    assert pod["spec"]["securityContext"]["runAsUser"] == 4242
    assert target["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert target["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert "nvidia.com/gpu" not in str(daemon.get("resources")) + str(drafter.get("resources"))
    assert env(drafter)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env(target)


def test_pod_local_mps_daemon_defaults_to_target_image() -> None:
    pod, _ = render(job_for("PodLocalMPS"))
    assert container(pod, "mps-daemon")["image"] == container(pod, "target")["image"]
    assert container(pod, "mps-daemon")["securityContext"]["runAsUser"] == 1000


def test_single_container_names_the_field_of_a_quantity_it_cannot_add() -> None:
    """SingleContainer adds the drafter's requests to the target's: a value that is no Kubernetes
    quantity is refused naming its field (GpuSharingError, which the operator shows as the spec's error)."""
    job = job_for("SingleContainer")
    job["spec"]["drafter"]["resources"] = {"requests": {"cpu": "500m"}}
    job["spec"]["target"]["resources"] = {"requests": {"cpu": "two cores"}}
    with pytest.raises(gpu_sharing.GpuSharingError,
                       match=r"spec\.target\.resources\.requests\.cpu: 'two cores' is not a Kubernetes quantity"):
        render(job)


def test_single_container_folds_drafter_into_supervised_target() -> None:
    job = job_for("SingleContainer")
    job["spec"]["drafter"]["maxFailures"] = 5
    job["spec"]["drafter"]["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}}
    job["spec"]["target"]["resources"] = {"requests": {"cpu": "2", "memory": "8Gi"},
                                          "limits": {"memory": "16Gi"}}
    plain, _ = builders.pod(job_for("None", gpusPerNode=0), 0)
    pod, extras = render(job)
    assert [o["kind"] for o in extras] == ["PodGroup"]
    assert "initContainers" not in pod["spec"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["target"]
    target = pod["spec"]["containers"][0]
    assert target["command"] == ["spectrain-supervisor"]
    cfg = supervisor.parse_args(target["args"])
    assert cfg.target == container(plain, "target")["command"] + container(plain, "target").get("args", [])
    assert cfg.drafter == ["spectrain-drafter"]
    assert cfg.drafter_max_failures == 5
    assert cfg.mps == ["nvidia-cuda-mps-control", "-f"]
    assert cfg.mps_ready is not None and "get_server_list" in " ".join(cfg.mps_ready)
    assert cfg.drafter_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert cfg.drafter_env["SPECTRAIN_METRICS_PORT"] == str(builders.DRAFTER_METRICS_PORT)
    # the drafter's ports (exchange, metrics) are declared where its processes now listen
    ports = {p["name"]: p["containerPort"] for p in target["ports"]}
    assert ports["dmetrics"] == builders.DRAFTER_METRICS_PORT and ports["drafter"] == builders.DRAFTER_PORT
    assert ports["metrics"] == builders.TARGET_METRICS_PORT and len(ports) == len(target["ports"])
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env(target)
    assert env(target)["CUDA_MPS_PIPE_DIRECTORY"] == gpu_sharing.MPS_PIPE_DIR
    assert target["resources"]["requests"] == {"cpu": "2500m", "memory": "9Gi", "nvidia.com/gpu": "4"}
    assert target["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": "4"}, \
        "a limit the drafter alone sets must not cap the target"
    assert mounts(target)["/dev/shm"] == "dshm"
    assert target["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_single_container_without_drafter_supervises_mps_and_target() -> None:
    pod, _ = render(job_for("SingleContainer"), drafter_disabled=True)
    cfg = supervisor.parse_args(pod["spec"]["containers"][0]["args"])
    assert cfg.drafter is None
    assert cfg.mps == ["nvidia-cuda-mps-control", "-f"]


def test_none_leaves_the_pod_unchanged() -> None:
    job = job_for("None")
    pod, _ = render(job)
    before = copy.deepcopy(pod)
    assert gpu_sharing.apply(pod, job) == []
    assert pod == before
    assert "resourceClaims" not in pod["spec"]
    assert all("CUDA_MPS" not in str(c.get("env")) for c in pod["spec"]["containers"] + pod["spec"]["initContainers"])


@pytest.mark.parametrize(("quantity", "expected"), [
    ("8Gi", "0=8192M"), ("1536Mi", "0=1536M"), ("8G", "0=7629M"), ("1Ti", "0=1048576M"), (2**30, "0=1024M"),
])
def test_pinned_limit_format(quantity: Any, expected: str) -> None:
    assert gpu_sharing.pinned_mem_limit_env(quantity, 1) == expected


def test_pinned_limit_lists_every_device() -> None:
    assert gpu_sharing.pinned_mem_limit_env("1Gi", 3) == "0=1024M,1=1024M,2=1024M"


@pytest.mark.parametrize("bad", ["lots", "8 GB", "-1Gi"])
def test_pinned_limit_errors_name_the_field(bad: str) -> None:
    with pytest.raises(gpu_sharing.GpuSharingError, match=r"spec\.drafter\.gpuShare\.pinnedMemoryLimit"):
        gpu_sharing.pinned_mem_limit_env(bad, 1)
    with pytest.raises(gpu_sharing.GpuSharingError, match=r"below 1Mi"):
        gpu_sharing.pinned_mem_limit_env("512Ki", 1)


def test_gpu_mode_without_gpus_names_the_field() -> None:
    job = job_for("DRA")
    job["spec"]["gpuSharing"]["gpusPerNode"] = 0
    pod, _ = builders.pod(job_for("None"), 0)
    with pytest.raises(gpu_sharing.GpuSharingError, match=r"spec\.gpuSharing\.gpusPerNode"):
        gpu_sharing.apply(pod, job)


def test_unknown_mode_names_the_field() -> None:
    job = job_for("None")
    job["spec"]["gpuSharing"]["mode"] = "Magic"
    with pytest.raises(gpu_sharing.GpuSharingError, match=r"spec\.gpuSharing\.mode"):
        gpu_sharing.apply({"spec": {"containers": [{"name": "target"}]}}, job)


def test_pod_without_target_is_rejected() -> None:
    with pytest.raises(gpu_sharing.GpuSharingError, match="target"):
        gpu_sharing.apply({"spec": {"containers": [{"name": "x"}]}}, job_for("DRA"))
