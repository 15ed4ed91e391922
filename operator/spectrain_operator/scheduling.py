"""Scheduler integration (spec.scheduling, Kueue labels, gang scheduling): pure manifest transforms.

`apply(pod, job)` mutates a built Pod manifest and returns the extra objects to create (a
PodGroup for gang scheduling, the same object for every pod of the job: create it once, idempotently).

- ``schedulerName``, ``priorityClassName``: copied when set.
- ``nodeSelector``: merged into the pod's (the job's value wins on a key both set).
- ``tolerations``: appended, without duplicates.
- Kueue: a ``kueue.x-k8s.io/queue-name`` label on the SpecTrainJob is passed through to its pods,
  together with Kueue's plain-pod group keys (label ``kueue.x-k8s.io/pod-group-name=<job>``,
  annotation ``kueue.x-k8s.io/pod-group-total-count=<nodes>``) so Kueue admits the job's pods as
  one workload, all or none. Kueue gates each pod, and on admission adds the ResourceFlavor's
  node selectors / tolerations to the pod. When the operator recreates a pod (RestartJob), it
  must keep those: see `merge_admitted`.
- Gang (``scheduling.gang.provider``):
  ``SchedulerPlugins``: a ``scheduling.x-k8s.io/v1alpha1`` PodGroup ``<job>`` with
  ``minMember = nodes`` and the pod label ``scheduling.x-k8s.io/pod-group=<job>`` (the
  coscheduling plugin of kubernetes-sigs/scheduler-plugins; that scheduler usually runs under its
  own name, so set ``schedulerName`` to it).
  ``Volcano``: a ``scheduling.volcano.sh/v1beta1`` PodGroup ``<job>`` with ``minMember = nodes``,
  the pod annotation ``scheduling.k8s.io/group-name=<job>`` and ``schedulerName: volcano``.
"""

from __future__ import annotations

import copy
from typing import Any

from spectrain_operator.objects import child_metadata as _child_metadata
from spectrain_operator.objects import get as _get

GANG_PROVIDERS = ("None", "SchedulerPlugins", "Volcano")

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_SCHEDULING_GATE = "kueue.x-k8s.io/admission"
SP_POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
SP_API_VERSION = "scheduling.x-k8s.io/v1alpha1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_API_VERSION = "scheduling.volcano.sh/v1beta1"
VOLCANO_SCHEDULER = "volcano"

# Tolerations the API server adds to every pod (DefaultTolerationSeconds admission): never
# "admission-added" in the Kueue sense, so merge_admitted does not carry them over.
_DEFAULT_TOLERATION_KEYS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


class SchedulingError(ValueError):
    """spec.scheduling cannot be honoured; the message names the field and the fix."""


def _nodes(job: dict) -> int:
    n = int(_get(job, "spec", "target", "nodes", default=1))
    if n < 1:
        raise SchedulingError(f"spec.target.nodes: {n}; set at least 1")
    return n


def gang_provider(job: dict) -> str:
    provider = _get(job, "spec", "scheduling", "gang", "provider", default="None")
    if provider not in GANG_PROVIDERS:
        raise SchedulingError(
            f"spec.scheduling.gang.provider: {provider!r} is not one of {', '.join(GANG_PROVIDERS)}")
    return str(provider)


def pod_group(job: dict) -> dict | None:
    """The gang PodGroup for the job (None without gang scheduling). Name: the job's name."""
    provider = gang_provider(job)
    if provider == "None":
        return None
    name = job["metadata"]["name"]
    if provider == "SchedulerPlugins":
        return {
            "apiVersion": SP_API_VERSION,
            "kind": "PodGroup",
            "metadata": _child_metadata(job, name),
            "spec": {"minMember": _nodes(job)},
        }
    spec: dict[str, Any] = {"minMember": _nodes(job)}
    priority = _get(job, "spec", "scheduling", "priorityClassName", default="")
    if priority:
        spec["priorityClassName"] = priority
    return {
        "apiVersion": VOLCANO_API_VERSION,
        "kind": "PodGroup",
        "metadata": _child_metadata(job, name),
        "spec": spec,
    }


def _toleration_key(t: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in t.items()))


def _merge_tolerations(into: list[dict], extra: list[dict]) -> None:
    seen = {_toleration_key(t) for t in into}
    for t in extra:
        k = _toleration_key(t)
        if k not in seen:
            into.append(copy.deepcopy(t))
            seen.add(k)


def apply(pod: dict, job: dict) -> list[dict]:
    """Mutate `pod` for spec.scheduling and Kueue; return extra objects (the gang PodGroup, if any).

    Raises SchedulingError naming the field when the spec contradicts itself (Volcano gang with a
    schedulerName other than ``volcano``).
    """
    sched = _get(job, "spec", "scheduling", default={})
    spec = pod.setdefault("spec", {})
    meta = pod.setdefault("metadata", {})
    name = job["metadata"]["name"]

    scheduler = sched.get("schedulerName") or ""
    if scheduler:
        spec["schedulerName"] = scheduler
    if sched.get("priorityClassName"):
        spec["priorityClassName"] = sched["priorityClassName"]
    node_selector = sched.get("nodeSelector") or {}
    if node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **node_selector}
    tolerations = sched.get("tolerations") or []
    if tolerations:
        _merge_tolerations(spec.setdefault("tolerations", []), tolerations)

    queue = _get(job, "metadata", "labels", KUEUE_QUEUE_LABEL, default="")
    if queue:
        labels = meta.setdefault("labels", {})
        labels[KUEUE_QUEUE_LABEL] = queue
        labels[KUEUE_GROUP_LABEL] = name
        meta.setdefault("annotations", {})[KUEUE_GROUP_COUNT_ANNOTATION] = str(_nodes(job))

    provider = gang_provider(job)
    if provider == "SchedulerPlugins":
        meta.setdefault("labels", {})[SP_POD_GROUP_LABEL] = name
    elif provider == "Volcano":
        if scheduler and scheduler != VOLCANO_SCHEDULER:
            raise SchedulingError(
                f"spec.scheduling.schedulerName: {scheduler!r} with gang.provider Volcano; Volcano "
                "PodGroups are only honoured by the volcano scheduler: leave schedulerName empty or "
                "set it to 'volcano'")
        spec["schedulerName"] = VOLCANO_SCHEDULER
        meta.setdefault("annotations", {})[VOLCANO_GROUP_ANNOTATION] = name
    group = pod_group(job)
    return [group] if group is not None else []


def merge_admitted(pod: dict, existing: dict) -> dict:
    """A copy of the freshly built `pod` that keeps what a Kueue admission added to `existing`.

    Kueue (plain-pod integration) injects the admitted ResourceFlavor's nodeSelector entries and
    tolerations into each pod when it removes the ``kueue.x-k8s.io/admission`` scheduling gate.
    Pod specs are immutable, so the operator never patches them; but when it recreates a pod
    (RestartJob, RestartWithoutDrafter, a pod lost with its node) it builds the replacement from
    the spec, which would drop the flavor. How to use:

        new = builders.build_pod(job, node)          # gpu_sharing.apply + scheduling.apply ran
        old = <the pod being replaced, read before deleting it> (or None)
        if old is not None:
            new = scheduling.merge_admitted(new, old)
        create(new)

    Kept: every nodeSelector key of `existing` that `pod` does not set itself (the builder wins a
    conflict: the job's own selectors are the user's intent), and every toleration of `existing`
    not already present, except the API server's default not-ready / unreachable tolerations.
    Not kept: schedulingGates (Kueue's webhook gates the new pod again), nodeName, status.
    `pod` is not mutated.
    """
    out = copy.deepcopy(pod)
    old_spec = existing.get("spec") or {}
    spec = out.setdefault("spec", {})
    old_selector = old_spec.get("nodeSelector") or {}
    if old_selector:
        spec["nodeSelector"] = {**old_selector, **(spec.get("nodeSelector") or {})}
    extra = [t for t in (old_spec.get("tolerations") or [])
             if t.get("key") not in _DEFAULT_TOLERATION_KEYS]
    if extra:
        _merge_tolerations(spec.setdefault("tolerations", []), extra)
    return out
