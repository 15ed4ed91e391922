"""The reconcile policies status.decide composes, one concern per module; all pure (no API calls).

- plan.py: the output of a pass: `Plan`, `Event`, `Conditions`, a policy's `Outcome`;
- context.py: the input of a pass: the job, the status carried over (parsed defensively), the
  pods by role (`PodSet`), together the `Context` every policy takes;
- lifecycle.py: spec errors, terminal phases, activeDeadlineSeconds, suspend/resume, success,
  the phase's Event, ttlSecondsAfterFinished;
- failures.py: the current pods' faults -> the failurePolicy action applied (fail, restart,
  disable the drafter in place);
- restart.py: gang restarts and their exponential backoff; pods deleted or evicted after
  creation -> an immediate restart;
- drafter.py: drafter crash accounting, disabled in place or at the next restart, its summary;
- progress.py: creating the missing pods, Pending/Starting/Running, Kueue's admission gate; the
  progress, ranks and informational conditions of the status.

Pod accessors live in spectrain_operator.pods.
"""
