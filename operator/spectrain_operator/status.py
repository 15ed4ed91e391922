"""Pure reconcile logic: (job, its pods, now) -> a Plan (the new status, pods to create and delete,
Events, whether to delete the job, when to look again). No API calls: kube.py executes the plan and
handlers.py wires it to kopf. The whole lifecycle of API.md lives here:

- spec errors (CEL/semantic/missing claims) -> Failed + SpecInvalid, nothing created;
- Succeeded / Failed are terminal; ttlSecondsAfterFinished then deletes the job;
- activeDeadlineSeconds (from status.startTime) -> Failed/DeadlineExceeded;
- suspend deletes the pods and keeps the rest; resume recreates them (the workloads resume from
  their last checkpoint);
- a target failure restarts the whole job (gang): a new restart generation, exponential backoff,
  up to runPolicy.maxRestarts; failurePolicy rules through faults.action_for (FailJob,
  RestartJob, RestartJobIgnoreMax, RestartWithoutDrafter);
- a target's exit 2 (configuration error) that no rule matches: Failed/ConfigError at once, no
  restart, the workload's error line (its termination message) in the condition;
- drafter failures never fail the job and never restart the target: counted, and past
  drafter.maxFailures (or by a drafter rule FailJob / RestartWithoutDrafter) the drafter is disabled
  in place (DrafterDegraded; every pod annotated ANNOTATION_DRAFTER_DISABLED, which the sidecar
  reads and then idles); the next restart the job needs anyway builds pods without it. Exits with
  EXIT_PEER_FRAME (a peer's frame ended the drafter) are counted apart (drafterPeerFailures);
- pods deleted by someone else are recreated, counted as a restart (not against maxRestarts);
- Succeeded when every target container exited 0.

State that must survive an operator restart lives in the status (restarts, restartGeneration,
restartAt, podsCreated, drafterDisabled, drafterDisabledGeneration, drafterPeerFrames); every field
is parsed defensively, so a status written by a user cannot crash the operator.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from spectrain_operator import builders, faults, scheduling
from spectrain_workloads.contract import ANNOTATION_DRAFTER_DISABLED, EXIT_PEER_FRAME, PHASES

Obj = dict[str, Any]

MAX_BACKOFF_S = 3600.0
TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    status: Obj
    create_nodes: list[int] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None
    generation: int = 0
    drafter_disabled: bool = False      # pods of `generation` are built without the drafter sidecar
    drafter_off: str = ""               # disabled in place in `generation`: the pods' annotation value
    annotate_pods: list[str] = field(default_factory=list)  # current pods still lacking that annotation

    def requeue(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


# ---------------------------------------------------------------- helpers

def backoff_seconds(base: float, attempt: int) -> float:
    """Delay before restart number `attempt` (1-based): base * 2^(attempt-1), capped at an hour."""
    if base <= 0 or attempt <= 0:
        return 0.0
    return float(min(base * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S))


def fmt_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _nonneg_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _container(pod: Obj, name: str, init: bool = False) -> Obj | None:
    key = "initContainerStatuses" if init else "containerStatuses"
    for c in (pod.get("status") or {}).get(key) or []:
        if isinstance(c, dict) and c.get("name") == name:
            return c
    return None


def target_exit_code(pod: Obj) -> int | None:
    c = _container(pod, "target")
    term = ((c or {}).get("state") or {}).get("terminated")
    if isinstance(term, dict):
        code = term.get("exitCode")
        return code if isinstance(code, int) else -1
    return None


def pod_succeeded(pod: Obj) -> bool:
    return target_exit_code(pod) == 0 or (pod.get("status") or {}).get("phase") == "Succeeded"


def pod_running(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def pod_ready(pod: Obj) -> bool:
    return any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def pod_scheduled(pod: Obj) -> bool:
    if (pod.get("spec") or {}).get("nodeName"):
        return True
    return any(isinstance(c, dict) and c.get("type") == "PodScheduled" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


# Pod conditions that say who ended a pod and why: Kubernetes' own (scheduler preemption, taint
# manager, eviction API, kubelet) and Kueue's (a pod group preempted or its Workload evicted).
EVICTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")


def _eviction(pods: list[Obj], nodes: list[int], generation: int) -> tuple[str, str] | None:
    """(reason, message) of the eviction condition on a deleted pod of `nodes` in `generation`."""
    for pod in pods:
        if pod_node(pod) not in nodes or pod_generation(pod) != generation:
            continue
        for c in (pod.get("status") or {}).get("conditions") or []:
            if isinstance(c, dict) and c.get("type") in EVICTION_CONDITIONS and c.get("status") == "True":
                return str(c.get("reason") or c["type"])[:128], str(c.get("message") or "")[:1000]
    return None


def _still_running(pod: Obj) -> bool:
    """Bound to a node and not terminated: its containers may still run (a deleted pod's kubelet
    marks it Failed or Succeeded before it goes; an unbound deleted pod never runs)."""
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def pod_generation(pod: Obj) -> int | None:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(builders.LABEL_GENERATION)
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def pod_node(pod: Obj) -> int | None:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(builders.LABEL_NODE)
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _opt_nonneg_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _peer_frames(value: Any, nodes: int) -> dict[str, Obj]:
    """status.drafterPeerFrames, parsed defensively: node index -> {count, last}."""
    out: dict[str, Obj] = {}
    for key, rec in (value if isinstance(value, dict) else {}).items():
        if isinstance(key, str) and key.isdigit() and int(key) < nodes and isinstance(rec, dict) \
                and _nonneg_int(rec.get("count")) and isinstance(rec.get("last"), str):
            out[key] = {"count": _nonneg_int(rec["count"]), "last": rec["last"][:64]}
    return out


def _annotation(pod: Obj, key: str) -> Obj | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(key)
    if not isinstance(raw, str) or len(raw) > 65536:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


class Conditions:
    """metav1.Conditions keyed by type; lastTransitionTime changes only when status flips."""

    def __init__(self, existing: Any, now: datetime, generation: int):
        self.items: dict[str, Obj] = {}
        for c in existing if isinstance(existing, list) else []:
            if isinstance(c, dict) and isinstance(c.get("type"), str) and c.get("status") in ("True", "False", "Unknown"):
                self.items[c["type"]] = dict(c)
        self.now = fmt_time(now)
        self.generation = generation

    def set(self, type_: str, status: bool, reason: str, message: str) -> None:
        value = "True" if status else "False"
        old = self.items.get(type_)
        since = self.now if old is None or old.get("status") != value else old.get("lastTransitionTime", self.now)
        self.items[type_] = {"type": type_, "status": value, "reason": reason, "message": (message or reason)[:2000],
                             "lastTransitionTime": since,
                             "observedGeneration": self.generation}

    def clear(self, type_: str, reason: str, message: str = "") -> None:
        """Set False only if the condition was ever reported."""
        if type_ in self.items:
            self.set(type_, False, reason, message)

    def is_true(self, type_: str) -> bool:
        return self.items.get(type_, {}).get("status") == "True"

    def as_list(self) -> list[Obj]:
        return list(self.items.values())


# ---------------------------------------------------------------- progress / drafter summaries

def progress_from(pods_by_node: dict[int, Obj], previous: Any, total_steps: int) -> Obj:
    data = _annotation(pods_by_node[0], builders.ANNOTATION_PROGRESS) if 0 in pods_by_node else None
    if data is None:
        if isinstance(previous, dict) and isinstance(previous.get("step"), int):
            return {**previous, "totalSteps": total_steps}
        return {"step": 0, "totalSteps": total_steps}
    out: Obj = {"step": _nonneg_int(data.get("step")), "totalSteps": total_steps,
                "loss": _finite(data.get("loss")), "tokensPerSecond": _finite(data.get("tokensPerSecond"))}
    updated = data.get("updatedAt")
    out["updatedAt"] = str(updated)[:64] if isinstance(updated, (str, int, float)) and not isinstance(updated, bool) else None
    return out


def drafter_from(pods_by_node: dict[int, Obj], previous: Any, *, enabled: bool, degraded: bool) -> Obj:
    reports = [r for r in (_annotation(p, builders.ANNOTATION_DRAFTER) for _, p in sorted(pods_by_node.items()))
               if r is not None]
    prev = previous if isinstance(previous, dict) else {}
    artifact = next((str(r["artifact"])[:1024] for r in reports if isinstance(r.get("artifact"), str) and r["artifact"]),
                    prev.get("artifact") if isinstance(prev.get("artifact"), str) else "")
    harvested = [v for v in (_finite(r.get("harvestedSeconds")) for r in reports) if v is not None]
    efficiency = [v for v in (_finite(r.get("harvestEfficiency")) for r in reports) if v is not None]
    acceptance = [v for v in (_finite(r.get("acceptanceLength")) for r in reports) if v is not None]
    active = sum(1 for r in reports if r.get("state") == "Active")
    if degraded:
        state = "Degraded"
    elif not enabled:
        state = "Disabled"
    elif active:
        state = "Active"
    elif any(r.get("state") == "Degraded" for r in reports):
        state = "Degraded"
    else:
        state = "Waiting"
    out: Obj = {"state": state, "activeRanks": active,
                "harvestedSeconds": round(sum(harvested), 3) if harvested else _finite(prev.get("harvestedSeconds")) or 0.0,
                "harvestEfficiency": round(sum(efficiency) / len(efficiency), 4) if efficiency
                else _finite(prev.get("harvestEfficiency")) or 0.0,
                "acceptanceLength": round(sum(acceptance) / len(acceptance), 4) if acceptance
                else _finite(prev.get("acceptanceLength")),
                "artifact": artifact}
    return out


# ---------------------------------------------------------------- the decision

def decide(job: Obj, pods: list[Obj], now: datetime, spec_errors: list[str] | None = None) -> Plan:
    """What to do for `job` (defaulted) given the pods carrying its label, at time `now`."""
    spec = job["spec"]
    meta = job.get("metadata") or {}
    old: Obj = job["status"] if isinstance(job.get("status"), dict) else {}
    generation = _nonneg_int(meta.get("generation"))
    nodes = int(spec["target"]["nodes"])
    run_policy = spec["runPolicy"]
    prev_phase = old.get("phase") if old.get("phase") in PHASES else None

    st: Obj = {
        "observedGeneration": generation,
        "restarts": _nonneg_int(old.get("restarts")),
        "restartsTowardsMax": _nonneg_int(old.get("restartsTowardsMax")),
        "restartGeneration": _nonneg_int(old.get("restartGeneration")),
        "restartAt": fmt_time(t) if (t := parse_time(old.get("restartAt"))) else None,
        "podsCreated": old.get("podsCreated") is True,
        "drafterDisabled": old.get("drafterDisabled") is True,
        "drafterDisabledGeneration": _opt_nonneg_int(old.get("drafterDisabledGeneration")),
        "drafterFailures": _nonneg_int(old.get("drafterFailures")),
        "drafterPeerFailures": _nonneg_int(old.get("drafterPeerFailures")),
        "drafterPeerFrames": _peer_frames(old.get("drafterPeerFrames"), nodes),
        "lastFailure": old["lastFailure"][:2000] if isinstance(old.get("lastFailure"), str) else None,
        "startTime": fmt_time(t) if (t := parse_time(old.get("startTime"))) else None,
        "completionTime": fmt_time(t) if (t := parse_time(old.get("completionTime"))) else None,
    }
    conds = Conditions(old.get("conditions"), now, generation)
    plan = Plan(status=st, generation=st["restartGeneration"])
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    current = {n: p for p in live if pod_generation(p) == st["restartGeneration"]
               and (n := pod_node(p)) is not None and 0 <= n < nodes}
    kept = {id(p) for p in current.values()}   # (not `p in current.values()`: quadratic in the pods)
    stale = [p["metadata"]["name"] for p in live if id(p) not in kept]
    names_in_use = {p["metadata"]["name"] for p in pods}
    # Nodes whose pod of an earlier generation still runs (bound, not terminated; deleted or not):
    # the replacement waits for it, so two pods of one rank never run at once (the same name does
    # that too, except for Kueue jobs, whose names alternate: builders.pod_object_name).
    busy = {n for p in pods if (n := pod_node(p)) is not None and _still_running(p)}
    phase: str
    reason: str
    message: str

    def active_pods() -> list[str]:
        return [p["metadata"]["name"] for p in live
                if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]

    def finish(ok: bool, why: str, text: str, delete: list[str]) -> tuple[str, str, str]:
        st["completionTime"] = st["completionTime"] or fmt_time(now)
        st["restartAt"] = None
        plan.delete_pods = delete
        conds.set("Succeeded" if ok else "Failed", True, why, text)
        conds.clear("Running", why, text)
        conds.clear("Restarting", why)
        return ("Succeeded" if ok else "Failed"), why, text

    def restart(why: str, text: str, counted: bool, without_drafter: bool = False,
                immediate: bool = False) -> tuple[str, str, str]:
        st["restarts"] += 1
        if counted:
            st["restartsTowardsMax"] += 1
        st["restartGeneration"] += 1
        st["podsCreated"] = False
        st["lastFailure"] = text[:2000]
        attempt = st["restartsTowardsMax"] if counted else st["restarts"]
        delay = 0.0 if immediate else backoff_seconds(run_policy["backoffSeconds"], attempt)
        st["restartAt"] = fmt_time(now + timedelta(seconds=delay)) if delay else None
        st["drafterPeerFrames"] = {}   # bookkeeping of the pods being replaced
        if without_drafter and not st["drafterDisabled"]:
            st["drafterDisabled"] = True
            st["drafterDisabledGeneration"] = st["restartGeneration"] - 1   # the new pods have no drafter
            conds.set("DrafterDegraded", True, "RestartWithoutDrafter", text)
        plan.generation = st["restartGeneration"]
        plan.delete_pods = [p["metadata"]["name"] for p in live]
        plan.events.append(Event("Warning", why, f"{text}; restart {st['restarts']} in {delay:.0f}s"
                                 + (" without the drafter" if without_drafter else "")))
        plan.requeue(delay)
        conds.set("Restarting", True, why, text)
        return "Restarting", why, text

    # drafter crashes: peer-frame exits counted apart; the rest are the drafter's own failures
    drafter_enabled = bool(spec["drafter"]["enabled"])
    own_failures = _drafter_accounting(job, st, current, plan) if current and drafter_enabled else {}

    # 1. a spec that cannot run: Failed + SpecInvalid, nothing created
    if spec_errors:
        text = "; ".join(spec_errors[:8])
        conds.set("SpecInvalid", True, "InvalidSpec", text)
        if prev_phase in TERMINAL and conds.is_true("Failed"):
            phase, reason, message = prev_phase, "InvalidSpec", text
            plan.delete_pods = active_pods()
        else:
            phase, reason, message = finish(False, "SpecInvalid", text, active_pods())
    # 2. terminal phases stay terminal; TTL
    elif prev_phase in TERMINAL:
        phase, reason, message = prev_phase, prev_phase, ""
        if prev_phase == "Failed":
            plan.delete_pods = active_pods()
        if st["completionTime"] is None:
            st["completionTime"] = fmt_time(now)
    # 3. deadline
    elif (deadline := run_policy.get("activeDeadlineSeconds")) and st["startTime"] and not spec["suspend"] and \
            now >= parse_time(st["startTime"]) + timedelta(seconds=deadline):  # type: ignore[operator]
        phase, reason, message = finish(False, "DeadlineExceeded",
                                        f"running longer than activeDeadlineSeconds {deadline}", active_pods())
    # 4. suspend
    elif spec["suspend"]:
        plan.delete_pods = [p["metadata"]["name"] for p in live]
        st["podsCreated"] = False
        st["startTime"] = None
        st["restartAt"] = None
        conds.set("Suspended", True, "Suspended", "spec.suspend is true: pods deleted, the rest kept")
        conds.clear("Running", "Suspended")
        conds.clear("Restarting", "Suspended")
        phase, reason, message = "Suspended", "Suspended", "spec.suspend is true"
    else:
        if conds.is_true("Suspended"):
            conds.set("Suspended", False, "Resumed", "spec.suspend is false: pods recreated from the last checkpoint")
        phase, reason, message = _run(job, st, conds, plan, current, stale, pods, names_in_use, busy, now, restart,
                                      finish, own_failures)
    _drafter_plan(st, conds, plan, current, phase)

    # Kueue holds the pods (its admission gate) until it admits the pod group
    if phase not in TERMINAL and any(scheduling.KUEUE_SCHEDULING_GATE in _gates(p) for p in current.values()):
        conds.set("Queued", True, "WaitingForKueue", _queued_message(job))
    elif current:
        conds.clear("Queued", "Admitted", "Kueue admitted the pod group")

    # summaries, conditions, ranks
    degraded = conds.is_true("DrafterDegraded")
    st["progress"] = progress_from(current, old.get("progress"), int(spec["target"]["steps"]))
    st["drafter"] = drafter_from(current, old.get("drafter"), enabled=drafter_enabled and not st["drafterDisabled"],
                                 degraded=degraded)
    if st["drafter"]["activeRanks"]:
        conds.set("DrafterActive", True, "Harvesting", f"{st['drafter']['activeRanks']} rank(s) training the drafter")
    else:
        conds.clear("DrafterActive", st["drafter"]["state"])
    if not spec["target"]["checkpoint"].get("claimName", ""):
        conds.set("CheckpointEphemeral", True, "EmptyDirCheckpoint",
                  "spec.target.checkpoint.claimName is empty: checkpoints live in an emptyDir and are lost with "
                  "the pods; set a PVC to resume after restarts")
    ranks = {"desired": nodes,
             "ready": sum(1 for p in current.values() if pod_ready(p)),
             "running": sum(1 for p in current.values() if pod_running(p)),
             "succeeded": sum(1 for p in current.values() if pod_succeeded(p)),
             "failed": sum(1 for p in current.values() if (target_exit_code(p) or 0) != 0)}
    st["ranks"] = ranks
    st["ready"] = f"{ranks['ready']}/{nodes}"
    st["phase"] = phase
    st["conditions"] = conds.as_list()

    if phase != prev_phase:
        kind = "Warning" if phase in ("Failed", "Restarting") else "Normal"
        plan.events.append(Event(kind, phase, message or f"phase {prev_phase or 'none'} -> {phase}"))

    # TTL after finishing
    ttl = run_policy.get("ttlSecondsAfterFinished")
    if phase in TERMINAL and ttl is not None and st["completionTime"]:
        left = (parse_time(st["completionTime"]) + timedelta(seconds=ttl) - now).total_seconds()  # type: ignore[operator]
        if left <= 0:
            plan.delete_job = True
            plan.events.append(Event("Normal", "TTLExpired", f"deleted {ttl}s after it finished"))
        else:
            plan.requeue(left)
    elif phase not in TERMINAL and (deadline := run_policy.get("activeDeadlineSeconds")) and st["startTime"]:
        left = (parse_time(st["startTime"]) + timedelta(seconds=deadline) - now).total_seconds()  # type: ignore[operator]
        plan.requeue(left)
    # Empty strings and nulls are left out: the status only holds what is known.
    for key in [k for k, v in st.items() if v is None or v == "" or v == {}]:
        del st[key]
    if not st["drafter"].get("artifact"):
        st["drafter"].pop("artifact", None)
    return plan


def _run(job: Obj, st: Obj, conds: Conditions, plan: Plan, current: dict[int, Obj], stale: list[str],
         pods: list[Obj], names_in_use: set[str], busy: set[int], now: datetime, restart: Any,
         finish: Any, own_failures: dict[int, int]) -> tuple[str, str, str]:
    """The job is neither invalid, finished, past its deadline nor suspended."""
    spec = job["spec"]
    nodes = int(spec["target"]["nodes"])
    max_restarts = int(spec["runPolicy"]["maxRestarts"])

    # a pending restart waits out its backoff (old pods go first)
    restart_at = parse_time(st["restartAt"])
    if restart_at is not None and now < restart_at:
        plan.delete_pods = stale + [p["metadata"]["name"] for p in current.values()]
        plan.requeue((restart_at - now).total_seconds())
        return "Restarting", "Backoff", f"restarting at {st['restartAt']}"
    st["restartAt"] = None

    # failures of the current pods
    for node in sorted(current):
        fault = faults.classify_pod(current[node])
        if fault is None:
            continue
        if fault.container == faults.DRAFTER:   # maxFailures counts the drafter's own failures only
            fault = dataclasses.replace(fault, restarts=own_failures.get(node, fault.restarts))
        try:
            action = faults.action_for(fault, job)
        except ValueError as exc:
            return finish(False, "SpecInvalid", str(exc), [p["metadata"]["name"] for p in current.values()])
        by_drafter = fault.container == faults.DRAFTER or fault.caused_by_drafter
        text = f"{builders.pod_name(job, node)}: {fault.message or fault.reason}"
        if action == faults.IGNORE:
            continue
        if action == faults.DISABLE_DRAFTER:
            _disable_drafter(job, st, conds, plan, fault, text)
            continue
        if action == faults.CONFIG_ERROR:
            st["lastFailure"] = text[:2000]
            return finish(False, "ConfigError", text,
                          [p["metadata"]["name"] for p in current.values()
                           if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")])
        if action == faults.FAIL_JOB:
            return finish(False, "FailedByPolicy", f"{text} (failurePolicy: FailJob)",
                          [p["metadata"]["name"] for p in current.values()
                           if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")])
        counted = action in (faults.RESTART_JOB, faults.RESTART_WITHOUT_DRAFTER) and not by_drafter
        if counted and st["restartsTowardsMax"] >= max_restarts:
            st["lastFailure"] = text[:2000]
            return finish(False, "BackoffLimitExceeded", f"{text}; maxRestarts {max_restarts} reached",
                          [p["metadata"]["name"] for p in current.values()
                           if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")])
        result: tuple[str, str, str] = restart(fault.reason or "TargetFailed", text, counted,
                                               without_drafter=action == faults.RESTART_WITHOUT_DRAFTER)
        return result

    # success: every target exited 0
    if len(current) == nodes and all(pod_succeeded(p) for p in current.values()):
        return finish(True, "Completed", f"all {nodes} target container(s) exited 0", [])

    missing = [n for n in range(nodes) if n not in current]
    if missing and st["podsCreated"]:
        names = ", ".join(builders.pod_name(job, n) for n in missing)
        evicted = _eviction(pods, missing, st["restartGeneration"])
        if evicted is not None:  # Kueue preempted the pod group, the scheduler or the kubelet evicted
            result = restart("PodEvicted", f"pod(s) {names} evicted ({evicted[0]}): {evicted[1]}", False,
                             immediate=True)
        else:
            result = restart("PodDeleted", f"pod(s) {names} disappeared (deleted or evicted)", False,
                             immediate=True)
        return result

    plan.delete_pods = stale
    if missing:
        free = [n for n in missing if n not in busy
                and builders.pod_object_name(job, n, st["restartGeneration"]) not in names_in_use]
        plan.create_nodes = free
        if len(free) == len(missing):
            st["podsCreated"] = True
            st["startTime"] = st["startTime"] or fmt_time(now)
            if not conds.is_true("Created"):
                conds.set("Created", True, "PodsCreated", f"{nodes} pod(s) created")
        else:
            plan.requeue(1.0)  # pods of the previous generation still terminating
        conds.clear("Restarting", "PodsRecreated")
        return "Pending", "PodsCreated", f"creating {len(free)} pod(s)"

    conds.clear("Restarting", "PodsRecreated")
    if all(pod_running(p) or pod_succeeded(p) for p in current.values()):
        conds.set("Running", True, "AllRanksRunning", f"{nodes} pod(s) running")
        return "Running", "AllRanksRunning", f"{nodes} pod(s) running"
    conds.clear("Running", "NotAllRunning", "not every pod is running")
    if all(pod_scheduled(p) for p in current.values()):
        return "Starting", "Starting", "pods scheduled, containers starting"
    if any(scheduling.KUEUE_SCHEDULING_GATE in _gates(p) for p in current.values()):
        return "Pending", "Queued", _queued_message(job)
    return "Pending", "Unscheduled", "waiting for pods to be scheduled"


def _last_termination(c: Obj) -> Obj | None:
    for key in ("state", "lastState"):
        term = (c.get(key) or {}).get("terminated") if isinstance(c.get(key), dict) else None
        if isinstance(term, dict):
            return term
    return None


def _drafter_accounting(job: Obj, st: Obj, current: dict[int, Obj], plan: Plan) -> dict[int, int]:
    """Count the current pods' drafter crashes; return each rank's own failures.

    The kubelet's restartCount counts every crash of the sidecar; a crash with EXIT_PEER_FRAME (a
    peer's frame ended the drafter) is not the drafter's own failure. Each pass sees the latest
    termination only (state, else lastState), so peer-frame exits are counted per rank across
    passes (status.drafterPeerFrames: count and the last one's finishedAt, so a termination seen
    twice counts once) and subtracted: own = restartCount - peer-frame exits. Approximations: a
    peer-frame exit followed by another crash before the operator's next look is never seen and
    counts as an own failure (toward disabling the drafter, the target's safe side); while a
    peer-frame exit is still the current state (not yet restarted) own is one low for a pass.
    """
    frames: dict[str, Obj] = {}
    own: dict[int, int] = {}
    for node, pod in sorted(current.items()):
        c = _container(pod, "drafter", init=True)
        rec = st["drafterPeerFrames"].get(str(node)) or {"count": 0, "last": ""}
        if c is None:   # no status reported (yet): keep what was counted
            if rec["count"]:
                frames[str(node)] = rec
            continue
        restarts = _nonneg_int(c.get("restartCount"))
        term = _last_termination(c)
        if term is not None and term.get("exitCode") == EXIT_PEER_FRAME:
            seen = str(term.get("finishedAt") or f"restart-{restarts}")[:64]
            if seen != rec["last"]:
                rec = {"count": rec["count"] + 1, "last": seen}
                st["drafterPeerFailures"] += 1
                plan.events.append(Event(
                    "Warning", "DrafterPeerFrame",
                    f"{builders.pod_name(job, node)}: a peer's frame ended the drafter (exit {EXIT_PEER_FRAME}); "
                    f"{st['drafterPeerFailures']} so far, not counted toward drafter.maxFailures"))
        if rec["count"]:
            frames[str(node)] = rec
        own[node] = max(0, restarts - rec["count"])
    st["drafterPeerFrames"] = frames
    st["drafterFailures"] = max(st["drafterFailures"], max(own.values(), default=0))
    return own


def _disable_drafter(job: Obj, st: Obj, conds: Conditions, plan: Plan, fault: faults.PodFault, text: str) -> None:
    """Disable the drafter in place (faults.DISABLE_DRAFTER): the target's pods stay, nothing
    restarts; `_drafter_plan` then annotates the pods. Idempotent."""
    if st["drafterDisabled"]:
        return
    why = faults.disable_reason(fault, job)
    cause = (f"the drafter failed {fault.restarts} time(s) on this rank (maxFailures "
             f"{job['spec']['drafter']['maxFailures']})" if why == "TooManyFailures" else f"failurePolicy: {why}")
    text = (f"{text}; {cause}: the drafter is disabled in place on every rank, the target keeps running "
            "(its pods are neither deleted nor restarted)")
    st["drafterDisabled"] = True
    st["drafterDisabledGeneration"] = st["restartGeneration"]
    conds.set("DrafterDegraded", True, why, text)
    plan.events.append(Event("Warning", "DrafterDegraded", text))


def _drafter_plan(st: Obj, conds: Conditions, plan: Plan, current: dict[int, Obj], phase: str) -> None:
    """How the pods of plan.generation carry a disabled drafter: built without it (any generation
    but the one it was disabled in; a status of older operators has no generation: every one), or,
    in the generation it was disabled in place, with it and ANNOTATION_DRAFTER_DISABLED, which the
    current pods that lack it get now."""
    if not st["drafterDisabled"]:
        return
    plan.drafter_disabled = st["drafterDisabledGeneration"] != plan.generation
    if plan.drafter_disabled:
        return
    plan.drafter_off = str((conds.items.get("DrafterDegraded") or {}).get("reason") or "Disabled")[:128]
    if phase in TERMINAL:
        return
    plan.annotate_pods = [
        p["metadata"]["name"] for _, p in sorted(current.items())
        if _container_spec(p, "drafter") and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        and ((p["metadata"].get("annotations") or {}).get(ANNOTATION_DRAFTER_DISABLED) != plan.drafter_off)]


def _container_spec(pod: Obj, name: str) -> bool:
    return any(isinstance(c, dict) and c.get("name") == name for c in (pod.get("spec") or {}).get("initContainers") or [])


def _queued_message(job: Obj) -> str:
    return f"waiting for Kueue to admit the pod group (LocalQueue {scheduling.kueue_queue(job)})"


def _gates(pod: Obj) -> list[str]:
    return [str(g.get("name")) for g in (pod.get("spec") or {}).get("schedulingGates") or [] if isinstance(g, dict)]
