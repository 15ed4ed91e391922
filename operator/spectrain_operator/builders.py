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

import base64
import copy
import json
from typing import Any

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
    ENV_FLEET_KEY_FILE,
    ENV_JOB_NAME,
    ENV_JOB_UID,
    ENV_METRICS_PORT,
    ENV_POD_IPS,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_RESTART_GENERATION,
    ENV_RING_DIR,
    ENV_RUN_DIR,
    IMAGE_GID,
    IMAGE_UID,
    KIND,
)
from spectrain_operator import spec as specmod
from spectrain_operator.objects import (
    LABEL_JOB,
    Obj,
    job_labels,
    owner_reference,
)
from spectrain_operator.objects import child_metadata as _meta

LABEL_NODE = "spectrain.io/node-index"
LABEL_GENERATION = "spectrain.io/restart-generation"
ANNOTATION_PROGRESS = "spectrain.io/progress"
ANNOTATION_DRAFTER = "spectrain.io/drafter"

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
# each): the operator disables a drafter in place by annotating its pod (ANNOTATION_DRAFTER_DISABLED).
PODINFO_DIR = f"{CONFIG_DIR}/podinfo"
PODINFO_ANNOTATIONS = "annotations"
# The per-job fleet key: Secret `<job>-fleet-key`, data key `key` = 64 lowercase hex characters (32
# random bytes), mounted only into the drafter container; the kubelet makes the file group-readable for
# the pods' fsGroup (POD_SECURITY_DEFAULTS), which is how the image's non-root user reads it.
FLEET_KEY_DIR = f"{CONFIG_DIR}/fleet-key"
FLEET_KEY_ITEM = "key"
FLEET_KEY_BYTES = 32
FLEET_KEY_MODE = 0o400
# The drafter container's memory limit when spec.drafter.resources sets none (a user value wins): a
# drafter that leaks or is fed oversized frames is OOM-killed alone (a drafter fault), never the node.
DRAFTER_MEMORY_LIMIT = "8Gi"
TARGET_COMMAND = ["spectrain-target"]
DRAFTER_COMMAND = ["spectrain-drafter"]
# The workloads write their fatal error line to /dev/termination-log; without one (a crash before
# the entrypoint ran) the kubelet puts the log's tail there. faults.classify_pod reads it back.
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
# Pod Security "restricted" by default (docs/operations.md, Security). User, group and seccomp are set on
# the pod, so they cover every container (init containers and the gpu_sharing ones included) and one
# spec.podSecurityContext field changes them all; what exists only per container is set on each one. A
# field of spec.podSecurityContext / spec.<target|drafter>.securityContext replaces its default (the CRD's
# rules have refused root, privilege and escalation before a builder runs). fsGroup: the kubelet gives the
# volumes (PVCs, the fleet key Secret) that group, so the image's user can read and write them.
POD_SECURITY_DEFAULTS: Obj = {
    "runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_GID, "fsGroup": IMAGE_GID,
    "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_DEFAULTS: Obj = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


# ---------------------------------------------------------------- names

def config_name(job: Obj) -> str:
    return f"{job['metadata']['name']}-config"


def service_name(job: Obj) -> str:
    return str(job["metadata"]["name"])


def status_account_name(job: Obj) -> str:
    return f"{job['metadata']['name']}-status"


def fleet_key_name(job: Obj) -> str:
    return f"{job['metadata']['name']}-fleet-key"


def pod_name(job: Obj, node: int) -> str:
    """The rank's name: its pod's hostname (peers address it as <pod_name>.<service>), and the
    pod's name except for a Kueue-queued job's odd restart generations (`pod_object_name`)."""
    return f"{job['metadata']['name']}-{node}"


def pod_object_name(job: Obj, node: int, generation: int = 0) -> str:
    """metadata.name of the pod of `node` in restart `generation`.

    A Kueue-queued job (scheduling.kueue_queue) alternates between `<job>-<node>` (even
    generations) and `<job>-<node>-r` (odd): Kueue's plain-pod-group integration keeps a pod that
    ended (its `kueue.x-k8s.io/managed` finalizer) until a replacement pod of the group exists, so a
    replacement cannot reuse the old pod's name. The pod two generations back is gone by then (Kueue
    finalizes replaced pods), so two names suffice and the status Role can list them all.
    """
    from spectrain_operator import scheduling

    base = pod_name(job, node)
    return f"{base}-r" if generation % 2 and scheduling.kueue_queue(job) else base


def pod_names(job: Obj) -> list[str]:
    """Every name a pod of the job can have (the status Role allows patching exactly these)."""
    from spectrain_operator import scheduling

    nodes = range(int(job["spec"]["target"]["nodes"]))
    return [pod_object_name(job, n, g) for g in ((0, 1) if scheduling.kueue_queue(job) else (0,)) for n in nodes]


def network_policy_name(job: Obj) -> str:
    return str(job["metadata"]["name"])


def selector(job: Obj) -> str:
    """Label selector of every child of the job."""
    return f"{LABEL_JOB}={job['metadata']['name']}"


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


def status_rbac(job: Obj) -> list[Obj]:
    """ServiceAccount + Role (patch only its own pods, by name) + RoleBinding for the status path."""
    name = status_account_name(job)
    ns = job["metadata"].get("namespace", "default")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(job, name),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"],
                    "resourceNames": pod_names(job)}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(job, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
    ]


def fleet_key_text(raw: bytes) -> str:
    """The key as the drafters read it: 64 lowercase hex characters of FLEET_KEY_BYTES random bytes."""
    if not isinstance(raw, bytes) or len(raw) != FLEET_KEY_BYTES:
        raise ValueError(f"fleet key: need {FLEET_KEY_BYTES} random bytes (secrets.token_bytes), got "
                         f"{len(raw) if isinstance(raw, bytes) else type(raw).__name__}")
    return raw.hex()


def fleet_key_secret(job: Obj, raw: bytes) -> Obj:
    """Secret `<job>-fleet-key` holding `raw` (created once: create-or-get, never rotated)."""
    text = fleet_key_text(raw)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(job, fleet_key_name(job)), "type": "Opaque",
            "data": {FLEET_KEY_ITEM: base64.b64encode(text.encode()).decode()}}


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


def network_policy_enabled(job: Obj) -> bool:
    return bool((job["spec"].get("networkPolicy") or {}).get("enabled", True))


def network_policy(job: Obj) -> Obj:
    """NetworkPolicy `<job>` on the job's pods: every port from the job's own pods (the c10d store and the
    drafter exchange, but also the ports gloo and NCCL pick at random for their peer links, which no
    port list can name), the metrics ports from the namespaces of spec.networkPolicy.metricsFrom ({}:
    all), nothing else. Ingress only: the pods' egress (API server, DNS, registries) is left to the
    namespace's policies."""
    own = {"matchLabels": {LABEL_JOB: job["metadata"]["name"]}}
    metrics_from = copy.deepcopy((job["spec"].get("networkPolicy") or {}).get("metricsFrom") or {})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, network_policy_name(job)),
            "spec": {"podSelector": own, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": copy.deepcopy(own)}]},
                                 {"from": [{"namespaceSelector": metrics_from}],
                                  "ports": [{"protocol": "TCP", "port": port} for port in metrics_ports(job)]}]}}


# ---------------------------------------------------------------- pods

def _overlay(defaults: Obj, overrides: Obj | None) -> Obj:
    """`defaults` with each field of `overrides` replacing it; a mapping in both (capabilities,
    seccompProfile) is merged one level, so adding NET_BIND_SERVICE keeps `drop: [ALL]`."""
    out = copy.deepcopy(defaults)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def pod_security_context(job: Obj) -> Obj:
    return _overlay(POD_SECURITY_DEFAULTS, job["spec"].get("podSecurityContext"))


def container_security_context(overrides: Obj | None = None) -> Obj:
    """A container's securityContext: CONTAINER_SECURITY_DEFAULTS and the spec's overrides."""
    return _overlay(CONTAINER_SECURITY_DEFAULTS, overrides)


def drafter_runs(job: Obj, drafter_disabled: bool = False) -> bool:
    return bool(job["spec"]["drafter"]["enabled"]) and not drafter_disabled


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


def _drafter_identity_env(job: Obj, generation: int) -> list[Obj]:
    """The fleet channel's inputs (docs/contracts.md): key file, job identity, the pod's own IPs, and
    the control file through which a drafter disabled in place learns it."""
    return [
        {"name": ENV_FLEET_KEY_FILE, "value": f"{FLEET_KEY_DIR}/{FLEET_KEY_ITEM}"},
        {"name": ENV_JOB_UID, "value": str(job["metadata"].get("uid") or "")},
        {"name": ENV_RESTART_GENERATION, "value": str(generation)},
        {"name": ENV_POD_IPS, "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}},
        {"name": ENV_DRAFTER_CONTROL, "value": f"{PODINFO_DIR}/{PODINFO_ANNOTATIONS}"},
    ]


def _drafter_volumes(job: Obj) -> list[Obj]:
    return [
        {"name": "podinfo", "downwardAPI": {"items": [
            {"path": PODINFO_ANNOTATIONS, "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
        {"name": "fleet-key", "secret": {"secretName": fleet_key_name(job), "defaultMode": FLEET_KEY_MODE}},
    ]


def _drafter_resources(job: Obj) -> Obj:
    """spec.drafter.resources with a memory limit: the user's, else DRAFTER_MEMORY_LIMIT (raised to
    the memory request when that is larger, so the limit is never below the request). Not in
    SingleContainer mode: there the drafter is no container of its own, and gpu_sharing folds only
    the user's resources into the target's."""
    from spectrain_operator.gpu_sharing import parse_quantity, sharing_mode

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


def _mounts(job: Obj, *, data: bool) -> list[Obj]:
    mounts: list[Obj] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "ring", "mountPath": RING_DIR},
        {"name": "run", "mountPath": RUN_DIR},
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
    drafter_on = drafter_runs(job, drafter_disabled)
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
        "securityContext": container_security_context(t.get("securityContext")),
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
            + _drafter_identity_env(job, generation),
            "ports": [{"name": port_name("drafter", i), "containerPort": DRAFTER_PORT + i, "protocol": "TCP"}
                      for i in range(int(t["procsPerNode"]))]
            + metrics_container_ports(job, DRAFTER_METRICS_PORT_NAME, DRAFTER_METRICS_PORT),
            "volumeMounts": _mounts(job, data=False) + [
                {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
                {"name": "fleet-key", "mountPath": FLEET_KEY_DIR, "readOnly": True}],
            "resources": _drafter_resources(job),
            "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
            "securityContext": container_security_context(d.get("securityContext")),
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
            "securityContext": pod_security_context(job),
            "initContainers": init,
            "containers": [target],
            "volumes": _volumes(job) + (_drafter_volumes(job) if drafter_on else []),
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
    key = [fleet_key_secret(job, fleet_key)] if fleet_key is not None and drafter_runs(job) else []
    policy = [network_policy(job)] if network_policy_enabled(job) else []
    return [*status_rbac(job), config_map(job), service(job), *policy, *key]


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
