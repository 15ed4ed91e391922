"""What a job's pods may do and reach, as pure builders: the Pod Security "restricted" contexts every
container runs under, the status path's ServiceAccount/Role/RoleBinding (its own job's status only),
the drafters' per-job fleet key Secret, and the job's NetworkPolicy. docs/operations.md, "Security",
explains the trust model these objects implement.
"""

from __future__ import annotations

import base64
import copy

from spectrain_api.names import GROUP, IMAGE_GID, IMAGE_UID, PLURAL
from spectrain_operator.objects import LABEL_JOB, Obj
from spectrain_operator.objects import child_metadata as _meta

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
# The per-job fleet key: Secret `<job>-fleet-key`, data key `key` = 64 lowercase hex characters (32
# random bytes), mounted only into the drafter container; the kubelet makes the file group-readable for
# the pods' fsGroup (POD_SECURITY_DEFAULTS), which is how the image's non-root user reads it.
FLEET_KEY_ITEM = "key"
FLEET_KEY_BYTES = 32
FLEET_KEY_MODE = 0o400


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


def status_rbac(job: Obj, name: str) -> list[Obj]:
    """ServiceAccount + Role + RoleBinding `name` for the status path (spectrain_workloads.podstatus):
    `patch` on this job's status subresource (the pods' reports, status.reports) and `get` on this job
    (a drafter learns there that it was disabled), both by name; nothing of any pod or other job. The
    operator holds both verbs, which is what RBAC asks of whoever grants them."""
    ns = job["metadata"].get("namespace", "default")
    job_name = [job["metadata"]["name"]]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(job, name),
         "rules": [{"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"],
                    "resourceNames": job_name},
                   {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get"], "resourceNames": job_name}]},
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


def fleet_key_secret(job: Obj, name: str, raw: bytes) -> Obj:
    """Secret `name` (`<job>-fleet-key`) holding `raw` (created once: create-or-get, never rotated)."""
    text = fleet_key_text(raw)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(job, name), "type": "Opaque",
            "data": {FLEET_KEY_ITEM: base64.b64encode(text.encode()).decode()}}


def network_policy_enabled(job: Obj) -> bool:
    return bool((job["spec"].get("networkPolicy") or {}).get("enabled", True))


def network_policy(job: Obj, name: str, metrics_ports: list[int]) -> Obj:
    """NetworkPolicy `<job>` on the job's pods: every port from the job's own pods (the c10d store and the
    drafter exchange, but also the ports gloo and NCCL pick at random for their peer links, which no
    port list can name), the metrics ports from the namespaces of spec.networkPolicy.metricsFrom ({}:
    all), nothing else. Ingress only: the pods' egress (API server, DNS, registries) is left to the
    namespace's policies."""
    own = {"matchLabels": {LABEL_JOB: job["metadata"]["name"]}}
    metrics_from = copy.deepcopy((job["spec"].get("networkPolicy") or {}).get("metricsFrom") or {})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, name),
            "spec": {"podSelector": own, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": copy.deepcopy(own)}]},
                                 {"from": [{"namespaceSelector": metrics_from}],
                                  "ports": [{"protocol": "TCP", "port": port} for port in metrics_ports]}]}}
