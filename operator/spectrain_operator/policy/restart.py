"""Gang restarts, their backoff, and the restarts pods that vanished force.

A restart replaces every pod of the job: a new restart generation (pod label
builders.LABEL_GENERATION), all pods deleted, new ones created once the backoff has passed and the
old ones are gone. Restarts are counted twice: `restarts` (every one) and `restartsTowardsMax`
(those runPolicy.maxRestarts limits: a target's failure under RestartJob or RestartWithoutDrafter;
not evictions, deletions by others, RestartJobIgnoreMax or anything the drafter caused). The
backoff before restart number n is runPolicy.backoffSeconds * 2^(n-1), capped at MAX_BACKOFF_S,
n counting the restarts of its own kind.

Pods that vanish after they were created (someone deleted them, or the scheduler, the kubelet or
Kueue evicted them) restart the job at once, with no backoff and not counted; the reason is
PodEvicted with the evicter's condition on the pod, otherwise PodDeleted.

A pod on a lost node never goes away by itself: the taint manager deletes it (its toleration of
`node.kubernetes.io/unreachable` ran out), but only the node's kubelet can confirm that its
containers stopped, and the replacement needs the rank's name (and `busy` keeps the rank's node
until the old pod is gone). So a deleted pod still there FORCE_DELETE_AFTER_S past its
deletionTimestamp (the end of its grace period, when a live kubelet has long SIGKILLed it) is
deleted without waiting for its kubelet (`force_overdue`). Its containers, if the node only lost
its network, run on until the kubelet reconnects and kills them; in a job of several pods they cannot
step (every step needs every rank of the old generation), so they write no checkpoint (a job of one
pod can: docs/operations.md, "A lost node").
"""

from __future__ import annotations

from datetime import timedelta

from spectrain_operator import objects
from spectrain_operator import pods as podlib
from spectrain_operator.objects import Obj
from spectrain_operator.pods import fmt_time, parse_time
from spectrain_operator.policy.context import Context
from spectrain_operator.policy.plan import MAX_MESSAGE_CHARS, MAX_REASON_CHARS, Event, Outcome

MAX_BACKOFF_S = 3600.0
# Pod conditions that say who ended a pod and why: Kubernetes' own (scheduler preemption, taint
# manager, eviction API, kubelet) and Kueue's (a pod group preempted or its Workload evicted).
EVICTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")
MAX_EVICTION_MESSAGE_CHARS = 1000
# How long after a deleted pod's deletionTimestamp (its grace period's end) the operator stops
# waiting for its kubelet: a live kubelet removes it within seconds of the SIGKILL at that time.
FORCE_DELETE_AFTER_S = 20.0


def backoff_seconds(base: float, attempt: int) -> float:
    """Delay before restart number `attempt` (1-based): base * 2^(attempt-1), capped at an hour."""
    if base <= 0 or attempt <= 0:
        return 0.0
    return float(min(base * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S))


def restart(ctx: Context, why: str, text: str, *, counted: bool, without_drafter: bool = False,
            immediate: bool = False) -> Outcome:
    """Start a gang restart with reason `why`. counted: towards maxRestarts; without_drafter: the
    new pods are built without the drafter sidecar; immediate: no backoff."""
    st = ctx.status
    st["restarts"] += 1
    if counted:
        st["restartsTowardsMax"] += 1
    st["restartGeneration"] += 1
    st["podsCreated"] = False
    st["lastFailure"] = text[:MAX_MESSAGE_CHARS]
    attempt = st["restartsTowardsMax"] if counted else st["restarts"]
    delay = 0.0 if immediate else backoff_seconds(ctx.run_policy["backoffSeconds"], attempt)
    st["restartAt"] = fmt_time(ctx.now + timedelta(seconds=delay)) if delay else None
    st["drafterPeerFrames"] = {}   # bookkeeping of the pods being replaced
    if without_drafter and not st["drafterDisabled"]:
        st["drafterDisabled"] = True
        st["drafterDisabledGeneration"] = st["restartGeneration"] - 1   # the new pods have no drafter
        ctx.conds.set("DrafterDegraded", True, "RestartWithoutDrafter", text)
    ctx.plan.generation = st["restartGeneration"]
    ctx.plan.delete_pods = ctx.pods.live_names()
    ctx.plan.events.append(Event("Warning", why, f"{text}; restart {st['restarts']} in {delay:.0f}s"
                                 + (" without the drafter" if without_drafter else "")))
    ctx.plan.requeue(delay)
    ctx.conds.set("Restarting", True, why, text)
    return Outcome("Restarting", why, text)


def wait_backoff(ctx: Context) -> Outcome | None:
    """A pending restart waits out its backoff (status.restartAt), deleting the old pods first;
    once it has passed, restartAt is dropped and the new pods may be created."""
    restart_at = parse_time(ctx.status["restartAt"])
    if restart_at is not None and ctx.now < restart_at:
        ctx.plan.delete_pods = ctx.pods.stale + ctx.pods.current_names()
        ctx.plan.requeue((restart_at - ctx.now).total_seconds())
        return Outcome("Restarting", "Backoff", f"restarting at {ctx.status['restartAt']}")
    ctx.status["restartAt"] = None
    return None


def eviction(pods: list[Obj], nodes: list[int], generation: int) -> tuple[str, str] | None:
    """(reason, message) of the first eviction condition on a pod (deleted or not) of `nodes` in
    `generation`; None when none carries one."""
    for pod in pods:
        if podlib.pod_node(pod) not in nodes or podlib.pod_generation(pod) != generation:
            continue
        found = podlib.true_conditions(pod, EVICTION_CONDITIONS)
        if found:
            return (str(found[0].get("reason") or found[0]["type"])[:MAX_REASON_CHARS],
                    str(found[0].get("message") or "")[:MAX_EVICTION_MESSAGE_CHARS])
    return None


def replace_missing(ctx: Context) -> Outcome | None:
    """Restart when a created pod of the current generation is missing; None otherwise."""
    missing = ctx.pods.missing
    if not missing or not ctx.status["podsCreated"]:
        return None
    names = ", ".join(objects.pod_name(ctx.job, n) for n in missing)
    evicted = eviction(ctx.pods.every, missing, ctx.status["restartGeneration"])
    if evicted is not None:
        return restart(ctx, "PodEvicted", f"pod(s) {names} evicted ({evicted[0]}): {evicted[1]}",
                       counted=False, immediate=True)
    return restart(ctx, "PodDeleted", f"pod(s) {names} disappeared (deleted or evicted)",
                   counted=False, immediate=True)


def force_overdue(ctx: Context) -> None:
    """Force-delete (grace 0) the job's deleted pods that are FORCE_DELETE_AFTER_S past their
    deletionTimestamp, one Warning Event each; look again when the next one comes due."""
    for pod in ctx.pods.every:
        due = parse_time((pod.get("metadata") or {}).get("deletionTimestamp"))
        if due is None:
            continue
        late = (ctx.now - due).total_seconds()
        if late < FORCE_DELETE_AFTER_S:
            ctx.plan.requeue(FORCE_DELETE_AFTER_S - late)
            continue
        name, node = podlib.name(pod), (pod.get("spec") or {}).get("nodeName") or "no node"
        ctx.plan.force_delete_pods.append(name)
        ctx.plan.events.append(Event("Warning", "PodForceDeleted",
                                     f"pod {name} was due to stop at {fmt_time(due)} and its node ({node}) has "
                                     f"not confirmed it for {late:.0f} s (node lost?): deleted without waiting "
                                     "for its kubelet"))
