"""Fault containment: classify why a rank's pod lost a container, and map it to a failurePolicy action.

Under MPS every client of a GPU shares one server: a fatal GPU fault in one client (say the
drafter) terminates every client on that GPU, the target included. The operator therefore has to
tell three things apart, from nothing but the pod's status:

- a **drafter fault**: the drafter sidecar exited non-zero (or was OOM-killed) while the target
  kept running. The kubelet restarts the sidecar (restartPolicy Always). Never fails the job.
- a **target fault**: the target exited non-zero on its own.
- an **MPS loss**: the ``mps-daemon`` sidecar (PodLocalMPS) terminated, or target and drafter died
  together (finishedAt within ``MPS_LOSS_WINDOW_S``) both with GPU-fault exits. When the drafter
  died first, or only the target reports being terminated by the MPS server, the loss is
  attributed to the drafter (``caused_by_drafter``). In SingleContainer mode the supervisor
  writes its verdict (JSON, spectrain_api.verdict) as the target container's
  termination message and that verdict is used instead.

Exit-code conventions (spectrain_api.names defines them; the workloads follow them):

| code | meaning |
|---|---|
| 0 | success (not a fault) |
| 1 | uncaught error (a bug, bad data...) |
| 2 | ``EXIT_CONFIG``: configuration error, the spec cannot run; a target's exit 2 fails the job (reason ConfigError, no restart) unless a rule matches it |
| 86 | ``EXIT_GPU_FAULT``: the process caught a CUDA / MPS error (cudaErrorMps*, illegal address...) |
| 128+N | killed by signal N: 134 SIGABRT and 139 SIGSEGV (CUDA driver aborts count as GPU faults), 137 SIGKILL (reason OOMKilled: out of memory), 143 SIGTERM |
| -1 | ``EXIT_UNKNOWN``: the pod failed with no container exit (eviction, node lost); rules are not consulted |

Reasons (``PodFault.reason``): TargetFailed, TargetOOMKilled, DrafterFailed, DrafterOOMKilled,
MPSDaemonLost, MPSServerLost, PodFailed.

`action_for(fault, job)` returns one of ``FailJob``, ``RestartJob``, ``RestartJobIgnoreMax``,
``RestartWithoutDrafter`` (the API's failurePolicy actions), ``Ignore`` (nothing to do now:
the kubelet restarts the drafter sidecar), ``DisableDrafter`` (a drafter fault past
``drafter.maxFailures``, or a drafter rule saying FailJob / RestartWithoutDrafter: the drafter is
disabled in place, the target's pods are neither deleted nor restarted; only a default, a rule
cannot name it) or ``ConfigError`` (the default for a target's exit 2: fail the job now with reason
ConfigError, never restart it, since the same spec fails the same way; only a default, a rule
cannot name it). A drafter's ``EXIT_PEER_FRAME`` (87: a peer's frame ended it) is always
``Ignore``: it is counted apart (status.drafterPeerFailures) and never toward maxFailures. It does not count restarts: applying maxRestarts to RestartJob is the caller's job.
The workloads write their fatal error line as the termination message
(spectrain_api.exitcodes.write_termination_message; the builders set
``terminationMessagePolicy: FallbackToLogsOnError``, so without one the kubelet puts the log's tail
there): ``PodFault.message`` carries it.
Classification is stateless: a drafter fault stays visible in ``lastState`` after the sidecar
restarts, so the caller sees it on every pass; ``Ignore`` is idempotent and ``restarts`` tells
the passes apart. ``restarts`` counts the terminations so far (``terminations``): the kubelet
raises restartCount only when it starts the container again, after a back-off of up to 5 min,
so a crash not yet restarted is added to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from spectrain_api.exitcodes import GPU_FAULT_TEXT
from spectrain_api.names import EXIT_CONFIG, EXIT_OK, EXIT_PEER_FRAME, GPU_FAULT_EXIT_CODES, MPS_LOSS_WINDOW_S
from spectrain_api.verdict import SupervisorVerdict
from spectrain_operator.objects import DRAFTER, MPS_DAEMON, TARGET
from spectrain_operator.pods import (
    container_status,
    is_deleted,
    last_termination,
    parse_time,
)

MPS = "mps"  # PodFault.container of an MPS loss (TARGET, DRAFTER: the containers' names)

EXIT_UNKNOWN = -1


FAIL_JOB = "FailJob"
RESTART_JOB = "RestartJob"
RESTART_JOB_IGNORE_MAX = "RestartJobIgnoreMax"
RESTART_WITHOUT_DRAFTER = "RestartWithoutDrafter"
IGNORE = "Ignore"
CONFIG_ERROR = "ConfigError"  # default for a target's EXIT_CONFIG: fail now, reason ConfigError
DISABLE_DRAFTER = "DisableDrafter"  # drafter faults: disable the drafter in place, the target untouched
ACTIONS = (FAIL_JOB, RESTART_JOB, RESTART_JOB_IGNORE_MAX, RESTART_WITHOUT_DRAFTER)  # what rules may say
MAX_ERROR_LINE_CHARS = 1000

# What a client sees when the MPS server terminated it for another client's fault (CUDA error 810,
# cudaErrorMpsClientTerminated): marks the collateral victim, not the culprit.
_MPS_COLLATERAL_TEXT = re.compile(r"MpsClientTerminated|client has been terminated", re.IGNORECASE)



@dataclass(frozen=True)
class PodFault:
    """Why a rank's pod lost a container. `container`: 'target' | 'drafter' | 'mps'."""

    container: str
    exit_code: int
    reason: str
    message: str
    restarts: int = 0  # the culprit container's terminations so far (`terminations`; drafter faults: own failures)
    caused_by_drafter: bool = False  # MPS loss the drafter triggered


@dataclass(frozen=True)
class _Exit:
    exit_code: int
    reason: str
    message: str
    finished: datetime | None
    restarts: int


def unrestarted(status: dict | None) -> bool:
    """Whether the container's latest termination is not in its restartCount yet. The kubelet
    raises restartCount only when it starts the container again (after a back-off of up to 5 min);
    until then the crash shows as state.terminated, or as state.waiting CrashLoopBackOff with the
    crash in lastState.terminated. (Other waiting reasons after a crash, ContainerCreating say,
    may already belong to the next attempt, whose restartCount counts it.)"""
    state = (status or {}).get("state")
    if not isinstance(state, dict):
        return False
    if isinstance(state.get("terminated"), dict) and state["terminated"]:
        return True
    waiting = state.get("waiting")
    last = (status or {}).get("lastState")
    return (isinstance(waiting, dict) and waiting.get("reason") == "CrashLoopBackOff"
            and isinstance(last, dict) and isinstance(last.get("terminated"), dict) and bool(last["terminated"]))


def terminations(status: dict | None) -> int:
    """How many times the container has terminated: restartCount, plus its latest termination while
    that one is not restarted yet (`unrestarted`)."""
    restarts = (status or {}).get("restartCount")
    count = restarts if isinstance(restarts, int) and not isinstance(restarts, bool) and restarts >= 0 else 0
    return count + (1 if unrestarted(status) else 0)


def termination_id(term: dict, restarts: int) -> str:
    """What tells one termination of a container from another across passes (the same one is seen
    in state.terminated, then in lastState): its finishedAt, else its containerID (of the dead
    container), else the restartCount it was seen with; at most 64 characters."""
    return str(term.get("finishedAt") or term.get("containerID") or f"restart-{restarts}")[-64:]


def _last_exit(status: dict | None) -> _Exit | None:
    """The container's most recent termination: the current state, else lastState."""
    term = last_termination(status)
    if status is None or term is None:
        return None
    return _Exit(int(term.get("exitCode", EXIT_UNKNOWN)), str(term.get("reason") or ""),
                 str(term.get("message") or ""), parse_time(term.get("finishedAt")),
                 terminations(status))


def _is_gpu_fault(e: _Exit) -> bool:
    return e.exit_code in GPU_FAULT_EXIT_CODES or bool(GPU_FAULT_TEXT.search(e.message))


def _shutdown(e: _Exit, t: _Exit | None) -> bool:
    """True when a sidecar's exit is the kubelet stopping it after the target ended (pod shutdown).

    Kubernetes timestamps have one-second resolution: an exit in the target's second counts as
    shutdown unless it looks like a GPU fault (then it may be the MPS loss that killed both).
    """
    if t is None or e.finished is None or t.finished is None:
        return False
    if e.finished > t.finished:
        return True
    return e.finished == t.finished and not _is_gpu_fault(e)


def _target_exit(pod: dict) -> _Exit | None:
    """The target's termination while it is terminated (None while it runs or has not started)."""
    t_status = container_status(pod, TARGET)
    return _last_exit(t_status) if t_status is not None and (t_status.get("state") or {}).get("terminated") else None


def stopped_at_shutdown(pod: dict, sidecar: dict | None) -> bool:
    """Whether the sidecar's latest termination is the kubelet stopping it after the target ended
    (pod shutdown, `_shutdown`): no failure of its own."""
    e = _last_exit(sidecar)
    return e is not None and _shutdown(e, _target_exit(pod))


def _within(a: datetime | None, b: datetime | None, window_s: float) -> bool:
    if a is None or b is None:
        return False
    return abs((a - b).total_seconds()) <= window_s


def error_line(message: str, limit: int = MAX_ERROR_LINE_CHARS) -> str:
    """The workload's error line from a termination message: the message itself when the workload
    wrote one (one line), else, from a log tail (FallbackToLogsOnError), its last line naming a
    configuration error, else its last non-empty line; at most `limit` characters (head kept)."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    if not lines:
        return ""
    line = next((ln for ln in reversed(lines) if "configuration error" in ln), lines[-1])
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _describe(who: str, e: _Exit) -> str:
    text = f"{who} exited with code {e.exit_code}"
    if e.reason:
        text += f" ({e.reason})"
    if e.message and e.exit_code == EXIT_CONFIG:
        text += f": {error_line(e.message)}"
    elif e.message:
        text += f": {e.message.strip()[-400:]}"
    return text


def _from_verdict(t: _Exit, v: SupervisorVerdict) -> PodFault | None:
    cause = v.cause
    if t.exit_code == EXIT_OK and cause == "success":
        return None
    if cause == "mps-daemon":
        return PodFault(MPS, v.mps_exit_code if v.mps_exit_code is not None else t.exit_code, "MPSDaemonLost",
                        f"the MPS control daemon exited ({v.mps_exit_code}); the target exited {t.exit_code}",
                        t.restarts)
    if cause == "mps-by-drafter":
        code = v.last_drafter_exit_code if v.last_drafter_exit_code is not None else EXIT_UNKNOWN
        return PodFault(MPS, code, "MPSServerLost",
                        f"the drafter failed (exit {code}) and the MPS server took the target down with it "
                        f"(target exit {t.exit_code})", t.restarts, caused_by_drafter=True)
    if cause == "mps":
        return PodFault(MPS, t.exit_code, "MPSServerLost",
                        f"target exited {t.exit_code} with a GPU fault, together with the drafter", t.restarts)
    if t.exit_code == EXIT_OK:
        return None
    reason = "TargetOOMKilled" if t.reason == "OOMKilled" else "TargetFailed"
    text = f"target exited with code {t.exit_code}"
    if v.target_message and v.target_message.strip():
        text += f": {error_line(v.target_message)}"
    return PodFault(TARGET, t.exit_code, reason, text, t.restarts)


def classify_pod(pod: dict) -> PodFault | None:
    """The pod's fault, or None (running fine, succeeded, or being deleted)."""
    if is_deleted(pod):
        return None
    status = pod.get("status") or {}
    t = _target_exit(pod)
    d = _last_exit(container_status(pod, DRAFTER, init=True))
    m = _last_exit(container_status(pod, MPS_DAEMON, init=True))

    if t is not None:
        verdict = SupervisorVerdict.from_json(t.message)
        if verdict is not None:
            return _from_verdict(t, verdict)

    t_end = t.finished if t is not None else None
    if d is not None and (d.exit_code == EXIT_OK or _shutdown(d, t)):
        d = None
    if m is not None and _shutdown(m, t):
        m = None

    if m is not None:
        who = f"mps-daemon exited with code {m.exit_code}"
        tail = f"; {_describe('target', t)}" if t is not None and t.exit_code != EXIT_OK else ""
        return PodFault(MPS, m.exit_code, "MPSDaemonLost", who + (f": {m.message.strip()}" if m.message else "") + tail,
                        m.restarts)

    if t is not None and t.exit_code != EXIT_OK:
        if d is not None and _within(d.finished, t_end, MPS_LOSS_WINDOW_S) and _is_gpu_fault(t) and _is_gpu_fault(d):
            drafter_first = d.finished is not None and t_end is not None and d.finished < t_end
            same_time = not drafter_first and d.finished == t_end
            collateral = bool(_MPS_COLLATERAL_TEXT.search(t.message)) and not _MPS_COLLATERAL_TEXT.search(d.message)
            by_drafter = drafter_first or (same_time and collateral)
            code = d.exit_code if by_drafter else t.exit_code
            lead = "the drafter's GPU fault took down the MPS server's clients" if by_drafter else \
                "target and drafter died together with GPU faults (MPS server lost)"
            return PodFault(MPS, code, "MPSServerLost",
                            f"{lead}; {_describe('drafter', d)}; {_describe('target', t)}",
                            d.restarts if by_drafter else t.restarts, caused_by_drafter=by_drafter)
        reason = "TargetOOMKilled" if t.reason == "OOMKilled" else "TargetFailed"
        return PodFault(TARGET, t.exit_code, reason, _describe("target", t), t.restarts)

    if d is not None and d.exit_code != EXIT_OK:
        reason = "DrafterOOMKilled" if d.reason == "OOMKilled" else "DrafterFailed"
        return PodFault(DRAFTER, d.exit_code, reason, _describe("drafter", d), d.restarts)

    if status.get("phase") == "Failed" and (t is None or t.exit_code == EXIT_OK):
        if t is not None:  # target succeeded, pod still marked failed: nothing the target did wrong
            return None
        reason = str(status.get("reason") or "")
        return PodFault(TARGET, EXIT_UNKNOWN, "PodFailed",
                        f"pod failed without a target exit ({reason or 'no reason'}): {status.get('message', '')}".strip())
    return None


# ---------------------------------------------------------------------------------------------


def _rules(job: dict) -> list[dict]:
    spec = job.get("spec") or {}
    rules = (((spec.get("runPolicy") or {}).get("failurePolicy") or {}).get("rules")) or []
    return [r for r in rules if isinstance(r, dict)]


def _rule_matches(rule: dict, container: str, exit_code: int) -> bool:
    on = rule.get("onExitCodes")
    if not on:
        return True  # a rule without onExitCodes matches every fault
    if on.get("container") and on["container"] != container:
        return False
    values = {int(v) for v in on.get("values") or []}
    op = on.get("operator", "In")
    if op == "In":
        return exit_code in values
    if op == "NotIn":
        return exit_code not in values
    raise ValueError(
        f"spec.runPolicy.failurePolicy.rules[].onExitCodes.operator: {op!r} is not In or NotIn; fix the rule")


def _first_action(job: dict, container: str, exit_code: int) -> str | None:
    for i, rule in enumerate(_rules(job)):
        if _rule_matches(rule, container, exit_code):
            action = rule.get("action")
            if action not in ACTIONS:
                raise ValueError(
                    f"spec.runPolicy.failurePolicy.rules[{i}].action: {action!r} is not one of "
                    f"{', '.join(ACTIONS)}; fix the rule")
            return str(action)
    return None


def _drafter_safe(action: str) -> str:
    """An MPS loss the drafter caused never fails the job and never spends the target's restart
    budget (the target died too, so a restart is needed anyway)."""
    if action == FAIL_JOB:
        return RESTART_WITHOUT_DRAFTER
    if action == RESTART_JOB:
        return RESTART_JOB_IGNORE_MAX
    return action


def _drafter_in_place(action: str) -> str:
    """A drafter fault (the target still runs) never restarts the target unless a rule asks for a
    restart: FailJob and RestartWithoutDrafter disable the drafter in place (the latter drops the
    sidecar at the next restart the job needs anyway); RestartJob never spends the target's budget."""
    if action in (FAIL_JOB, RESTART_WITHOUT_DRAFTER):
        return DISABLE_DRAFTER
    if action == RESTART_JOB:
        return RESTART_JOB_IGNORE_MAX
    return action


def disable_reason(fault: PodFault, job: dict) -> str:
    """Why a drafter fault disabled the drafter (DrafterDegraded's reason, the pod annotation's
    value): the matching drafter rule's action, else TooManyFailures (drafter.maxFailures)."""
    return _first_action(job, DRAFTER, fault.exit_code) or "TooManyFailures"


def action_for(fault: PodFault, job: dict) -> str:
    """The failurePolicy action for `fault` (first matching rule wins; see the module docstring).

    - target faults: the first rule for container target (or without a container) matching the
      exit code; default RestartJob, but ConfigError for EXIT_CONFIG (2: the spec cannot run, a
      restart would fail the same way). EXIT_UNKNOWN (no exit code): RestartJob, rules not consulted.
    - drafter faults: EXIT_PEER_FRAME -> Ignore (rules not consulted: a peer's frame ended it);
      otherwise the first rule for the drafter, applied in place (FailJob, RestartWithoutDrafter ->
      DisableDrafter; RestartJob -> RestartJobIgnoreMax); without a rule, Ignore while
      `restarts < drafter.maxFailures`, then DisableDrafter. `fault.restarts` must count the
      drafter's own failures (policy/drafter.py subtracts the peer-frame exits from `terminations`). Exit 2
      included: a drafter's configuration error costs the job its drafter, never the job.
    - MPS losses caused by the drafter: the first rule for the drafter matching its exit code,
      made drafter-safe (so a rule can say RestartWithoutDrafter); default RestartJob.
      Other MPS server losses: target rules on the target's exit code; default RestartJob.
      MPS daemon losses: RestartJob.
    """
    if fault.container == DRAFTER:
        if fault.exit_code == EXIT_PEER_FRAME:
            return IGNORE
        action = _first_action(job, DRAFTER, fault.exit_code)
        if action is not None:
            return _drafter_in_place(action)
        max_failures = int(((job.get("spec") or {}).get("drafter") or {}).get("maxFailures", 3))
        return DISABLE_DRAFTER if fault.restarts >= max_failures else IGNORE
    if fault.container == MPS:
        if fault.caused_by_drafter:
            action = _first_action(job, DRAFTER, fault.exit_code)
            return _drafter_safe(action) if action is not None else RESTART_JOB
        if fault.reason == "MPSDaemonLost":
            return RESTART_JOB
        return _first_action(job, TARGET, fault.exit_code) or RESTART_JOB
    if fault.container == TARGET:
        if fault.exit_code == EXIT_UNKNOWN:
            return RESTART_JOB
        default = CONFIG_ERROR if fault.exit_code == EXIT_CONFIG else RESTART_JOB
        return _first_action(job, TARGET, fault.exit_code) or default
    raise ValueError(f"PodFault.container: {fault.container!r} is not target, drafter or mps")
