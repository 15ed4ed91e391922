"""Read what a pod says: pure accessors over a pod as the API server returns it (a dict).

Every accessor is defensive: a field missing, null or of the wrong type reads as "not there",
never raises, because a pod's status is written by kubelets, Kueue and users, not by the
operator. The operator's own labels (builders.LABEL_NODE, builders.LABEL_GENERATION) and
annotations are read here too, and so are the reports each pod writes into its job's status
(names.STATUS_REPORTS, keyed by the pod's UID: written by the job's pods, so read as untrusted).
Timestamps are RFC 3339 in UTC ("2026-01-01T12:00:00Z"); `parse_time` reads them as aware
datetimes, so any two compare.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from spectrain_api.names import MAX_REPORT_CHARS, REPORT_POD, STATUS_REPORTS
from spectrain_operator import builders
from spectrain_operator.objects import TARGET, Obj

FINISHED_PHASES = ("Succeeded", "Failed")  # a pod in one of these runs no container any more


# ---------------------------------------------------------------- timestamps

def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp (or a datetime) as an aware datetime; a naive one is taken as UTC.
    None for anything else."""
    if isinstance(value, datetime):
        t = value
    elif isinstance(value, str) and value:
        try:
            t = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    else:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def fmt_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- metadata

def name(pod: Obj) -> str:
    return str(pod["metadata"]["name"])


def is_deleted(pod: Obj) -> bool:
    """Being deleted (deletionTimestamp set): its containers may still run a while."""
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _int_label(pod: Obj, key: str) -> int | None:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(key)
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def pod_generation(pod: Obj) -> int | None:
    """The restart generation the pod was built for (label builders.LABEL_GENERATION)."""
    return _int_label(pod, builders.LABEL_GENERATION)


def pod_node(pod: Obj) -> int | None:
    """The node index (rank of pods) the pod was built for (label builders.LABEL_NODE)."""
    return _int_label(pod, builders.LABEL_NODE)


def uid(pod: Obj) -> str:
    value = (pod.get("metadata") or {}).get("uid")
    return value if isinstance(value, str) else ""


def report(job_status: Any, pod: Obj, kind: str) -> Obj | None:
    """The pod's `kind` report (names.REPORT_PROGRESS / REPORT_DRAFTER) from its job's status, written
    by this very pod (keyed by its UID, naming it): a JSON object, or None (missing, too long, not
    JSON, not an object, or left by an earlier pod of the same name)."""
    reports = job_status.get(STATUS_REPORTS) if isinstance(job_status, dict) else None
    key = uid(pod)
    entry = reports.get(key) if isinstance(reports, dict) and key else None
    if not isinstance(entry, dict) or entry.get(REPORT_POD) != name(pod):
        return None
    raw = entry.get(kind)
    if not isinstance(raw, str) or len(raw) > MAX_REPORT_CHARS:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def stale_reports(job_status: Any, pods: list[Obj]) -> list[str]:
    """Keys of status.reports that belong to no pod of `pods` (the job's pods listed after its status
    was read): pods deleted or replaced since, whose reports nothing reads any more."""
    reports = job_status.get(STATUS_REPORTS) if isinstance(job_status, dict) else None
    live = {uid(p) for p in pods}
    return sorted(k for k in reports if k not in live) if isinstance(reports, dict) else []


# ---------------------------------------------------------------- spec

def has_init_container(pod: Obj, container: str) -> bool:
    """The pod's spec has an init container (a native sidecar: drafter, mps-daemon) of that name."""
    return any(isinstance(c, dict) and c.get("name") == container
               for c in (pod.get("spec") or {}).get("initContainers") or [])


def scheduling_gates(pod: Obj) -> list[str]:
    return [str(g.get("name")) for g in (pod.get("spec") or {}).get("schedulingGates") or [] if isinstance(g, dict)]


# ---------------------------------------------------------------- status

def phase(pod: Obj) -> Any:
    """status.phase as written (None when missing)."""
    return (pod.get("status") or {}).get("phase")


def is_finished(pod: Obj) -> bool:
    return phase(pod) in FINISHED_PHASES


def pod_running(pod: Obj) -> bool:
    return phase(pod) == "Running"


def _condition_true(pod: Obj, type_: str) -> bool:
    return any(isinstance(c, dict) and c.get("type") == type_ and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def pod_ready(pod: Obj) -> bool:
    return _condition_true(pod, "Ready")


def pod_scheduled(pod: Obj) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName")) or _condition_true(pod, "PodScheduled")


def still_running(pod: Obj) -> bool:
    """Bound to a node and not finished: its containers may still run (a deleted pod's kubelet
    marks it Failed or Succeeded before it goes; an unbound deleted pod never runs)."""
    return bool((pod.get("spec") or {}).get("nodeName")) and not is_finished(pod)


def true_conditions(pod: Obj, types: tuple[str, ...]) -> list[Obj]:
    """The pod's conditions of one of `types` whose status is True, in the pod's order."""
    return [c for c in (pod.get("status") or {}).get("conditions") or []
            if isinstance(c, dict) and c.get("type") in types and c.get("status") == "True"]


def container_status(pod: Obj, container: str, init: bool = False) -> Obj | None:
    """The status of a container (init: of an init container, where the sidecars are)."""
    key = "initContainerStatuses" if init else "containerStatuses"
    for c in (pod.get("status") or {}).get(key) or []:
        if isinstance(c, dict) and c.get("name") == container:
            return c
    return None


def last_termination(status: Obj | None) -> Obj | None:
    """A container's most recent termination, {exitCode, reason, message, finishedAt, ...}: the
    current state's, else lastState's (a restarted sidecar keeps its last crash there)."""
    for key in ("state", "lastState"):
        state = (status or {}).get(key)
        term = state.get("terminated") if isinstance(state, dict) else None
        if isinstance(term, dict) and term:
            return term
    return None


def target_exit_code(pod: Obj) -> int | None:
    """The target container's exit code while it is terminated (-1: terminated without one);
    None while it has not terminated."""
    c = container_status(pod, TARGET)
    term = ((c or {}).get("state") or {}).get("terminated")
    if isinstance(term, dict):
        code = term.get("exitCode")
        return code if isinstance(code, int) else -1
    return None


def pod_succeeded(pod: Obj) -> bool:
    return target_exit_code(pod) == 0 or phase(pod) == "Succeeded"


def pod_completed(pod: Obj) -> bool:
    """The target exited 0 and the pod has finished: its drafter sidecar was stopped by the kubelet
    after the target and had its shutdown (the last combined version exported, the last report
    written) within the grace period. The kubelet ends the pod either way, so this always comes."""
    return pod_succeeded(pod) and is_finished(pod)
