"""GPU sharing between the target and its drafter (spec.gpuSharing.mode): pure manifest transforms.

`apply(pod, job)` mutates a built Pod manifest for the job's sharing mode and returns the extra
objects the operator must create alongside (today: the DRA ResourceClaimTemplate). The pod it
receives is the builders' layout (docs/contracts.md): container `target` in spec.containers and,
unless the drafter is disabled, the native sidecar `drafter` (restartPolicy Always) in
spec.initContainers. No Kubernetes client, no torch: the same input always yields the same output.

Modes (docs/gpu-sharing.md says which to pick):

- ``DRA``: a ResourceClaimTemplate ``<job>-gpu`` (resource.k8s.io/v1) requesting ``gpusPerNode``
  devices of ``dra.deviceClassName`` with the NVIDIA DRA driver's opaque ``GpuConfig`` sharing
  strategy ``MPS``; a pod-level ``resourceClaims`` entry ``gpu``; ``target`` and ``drafter`` both
  reference it, so the driver's MPS control daemon serves both and both see the same devices.
- ``PodLocalMPS``: a native sidecar ``mps-daemon`` running ``nvidia-cuda-mps-control -f`` (started
  before the drafter and the target; its startup probe asks the daemon for its server list),
  shared pipe/log emptyDirs, a memory-backed /dev/shm shared by all containers, one runAsUser for
  all (the MPS server only serves clients of its own UID), the target requesting
  ``nvidia.com/gpu: gpusPerNode``. Device-visibility caveat: with the NVIDIA device plugin only a
  container that requests ``nvidia.com/gpu`` gets the devices; the sidecars here set
  ``NVIDIA_VISIBLE_DEVICES=all``, which only works where the container runtime honours that
  variable from unprivileged containers and the pod takes every GPU of its node. Elsewhere use
  DRA or SingleContainer.
- ``SingleContainer``: the drafter sidecar is folded into the ``target`` container, whose command
  becomes ``spectrain-supervisor`` (spectrain_workloads.supervisor): it starts the MPS daemon, the
  drafter (restarted on its own failures, up to drafter.maxFailures) and the target, and exits
  with the target's exit code. The one container keeps the target's read-write ``run`` mount: the
  drafter's read-only view of the run volume (all but its own directory) needs a container of its own.
- ``None``: the pod is returned unchanged (CPU, tests, the local backend).

In every GPU mode the drafter gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from drafter.gpuShare; the target gets neither, so it is
never capped (a client-side value can only lower the daemon's default, never raise it).
All containers get ``SPECTRAIN_GPU_SHARING=<mode>`` (read by spectrain_workloads.nvml reports).
"""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from typing import Any

from spectrain_api.names import ENV_GPU_SHARING
from spectrain_operator import access
from spectrain_operator.objects import (
    DRAFTER,
    LABEL_JOB,
    MPS_DAEMON,
    TARGET,
    add_mount,
    add_volume,
    child_metadata,
    find_container,
    format_quantity,
    parse_quantity,
    set_env,
)
from spectrain_operator.objects import get as _get

MODES = ("DRA", "PodLocalMPS", "SingleContainer", "None")

CLAIM_NAME = "gpu"  # pod-level resourceClaims[].name, referenced by containers[].resources.claims
DRA_REQUEST_NAME = "gpus"  # devices.requests[].name inside the ResourceClaimTemplate
NVIDIA_DRA_DRIVER = "gpu.nvidia.com"  # the NVIDIA DRA driver's name (opaque config's `driver`)
GPU_CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"
GPU_RESOURCE = "nvidia.com/gpu"

MPS_PIPE_DIR = "/var/run/spectrain/mps/pipe"
MPS_LOG_DIR = "/var/run/spectrain/mps/log"
MPS_PIPE_VOLUME = "mps-pipe"
MPS_LOG_VOLUME = "mps-log"
SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
MPS_CONTROL_COMMAND = ["nvidia-cuda-mps-control", "-f"]
# The control daemon answers `get_server_list` as soon as it listens on its pipe (an empty list
# before the first client): a non-zero exit means the daemon is not up yet.
MPS_READY_COMMAND = ["sh", "-c", "echo get_server_list | nvidia-cuda-mps-control"]

SUPERVISOR_COMMAND = "spectrain-supervisor"


class GpuSharingError(ValueError):
    """The spec cannot be turned into a GPU-sharing layout; the message names the field and the fix."""


def _quantity(value: Any, field: str) -> Fraction:
    """objects.parse_quantity, its refusal as this module's GpuSharingError."""
    try:
        return parse_quantity(value, field)
    except ValueError as exc:
        raise GpuSharingError(str(exc)) from None


def pinned_mem_limit_env(pinned_memory_limit: Any, gpus: int) -> str:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for `gpus` devices: "0=8192M,1=8192M".

    The CUDA MPS format is a comma-separated list of `<device ordinal>=<limit>`; the limit is
    written in whole MiB ("M", as the NVIDIA DRA driver does), rounded down, so a Gi quantity maps
    exactly and no limit is ever raised by rounding.
    """
    field = "spec.drafter.gpuShare.pinnedMemoryLimit"
    mib = int(_quantity(pinned_memory_limit, field) / (1 << 20))
    if mib < 1:
        raise GpuSharingError(f"{field}: {pinned_memory_limit!r} is below 1Mi; set at least 1Mi (e.g. 8Gi)")
    return ",".join(f"{i}={mib}M" for i in range(max(gpus, 1)))


# ---------------------------------------------------------------------------------------------
# spec access with API.md defaults


def sharing_mode(job: dict) -> str:
    mode = _get(job, "spec", "gpuSharing", "mode", default="None")
    if mode not in MODES:
        raise GpuSharingError(f"spec.gpuSharing.mode: {mode!r} is not one of {', '.join(MODES)}")
    return str(mode)


def gpus_per_node(job: dict) -> int:
    n = int(_get(job, "spec", "gpuSharing", "gpusPerNode", default=0))
    if sharing_mode(job) != "None" and n < 1:
        raise GpuSharingError(
            f"spec.gpuSharing.gpusPerNode: {n} with mode {sharing_mode(job)}; set it to "
            "target.procsPerNode (>= 1) or set mode None")
    return n


def drafter_mps_env(job: dict) -> dict[str, str]:
    """The drafter's MPS caps from spec.drafter.gpuShare (defaults 30 % and 8Gi)."""
    share = _get(job, "spec", "drafter", "gpuShare", default={})
    pct = int(share.get("activeThreadPercentage", 30))
    if not 1 <= pct <= 100:
        raise GpuSharingError(
            f"spec.drafter.gpuShare.activeThreadPercentage: {pct} is outside 1..100; pick e.g. 30")
    return {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": pinned_mem_limit_env(
            share.get("pinnedMemoryLimit", "8Gi"), gpus_per_node(job)),
    }


def resource_claim_template(job: dict) -> dict:
    """The DRA ResourceClaimTemplate `<job>-gpu` (resource.k8s.io/v1, Kubernetes >= 1.34).

    The GpuConfig's MPS defaults are deliberately uncapped (100 % threads, no pinned limit): the
    daemon's defaults bound every client, the target included, and a client's own
    CUDA_MPS_* variables can only lower them. The drafter caps itself through its env.
    """
    name = job["metadata"]["name"]
    device_class = _get(job, "spec", "gpuSharing", "dra", "deviceClassName", default="gpu.nvidia.com")
    if not device_class:
        raise GpuSharingError(
            "spec.gpuSharing.dra.deviceClassName: empty; set the DeviceClass of the NVIDIA DRA driver "
            "(gpu.nvidia.com by default)")
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": child_metadata(job, f"{name}-gpu"),
        "spec": {
            "metadata": {"labels": {LABEL_JOB: name}},
            "spec": {
                "devices": {
                    "requests": [{
                        "name": DRA_REQUEST_NAME,
                        "exactly": {
                            "deviceClassName": device_class,
                            "allocationMode": "ExactCount",
                            "count": gpus_per_node(job),
                        },
                    }],
                    "config": [{
                        "requests": [DRA_REQUEST_NAME],
                        "opaque": {
                            "driver": NVIDIA_DRA_DRIVER,
                            "parameters": {
                                "apiVersion": GPU_CONFIG_API_VERSION,
                                "kind": "GpuConfig",
                                "sharing": {
                                    "strategy": "MPS",
                                    "mpsConfig": {"defaultActiveThreadPercentage": 100},
                                },
                            },
                        },
                    }],
                },
            },
        },
    }


# ---------------------------------------------------------------------------------------------
# the modes


def _containers(pod: dict) -> tuple[dict, dict | None]:
    spec = pod.get("spec", {})
    target = find_container(spec.get("containers", []), TARGET)
    if target is None:
        raise GpuSharingError("pod.spec.containers: no container named 'target'; build the pod first")
    drafter = find_container(spec.get("initContainers", []), DRAFTER)
    return target, drafter


def _apply_dra(pod: dict, job: dict) -> list[dict]:
    target, drafter = _containers(pod)
    rct = resource_claim_template(job)
    claims = pod["spec"].setdefault("resourceClaims", [])
    if not any(c.get("name") == CLAIM_NAME for c in claims):
        claims.append({"name": CLAIM_NAME, "resourceClaimTemplateName": rct["metadata"]["name"]})
    for c in (target, drafter):
        if c is None:
            continue
        res = c.setdefault("resources", {})
        refs = res.setdefault("claims", [])
        if not any(r.get("name") == CLAIM_NAME for r in refs):
            refs.append({"name": CLAIM_NAME})
    return [rct]


def _mps_env(container: dict) -> None:
    set_env(container, "CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIR)
    set_env(container, "CUDA_MPS_LOG_DIRECTORY", MPS_LOG_DIR)
    add_mount(container, MPS_PIPE_VOLUME, MPS_PIPE_DIR)
    add_mount(container, MPS_LOG_VOLUME, MPS_LOG_DIR)
    add_mount(container, SHM_VOLUME, SHM_PATH)


def _run_as(container: dict, uid: int) -> None:
    sc = container.setdefault("securityContext", {})
    sc["runAsUser"] = uid


def _request_gpus(container: dict, n: int) -> None:
    res = container.setdefault("resources", {})
    res.setdefault("limits", {})[GPU_RESOURCE] = str(n)
    res.setdefault("requests", {})[GPU_RESOURCE] = str(n)


def _mps_volumes(pod: dict) -> None:
    add_volume(pod, {"name": MPS_PIPE_VOLUME, "emptyDir": {"medium": "Memory"}})
    add_volume(pod, {"name": MPS_LOG_VOLUME, "emptyDir": {}})
    add_volume(pod, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})


def mps_uid(job: dict) -> int:
    uid = int(_get(job, "spec", "gpuSharing", "mps", "runAsUser", default=1000))
    if uid < 0:
        raise GpuSharingError(f"spec.gpuSharing.mps.runAsUser: {uid} is negative; use a UID >= 0 (e.g. 1000)")
    return uid


def _apply_pod_local(pod: dict, job: dict) -> list[dict]:
    target, drafter = _containers(pod)
    uid = mps_uid(job)
    image = _get(job, "spec", "gpuSharing", "mps", "image", default="") or target.get("image") \
        or _get(job, "spec", "target", "image", default="")
    daemon: dict[str, Any] = {
        "name": MPS_DAEMON,
        "image": image,
        "command": list(MPS_CONTROL_COMMAND),
        "restartPolicy": "Always",
        # Sidecars are not allocated devices by the device plugin: see the module docstring.
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}],
        "startupProbe": {
            "exec": {"command": list(MPS_READY_COMMAND)},
            "periodSeconds": 2,
            "failureThreshold": 30,
            "timeoutSeconds": 5,
        },
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
        # Pod Security "restricted" like the other containers: the control daemon needs no
        # privilege, only the UID its clients share.
        "securityContext": access.container_security_context(),
    }
    _mps_volumes(pod)
    init = pod["spec"].setdefault("initContainers", [])
    if find_container(init, MPS_DAEMON) is None:
        init.insert(0, daemon)  # before the drafter: its startup probe gates the drafter and target
    for c in (daemon, target, drafter):
        if c is None:
            continue
        _mps_env(c)
        _run_as(c, uid)
    if drafter is not None:
        set_env(drafter, "NVIDIA_VISIBLE_DEVICES", "all")
    _request_gpus(target, gpus_per_node(job))
    psc = pod["spec"].setdefault("securityContext", {})
    psc["runAsUser"] = uid
    return []


def _sum_resources(target: dict, drafter: dict) -> None:
    """Fold the drafter's cpu/memory into the target's: requests add up; a limit is raised only
    where both had one (adding a limit the target did not have would cap the target)."""
    t_res = target.setdefault("resources", {})
    d_res = drafter.get("resources") or {}
    for kind in ("requests", "limits"):
        d = d_res.get(kind) or {}
        if not d:
            continue
        t = t_res.setdefault(kind, {})
        for key, val in d.items():
            if key == GPU_RESOURCE:
                continue
            field = f"spec.drafter.resources.{kind}.{key}"
            if key in t:
                total = _quantity(t[key], f"spec.target.resources.{kind}.{key}") + _quantity(val, field)
                t[key] = format_quantity(total)
            elif kind == "requests":
                t[key] = val
        if not t:
            t_res.pop(kind)


def _covers(t: dict, m: dict) -> bool:
    """Whether the target's mount `t` already shows what the drafter's mount `m` shows at its path:
    the same mountPath, or `m` a subPath of the volume `t` mounts whole, where `t` shows it. So the
    one container keeps the target's read-write `run` volume and none of the drafter's read-only
    view of it (builders._run_mounts): target and drafter cannot be split inside one container."""
    if t.get("mountPath") == m.get("mountPath"):
        return True
    return (t.get("name") == m.get("name") and not t.get("subPath") and bool(m.get("subPath"))
            and m.get("mountPath") == f"{t['mountPath'].rstrip('/')}/{m['subPath']}")


def _apply_single(pod: dict, job: dict) -> list[dict]:
    target, drafter = _containers(pod)
    _mps_volumes(pod)
    target_cmd = list(target.get("command") or ["spectrain-target"]) + list(target.get("args") or [])
    args: list[str] = ["--mps-command", json.dumps(MPS_CONTROL_COMMAND),
                       "--mps-ready-command", json.dumps(MPS_READY_COMMAND)]
    if drafter is not None:
        drafter_cmd = list(drafter.get("command") or ["spectrain-drafter"]) + list(drafter.get("args") or [])
        target_env = {e["name"]: e for e in target.get("env", [])}
        drafter_env: dict[str, str] = {}
        for e in drafter.get("env", []):
            if target_env.get(e["name"]) == e:
                continue
            if "value" in e or "valueFrom" not in e:
                drafter_env[e["name"]] = str(e.get("value", ""))
            elif e["name"] not in target_env:
                target.setdefault("env", []).append(copy.deepcopy(e))  # drafter-only valueFrom
            else:
                raise GpuSharingError(
                    f"drafter env {e['name']}: a valueFrom differing from the target's cannot be carried "
                    "into one container in SingleContainer mode; give it a plain value or use mode DRA")
        for m in drafter.get("volumeMounts", []):
            if not any(_covers(t, m) for t in target.get("volumeMounts", [])):
                target.setdefault("volumeMounts", []).append(copy.deepcopy(m))
        _sum_resources(target, drafter)
        # The drafter's processes now listen in this container: declare their ports here (the
        # metrics ports are how Prometheus' pod discovery finds them; names are unique per pod).
        target.setdefault("ports", []).extend(copy.deepcopy(drafter.get("ports", [])))
        max_failures = int(_get(job, "spec", "drafter", "maxFailures", default=3))
        args += ["--drafter-command", json.dumps(drafter_cmd),
                 "--drafter-env", json.dumps(drafter_env, sort_keys=True),
                 "--drafter-max-failures", str(max_failures)]
        pod["spec"]["initContainers"] = [c for c in pod["spec"].get("initContainers", [])
                                         if c.get("name") != DRAFTER]
        if not pod["spec"]["initContainers"]:
            pod["spec"].pop("initContainers")
    target["command"] = [SUPERVISOR_COMMAND]
    target["args"] = [*args, "--", *target_cmd]
    _mps_env(target)
    _request_gpus(target, gpus_per_node(job))
    # The supervisor writes its JSON verdict there; faults.classify_pod reads it back.
    target.setdefault("terminationMessagePath", "/dev/termination-log")
    target["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return []


def apply(pod: dict, job: dict) -> list[dict]:
    """Mutate `pod` for spec.gpuSharing.mode; return the extra objects the operator must create.

    `pod` is the built Pod manifest (container `target`; native sidecar `drafter` unless the
    drafter is disabled); `job` is the SpecTrainJob with its spec defaulted. Raises
    GpuSharingError (a ValueError) naming the field when the spec cannot be laid out.
    """
    mode = sharing_mode(job)
    if mode == "None":
        return []
    drafter_env = drafter_mps_env(job)
    _, drafter = _containers(pod)
    if drafter is not None:
        for k, v in drafter_env.items():
            set_env(drafter, k, v)
    containers = list(pod["spec"].get("containers", [])) + list(pod["spec"].get("initContainers", []))
    for c in containers:
        set_env(c, ENV_GPU_SHARING, mode)
    if mode == "DRA":
        return _apply_dra(pod, job)
    if mode == "PodLocalMPS":
        return _apply_pod_local(pod, job)
    return _apply_single(pod, job)
