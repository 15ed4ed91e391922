"""How far the job is: its pods coming up (create the missing ones, then Pending -> Starting ->
Running from what the pods say, with Kueue's admission gate, Queued, in between) and what the
status reports beside the phase: training progress (rank 0's ANNOTATION_PROGRESS), the drafter's
summary (policy/drafter.py), the ranks' counts and the informational conditions DrafterActive and
CheckpointEphemeral.

A missing pod is created only once its node has no pod of an earlier generation still running
and its name is free, so two pods of one rank never run at once; until then the pass looks again
after a second.
"""

from __future__ import annotations

from spectrain_api.names import REPORT_PROGRESS
from spectrain_operator import objects, scheduling
from spectrain_operator import pods as podlib
from spectrain_operator.objects import Obj
from spectrain_operator.pods import fmt_time
from spectrain_operator.policy import drafter
from spectrain_operator.policy.context import Context, finite, nonneg_int
from spectrain_operator.policy.plan import MAX_MESSAGE_CHARS, TERMINAL, Event, Outcome

WAIT_FOR_OLD_POD_S = 1.0  # requeue while pods of the previous generation still terminate
MAX_TIMESTAMP_CHARS = 64  # status.progress.updatedAt, as the workload wrote it


def queued_message(ctx: Context) -> str:
    return f"waiting for Kueue to admit the pod group (LocalQueue {scheduling.kueue_queue(ctx.job)})"


def _gated(ctx: Context) -> bool:
    """Kueue holds a current pod (its admission gate) until it admits the pod group."""
    return any(scheduling.KUEUE_SCHEDULING_GATE in podlib.scheduling_gates(p) for p in ctx.pods.current.values())


def come_up(ctx: Context) -> Outcome:
    """The job has no failure, is not done and lost no created pod: delete pods of other
    generations, create the missing ones, else report how far the pods are."""
    ctx.plan.delete_pods = ctx.pods.stale
    if ctx.pods.missing:
        return _create_missing(ctx)
    ctx.conds.clear("Restarting", "PodsRecreated")
    return _phase(ctx)


def _create_missing(ctx: Context) -> Outcome:
    st, nodes = ctx.status, ctx.nodes
    missing = ctx.pods.missing
    free = [n for n in missing if n not in ctx.pods.busy
            and objects.pod_object_name(ctx.job, n, st["restartGeneration"]) not in ctx.pods.names_in_use]
    ctx.plan.create_nodes = free
    if len(free) == len(missing):
        st["podsCreated"] = True
        st["startTime"] = st["startTime"] or fmt_time(ctx.now)
        if not ctx.conds.is_true("Created"):
            ctx.conds.set("Created", True, "PodsCreated", f"{nodes} pod(s) created")
    else:
        ctx.plan.requeue(WAIT_FOR_OLD_POD_S)
    ctx.conds.clear("Restarting", "PodsRecreated")
    return Outcome("Pending", "PodsCreated", f"creating {len(free)} pod(s)")


def _phase(ctx: Context) -> Outcome:
    """Every node has its pod: Running, Starting (all scheduled), Pending (queued or unscheduled)."""
    current, nodes = ctx.pods.current.values(), ctx.nodes
    if all(podlib.pod_running(p) or podlib.pod_succeeded(p) for p in current):
        ctx.conds.set("Running", True, "AllRanksRunning", f"{nodes} pod(s) running")
        return Outcome("Running", "AllRanksRunning", f"{nodes} pod(s) running")
    ctx.conds.clear("Running", "NotAllRunning", "not every pod is running")
    if all(podlib.pod_scheduled(p) for p in current):
        return Outcome("Starting", "Starting", "pods scheduled, containers starting")
    if _gated(ctx):
        return Outcome("Pending", "Queued", queued_message(ctx))
    return Outcome("Pending", "Unscheduled", "waiting for pods to be scheduled")


def mark_queued(ctx: Context, phase: str) -> None:
    """Condition Queued: True while Kueue gates a pod of a job still going, False once admitted."""
    if phase not in TERMINAL and _gated(ctx):
        ctx.conds.set("Queued", True, "WaitingForKueue", queued_message(ctx))
    elif ctx.pods.current:
        ctx.conds.clear("Queued", "Admitted", "Kueue admitted the pod group")


def progress(pods_by_node: dict[int, Obj], job_status: object, previous: object, total_steps: int) -> Obj:
    """status.progress from the report of rank 0's pod (node 0) in `job_status` (the status as
    read): step, loss, tokens/s, updatedAt; without a report the previous step is kept."""
    data = podlib.report(job_status, pods_by_node[0], REPORT_PROGRESS) if 0 in pods_by_node else None
    if data is None:
        if isinstance(previous, dict) and isinstance(previous.get("step"), int):
            return {**previous, "totalSteps": total_steps}
        return {"step": 0, "totalSteps": total_steps}
    out: Obj = {"step": nonneg_int(data.get("step")), "totalSteps": total_steps,
                "loss": finite(data.get("loss")), "tokensPerSecond": finite(data.get("tokensPerSecond"))}
    updated = data.get("updatedAt")
    out["updatedAt"] = (str(updated)[:MAX_TIMESTAMP_CHARS]
                        if isinstance(updated, (str, int, float)) and not isinstance(updated, bool) else None)
    return out


def ranks(pods_by_node: dict[int, Obj], nodes: int) -> Obj:
    """status.ranks: how many of the current pods are ready, running, succeeded, failed."""
    current = pods_by_node.values()
    return {"desired": nodes,
            "ready": sum(1 for p in current if podlib.pod_ready(p)),
            "running": sum(1 for p in current if podlib.pod_running(p)),
            "succeeded": sum(1 for p in current if podlib.pod_succeeded(p)),
            "failed": sum(1 for p in current if (podlib.target_exit_code(p) or 0) != 0)}


def summarize(ctx: Context) -> None:
    """Fill status.progress, .drafter, .ranks and .ready, and the informational conditions."""
    st, spec, current = ctx.status, ctx.spec, ctx.pods.current
    st["progress"] = progress(current, ctx.old, ctx.old.get("progress"), int(spec["target"]["steps"]))
    reports, refused = drafter.checked_reports(current, ctx.old, ctx.job, ctx.now)
    previous: Obj = ctx.old["drafter"] if isinstance(ctx.old.get("drafter"), dict) else {}
    st["drafter"] = drafter.summary(reports, previous, enabled=ctx.drafter_enabled and not st["drafterDisabled"],
                                    degraded=ctx.conds.is_true("DrafterDegraded"), refused=len(refused))
    if refused and len(refused) != nonneg_int(previous.get("reportFieldsRefused")):
        # a report is a claim any container of the job can write: refused fields are never copied
        ctx.plan.events.append(Event("Warning", "DrafterReportRefused",
                                     f"{len(refused)} drafter report field(s) ignored: "
                                     f"{'; '.join(refused)}"[:MAX_MESSAGE_CHARS]))
    if st["drafter"]["activeRanks"]:
        ctx.conds.set("DrafterActive", True, "Harvesting", f"{st['drafter']['activeRanks']} rank(s) training the drafter")
    else:
        ctx.conds.clear("DrafterActive", st["drafter"]["state"])
    if not spec["target"]["checkpoint"].get("claimName", ""):
        ctx.conds.set("CheckpointEphemeral", True, "EmptyDirCheckpoint",
                      "spec.target.checkpoint.claimName is empty: checkpoints live in an emptyDir and are lost with "
                      "the pods; set a PVC to resume after restarts")
    st["ranks"] = ranks(current, ctx.nodes)
    st["ready"] = f"{st['ranks']['ready']}/{ctx.nodes}"
