"""The local backend's supervision: run the processes `local_layout.plan` made from the builders'
pods, as the kubelet and the operator would on a cluster.

Native sidecars (init containers with restartPolicy Always) start first and are restarted when
they exit, like the kubelet does; the job's exit code is the targets' outcome. A drafter past
drafter.maxFailures (or matched by a drafter failurePolicy rule that disables it) is disabled in
place as on a cluster: every pod's control file (the downward-API file of its annotations,
`pods/<pod>/podinfo/annotations`, in the kubelet's `key="value"` format) gets
ANNOTATION_DRAFTER_DISABLED, the sidecar is restarted once more and idles, and `status.json` says
`drafterDisabled` with a DrafterDegraded condition. Exits with EXIT_PEER_FRAME are counted apart.
Targets are never restarted: the first failing target stops the run, which ends Failed with the
reason the operator's failure policy gives its exit (a target's exit 2 without a matching rule:
ConfigError) and the workload's termination message (SPECTRAIN_TERMINATION_LOG, a file per
container under `logs/`), on stderr and in `status.json` of the run dir.

Torch-free: the workloads run in child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spectrain_api.exitcodes import returncode_to_exit
from spectrain_api.names import (
    ANNOTATION_DRAFTER_DISABLED,
    ENV_DRAFTER_CONTROL,
    EXIT_PEER_FRAME,
)
from spectrain_operator import faults
from spectrain_operator.local_layout import (
    GRACE_S,
    LocalContainer,
    LocalRun,
    load_manifest,
    plan,
    write_control_file,
)
from spectrain_operator.progress import ProgressView


def _start(c: LocalContainer) -> None:
    if c.termination_log is not None:   # fresh for every start, like the kubelet's per container
        with contextlib.suppress(OSError):
            c.termination_log.unlink()
    with open(c.log, "ab") as log:
        c.proc = subprocess.Popen(c.argv, env=c.env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)


def _signal(c: LocalContainer, sig: int) -> None:
    if c.proc is not None and c.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, sig)


def _stop_all(cs: list[LocalContainer], grace_s: float) -> None:
    for c in cs:
        _signal(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in cs:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(c, signal.SIGKILL)
            c.proc.wait()


def _termination_message(c: LocalContainer) -> str:
    if c.termination_log is None:
        return ""
    try:
        return c.termination_log.read_text(errors="replace")[:4096]
    except OSError:
        return ""


def failure_outcome(run: LocalRun, c: LocalContainer) -> dict[str, Any]:
    """What the operator's status would say about target `c`'s exit (no restarts here): the fault
    classified from a pod status carrying its exit code and termination message, the reason from
    the failure policy (ConfigError for an exit 2 no rule matches)."""
    code = returncode_to_exit(int(c.exit_code if c.exit_code is not None else 1))
    pod = {"metadata": {"name": c.pod}, "status": {"phase": "Failed", "containerStatuses": [{
        "name": "target", "restartCount": 0,
        "state": {"terminated": {"exitCode": code, "reason": "Error", "message": _termination_message(c)}}}]}}
    fault = faults.classify_pod(pod) or faults.PodFault(faults.TARGET, code, "TargetFailed",
                                                        f"target exited with code {code}")
    try:
        action = faults.action_for(fault, run.job)
    except ValueError as exc:
        return {"phase": "Failed", "reason": "SpecInvalid", "message": str(exc), "exitCode": code}
    reason = {faults.CONFIG_ERROR: "ConfigError", faults.FAIL_JOB: "FailedByPolicy"}.get(action, fault.reason)
    return {"phase": "Failed", "reason": reason, "message": f"{c.pod}: {fault.message}", "exitCode": code}


def _sidecar_exited(run: LocalRun, c: LocalContainer) -> bool:
    """Count a sidecar's exit; whether to start it again. A drafter's exit never fails the job; the
    operator's policy (faults.action_for) decides when it is disabled in place: then every pod's
    control file says so, and each drafter is started at most once more (it reads the file and
    idles). Other sidecars are restarted up to drafter.maxFailures times, as before."""
    assert c.proc is not None
    code = returncode_to_exit(int(c.proc.returncode))
    c.proc = None
    if c.name != faults.DRAFTER:
        c.failures += 1
        return c.failures <= run.max_sidecar_restarts
    _count(c, code)
    if run.drafter_off is not None:   # disabled: one more start (it reads the control file and idles)
        c.starts_after_off += 1
        return c.starts_after_off <= 1
    fault = faults.PodFault(faults.DRAFTER, code, "DrafterFailed", f"drafter exited with code {code}",
                            restarts=c.failures)
    try:
        action = faults.action_for(fault, run.job)
        why = faults.disable_reason(fault, run.job) if action == faults.DISABLE_DRAFTER else ""
    except ValueError as exc:   # spec.validate checked the rules; keep the drafter restarting
        sys.stderr.write(f"{c.pod}/{c.name}: {exc}\n")
        return True
    if action == faults.DISABLE_DRAFTER:
        c.starts_after_off = 1
        disable_drafter(run, why, f"{c.pod}: drafter exited with code {code}, {c.failures} failure(s) "
                                  f"(maxFailures {run.max_sidecar_restarts}); disabled in place, the target "
                                  "keeps running")
    return True


def _count(c: LocalContainer, code: int) -> None:
    if code == EXIT_PEER_FRAME:
        c.peer_failures += 1
    else:
        c.failures += 1


def disable_drafter(run: LocalRun, reason: str, message: str) -> None:
    """Disable every drafter of the run in place: the annotation in each pod's control file."""
    run.drafter_off = {"reason": reason, "message": message}
    for path in sorted({c.env[ENV_DRAFTER_CONTROL] for c in run.sidecars if ENV_DRAFTER_CONTROL in c.env}):
        write_control_file(Path(path), {ANNOTATION_DRAFTER_DISABLED: reason})
    sys.stderr.write(f"drafter disabled ({reason}): {message}\n")


def _drafter_status(run: LocalRun) -> dict[str, Any]:
    """The status fields of the run's drafters (as the operator's status names them)."""
    drafters = [c for c in run.sidecars if c.name == faults.DRAFTER]
    out: dict[str, Any] = {"drafterDisabled": run.drafter_off is not None,
                           "drafterFailures": max((c.failures for c in drafters), default=0),
                           "drafterPeerFailures": sum(c.peer_failures for c in drafters)}
    if run.drafter_off is not None:
        out["conditions"] = [{"type": "DrafterDegraded", "status": "True", **run.drafter_off}]
    return out


def _finish(run: LocalRun, outcome: dict[str, Any]) -> None:
    outcome = {**outcome, **_drafter_status(run)}
    run.outcome = outcome
    with contextlib.suppress(OSError):
        (run.run_dir / "status.json").write_text(json.dumps(outcome, indent=2))


def execute(run: LocalRun, *, view: ProgressView | None = None, poll_s: float = 0.2) -> int:
    """Run to completion. Returns 0 when every target exited 0, else the first failing code.
    `run.outcome` (and status.json in the run dir) says Succeeded or Failed with the reason."""
    stopping = False
    with contextlib.suppress(OSError):
        (run.run_dir / "status.json").unlink()   # a --resume starts without the last run's outcome

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    old = signal.signal(signal.SIGINT, on_sigint)
    old_term = signal.signal(signal.SIGTERM, on_sigint)
    try:
        for c in run.sidecars:      # native sidecars start before the main containers
            _start(c)
        for c in run.targets:
            _start(c)
        while True:
            if stopping:
                # Ctrl-C: targets checkpoint on SIGTERM and exit; then the sidecars.
                _stop_all(run.targets, GRACE_S)
                _stop_all(run.sidecars, GRACE_S)
                return 130
            for c in run.targets:
                if c.exit_code is None and c.proc is not None and c.proc.poll() is not None:
                    c.exit_code = c.proc.returncode
            failed = [c for c in run.targets if c.exit_code not in (None, 0)]
            if failed:
                # One rank failed: the gang stops (the operator restarts the whole job).
                _stop_all(run.targets, GRACE_S)
                _stop_all(run.sidecars, GRACE_S)
                for c in failed:
                    sys.stderr.write(f"{c.pod}/{c.name} exited {c.exit_code}; log: {c.log}\n")
                outcome = failure_outcome(run, failed[0])
                _finish(run, outcome)
                sys.stderr.write(f"job Failed ({outcome['reason']}): {outcome['message']}\n")
                return int(failed[0].exit_code or 1)
            if all(c.exit_code == 0 for c in run.targets):
                _stop_all(run.sidecars, GRACE_S)
                _finish(run, {"phase": "Succeeded", "reason": "Completed", "exitCode": 0,
                              "message": f"all {len(run.targets)} target container(s) exited 0"})
                return 0
            for c in run.sidecars:
                if c.proc is not None and c.proc.poll() is not None and _sidecar_exited(run, c):
                    c.restarts += 1      # restart it like the kubelet would
                    _start(c)
            if view is not None:
                view.refresh()
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, old_term)
        if view is not None:
            view.close()
        shutil.rmtree(run.shm_dir, ignore_errors=True)


def run_job(path: str | Path, run_dir: Path, *, resume: bool = False, drafter: bool = True,
            live: bool = True, env_overrides: dict[str, str] | None = None) -> int:
    manifest = load_manifest(path)
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise SystemExit(f"--run-dir {run_dir} already holds a run: pass --resume to continue it, "
                         "or choose another directory")
    run = plan(manifest, run_dir, drafter=drafter, env_overrides=env_overrides)
    data_dirs = json.loads((run_dir / "layout.json").read_text())["data_dirs"]
    view = ProgressView(Path(data_dirs[0]), live=live) if data_dirs else None
    return execute(run, view=view)


def run_main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir or f"runs/{Path(args.file).stem}")
    live = sys.stdout.isatty() and not getattr(args, "quiet", False)
    t0 = time.monotonic()
    if getattr(args, "baseline", False):
        # The same job with the drafter off, so the report can compare target step times.
        base_dir = run_dir / "baseline"
        print(f"baseline run (drafter off) -> {base_dir}")
        code = run_job(args.file, base_dir, resume=args.resume, drafter=False, live=live)
        if code != 0:
            return code
    print(f"run -> {run_dir}")
    code = run_job(args.file, run_dir, resume=args.resume or getattr(args, "baseline", False),
                   live=live)
    print(f"job finished with exit code {code} in {time.monotonic() - t0:.0f} s")
    volumes = json.loads((run_dir / "layout.json").read_text())["data_dirs"]
    print(f"run volume{'s' if len(volumes) > 1 else ''}: {', '.join(volumes)}")
    if code == 0 and getattr(args, "report", False):
        from spectrain_workloads import report  # lazy: needs matplotlib

        out = report.build_report(run_dir)
        report.print_headline(run_dir, out)
    return code
