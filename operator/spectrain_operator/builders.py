"""Pure builders: SpecTrainJob (a dict) -> the manifests the operator creates. No API calls, no
clock, no randomness: the same job always renders the same objects (`spectrain render` prints them,
the local backend runs them, the operator creates them).

Children (API.md): `<job>-config` ConfigMap (key config.json = the manifest with its spec
defaulted), `<job>` headless Service, `<job>-status` ServiceAccount/Role/RoleBinding (the status
path of docs/design.md), `<job>-fleet-key` Secret (the drafters' per-job key; its random bytes are
passed in, never made here), `<job>` NetworkPolicy (unless spec.networkPolicy.enabled is false), one
Pod `<job>-<node>` per node with container `target` and the drafter as a native-sidecar init
container, plus whatever gpu_sharing / scheduling add (ResourceClaimTemplate, PodGroup). Pod layout,
env and volumes: docs/contracts.md.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from spectrain_api import fleet_identity, rundir
from spectrain_api.names import (
    ANNOTATION_DRAFTER_DISABLED,
    API_VERSION,
    ENV_CONFIG,
    ENV_DATA_ROOT,
    ENV_DEVICE,
    ENV_DRAFTER_CONTROL,
    ENV_DRAFTER_ENABLED,
    ENV_DRAFTER_PEERS,
    ENV_EXPORT_DIR,
    ENV_FLEET_IDENTITY_FILE,
    ENV_FLEET_KEY_FILE,
    ENV_FLEET_PEERS_FILE,
    ENV_JOB_NAME,
    ENV_JOB_UID,
    ENV_METRICS_PORT,
    ENV_POD_IP,
    ENV_POD_IPS,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_RESTART_GENERATION,
    ENV_RING_DIR,
    ENV_RUN_DIR,
    KIND,
)
from spectrain_operator import access
from spectrain_operator import spec as specmod
from spectrain_operator.objects import (
    LABEL_JOB,
    Obj,
    config_name,
    fleet_identity_name,
    fleet_key_name,
    job_labels,
    network_policy_name,
    owner_reference,
    parse_quantity,
    pod_name,
    pod_object_name,
    service_name,
    status_account_name,
)
from spectrain_operator.objects import child_metadata as _meta

LABEL_NODE = "spectrain.io/node-index"
LABEL_GENERATION = "spectrain.io/restart-generation"

CONFIG_DIR = "/etc/spectrain"
CONFIG_KEY = "config.json"
RING_DIR = "/var/run/spectrain/ring"
RUN_DIR = "/var/run/spectrain/run"
EXPORT_DIR = "/var/run/spectrain/export"
DATA_ROOT = "/var/run/spectrain/data"
MASTER_PORT = 29500
TARGET_METRICS_PORT = 9400
DRAFTER_METRICS_PORT = 9464   # past the targets' 9400 + local rank (procsPerNode <= 64, the CRD's maximum)
# Names of the metrics container ports (local rank 0: the bare name, i > 0: `<name>-<i>`), which the
# chart's PodMonitor selects by; container port names are at most 15 characters and unique in a pod.
TARGET_METRICS_PORT_NAME = "metrics"
DRAFTER_METRICS_PORT_NAME = "dmetrics"
DRAFTER_PORT = 29600       # the drafters' exchange (drafter.fleet); local rank i listens on + i
# The drafter's downward-API file of its pod's annotations (kubelet format: one `key="value"` line
# each): a pod created in the generation whose drafter was disabled in place carries
# ANNOTATION_DRAFTER_DISABLED (pods already running read status.drafterDisabled instead).
PODINFO_DIR = f"{CONFIG_DIR}/podinfo"
PODINFO_ANNOTATIONS = "annotations"
# The drafters' fleet key (spectrain_operator.access), mounted read-only into the drafter container only.
FLEET_KEY_DIR = f"{CONFIG_DIR}/fleet-key"
# The pod's own fleet identity for its restart generation (spectrain_api.fleet_identity): its private
# key and every pod's public key, from the Secret the operator mints per pod and generation; drafter only.
FLEET_IDENTITY_DIR = f"{CONFIG_DIR}/fleet-identity"
# The drafter container's memory limit when spec.drafter.resources sets none (a user value wins): a
# drafter that leaks or is fed oversized frames is OOM-killed alone (a drafter fault), never the node.
DRAFTER_MEMORY_LIMIT = "8Gi"
TARGET_COMMAND = ["spectrain-target"]
DRAFTER_COMMAND = ["spectrain-drafter"]
# The workloads write their fatal error line to /dev/termination-log; without one (a crash before
# the entrypoint ran) the kubelet puts the log's tail there. faults.classify_pod reads it back.
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"


# ---------------------------------------------------------------- non-pod children

def workload_config(job: Obj) -> Obj:
    """The rendered workload config (shape: spectrain_api.config)."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": job["metadata"]["name"], "namespace": job["metadata"].get("namespace", "default")},
            "spec": copy.deepcopy(job["spec"])}


def config_map(job: Obj) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, config_name(job)),
            "data": {CONFIG_KEY: json.dumps(workload_config(job), sort_keys=True, indent=2)}}


def service(job: Obj) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, service_name(job)),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: job["metadata"]["name"]},
                     "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT,
                                "protocol": "TCP"},
                               {"name": "drafter", "port": DRAFTER_PORT, "targetPort": DRAFTER_PORT,
                                "protocol": "TCP"}]}}


def metrics_ports(job: Obj) -> list[int]:
    """The pod's Prometheus ports: every process serves its container's SPECTRAIN_METRICS_PORT + its
    local rank, the targets from TARGET_METRICS_PORT and, where a drafter runs, the drafters from
    DRAFTER_METRICS_PORT (in SingleContainer mode too: the supervisor passes it in its env)."""
    procs = range(int(job["spec"]["target"]["procsPerNode"]))
    bases = [TARGET_METRICS_PORT] + ([DRAFTER_METRICS_PORT] if drafter_runs(job) else [])
    return sorted({base + i for base in bases for i in procs})


def target_metrics_ports(job: Obj) -> list[int]:
    return [TARGET_METRICS_PORT + i for i in range(int(job["spec"]["target"]["procsPerNode"]))]


def port_name(name: str, local_rank: int) -> str:
    """The container port name of local rank `local_rank`'s port in a series named `name`."""
    return f"{name}-{local_rank}" if local_rank else name


def metrics_container_ports(job: Obj, name: str, base: int) -> list[Obj]:
    """Named container ports `name`, `name-1`, ... at `base` + local rank: Prometheus' pod discovery
    sees only declared ports, and a PodMonitor picks them by name."""
    return [{"name": port_name(name, i), "containerPort": base + i, "protocol": "TCP"}
            for i in range(int(job["spec"]["target"]["procsPerNode"]))]


# ---------------------------------------------------------------- pods

def drafter_runs(job: Obj, drafter_disabled: bool = False) -> bool:
    return bool(job["spec"]["drafter"]["enabled"]) and not drafter_disabled


def fleet_runs(job: Obj, drafter_disabled: bool = False) -> bool:
    """The pods' drafters exchange with each other (fleet_identity.fleet_in_use): only then is each
    pod's identity minted and mounted."""
    d, t = job["spec"]["drafter"], job["spec"]["target"]
    return drafter_runs(job, drafter_disabled) and fleet_identity.fleet_in_use(
        d["activation"]["policy"], bool(d["exchange"]["enabled"]), int(t["nodes"]) * int(t["procsPerNode"]))


def export_dir(job: Obj) -> str:
    export = job["spec"]["drafter"]["export"]
    base = EXPORT_DIR if export.get("claimName", "") else RUN_DIR
    return f"{base}/{export['path']}"


def _env(job: Obj, node: int, drafter_on: bool, metrics_port: int) -> list[Obj]:
    t = job["spec"]["target"]
    name = job["metadata"]["name"]
    ns = job["metadata"].get("namespace", "default")
    procs = int(t["procsPerNode"])
    env: list[Obj] = [
        {"name": ENV_CONFIG, "value": f"{CONFIG_DIR}/{CONFIG_KEY}"},
        {"name": ENV_RING_DIR, "value": RING_DIR},
        {"name": ENV_RUN_DIR, "value": RUN_DIR},
        {"name": ENV_EXPORT_DIR, "value": export_dir(job)},
        {"name": ENV_DATA_ROOT, "value": DATA_ROOT},
        {"name": ENV_JOB_NAME, "value": name},
        {"name": ENV_DRAFTER_ENABLED, "value": "1" if drafter_on else "0"},
        {"name": ENV_DEVICE, "value": "auto"},
        {"name": ENV_METRICS_PORT, "value": str(metrics_port)},
        {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": ENV_POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": ENV_POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RANK", "value": str(node * procs)},
        {"name": "NODE_RANK", "value": str(node)},
        {"name": "WORLD_SIZE", "value": str(int(t["nodes"]) * procs)},
        {"name": "LOCAL_WORLD_SIZE", "value": str(procs)},
        {"name": "MASTER_ADDR", "value": f"{pod_name(job, 0)}.{service_name(job)}.{ns}.svc"},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
    ]
    return env


def _drafter_peers_env(job: Obj) -> list[Obj]:
    """Every pod's drafter address (`host:port` per node, through the headless Service)."""
    ns = job["metadata"].get("namespace", "default")
    peers = ",".join(f"{pod_name(job, n)}.{service_name(job)}.{ns}.svc:{DRAFTER_PORT}"
                     for n in range(int(job["spec"]["target"]["nodes"])))
    return [{"name": ENV_DRAFTER_PEERS, "value": peers}]


def _drafter_identity_env(job: Obj, generation: int, fleet: bool) -> list[Obj]:
    """The fleet channel's inputs (docs/contracts.md): key file, the pod's identity (`fleet`: a job
    whose drafters exchange), job identity, the pod's own IPs, and the control file through which a
    drafter disabled in place learns it."""
    identity = [
        {"name": ENV_FLEET_IDENTITY_FILE, "value": f"{FLEET_IDENTITY_DIR}/{fleet_identity.IDENTITY_ITEM}"},
        {"name": ENV_FLEET_PEERS_FILE, "value": f"{FLEET_IDENTITY_DIR}/{fleet_identity.PEERS_ITEM}"},
    ] if fleet else []
    return [
        {"name": ENV_FLEET_KEY_FILE, "value": f"{FLEET_KEY_DIR}/{access.FLEET_KEY_ITEM}"},
        *identity,
        {"name": ENV_JOB_UID, "value": str(job["metadata"].get("uid") or "")},
        {"name": ENV_RESTART_GENERATION, "value": str(generation)},
        {"name": ENV_POD_IPS, "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}},
        {"name": ENV_DRAFTER_CONTROL, "value": f"{PODINFO_DIR}/{PODINFO_ANNOTATIONS}"},
    ]


def _drafter_volumes(job: Obj, node: int, generation: int, fleet: bool) -> list[Obj]:
    return [
        {"name": "podinfo", "downwardAPI": {"items": [
            {"path": PODINFO_ANNOTATIONS, "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
        {"name": "fleet-key", "secret": {"secretName": fleet_key_name(job), "defaultMode": access.FLEET_KEY_MODE}},
    ] + ([{"name": "fleet-identity", "secret": {"secretName": fleet_identity_name(job, node, generation),
                                                "defaultMode": access.FLEET_KEY_MODE}}] if fleet else [])


def _drafter_resources(job: Obj) -> Obj:
    """spec.drafter.resources with a memory limit: the user's, else DRAFTER_MEMORY_LIMIT (raised to
    the memory request when that is larger, so the limit is never below the request). Not in
    SingleContainer mode: there the drafter is no container of its own, and gpu_sharing folds only
    the user's resources into the target's."""
    from spectrain_operator.gpu_sharing import sharing_mode

    res = copy.deepcopy(job["spec"]["drafter"].get("resources") or {})
    if sharing_mode(job) == "SingleContainer":
        return res
    limits = res.setdefault("limits", {})
    if "memory" not in limits:
        request = (res.get("requests") or {}).get("memory")
        above = request is not None and parse_quantity(request, "spec.drafter.resources.requests.memory") > \
            parse_quantity(DRAFTER_MEMORY_LIMIT, "DRAFTER_MEMORY_LIMIT")
        limits["memory"] = request if above else DRAFTER_MEMORY_LIMIT
    return res


def _run_mounts(job: Obj, *, drafter: bool) -> list[Obj]:
    """The `run` volume: read-write for the target; for the drafter read-only, plus read-write its
    own directory (rundir.DRAFTER_DIR) and an export path of its own elsewhere on the volume, each a
    subPath mounted where it lies in the volume (the kubelet creates the subPath directory, so the
    mount point exists inside the read-only mount). SingleContainer mode keeps the target's mount
    (gpu_sharing: one container, one view of the volume)."""
    if not drafter:
        return [{"name": "run", "mountPath": RUN_DIR}]
    export = job["spec"]["drafter"]["export"]
    own = [rundir.DRAFTER_DIR, rundir.export_subpath(export.get("claimName", ""), export["path"])]
    return [{"name": "run", "mountPath": RUN_DIR, "readOnly": True}] + [
        {"name": "run", "mountPath": f"{RUN_DIR}/{sub}", "subPath": sub} for sub in own if sub]


def _mounts(job: Obj, *, data: bool, drafter: bool = False) -> list[Obj]:
    mounts: list[Obj] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "ring", "mountPath": RING_DIR},
        *_run_mounts(job, drafter=drafter),
    ]
    if job["spec"]["drafter"]["export"].get("claimName", ""):
        mounts.append({"name": "export", "mountPath": EXPORT_DIR})
    if data:
        mounts += [{"name": vol, "mountPath": f"{DATA_ROOT}/{claim}", "readOnly": True}
                   for vol, _, claim in specmod.input_claims(job["spec"])]
    return mounts


def _volumes(job: Obj) -> list[Obj]:
    s = job["spec"]
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": config_name(job), "items": [{"key": CONFIG_KEY, "path": CONFIG_KEY}]}},
        {"name": "ring", "emptyDir": {"medium": "Memory", "sizeLimit": s["ring"]["sizeLimit"]}},
    ]
    ckpt = s["target"]["checkpoint"].get("claimName", "")
    volumes.append({"name": "run", "persistentVolumeClaim": {"claimName": ckpt}} if ckpt
                   else {"name": "run", "emptyDir": {}})
    if s["drafter"]["export"].get("claimName", ""):
        volumes.append({"name": "export", "persistentVolumeClaim": {"claimName": s["drafter"]["export"]["claimName"]}})
    volumes += [{"name": vol, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
                for vol, _, claim in specmod.input_claims(s)]
    return volumes


def pod(job: Obj, node: int, *, generation: int = 0, drafter_disabled: bool = False,
        drafter_off: str = "") -> tuple[Obj, list[Obj]]:
    """Pod `<job>-<node>` and the extra objects gpu_sharing / scheduling need for it.

    `drafter_disabled`: no drafter sidecar (a generation after the drafter was disabled).
    `drafter_off`: the drafter was disabled in place in this generation: the sidecar stays (the
    pod matches its gang) and the pod carries ANNOTATION_DRAFTER_DISABLED = `drafter_off`."""
    from spectrain_operator import gpu_sharing, scheduling

    s = job["spec"]
    t = s["target"]
    d = s["drafter"]
    drafter_on, fleet = drafter_runs(job, drafter_disabled), fleet_runs(job, drafter_disabled)
    target: Obj = {
        "name": "target",
        "image": t["image"],
        "command": list(t.get("command") or TARGET_COMMAND),
        "env": _env(job, node, drafter_on, TARGET_METRICS_PORT) + copy.deepcopy(t.get("env") or []),
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}]
        + metrics_container_ports(job, TARGET_METRICS_PORT_NAME, TARGET_METRICS_PORT),
        "volumeMounts": _mounts(job, data=True),
        "resources": copy.deepcopy(t.get("resources") or {}),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "securityContext": access.container_security_context(t.get("securityContext")),
    }
    if t.get("args"):
        target["args"] = list(t["args"])
    init: list[Obj] = []
    if drafter_on:
        init.append({
            "name": "drafter",
            "image": d.get("image") or t["image"],
            "command": list(DRAFTER_COMMAND),
            "restartPolicy": "Always",
            "env": _env(job, node, True, DRAFTER_METRICS_PORT) + _drafter_peers_env(job)
            + _drafter_identity_env(job, generation, fleet),
            "ports": [{"name": port_name("drafter", i), "containerPort": DRAFTER_PORT + i, "protocol": "TCP"}
                      for i in range(int(t["procsPerNode"]))]
            + metrics_container_ports(job, DRAFTER_METRICS_PORT_NAME, DRAFTER_METRICS_PORT),
            "volumeMounts": _mounts(job, data=False, drafter=True) + [
                {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
                {"name": "fleet-key", "mountPath": FLEET_KEY_DIR, "readOnly": True}]
            + ([{"name": "fleet-identity", "mountPath": FLEET_IDENTITY_DIR, "readOnly": True}] if fleet else []),
            "resources": _drafter_resources(job),
            "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
            "securityContext": access.container_security_context(d.get("securityContext")),
        })
    labels = {LABEL_NODE: str(node), LABEL_GENERATION: str(generation)}
    manifest: Obj = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": _meta(job, pod_object_name(job, node, generation), labels),
        "spec": {
            "restartPolicy": "Never",
            "hostname": pod_name(job, node),
            "subdomain": service_name(job),
            "serviceAccountName": status_account_name(job),
            "automountServiceAccountToken": True,
            "enableServiceLinks": False,
            "securityContext": access.pod_security_context(job),
            "initContainers": init,
            "containers": [target],
            "volumes": _volumes(job) + (_drafter_volumes(job, node, generation, fleet) if drafter_on else []),
        },
    }
    if not init:
        del manifest["spec"]["initContainers"]
    elif drafter_off:
        manifest["metadata"]["annotations"] = {ANNOTATION_DRAFTER_DISABLED: drafter_off}
    extras = list(gpu_sharing.apply(manifest, job)) + list(scheduling.apply(manifest, job))
    for extra in extras:
        meta = extra.setdefault("metadata", {})
        meta.setdefault("namespace", job["metadata"].get("namespace", "default"))
        meta["labels"] = {**job_labels(job), **(meta.get("labels") or {})}
        if job["metadata"].get("uid"):
            meta.setdefault("ownerReferences", [owner_reference(job)])
    return manifest, extras


def pods(job: Obj, *, generation: int = 0, drafter_disabled: bool = False, drafter_off: str = "",
         nodes: list[int] | None = None) -> tuple[list[Obj], list[Obj]]:
    """Pods for the given node indices (default all) and their deduplicated extra objects."""
    out: list[Obj] = []
    extras: dict[tuple[str, str, str], Obj] = {}
    for node in range(int(job["spec"]["target"]["nodes"])) if nodes is None else nodes:
        p, more = pod(job, node, generation=generation, drafter_disabled=drafter_disabled, drafter_off=drafter_off)
        out.append(p)
        for extra in more:
            extras.setdefault((extra.get("apiVersion", ""), extra.get("kind", ""), extra["metadata"]["name"]), extra)
    return out, list(extras.values())


def children(job: Obj, fleet_key: bytes | None = None) -> list[Obj]:
    """Everything but the pods, in creation order; with `fleet_key` (random bytes), its Secret too
    (only a job with a drafter needs one). The NetworkPolicy is created before any pod, so no pod of
    the job is reachable without it."""
    key = ([access.fleet_key_secret(job, fleet_key_name(job), fleet_key)]
           if fleet_key is not None and drafter_runs(job) else [])
    policy = ([access.network_policy(job, network_policy_name(job), metrics_ports(job))]
              if access.network_policy_enabled(job) else [])
    return [*access.status_rbac(job, status_account_name(job)), config_map(job), service(job),
            *policy, *key]


def render(job: Obj, *, generation: int = 0, drafter_disabled: bool = False,
           fleet_key: bytes | None = None) -> list[Obj]:
    """Every object the operator creates for a (defaulted, valid) job, in creation order; the
    fleet-key Secret only when `fleet_key` is given (the operator makes its bytes once per job)."""
    job = specmod.apply_defaults(job)
    job.setdefault("metadata", {}).setdefault("namespace", "default")
    pod_list, extras = pods(job, generation=generation, drafter_disabled=drafter_disabled)
    return [*children(job, fleet_key), *extras, *pod_list]


# Names the other modules use (the local backend, the tests).
def build_children(job: Obj, **kw: Any) -> list[Obj]:
    """Alias of render: every object for the job, pods last."""
    return render(job, **kw)


def build_pod(job: Obj, node: int, **kw: Any) -> Obj:
    """The pod of one node (gpu_sharing / scheduling applied), without its extra objects."""
    return pod(job, node, **kw)[0]
