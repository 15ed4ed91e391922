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

from datetime import datetime

from spectrain_api.names import (
    ACTIVE,
    COMBINE_ADJUST_CAUSES,
    DEGRADED,
    EXIT_OK,
    EXIT_PEER_FRAME,
    EXPORT_REJECT_CAUSES,
    REPORT_DRAFTER,
    SUCCEEDED,
)
from spectrain_api.reports import HARVEST_CLOCK_SLACK_S, checked_drafter_report, export_rank
from spectrain_operator import builders, faults, objects
from spectrain_operator import pods as podlib
from spectrain_operator.objects import DRAFTER, Obj
from spectrain_operator.pods import parse_time
from spectrain_operator.policy.context import Context, finite, nonneg_int
from spectrain_operator.policy.plan import MAX_MESSAGE_CHARS, MAX_REASON_CHARS, Event


def count_crashes(ctx: Context) -> dict[int, int]:
    """Count the current pods' drafter failures; return each rank's own failures.

    A rank's drafter has terminated faults.terminations times: restartCount plus the latest
    termination while the kubelet has not restarted it yet (restartCount rises only at the restart,
    after a back-off of up to 5 min: a crash must count, and may disable the drafter, in the pass
    that first sees it, and one at the end of the job must count at all). The kubelet stopping the
    sidecar at pod shutdown is no failure. An exit with EXIT_PEER_FRAME (a peer's frame ended the
    drafter) is not the drafter's own failure: such exits are counted per rank across passes
    (status.drafterPeerFrames: count, and `last`, faults.termination_id of the last termination
    seen, own or not, so one seen in two passes counts once) and subtracted: own = terminations -
    peer-frame exits. Every own failure seen is announced once (Event DrafterFailed). Approximation:
    of terminations between two looks of the operator only the latest is seen; an earlier
    peer-frame exit among them counts as an own failure (toward disabling the drafter, the
    target's safe side) and only the latest gets an Event.
    """
    st = ctx.status
    max_failures = ctx.spec["drafter"]["maxFailures"]
    frames: dict[str, Obj] = {}
    own: dict[int, int] = {}
    for node, pod in sorted(ctx.pods.current.items()):
        c = podlib.container_status(pod, DRAFTER, init=True)
        rec = st["drafterPeerFrames"].get(str(node)) or {"count": 0, "last": ""}
        if c is None:   # no status reported (yet): keep what was counted
            if rec["count"] or rec["last"]:
                frames[str(node)] = rec
            continue
        restarts = nonneg_int(c.get("restartCount"))
        term = podlib.last_termination(c)
        # exit 0 (it stopped on its own) and the shutdown stop are no failures; the kubelet restarts
        # the former all the same, and restartCount keeps counting it
        failed = term is not None and term.get("exitCode") != EXIT_OK and not faults.stopped_at_shutdown(pod, c)
        seen = faults.termination_id(term, restarts) if term is not None else ""
        new = failed and seen != rec["last"]
        peer = term is not None and term.get("exitCode") == EXIT_PEER_FRAME
        if new:
            rec = {"count": rec["count"] + (1 if peer else 0), "last": seen}
        if new and peer:
            st["drafterPeerFailures"] += 1
            ctx.plan.events.append(Event(
                "Warning", "DrafterPeerFrame",
                f"{objects.pod_name(ctx.job, node)}: a peer's frame ended the drafter (exit {EXIT_PEER_FRAME}); "
                f"{st['drafterPeerFailures']} so far, not counted toward drafter.maxFailures"))
        if rec["count"] or rec["last"]:
            frames[str(node)] = rec
        ended = restarts + (1 if failed and faults.unrestarted(c) else 0)
        own[node] = max(0, ended - rec["count"])
        if new and not peer and term is not None:
            ctx.plan.events.append(Event("Warning", "DrafterFailed", _failure_text(ctx, node, term, own[node],
                                                                                  max_failures)))
    st["drafterPeerFrames"] = frames
    st["drafterFailures"] = max(st["drafterFailures"], max(own.values(), default=0))
    return own


def _failure_text(ctx: Context, node: int, term: Obj, failures: int, max_failures: int) -> str:
    """DrafterFailed's message: the pod, exit code, reason and error line, the rank's count."""
    code, reason = term.get("exitCode"), str(term.get("reason") or "")[:MAX_REASON_CHARS]
    line = faults.error_line(str(term.get("message") or ""), 400)
    return (f"{objects.pod_name(ctx.job, node)}: the drafter exited with code {code}"
            + (f" ({reason})" if reason else "") + (f": {line}" if line else "")
            + f"; failure {failures} of maxFailures {max_failures} on this rank (the target keeps running)")


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


def never_trained(ctx: Context, phase: str) -> None:
    """A job that finished with its drafter enabled and never disabled, yet nothing harvested (an
    export, if any, is the untrained initial drafter): condition DrafterNeverTrained and one Warning Event naming each rank's last drafter
    state (e.g. Waiting/NoRing, Waiting/NoTargetWeights), so that a Succeeded job that trained no
    drafter cannot pass for one that did. Needs status.drafter (summary) of this pass."""
    st = ctx.status
    if phase != SUCCEEDED or not ctx.drafter_enabled or st["drafterDisabled"] \
            or ctx.conds.is_true("DrafterNeverTrained"):
        return
    d = st["drafter"]
    if (finite(d.get("harvestedSeconds")) or 0.0) > 0:
        return
    states = []
    for node, pod in sorted(ctx.pods.current.items()):
        r = podlib.report(ctx.old, pod, REPORT_DRAFTER)
        states.append(f"rank {node}: " + (f"{r.get('state')}/{r.get('reason')}" if r else "no drafter report"))
    reasons = {s.split(": ", 1)[1].split("/")[-1] for s in states}
    reason = reasons.pop() if len(reasons) == 1 else "Various"
    text = (f"the job finished but its drafter never trained (harvested 0 s); last drafter "
            f"state {'; '.join(states)}; `kubectl logs <pod> -c {DRAFTER}` says why")[:MAX_MESSAGE_CHARS]
    ctx.conds.set("DrafterNeverTrained", True, "".join(ch for ch in reason if ch.isalnum())[:MAX_REASON_CHARS]
                  or "NeverTrained", text)
    ctx.plan.events.append(Event("Warning", "DrafterNeverTrained", text))


def report_limits(job: Obj, now: datetime) -> tuple[int, str, float]:
    """What a pod's drafter report is checked against (spectrain_api.reports): the exporting rank's
    node, the job's export path as the pods see it, and the most idle seconds one pod's ranks can
    have harvested (local ranks x the job's age, plus clock slack)."""
    t = job["spec"]["target"]
    procs = int(t["procsPerNode"])
    created = parse_time((job.get("metadata") or {}).get("creationTimestamp"))
    age = (now - created).total_seconds() if created is not None else 0.0
    return (export_rank(int(t["nodes"]) * procs) // procs, builders.export_dir(job),
            procs * (max(0.0, age) + HARVEST_CLOCK_SLACK_S))


def checked_reports(pods_by_node: dict[int, Obj], job_status: object, job: Obj,
                    now: datetime) -> tuple[list[Obj], list[str]]:
    """The pods' drafter reports with only the fields that pass spectrain_api.reports, and one line
    per refused field ("pod <name>: <field>=<value> refused: <why>")."""
    export_node, export_dir, max_harvest_s = report_limits(job, now)
    kept: list[Obj] = []
    refused: list[str] = []
    for node, pod in sorted(pods_by_node.items()):
        raw = podlib.report(job_status, pod, REPORT_DRAFTER)
        if raw is None:
            continue
        ok, bad = checked_drafter_report(raw, exporting=node == export_node, export_dir=export_dir,
                                         max_harvest_s=max_harvest_s)
        kept.append(ok)
        refused += [f"pod {podlib.name(pod)}: {r}" for r in bad]
    return kept, refused


def summary(reports: list[Obj], previous: object, *, enabled: bool, degraded: bool, refused: int = 0) -> Obj:
    """status.drafter from the pods' checked drafter reports (`checked_reports`): state, active
    ranks, harvested seconds (sum), harvest efficiency and acceptance length (means), the exported
    artifact (the exporting pod's), the export gate's rejections by cause; a figure no pod reports keeps its previous value. `refused`:
    the report fields refused in this pass (status.drafter.reportFieldsRefused)."""
    prev: Obj = previous if isinstance(previous, dict) else {}
    artifact = next((r["artifact"] for r in reports if r.get("artifact")),
                    prev.get("artifact") if isinstance(prev.get("artifact"), str) else "")
    harvested = [r["harvestedSeconds"] for r in reports if "harvestedSeconds" in r]
    efficiency = [r["harvestEfficiency"] for r in reports if "harvestEfficiency" in r]
    acceptance = [r["acceptanceLength"] for r in reports if "acceptanceLength" in r]
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
            "artifact": artifact, "reportFieldsRefused": refused,
            "exportsRejectedByCause": counts_by_cause(reports, prev, "exportsRejectedByCause", EXPORT_REJECT_CAUSES),
            "combineAdjustedByCause": counts_by_cause(reports, prev, "combineAdjustedByCause", COMBINE_ADJUST_CAUSES)}


# Bound of a reported count by cause: the CRD's integer (int32); a larger one is not a drafter's.
MAX_REJECTIONS = 2**31 - 1


def counts_by_cause(reports: list[Obj], previous: Obj, field: str, causes: tuple[str, ...]) -> dict[str, int]:
    """status.drafter.<field>: per cause, the sum of the pods' drafter reports' counts (field
    exportsRejectedByCause: the exporting rank's gate, names.EXPORT_REJECT_CAUSES; combineAdjustedByCause:
    the fleet's coordinator, names.COMBINE_ADJUST_CAUSES). A count that is not an integer in
    [0, MAX_REJECTIONS], or of another cause, is not read; with no pod reporting any, the previous ones."""
    total = dict.fromkeys(causes, 0)
    seen = False
    for r in reports:
        by = r.get(field)
        if not isinstance(by, dict):
            continue
        seen = True
        for cause in causes:
            n = by.get(cause)
            if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_REJECTIONS:
                total[cause] = min(total[cause] + n, MAX_REJECTIONS)
    if seen:
        return total
    before = previous.get(field)
    before = before if isinstance(before, dict) else {}
    return {c: n if isinstance(n := before.get(c), int) and not isinstance(n, bool) and 0 <= n <= MAX_REJECTIONS
            else 0 for c in causes}
