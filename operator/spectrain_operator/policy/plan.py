"""What one reconcile pass decides: the `Plan` (new status, pods to create and delete, Events,
whether to delete the job, when to look again), the conditions it writes and a policy's `Outcome`.

Pure data: the policies fill a Plan, kube.py / reconciler.py execute it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from spectrain_operator.objects import Obj
from spectrain_operator.pods import fmt_time

TERMINAL = ("Succeeded", "Failed")  # job phases no pass leaves
MAX_MESSAGE_CHARS = 2000            # a condition's message, status.lastFailure
MAX_REASON_CHARS = 128              # a reason taken from elsewhere (an eviction condition, DrafterDegraded's)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


class Outcome(NamedTuple):
    """The phase a policy settled on, with the reason and message of that transition."""

    phase: str
    reason: str
    message: str


@dataclass
class Plan:
    status: Obj
    create_nodes: list[int] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    force_delete_pods: list[str] = field(default_factory=list)   # grace 0: their kubelet is gone (restart.force_overdue)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None
    generation: int = 0
    drafter_disabled: bool = False      # pods of `generation` are built without the drafter sidecar
    drafter_off: str = ""               # disabled in place in `generation`: new pods' annotation value

    def requeue(self, seconds: float) -> None:
        """Look again after `seconds` at the latest (the earliest of every request wins)."""
        seconds = max(0.0, seconds)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


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
        self.items[type_] = {"type": type_, "status": value, "reason": reason, "message": (message or reason)[:MAX_MESSAGE_CHARS],
                             "lastTransitionTime": since,
                             "observedGeneration": self.generation}

    def clear(self, type_: str, reason: str, message: str = "") -> None:
        """Set False only if the condition was ever reported."""
        if type_ in self.items:
            self.set(type_, False, reason, message)

    def is_true(self, type_: str) -> bool:
        return self.items.get(type_, {}).get("status") == "True"

    def reason(self, type_: str) -> str | None:
        reason = self.items.get(type_, {}).get("reason")
        return str(reason) if reason else None

    def as_list(self) -> list[Obj]:
        return list(self.items.values())
