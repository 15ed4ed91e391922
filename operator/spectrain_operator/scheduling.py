"""Scheduler integration (spec.scheduling, Kueue labels, gang scheduling): pure manifest transforms.

`apply(pod, job)` mutates a built Pod manifest and returns the extra objects to create (a
PodGroup for gang scheduling, the same object for every pod of the job: create it once, idempotently).

- ``schedulerName``, ``priorityClassName``: copied when set.
- ``nodeSelector``: merged into the pod's (the job's value wins on a key both set).
- ``tolerations``: appended, without duplicates.
- Kueue: a ``kueue.x-k8s.io/queue-name`` label on the SpecTrainJob is passed through to its pods
  (with its ``kueue.x-k8s.io/priority-class`` label: Kueue reads a pod group's priority from the
  pods), together with Kueue's plain-pod group keys (label ``kueue.x-k8s.io/pod-group-name=<job>``,
  annotation ``kueue.x-k8s.io/pod-group-total-count=<nodes>``) so Kueue admits the job's pods as
  one workload, all or none. Kueue gates each pod, and on admission adds the ResourceFlavor's
  node selectors to it; it does so for replacement pods too, which must therefore be built from
  the spec alone (Kueue matches them to the admitted pod set by a hash of the spec).
  `kueue_release` names the pods to mark finished for Kueue once no more are created
  (docs/design.md, "Kueue").
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

from spectrain_operator.objects import LABEL_JOB
from spectrain_operator.objects import child_metadata as _child_metadata
from spectrain_operator.objects import get as _get

GANG_PROVIDERS = ("None", "SchedulerPlugins", "Volcano")

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_SCHEDULING_GATE = "kueue.x-k8s.io/admission"
KUEUE_FINALIZER = "kueue.x-k8s.io/managed"
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
SP_POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
SP_API_VERSION = "scheduling.x-k8s.io/v1alpha1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_API_VERSION = "scheduling.volcano.sh/v1beta1"
VOLCANO_SCHEDULER = "volcano"
HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"


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


def kueue_queue(job: dict) -> str:
    """The LocalQueue a job is queued in (its ``kueue.x-k8s.io/queue-name`` label), or ""."""
    return str(_get(job, "metadata", "labels", KUEUE_QUEUE_LABEL, default="") or "")


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
    if int(_get(job, "spec", "target", "nodes", default=1)) > 1:
        # One pod per node: where nothing else keeps two of a job's pods apart (GPU requests that
        # fill a node do), the scheduler spreads them over the nodes it can.
        spec.setdefault("affinity", {})["podAntiAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100,
                "podAffinityTerm": {"labelSelector": {"matchLabels": {LABEL_JOB: name}},
                                    "topologyKey": HOSTNAME_TOPOLOGY_KEY}}]}

    queue = kueue_queue(job)
    if queue:
        labels = meta.setdefault("labels", {})
        labels[KUEUE_QUEUE_LABEL] = queue
        priority = _get(job, "metadata", "labels", KUEUE_PRIORITY_LABEL, default="")
        if priority:  # Kueue reads a pod group's WorkloadPriorityClass from its pods' labels
            labels[KUEUE_PRIORITY_LABEL] = priority
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


def kueue_release(pods: list[dict]) -> list[str]:
    """Pods to annotate ``kueue.x-k8s.io/retriable-in-group: "false"`` once the operator creates
    no more pods for the job (it Failed, or it was deleted).

    Kueue keeps every pod of a plain pod group that ended (its ``kueue.x-k8s.io/managed``
    finalizer) and the group's Workload admitted, holding its quota, until replacement pods
    arrive, all pods succeeded, or a pod carries that annotation: a failed or deleted job's pods
    would otherwise stay Terminating and its quota stay taken for good. Every pod Kueue still
    holds gets it (a single pod would do, but it may be the one Kueue finalizes first).
    """
    return [p["metadata"]["name"] for p in pods
            if KUEUE_FINALIZER in ((p.get("metadata") or {}).get("finalizers") or [])
            and ((p.get("metadata") or {}).get("annotations") or {}).get(KUEUE_RETRIABLE_ANNOTATION) != "false"]
