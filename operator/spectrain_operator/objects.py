"""Small pure helpers every builder shares: labels, container names, ownerReferences, child metadata,
safe spec access, and the name of every child of a job.

Kept apart from builders.py so gpu_sharing.py and scheduling.py (which builders.py calls) can use
them without an import cycle.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from spectrain_api.names import API_VERSION, GROUP, KIND

LABEL_JOB = f"{GROUP}/job-name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "spectrain-operator"

TARGET = "target"              # a rank's pod's containers by name: the trainer,
DRAFTER = "drafter"            # the drafter sidecar (an init container, restartPolicy Always),
MPS_DAEMON = "mps-daemon"      # the PodLocalMPS control daemon sidecar (gpu_sharing)

Obj = dict[str, Any]


def get(obj: Any, *path: str, default: Any = None) -> Any:
    """obj[path[0]][path[1]]... or `default` when a level is missing, null or not a mapping."""
    for key in path:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return default
        obj = obj[key]
    return obj


def job_labels(job: Obj) -> dict[str, str]:
    return {LABEL_JOB: str(job["metadata"]["name"]), LABEL_MANAGED_BY: MANAGER}


def owner_reference(job: Obj) -> Obj:
    # No blockOwnerDeletion: it would need `update` on spectrainjobs/finalizers for nothing we use.
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"], "controller": True}


def child_metadata(job: Obj, name: str, labels: dict[str, str] | None = None) -> Obj:
    """Metadata of a child: name, namespace, the job's labels, an ownerReference once the job has a uid."""
    meta: Obj = {"name": name, "namespace": job["metadata"].get("namespace", "default"),
                 "labels": {**job_labels(job), **(labels or {})}}
    if job["metadata"].get("uid"):
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


# ---------------------------------------------------------------- editing a pod in place

def find_container(containers: list[dict], name: str) -> dict | None:
    for c in containers:
        if c.get("name") == name:
            return c
    return None


def set_env(container: dict, name: str, value: str) -> None:
    """Set (or replace) a plain-value env var, keeping the list's order otherwise."""
    env = container.setdefault("env", [])
    for e in env:
        if e.get("name") == name:
            e.clear()
            e.update({"name": name, "value": value})
            return
    env.append({"name": name, "value": value})


def add_mount(container: dict, name: str, path: str) -> None:
    mounts = container.setdefault("volumeMounts", [])
    if not any(m.get("mountPath") == path for m in mounts):
        mounts.append({"name": name, "mountPath": path})


def add_volume(pod: dict, volume: dict) -> None:
    volumes = pod["spec"].setdefault("volumes", [])
    if not any(v.get("name") == volume["name"] for v in volumes):
        volumes.append(volume)


# ---------------------------------------------------------------- Kubernetes quantities

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
_FACTORS = {
    None: Fraction(1), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}


def parse_quantity(value: Any, field: str) -> Fraction:
    """A Kubernetes quantity ("8Gi", "500m", 2) as an exact Fraction; errors name `field`."""
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(
            f"{field}: {value!r} is not a Kubernetes quantity; write e.g. 8Gi, 512Mi or 8G")
    return Fraction(m.group(1)) * _FACTORS[m.group(2)]


def format_quantity(value: Fraction) -> str:
    """The shortest exact spelling of a quantity: whole Gi or Mi, an integer, or millis."""
    if value.denominator == 1:
        n = value.numerator
        for suffix, factor in (("Gi", 2**30), ("Mi", 2**20)):
            if n and n % factor == 0:
                return f"{n // factor}{suffix}"
        return str(n)
    millis = value * 1000
    if millis.denominator == 1:
        return f"{millis.numerator}m"
    return str(float(value))


# ---------------------------------------------------------------- the children's names

def config_name(job: Obj) -> str:
    return f"{job['metadata']['name']}-config"


def service_name(job: Obj) -> str:
    return str(job["metadata"]["name"])


STATUS_ACCOUNT_SUFFIX = "-status"   # <job>-status: the status path's ServiceAccount, Role and RoleBinding


def status_account_name(job: Obj) -> str:
    return f"{job['metadata']['name']}{STATUS_ACCOUNT_SUFFIX}"


def fleet_key_name(job: Obj) -> str:
    return f"{job['metadata']['name']}-fleet-key"


def fleet_identity_name(job: Obj, node: int, generation: int) -> str:
    """The Secret holding the fleet identity of `node`'s pod in restart `generation`
    (spectrain_api.fleet_identity): its private key and every pod's public key."""
    return f"{job['metadata']['name']}-fleet-id-{generation}-{node}"


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
    finalizes replaced pods), so two names suffice.
    """
    from spectrain_operator import scheduling

    base = pod_name(job, node)
    return f"{base}-r" if generation % 2 and scheduling.kueue_queue(job) else base


def network_policy_name(job: Obj) -> str:
    return str(job["metadata"]["name"])


def selector(job: Obj) -> str:
    """Label selector of every child of the job."""
    return f"{LABEL_JOB}={job['metadata']['name']}"
