"""The job's lifecycle gates: finished or failed, a spec that cannot run, terminal phases,
activeDeadlineSeconds, suspend and resume, success, and what follows a phase (its Event, the TTL
after finishing, the requeue for the deadline).

Each gate returns the `Outcome` it settles on, or None when it does not apply; status.decide
tries them in the order of precedence of the module docstring there.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from spectrain_api.names import FAILED
from spectrain_operator import pods as podlib
from spectrain_operator.pods import fmt_time, parse_time
from spectrain_operator.policy.context import Context
from spectrain_operator.policy.plan import TERMINAL, Event, Outcome

MAX_SPEC_ERRORS = 8  # spec errors named in the SpecInvalid condition


def finish(ctx: Context, ok: bool, why: str, text: str, delete: list[str]) -> Outcome:
    """Succeeded (ok) or Failed with reason `why`; `delete`: the pods to delete with it."""
    st = ctx.status
    st["completionTime"] = st["completionTime"] or fmt_time(ctx.now)
    st["restartAt"] = None
    ctx.plan.delete_pods = delete
    phase = "Succeeded" if ok else "Failed"
    ctx.conds.set(phase, True, why, text)
    ctx.conds.clear("Running", why, text)
    ctx.conds.clear("Restarting", why)
    return Outcome(phase, why, text)


def spec_invalid(ctx: Context, errors: list[str]) -> Outcome:
    """A spec that cannot run: Failed + SpecInvalid, nothing created (a job already Failed keeps
    its reason; its condition SpecInvalid names the errors)."""
    text = "; ".join(errors[:MAX_SPEC_ERRORS])
    ctx.conds.set("SpecInvalid", True, "InvalidSpec", text)
    prev = ctx.prev_phase
    if prev is not None and prev in TERMINAL and ctx.conds.is_true("Failed"):
        ctx.plan.delete_pods = ctx.pods.active()
        return Outcome(prev, "InvalidSpec", text)
    return finish(ctx, False, "SpecInvalid", text, ctx.pods.active())


def stay_terminal(ctx: Context) -> Outcome | None:
    """Succeeded and Failed are for good; a Failed job's pods that still run are deleted."""
    prev = ctx.prev_phase
    if prev is None or prev not in TERMINAL:
        return None
    if prev == FAILED:
        ctx.plan.delete_pods = ctx.pods.active()
    if ctx.status["completionTime"] is None:
        ctx.status["completionTime"] = fmt_time(ctx.now)
    return Outcome(prev, prev, "")


def _deadline(ctx: Context) -> datetime | None:
    """startTime + activeDeadlineSeconds (None: no deadline, or not started)."""
    seconds = ctx.run_policy.get("activeDeadlineSeconds")
    start = parse_time(ctx.status["startTime"])
    return start + timedelta(seconds=seconds) if seconds and start is not None else None


def past_deadline(ctx: Context) -> Outcome | None:
    """Running longer than activeDeadlineSeconds (from status.startTime): Failed/DeadlineExceeded."""
    deadline = _deadline(ctx)
    if deadline is None or ctx.spec["suspend"] or ctx.now < deadline:
        return None
    return finish(ctx, False, "DeadlineExceeded",
                  f"running longer than activeDeadlineSeconds {ctx.run_policy['activeDeadlineSeconds']}",
                  ctx.pods.active())


def suspended(ctx: Context) -> Outcome | None:
    """spec.suspend deletes the pods and keeps the rest (the restart budget, the drafter state)."""
    if not ctx.spec["suspend"]:
        return None
    st = ctx.status
    ctx.plan.delete_pods = ctx.pods.live_names()
    st["podsCreated"] = False
    st["startTime"] = None
    st["restartAt"] = None
    ctx.conds.set("Suspended", True, "Suspended", "spec.suspend is true: pods deleted, the rest kept")
    ctx.conds.clear("Running", "Suspended")
    ctx.conds.clear("Restarting", "Suspended")
    return Outcome("Suspended", "Suspended", "spec.suspend is true")


def resume(ctx: Context) -> None:
    """A job no longer suspended: the pods are recreated, the workloads resume from their last
    checkpoint."""
    if ctx.conds.is_true("Suspended"):
        ctx.conds.set("Suspended", False, "Resumed", "spec.suspend is false: pods recreated from the last checkpoint")


def succeeded(ctx: Context) -> Outcome | None:
    """Succeeded when every node's target container exited 0 and its pod has finished (the
    drafters' last export and reports are in: status.drafter names the final drafter)."""
    current = ctx.pods.current
    if len(current) == ctx.nodes and all(podlib.pod_completed(p) for p in current.values()):
        return finish(ctx, True, "Completed", f"all {ctx.nodes} target container(s) exited 0", [])
    return None


def announce(ctx: Context, outcome: Outcome) -> None:
    """An Event for a phase transition (Warning for Failed and Restarting)."""
    if outcome.phase != ctx.prev_phase:
        kind = "Warning" if outcome.phase in ("Failed", "Restarting") else "Normal"
        ctx.plan.events.append(Event(kind, outcome.phase,
                                     outcome.message or f"phase {ctx.prev_phase or 'none'} -> {outcome.phase}"))


def expire(ctx: Context, phase: str) -> None:
    """ttlSecondsAfterFinished deletes a finished job (or requeues for then); a running job is
    looked at again at its activeDeadlineSeconds."""
    ttl = ctx.run_policy.get("ttlSecondsAfterFinished")
    completion = parse_time(ctx.status["completionTime"])
    if phase in TERMINAL and ttl is not None and completion is not None:
        left = (completion + timedelta(seconds=ttl) - ctx.now).total_seconds()
        if left <= 0:
            ctx.plan.delete_job = True
            ctx.plan.events.append(Event("Normal", "TTLExpired", f"deleted {ttl}s after it finished"))
        else:
            ctx.plan.requeue(left)
    elif phase not in TERMINAL and (deadline := _deadline(ctx)) is not None:
        ctx.plan.requeue((deadline - ctx.now).total_seconds())
