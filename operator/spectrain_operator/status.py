"""Pure reconcile logic: (job, its pods, now) -> a Plan (the new status, pods to create and delete,
Events, whether to delete the job, when to look again). No API calls: kube.py executes the plan and
handlers.py wires it to kopf. `decide` composes the policies of spectrain_operator.policy, one
concern per module; the first that applies, in this order, settles the phase (API.md's lifecycle):

1. spec errors (CEL/semantic/missing claims) -> Failed + SpecInvalid, nothing created (lifecycle);
2. Succeeded / Failed are terminal; ttlSecondsAfterFinished then deletes the job (lifecycle);
3. activeDeadlineSeconds (from status.startTime) -> Failed/DeadlineExceeded (lifecycle);
4. suspend deletes the pods and keeps the rest; resume recreates them, the workloads resume from
   their last checkpoint (lifecycle);
5. a pending restart waits out its backoff (restart);
6. failures of the current pods (failures): a target failure restarts the whole job (gang): a new
   restart generation, exponential backoff, up to runPolicy.maxRestarts; failurePolicy rules
   through faults.action_for (FailJob, RestartJob, RestartJobIgnoreMax, RestartWithoutDrafter); a
   target's exit 2 (configuration error) that no rule matches: Failed/ConfigError at once, no
   restart, the workload's error line (its termination message) in the condition; drafter
   failures never fail the job and never restart the target: counted, and past
   drafter.maxFailures (or by a drafter rule FailJob / RestartWithoutDrafter) the drafter is
   disabled in place (DrafterDegraded and status.drafterDisabled, which the sidecars read through
   the status path and then idle); the next restart the job needs anyway builds pods without it
   (drafter). Exits with EXIT_PEER_FRAME (a peer's frame ended the drafter) are counted apart
   (drafterPeerFailures);
7. Succeeded when every target container exited 0 and its pod has finished (lifecycle);
8. pods deleted or evicted by someone else: an immediate restart, not counted against
   maxRestarts (restart); whatever the phase, a deleted pod whose kubelet never confirmed it (a
   lost node) is force-deleted once well past its grace period (restart.force_overdue);
9. otherwise missing pods are created and the phase follows the pods: Pending, Starting, Running
   (progress).

State that must survive an operator restart lives in the status (restarts, restartGeneration,
restartAt, podsCreated, drafterDisabled, drafterDisabledGeneration, drafterPeerFrames); every field
is parsed defensively (policy/context.py), so a status written by a user, or by the job's own pods
(whose Role lets them write status.reports), cannot crash the operator.
"""

from __future__ import annotations

from datetime import datetime

from spectrain_api.names import PHASES
from spectrain_operator.objects import Obj
from spectrain_operator.pods import fmt_time
from spectrain_operator.policy import drafter, failures, lifecycle, progress, restart
from spectrain_operator.policy.context import Context, prune
from spectrain_operator.policy.plan import TERMINAL, Conditions, Event, Outcome, Plan
from spectrain_operator.policy.restart import MAX_BACKOFF_S, backoff_seconds

# What kube.py, reconciler.py and the tests take from here.
__all__ = ["MAX_BACKOFF_S", "PHASES", "RECONCILE_ERROR", "TERMINAL", "Conditions", "Event", "Plan",
           "backoff_seconds", "decide", "fmt_time"]

# Condition (and Warning Event) of a pass that raised (reconciler.py); a pass that gets as far as a
# decision clears it.
RECONCILE_ERROR = "ReconcileError"


def decide(job: Obj, pods: list[Obj], now: datetime, spec_errors: list[str] | None = None) -> Plan:
    """What to do for `job` (defaulted) given the pods carrying its label, at time `now`."""
    ctx = Context.of(job, pods, now)
    # drafter crashes: peer-frame exits counted apart; the rest are the drafter's own failures
    own_failures = drafter.count_crashes(ctx) if ctx.pods.current and ctx.drafter_enabled else {}
    outcome = _outcome(ctx, spec_errors, own_failures)
    restart.force_overdue(ctx)
    drafter.carry_disabled(ctx)
    progress.mark_queued(ctx, outcome.phase)
    progress.summarize(ctx)
    drafter.never_trained(ctx, outcome.phase)
    ctx.status["phase"] = outcome.phase
    ctx.conds.clear(RECONCILE_ERROR, "Reconciled", "the operator's last pass succeeded")
    ctx.status["conditions"] = ctx.conds.as_list()
    lifecycle.announce(ctx, outcome)
    lifecycle.expire(ctx, outcome.phase)
    prune(ctx.status)
    return ctx.plan


def _outcome(ctx: Context, spec_errors: list[str] | None, own_failures: dict[int, int]) -> Outcome:
    """The first policy, in order of precedence, that settles the phase."""
    if spec_errors:
        return lifecycle.spec_invalid(ctx, spec_errors)
    gate = lifecycle.stay_terminal(ctx) or lifecycle.past_deadline(ctx) or lifecycle.suspended(ctx)
    if gate is not None:
        return gate
    lifecycle.resume(ctx)
    # each policy returns None when it does not apply (an Outcome, a 3-tuple, is never falsy)
    return (restart.wait_backoff(ctx)
            or failures.handle(ctx, own_failures)
            or lifecycle.succeeded(ctx)
            or restart.replace_missing(ctx)
            or progress.come_up(ctx))
