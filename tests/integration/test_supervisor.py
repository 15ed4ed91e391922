"""spectrain-supervisor (SingleContainer mode) supervising real processes: python stand-ins for the
MPS daemon, the drafter and the target. Synchronisation goes through files and /proc, never sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spectrain_api import names
from spectrain_operator import faults
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

TIMEOUT = 60


def script(tmp: Path, name: str, body: str) -> list[str]:
    path = tmp / f"{name}.py"
    prelude = textwrap.dedent("""\
        import os, signal, sys, time
        from pathlib import Path
        D = Path(sys.argv[1])
        def wait_until(cond, what, timeout=50):
            deadline = time.monotonic() + timeout
            while not cond():
                if time.monotonic() > deadline:
                    sys.stderr.write("stand-in timed out waiting for " + what + "\\n"); sys.exit(99)
                time.sleep(0.01)
        def reaped(pid):  # the supervisor collected this child's exit status
            return not os.path.exists(f"/proc/{pid}")
        def starts(name):
            p = D / name
            return p.read_text().split() if p.exists() else []
        def record_start(name):
            with open(D / name, "a") as f:
                f.write(f"{os.getpid()}\\n")
        """)
    path.write_text(prelude + textwrap.dedent(body))
    return [sys.executable, str(path), str(tmp)]


MPS_DAEMON = """
    def stop(*_):
        (D / "mps-stopped").write_text("1"); sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    (D / "mps-ready").write_text("1")
    while True:
        signal.pause()
"""
MPS_READY = """
    sys.exit(0 if (D / "mps-ready").exists() else 1)
"""
DRAFTER_FOREVER = """
    record_start("drafter-starts")
    def stop(*_):
        (D / "drafter-terminated").write_text("1"); sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30", "drafter env applied"
    while True:
        signal.pause()
"""


def run_supervisor(tmp: Path, target: list[str], *, drafter: list[str] | None = None, mps: bool = True,
                   mps_cmd: list[str] | None = None, max_failures: int = 3, backoff_s: float = 0.0,
                   ready_timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "spectrain_workloads.supervisor",
            "--termination-log", str(tmp / "termination-log"), "--stop-grace-s", "10",
            "--drafter-backoff-s", str(backoff_s), "--drafter-max-failures", str(max_failures),
            "--mps-ready-timeout-s", str(ready_timeout_s)]
    if mps:
        argv += ["--mps-command", json.dumps(mps_cmd or script(tmp, "mps", MPS_DAEMON)),
                 "--mps-ready-command", json.dumps(script(tmp, "ready", MPS_READY))]
    if drafter:
        argv += ["--drafter-command", json.dumps(drafter),
                 "--drafter-env", json.dumps({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"})]
    return subprocess.Popen([*argv, "--", *target])


def verdict(tmp: Path) -> dict:
    data: dict = json.loads((tmp / "termination-log").read_text())["spectrainSupervisor"]
    return data


def finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_exit_code_is_the_targets_and_mps_brackets_the_run(tmp_path: Path) -> None:
    target = script(tmp_path, "target", """
        if not (D / "mps-ready").exists():
            sys.exit(9)  # started before the MPS daemon was ready
        wait_until(lambda: starts("drafter-starts"), "the drafter")
        sys.exit(3)
    """)
    proc = run_supervisor(tmp_path, target, drafter=script(tmp_path, "drafter", DRAFTER_FOREVER))
    assert finish(proc) == 3
    v = verdict(tmp_path)
    assert v["cause"] == "target" and v["targetExitCode"] == 3 and v["drafterFailures"] == 0
    assert (tmp_path / "drafter-terminated").exists(), "the drafter is stopped when the target ends"
    assert (tmp_path / "mps-stopped").exists(), "the MPS daemon is stopped last"


def test_drafter_restarted_until_max_failures_then_target_carries_on(tmp_path: Path) -> None:
    drafter = script(tmp_path, "drafter", """
        record_start("drafter-starts")
        sys.exit(1)
    """)
    target = script(tmp_path, "target", """
        wait_until(lambda: len(starts("drafter-starts")) >= 3 and reaped(int(starts("drafter-starts")[2])),
                   "the third drafter failure")
        (D / "target-done").write_text("1")
        sys.exit(0)
    """)
    proc = run_supervisor(tmp_path, target, drafter=drafter, max_failures=2)
    assert finish(proc) == 0
    v = verdict(tmp_path)
    assert v["cause"] == "success"
    assert v["drafterFailures"] == 3 and v["drafterDisabled"] is True and v["lastDrafterExitCode"] == 1
    assert len((tmp_path / "drafter-starts").read_text().split()) == 3, "no restart after maxFailures"


def test_sigterm_is_forwarded_and_the_target_decides_the_exit_code(tmp_path: Path) -> None:
    target = script(tmp_path, "target", """
        def stop(*_):
            (D / "target-got-term").write_text("1"); sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        (D / "target-up").write_text("1")
        while True:
            signal.pause()
    """)
    proc = run_supervisor(tmp_path, target, drafter=script(tmp_path, "drafter", DRAFTER_FOREVER))
    try:
        wait_for(lambda: (tmp_path / "target-up").exists() and (tmp_path / "drafter-starts").exists(),
                 TIMEOUT, what="target and drafter up")
    except TimeoutError:
        proc.kill()
        raise
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 7
    assert (tmp_path / "target-got-term").exists()
    assert (tmp_path / "drafter-terminated").exists()
    assert verdict(tmp_path)["drafterFailures"] == 0, "stopping the drafter is not a drafter failure"


def test_mps_daemon_that_never_gets_ready(tmp_path: Path) -> None:
    broken_mps = script(tmp_path, "mps-broken", "sys.exit(1)\n")
    target = script(tmp_path, "target", "(D / 'target-ran').write_text('1')\n")
    proc = run_supervisor(tmp_path, target, mps_cmd=broken_mps)
    assert finish(proc) == names.EXIT_GPU_FAULT
    v = verdict(tmp_path)
    assert v["cause"] == "mps-daemon" and v["mpsExitCode"] == 1
    assert not (tmp_path / "target-ran").exists(), "no target without an MPS daemon"


def test_drafter_fault_that_kills_the_target_is_attributed_to_the_drafter(tmp_path: Path) -> None:
    drafter = script(tmp_path, "drafter", """
        record_start("drafter-starts")
        sys.exit(86)  # a GPU fault
    """)
    target = script(tmp_path, "target", """
        wait_until(lambda: starts("drafter-starts") and reaped(int(starts("drafter-starts")[0])),
                   "the drafter's fault")
        sys.exit(86)  # the MPS server terminated this client too
    """)
    proc = run_supervisor(tmp_path, target, drafter=drafter, backoff_s=600)
    assert finish(proc) == 86
    v = verdict(tmp_path)
    assert v["cause"] == "mps-by-drafter"
    message = (tmp_path / "termination-log").read_text()
    pod = {"metadata": {}, "status": {"phase": "Failed", "containerStatuses": [{
        "name": "target", "restartCount": 0,
        "state": {"terminated": {"exitCode": 86, "reason": "Error", "message": message,
                                 "finishedAt": "2026-11-29T12:00:00Z"}}}]}}
    fault = faults.classify_pod(pod)
    assert fault is not None and fault.container == "mps" and fault.caused_by_drafter
    rule = {"action": "RestartWithoutDrafter", "onExitCodes": {"container": "drafter", "operator": "In",
                                                               "values": [86]}}
    job = {"spec": {"runPolicy": {"failurePolicy": {"rules": [rule]}}}}
    assert faults.action_for(fault, job) == "RestartWithoutDrafter"


def test_target_killed_by_a_signal_exits_128_plus_n(tmp_path: Path) -> None:
    target = script(tmp_path, "target", "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = run_supervisor(tmp_path, target, mps=False)
    assert finish(proc) == 137
    assert verdict(tmp_path)["targetExitCode"] == 137


def test_missing_target_command_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, "-m", "spectrain_workloads.supervisor", "--mps-command", "[]"],
                         capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ})
    assert out.returncode != 0 and "after '--'" in out.stderr
