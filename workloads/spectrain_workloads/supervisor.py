"""`spectrain-supervisor`: the SingleContainer entrypoint (spec.gpuSharing.mode SingleContainer).

For clusters whose device plugin only gives the GPU to one container, the operator folds the
drafter into the target container and runs this supervisor there (see
spectrain_operator.gpu_sharing). It

1. starts the MPS control daemon (``--mps-command``) and waits until ``--mps-ready-command``
   succeeds (the daemon answers ``get_server_list``);
2. starts the drafter (``--drafter-command``, environment plus ``--drafter-env``) and restarts it
   after each failure with exponential backoff, up to ``--drafter-max-failures`` failures; after
   that the drafter stays off and the target carries on alone;
3. starts the target (the argv after ``--``) and exits with the target's exit code (128+N when a
   signal N killed it). The drafter never decides the container's exit code.

SIGTERM / SIGINT are forwarded to the target and the drafter; the MPS daemon is stopped last.
At exit the supervisor writes its verdict (spectrain_api.verdict) as JSON to ``--termination-log``
(the container's terminationMessagePath), which spectrain_operator.faults.classify_pod reads. The target and the drafter each get a private SPECTRAIN_TERMINATION_LOG (so
neither clobbers the verdict); ``targetMessage`` carries the target's fatal error line from it (a
configuration error's message reaches the job's Failed/ConfigError condition that way). The
supervisor's own usage errors exit 2 (EXIT_CONFIG) with the error as the termination message.

No torch import; waits on child exits through a signal wakeup fd (no polling loop with sleeps).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spectrain_api.exitcodes import returncode_to_exit, write_termination_message
from spectrain_api.names import (
    ENV_TERMINATION_LOG,
    EXIT_CONFIG,
    EXIT_GPU_FAULT,
    GPU_FAULT_EXIT_CODES,
    MPS_LOSS_WINDOW_S,
    TERMINATION_LOG,
)
from spectrain_api.verdict import MAX_TARGET_MESSAGE_CHARS, SupervisorVerdict


def _log(msg: str) -> None:
    print(f"[spectrain-supervisor] {msg}", file=sys.stderr, flush=True)


@dataclass
class SupervisorConfig:
    target: list[str]
    drafter: list[str] | None = None
    drafter_env: dict[str, str] = field(default_factory=dict)
    drafter_max_failures: int = 3
    drafter_backoff_s: float = 1.0
    drafter_backoff_max_s: float = 30.0
    mps: list[str] | None = None
    mps_ready: list[str] | None = None
    mps_ready_timeout_s: float = 60.0
    stop_grace_s: float = 10.0
    termination_log: str | None = TERMINATION_LOG


class Supervisor:
    def __init__(self, cfg: SupervisorConfig, *, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.verdict = SupervisorVerdict()
        self._target: subprocess.Popen[bytes] | None = None
        self._drafter: subprocess.Popen[bytes] | None = None
        self._mps: subprocess.Popen[bytes] | None = None
        self._drafter_restart_at: float | None = None
        self._drafter_failed_at: float | None = None
        self._mps_lost_at: float | None = None
        self._stop_signal: int | None = None
        self._messages = tempfile.mkdtemp(prefix="spectrain-supervisor-")  # the children's termination logs
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        os.set_blocking(self._rfd, False)

    # -------------------------------------------------------------- signals
    def _install_signals(self) -> dict[int, Any]:
        old: dict[int, Any] = {}

        def on_stop(signum: int, frame: Any) -> None:
            self._stop_signal = signum

        def on_child(signum: int, frame: Any) -> None:
            pass

        old[-1] = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        for sig, handler in ((signal.SIGTERM, on_stop), (signal.SIGINT, on_stop), (signal.SIGCHLD, on_child)):
            old[sig] = signal.signal(sig, handler)
        return old

    def _restore_signals(self, old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            if sig == -1:
                signal.set_wakeup_fd(handler)
            else:
                signal.signal(sig, handler)

    def _wait_event(self, timeout_s: float | None) -> None:
        """Block until a signal (child exit, stop) arrives or `timeout_s` passes."""
        try:
            select.select([self._rfd], [], [], timeout_s)
        except InterruptedError:  # pragma: no cover - PEP 475 retries select
            pass
        try:
            while os.read(self._rfd, 512):
                pass
        except BlockingIOError:
            pass

    # -------------------------------------------------------------- children
    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, env=env)

    def _start_drafter(self) -> None:
        assert self.cfg.drafter is not None
        env = {**os.environ, **self.cfg.drafter_env,
               ENV_TERMINATION_LOG: os.path.join(self._messages, "drafter")}
        _log(f"starting drafter: {self.cfg.drafter}")
        self._drafter = self._spawn(self.cfg.drafter, env)
        self._drafter_restart_at = None

    def _start_mps(self) -> bool:
        if not self.cfg.mps:
            return True
        _log(f"starting MPS daemon: {self.cfg.mps}")
        self._mps = self._spawn(self.cfg.mps)
        if not self.cfg.mps_ready:
            return True
        deadline = self.clock() + self.cfg.mps_ready_timeout_s
        delay = 0.05
        while True:
            rc = subprocess.run(self.cfg.mps_ready, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            if rc == 0:
                _log("MPS daemon ready")
                return True
            code = self._mps.poll()
            if code is not None:
                self.verdict.mps_exit_code = returncode_to_exit(code)
                _log(f"MPS daemon exited with {self.verdict.mps_exit_code} before it was ready")
                return False
            if self.clock() >= deadline or self._stop_signal is not None:
                _log(f"MPS daemon not ready after {self.cfg.mps_ready_timeout_s:.0f}s")
                return False
            self._wait_event(delay)
            delay = min(delay * 2, 1.0)

    def _check_drafter(self) -> bool:
        """Reap the drafter if it exited; True when it did (in this call)."""
        d = self._drafter
        if d is None:
            return False
        code = d.poll()
        if code is None:
            return False
        self._drafter = None
        exit_code = returncode_to_exit(code)
        self.verdict.last_drafter_exit_code = exit_code
        if self._stop_signal is not None:
            return True  # stopped by us on SIGTERM: not a failure
        if exit_code == 0:
            # The sidecar contract: the drafter runs for the target's lifetime; a clean exit
            # (training finished) is neither a failure nor restarted.
            _log("drafter exited cleanly; not restarting it")
            return True
        self.verdict.drafter_failures += 1
        self._drafter_failed_at = self.clock()
        n = self.verdict.drafter_failures
        if n > self.cfg.drafter_max_failures:
            self.verdict.drafter_disabled = True
            _log(f"drafter failed {n} times (exit {exit_code}); maxFailures "
                 f"{self.cfg.drafter_max_failures} reached: the target continues without it")
            return True
        backoff = min(self.cfg.drafter_backoff_s * (2 ** (n - 1)), self.cfg.drafter_backoff_max_s)
        _log(f"drafter failed (exit {exit_code}, failure {n}/{self.cfg.drafter_max_failures}); "
             f"restarting in {backoff:.1f}s")
        self._drafter_restart_at = self.clock() + backoff
        return True

    def _check_mps(self) -> None:
        if self._mps is None or self._mps_lost_at is not None:
            return
        code = self._mps.poll()
        if code is not None:
            self._mps_lost_at = self.clock()
            self.verdict.mps_exit_code = returncode_to_exit(code)
            _log(f"MPS daemon exited with {self.verdict.mps_exit_code} while the target runs")

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None, grace_s: float) -> int | None:
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def _forward(self, sig: int) -> None:
        for p in (self._target, self._drafter):
            if p is not None and p.poll() is None:
                p.send_signal(sig)

    # -------------------------------------------------------------- main
    def _decide_cause(self, target_exit: int, target_end: float, same_round: bool) -> str:
        """Why the target ended. `same_round`: the drafter's exit was reaped together with the
        target's, so which came first is unknown and the loss is not attributed to the drafter."""
        if target_exit == 0:
            return "success"
        if self._mps_lost_at is not None and self._mps_lost_at <= target_end:
            return "mps-daemon"
        d_exit = self.verdict.last_drafter_exit_code
        d_at = self._drafter_failed_at
        if (d_exit is not None and d_at is not None and target_exit in GPU_FAULT_EXIT_CODES
                and d_exit in GPU_FAULT_EXIT_CODES and abs(target_end - d_at) <= MPS_LOSS_WINDOW_S):
            return "mps-by-drafter" if d_at < target_end and not same_round else "mps"
        return "target"

    def run(self) -> int:
        old = self._install_signals()
        try:
            return self._run()
        finally:
            self._restore_signals(old)
            os.close(self._rfd)
            os.close(self._wfd)
            shutil.rmtree(self._messages, ignore_errors=True)

    def _run(self) -> int:
        if not self._start_mps():
            self._stop(self._mps, self.cfg.stop_grace_s)
            if self._stop_signal is not None:
                self.verdict.cause = "target"
                self._write_verdict()
                return 128 + self._stop_signal
            self.verdict.cause = "mps-daemon"
            self.verdict.target_exit_code = None
            self._write_verdict()
            return EXIT_GPU_FAULT
        if self.cfg.drafter:
            self._start_drafter()
        _log(f"starting target: {self.cfg.target}")
        target_log = os.path.join(self._messages, "target")
        self._target = self._spawn(self.cfg.target, {**os.environ, ENV_TERMINATION_LOG: target_log})
        forwarded = False
        while True:
            # drafter before target: when both died in this round, the drafter's exit is recorded first
            drafter_exited = self._check_drafter()
            self._check_mps()
            code = self._target.poll()
            if code is not None:
                break
            if self._stop_signal is not None and not forwarded:
                _log(f"signal {self._stop_signal}: forwarding to target and drafter")
                self._forward(signal.SIGTERM)
                self._drafter_restart_at = None
                forwarded = True
            now = self.clock()
            if self._drafter_restart_at is not None and now >= self._drafter_restart_at and not forwarded:
                self._start_drafter()
                continue
            timeout = None if self._drafter_restart_at is None else max(0.0, self._drafter_restart_at - now)
            # a child exit or signal wakes us; the 5 s cap is a safety net against a lost SIGCHLD
            self._wait_event(5.0 if timeout is None else min(timeout, 5.0))
        target_end = self.clock()
        target_exit = returncode_to_exit(code)
        same_round = self._check_drafter() or drafter_exited
        self.verdict.target_exit_code = target_exit
        self.verdict.target_message = self._read_message(target_log)
        self.verdict.cause = self._decide_cause(target_exit, target_end, same_round)
        self._drafter_restart_at = None
        self._stop(self._drafter, self.cfg.stop_grace_s)
        self._stop(self._mps, self.cfg.stop_grace_s)
        _log(f"target exited with {target_exit} (cause: {self.verdict.cause})")
        self._write_verdict()
        return target_exit

    @staticmethod
    def _read_message(path: str) -> str | None:
        try:
            with open(path, errors="replace") as f:
                text = " ".join(f.read(MAX_TARGET_MESSAGE_CHARS * 4).split())
        except OSError:
            return None
        return text[:MAX_TARGET_MESSAGE_CHARS] or None

    def _write_verdict(self) -> None:
        path = self.cfg.termination_log
        if not path:
            return
        try:
            with open(path, "w") as f:
                f.write(self.verdict.to_json())
        except OSError as e:
            _log(f"cannot write the termination message to {path}: {e}")


def _json_list(text: str, flag: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise SystemExit(f"{flag}: not JSON ({e}); pass a JSON list of strings, e.g. '[\"cmd\", \"-f\"]'") from e
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise SystemExit(f"{flag}: {text!r} is not a non-empty JSON list of strings")
    return value


def parse_args(argv: Sequence[str]) -> SupervisorConfig:
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("spectrain-supervisor: the target command is missing; pass it after '--'")
    split = argv.index("--")
    own, target = argv[:split], argv[split + 1:]
    if not target:
        raise SystemExit("spectrain-supervisor: the target command after '--' is empty")
    p = argparse.ArgumentParser(prog="spectrain-supervisor", description=__doc__.split("\n")[0])
    p.add_argument("--mps-command")
    p.add_argument("--mps-ready-command")
    p.add_argument("--mps-ready-timeout-s", type=float, default=60.0)
    p.add_argument("--drafter-command")
    p.add_argument("--drafter-env", default="{}")
    p.add_argument("--drafter-max-failures", type=int, default=3)
    p.add_argument("--drafter-backoff-s", type=float, default=1.0)
    p.add_argument("--stop-grace-s", type=float, default=10.0)
    p.add_argument("--termination-log", default=os.environ.get(ENV_TERMINATION_LOG) or TERMINATION_LOG)
    a = p.parse_args(own)
    env = json.loads(a.drafter_env)
    if not isinstance(env, dict):
        raise SystemExit("--drafter-env: pass a JSON object of NAME: value strings")
    if a.drafter_max_failures < 0:
        raise SystemExit("--drafter-max-failures: must be >= 0 (spec.drafter.maxFailures)")
    return SupervisorConfig(
        target=target,
        drafter=_json_list(a.drafter_command, "--drafter-command") if a.drafter_command else None,
        drafter_env={str(k): str(v) for k, v in env.items()},
        drafter_max_failures=a.drafter_max_failures,
        drafter_backoff_s=a.drafter_backoff_s,
        mps=_json_list(a.mps_command, "--mps-command") if a.mps_command else None,
        mps_ready=_json_list(a.mps_ready_command, "--mps-ready-command") if a.mps_ready_command else None,
        mps_ready_timeout_s=a.mps_ready_timeout_s,
        stop_grace_s=a.stop_grace_s,
        termination_log=a.termination_log or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise  # --help (0) or argparse's own usage error (2, already printed)
        # The pod's command line cannot run: a configuration error, not worth a restart.
        print(exc.code, file=sys.stderr, flush=True)
        write_termination_message(f"configuration error: {exc.code}")
        return EXIT_CONFIG
    return Supervisor(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
