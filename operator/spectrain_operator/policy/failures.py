"""Failures of the current pods -> what the job does: faults.classify_pod says what failed,
faults.action_for what runPolicy.failurePolicy makes of it, and this module applies it:

| action | the job |
|---|---|
| Ignore | nothing (the kubelet restarts the drafter sidecar) |
| DisableDrafter | keeps running; the drafter is disabled in place (policy/drafter.py) |
| ConfigError | Failed/ConfigError now, no restart (the same spec fails the same way) |
| FailJob | Failed/FailedByPolicy |
| RestartJob, RestartWithoutDrafter | a gang restart counted towards maxRestarts (not when the drafter caused it); past maxRestarts Failed/BackoffLimitExceeded |
| RestartJobIgnoreMax | a gang restart not counted |

Pods are looked at by node index; the first fault that does more than Ignore or DisableDrafter
decides the pass.
"""

from __future__ import annotations

import dataclasses

from spectrain_operator import faults, objects
from spectrain_operator.objects import Obj
from spectrain_operator.policy import drafter, lifecycle, restart
from spectrain_operator.policy.context import Context
from spectrain_operator.policy.plan import MAX_MESSAGE_CHARS, Outcome

COUNTED_ACTIONS = (faults.RESTART_JOB, faults.RESTART_WITHOUT_DRAFTER)  # spend the maxRestarts budget


def _fault(pod: Obj, node: int, own_failures: dict[int, int]) -> faults.PodFault | None:
    """The pod's fault; a drafter fault counts the drafter's own failures (drafter.count_crashes),
    which is what drafter.maxFailures limits."""
    fault = faults.classify_pod(pod)
    if fault is not None and fault.container == faults.DRAFTER:
        fault = dataclasses.replace(fault, restarts=own_failures.get(node, fault.restarts))
    return fault


def handle(ctx: Context, own_failures: dict[int, int]) -> Outcome | None:
    """The outcome of the current pods' failures, or None when none needs more than the drafter
    disabled in place."""
    for node, pod in sorted(ctx.pods.current.items()):
        fault = _fault(pod, node, own_failures)
        if fault is None:
            continue
        try:
            action = faults.action_for(fault, ctx.job)
        except ValueError as exc:   # a failurePolicy rule the schema let through cannot be applied
            return lifecycle.finish(ctx, False, "SpecInvalid", str(exc), ctx.pods.current_names())
        text = f"{objects.pod_name(ctx.job, node)}: {fault.message or fault.reason}"
        if action == faults.IGNORE:
            continue
        if action == faults.DISABLE_DRAFTER:
            drafter.disable_in_place(ctx, fault, text)
            continue
        return _apply(ctx, fault, action, text)
    return None


def _apply(ctx: Context, fault: faults.PodFault, action: str, text: str) -> Outcome:
    """Fail the job or restart it for `fault` under `action` (neither Ignore nor DisableDrafter)."""
    st = ctx.status
    if action == faults.CONFIG_ERROR:
        st["lastFailure"] = text[:MAX_MESSAGE_CHARS]
        return lifecycle.finish(ctx, False, "ConfigError", text, ctx.pods.current_active())
    if action == faults.FAIL_JOB:
        return lifecycle.finish(ctx, False, "FailedByPolicy", f"{text} (failurePolicy: FailJob)",
                                ctx.pods.current_active())
    by_drafter = fault.container == faults.DRAFTER or fault.caused_by_drafter
    counted = action in COUNTED_ACTIONS and not by_drafter
    max_restarts = int(ctx.run_policy["maxRestarts"])
    if counted and st["restartsTowardsMax"] >= max_restarts:
        st["lastFailure"] = text[:MAX_MESSAGE_CHARS]
        return lifecycle.finish(ctx, False, "BackoffLimitExceeded", f"{text}; maxRestarts {max_restarts} reached",
                                ctx.pods.current_active())
    return restart.restart(ctx, fault.reason or "TargetFailed", text, counted=counted,
                           without_drafter=action == faults.RESTART_WITHOUT_DRAFTER)
