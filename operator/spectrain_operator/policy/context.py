"""What one pass knows: the job, the status it carries over (parsed defensively) and its pods
sorted by role, in one `Context` every policy reads and writes.

State that must survive an operator restart lives in the status (restarts, restartGeneration,
restartAt, podsCreated, drafterDisabled, drafterDisabledGeneration, drafterPeerFrames); every field
is parsed here so that a status written by a user cannot crash the operator: a field of the wrong
type reads as its zero value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spectrain_api.names import PHASES
from spectrain_operator import pods as podlib
from spectrain_operator.objects import Obj
from spectrain_operator.pods import fmt_time, parse_time
from spectrain_operator.policy.plan import MAX_MESSAGE_CHARS, Conditions, Plan


def nonneg_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def opt_nonneg_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _time(value: Any) -> str | None:
    t = parse_time(value)
    return fmt_time(t) if t else None


def _peer_frames(value: Any, nodes: int) -> dict[str, Obj]:
    """status.drafterPeerFrames, parsed defensively: node index -> {count, last} (a rank whose
    drafter only failed on its own has count 0 and the last termination seen)."""
    out: dict[str, Obj] = {}
    for key, rec in (value if isinstance(value, dict) else {}).items():
        if isinstance(key, str) and key.isdigit() and int(key) < nodes and isinstance(rec, dict) \
                and isinstance(rec.get("last"), str) and (nonneg_int(rec.get("count")) or rec["last"]):
            out[key] = {"count": nonneg_int(rec["count"]), "last": rec["last"][:64]}
    return out


def carried_status(old: Obj, generation: int, nodes: int) -> Obj:
    """The fields of the previous status a pass starts from; the policies update them in place."""
    return {
        "observedGeneration": generation,
        "restarts": nonneg_int(old.get("restarts")),
        "restartsTowardsMax": nonneg_int(old.get("restartsTowardsMax")),
        "restartGeneration": nonneg_int(old.get("restartGeneration")),
        "restartAt": _time(old.get("restartAt")),
        "podsCreated": old.get("podsCreated") is True,
        "drafterDisabled": old.get("drafterDisabled") is True,
        "drafterDisabledGeneration": opt_nonneg_int(old.get("drafterDisabledGeneration")),
        "drafterFailures": nonneg_int(old.get("drafterFailures")),
        "drafterPeerFailures": nonneg_int(old.get("drafterPeerFailures")),
        "drafterPeerFrames": _peer_frames(old.get("drafterPeerFrames"), nodes),
        "lastFailure": old["lastFailure"][:MAX_MESSAGE_CHARS] if isinstance(old.get("lastFailure"), str) else None,
        "startTime": _time(old.get("startTime")),
        "completionTime": _time(old.get("completionTime")),
    }


def prune(status: Obj) -> None:
    """Leave out empty strings, nulls and empty objects: the status only holds what is known."""
    for key in [k for k, v in status.items() if v is None or v == "" or v == {}]:
        del status[key]
    if not status["drafter"].get("artifact"):
        status["drafter"].pop("artifact", None)


@dataclass(frozen=True)
class PodSet:
    """The job's pods (every pod carrying its label) by role, for restart generation `generation`."""

    every: list[Obj]          # including those being deleted
    live: list[Obj]           # not being deleted
    current: dict[int, Obj]   # node index -> its live pod of `generation` (nodes 0..N-1 only)
    missing: list[int]        # nodes 0..N-1 without one, ascending
    stale: list[str]          # names of the other live pods: older generations, foreign node labels
    names_in_use: set[str]    # every pod's name: a new pod cannot take one until it is gone
    busy: set[int]            # nodes with a pod still running (any generation, deleted or not)

    @classmethod
    def of(cls, pods: list[Obj], generation: int, nodes: int) -> PodSet:
        live = [p for p in pods if not podlib.is_deleted(p)]
        current = {n: p for p in live if podlib.pod_generation(p) == generation
                   and (n := podlib.pod_node(p)) is not None and 0 <= n < nodes}
        kept = {id(p) for p in current.values()}   # (not `p in current.values()`: quadratic in the pods)
        # `busy`: the replacement of such a node waits for its old pod, so two pods of one rank
        # never run at once (the same name does that too, except for Kueue jobs, whose names
        # alternate: objects.pod_object_name).
        return cls(every=pods, live=live, current=current, missing=[n for n in range(nodes) if n not in current],
                   stale=[podlib.name(p) for p in live if id(p) not in kept],
                   names_in_use={podlib.name(p) for p in pods},
                   busy={n for p in pods if (n := podlib.pod_node(p)) is not None and podlib.still_running(p)})

    def active(self) -> list[str]:
        """Live pods whose containers have not finished: what a finished job still deletes."""
        return [podlib.name(p) for p in self.live if not podlib.is_finished(p)]

    def live_names(self) -> list[str]:
        return [podlib.name(p) for p in self.live]

    def current_names(self) -> list[str]:
        return [podlib.name(p) for p in self.current.values()]

    def current_active(self) -> list[str]:
        return [podlib.name(p) for p in self.current.values() if not podlib.is_finished(p)]


@dataclass
class Context:
    """One pass: the job (defaulted), `now`, the status being built (`plan.status`), its
    conditions, the plan and the pods. Policies read it and update `status`, `conds` and `plan`."""

    job: Obj
    now: datetime
    prev_phase: str | None     # the phase the previous status reported (None: unknown or none)
    old: Obj                   # the previous status as written (summaries fall back on it)
    conds: Conditions
    plan: Plan
    pods: PodSet

    @classmethod
    def of(cls, job: Obj, pods: list[Obj], now: datetime) -> Context:
        old: Obj = job["status"] if isinstance(job.get("status"), dict) else {}
        generation = nonneg_int((job.get("metadata") or {}).get("generation"))
        nodes = int(job["spec"]["target"]["nodes"])
        status = carried_status(old, generation, nodes)
        return cls(job=job, now=now, prev_phase=old.get("phase") if old.get("phase") in PHASES else None,
                   old=old, conds=Conditions(old.get("conditions"), now, generation),
                   plan=Plan(status=status, generation=status["restartGeneration"]),
                   pods=PodSet.of(pods, status["restartGeneration"], nodes))

    @property
    def status(self) -> Obj:
        return self.plan.status

    @property
    def spec(self) -> Obj:
        return self.job["spec"]

    @property
    def run_policy(self) -> Obj:
        return self.job["spec"]["runPolicy"]

    @property
    def nodes(self) -> int:
        return int(self.job["spec"]["target"]["nodes"])

    @property
    def drafter_enabled(self) -> bool:
        """spec.drafter.enabled (a drafter disabled at run time: status.drafterDisabled)."""
        return bool(self.job["spec"]["drafter"]["enabled"])
