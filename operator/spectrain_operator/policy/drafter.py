"""The drafter sidecar's fate: crash accounting, degraded / disabled, and its status summary.

Drafter failures never fail the job and never restart the target. Its crashes are counted
(status.drafterFailures); exits with EXIT_PEER_FRAME (a peer's frame ended the drafter) apart
(status.drafterPeerFailures). Past drafter.maxFailures, or by a drafter rule FailJob /
RestartWithoutDrafter, the drafter is disabled in place: condition DrafterDegraded and
status.drafterDisabled for that restart generation (the sidecars read it through the status path and
idle; a pod of that generation created later carries ANNOTATION_DRAFTER_DISABLED), the target
untouched; the next restart the job needs anyway builds pods without the sidecar.
"""

from __future__ import annotations

from spectrain_api.names import ACTIVE, DEGRADED, EXIT_PEER_FRAME, REPORT_DRAFTER
from spectrain_operator import faults, objects
from spectrain_operator import pods as podlib
from spectrain_operator.objects import DRAFTER, Obj
from spectrain_operator.policy.context import Context, finite, nonneg_int
from spectrain_operator.policy.plan import MAX_REASON_CHARS, Event


def count_crashes(ctx: Context) -> dict[int, int]:
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
    st = ctx.status
    frames: dict[str, Obj] = {}
    own: dict[int, int] = {}
    for node, pod in sorted(ctx.pods.current.items()):
        c = podlib.container_status(pod, DRAFTER, init=True)
        rec = st["drafterPeerFrames"].get(str(node)) or {"count": 0, "last": ""}
        if c is None:   # no status reported (yet): keep what was counted
            if rec["count"]:
                frames[str(node)] = rec
            continue
        restarts = nonneg_int(c.get("restartCount"))
        term = podlib.last_termination(c)
        if term is not None and term.get("exitCode") == EXIT_PEER_FRAME:
            seen = str(term.get("finishedAt") or f"restart-{restarts}")[:64]
            if seen != rec["last"]:
                rec = {"count": rec["count"] + 1, "last": seen}
                st["drafterPeerFailures"] += 1
                ctx.plan.events.append(Event(
                    "Warning", "DrafterPeerFrame",
                    f"{objects.pod_name(ctx.job, node)}: a peer's frame ended the drafter (exit {EXIT_PEER_FRAME}); "
                    f"{st['drafterPeerFailures']} so far, not counted toward drafter.maxFailures"))
        if rec["count"]:
            frames[str(node)] = rec
        own[node] = max(0, restarts - rec["count"])
    st["drafterPeerFrames"] = frames
    st["drafterFailures"] = max(st["drafterFailures"], max(own.values(), default=0))
    return own


def disable_in_place(ctx: Context, fault: faults.PodFault, text: str) -> None:
    """Disable the drafter in place (faults.DISABLE_DRAFTER): the target's pods stay, nothing
    restarts; the sidecars read status.drafterDisabled and idle. Idempotent."""
    st = ctx.status
    if st["drafterDisabled"]:
        return
    why = faults.disable_reason(fault, ctx.job)
    cause = (f"the drafter failed {fault.restarts} time(s) on this rank (maxFailures "
             f"{ctx.spec['drafter']['maxFailures']})" if why == "TooManyFailures" else f"failurePolicy: {why}")
    text = (f"{text}; {cause}: the drafter is disabled in place on every rank, the target keeps running "
            "(its pods are neither deleted nor restarted)")
    st["drafterDisabled"] = True
    st["drafterDisabledGeneration"] = st["restartGeneration"]
    ctx.conds.set("DrafterDegraded", True, why, text)
    ctx.plan.events.append(Event("Warning", "DrafterDegraded", text))


def carry_disabled(ctx: Context) -> None:
    """How the pods of plan.generation carry a disabled drafter: built without it (any generation
    but the one it was disabled in; a status of older operators has no generation: every one), or,
    in the generation it was disabled in place, with it and ANNOTATION_DRAFTER_DISABLED = drafter_off
    (a pod created now; those running read status.drafterDisabled)."""
    st, plan = ctx.status, ctx.plan
    if not st["drafterDisabled"]:
        return
    plan.drafter_disabled = st["drafterDisabledGeneration"] != plan.generation
    if not plan.drafter_disabled:
        plan.drafter_off = (ctx.conds.reason("DrafterDegraded") or "Disabled")[:MAX_REASON_CHARS]


def summary(pods_by_node: dict[int, Obj], job_status: object, previous: object, *, enabled: bool,
            degraded: bool) -> Obj:
    """status.drafter from the pods' drafter reports in `job_status` (the status as read): state,
    active ranks, harvested seconds (sum), harvest efficiency and acceptance length (means), the
    exported artifact; a figure no pod reports keeps its previous value."""
    reports = [r for r in (podlib.report(job_status, p, REPORT_DRAFTER) for _, p in sorted(pods_by_node.items()))
               if r is not None]
    prev: Obj = previous if isinstance(previous, dict) else {}
    artifact = next((str(r["artifact"])[:1024] for r in reports if isinstance(r.get("artifact"), str) and r["artifact"]),
                    prev.get("artifact") if isinstance(prev.get("artifact"), str) else "")
    harvested = [v for v in (finite(r.get("harvestedSeconds")) for r in reports) if v is not None]
    efficiency = [v for v in (finite(r.get("harvestEfficiency")) for r in reports) if v is not None]
    acceptance = [v for v in (finite(r.get("acceptanceLength")) for r in reports) if v is not None]
    active = sum(1 for r in reports if r.get("state") == ACTIVE)
    if degraded:
        state = "Degraded"
    elif not enabled:
        state = "Disabled"
    elif active:
        state = "Active"
    elif any(r.get("state") == DEGRADED for r in reports):
        state = "Degraded"
    else:
        state = "Waiting"
    return {"state": state, "activeRanks": active,
            "harvestedSeconds": round(sum(harvested), 3) if harvested else finite(prev.get("harvestedSeconds")) or 0.0,
            "harvestEfficiency": round(sum(efficiency) / len(efficiency), 4) if efficiency
            else finite(prev.get("harvestEfficiency")) or 0.0,
            "acceptanceLength": round(sum(acceptance) / len(acceptance), 4) if acceptance
            else finite(prev.get("acceptanceLength")),
            "artifact": artifact}
