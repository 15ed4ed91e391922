"""Small pure helpers every builder shares: labels, container names, ownerReferences, child metadata,
safe spec access.

Kept apart from builders.py so gpu_sharing.py and scheduling.py (which builders.py calls) can use
them without an import cycle.
"""

from __future__ import annotations

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
