"""`spectrain-target`: the entrypoint of a pod's `target` container.

Reads the environment of docs/contracts.md (SPECTRAIN_CONFIG, SPECTRAIN_RUN_DIR, SPECTRAIN_RING_DIR,
SPECTRAIN_DRAFTER_ENABLED, SPECTRAIN_DEVICE, SPECTRAIN_METRICS_PORT and torchrun's RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). `RANK` is the pod's base rank; with
LOCAL_WORLD_SIZE > 1 and no LOCAL_RANK this process spawns one child per local rank
(RANK = base + i, LOCAL_RANK = i), forwards SIGTERM/SIGINT to them, stops the others when one
fails, and exits with the first failure's code.

Dispatch on spec.mode through `MODES`: each mode is a `loop.ModeLoop` (the one loop that owns
resume, checkpoints, SIGTERM and metrics), imported lazily so that a configuration error exits
before torch is imported.

Exit codes (spectrain_api.exitcodes): 0 success, 2 configuration error (a message naming
the field, before any training), 143 after a SIGTERM (checkpoint saved), 1 / 86 other errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback
from importlib import import_module
from typing import TYPE_CHECKING, Any

from spectrain_api.errors import ConfigError
from spectrain_api.exitcodes import exit_code_for, returncode_to_exit
from spectrain_api.names import ASYNC_PIPELINE, EXIT_CONFIG, EXIT_OK, PRETRAIN, RL
from spectrain_api.rules import require_valid

if TYPE_CHECKING:
    from spectrain_workloads.loop import ModeLoop

# spec.mode -> "module:class" of its ModeLoop.
MODES: dict[str, str] = {
    PRETRAIN: "spectrain_workloads.target.trainer:PretrainLoop",
    RL: "spectrain_workloads.rl.mode:RLLoop",
    ASYNC_PIPELINE: "spectrain_workloads.target.async_pipeline:AsyncPipelineLoop",
}


def mode_loop(mode: str) -> type[ModeLoop]:
    """The ModeLoop class of spec.mode `mode` (imported now; require_valid has checked the mode)."""
    module, _, name = MODES[mode].partition(":")
    cls: type[ModeLoop] = getattr(import_module(module), name)
    return cls


def _log(msg: str) -> None:
    print(f"[spectrain-target] {msg}", file=sys.stderr, flush=True)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def spawn_local_ranks(local_world: int, grace_s: float = 30.0) -> int:
    """Run one child per local rank; returns the exit status for this process."""
    base = _int_env("RANK", 0)
    children: list[subprocess.Popen[Any]] = []
    for i in range(local_world):
        env = {**os.environ, "RANK": str(base + i), "LOCAL_RANK": str(i)}
        children.append(subprocess.Popen([sys.executable, "-m", "spectrain_workloads.target"], env=env))

    def forward(signum: int, _frame: Any) -> None:
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    by_pid = {c.pid: c for c in children}
    status = EXIT_OK
    left = set(by_pid)
    while left:
        pid, raw = os.wait()          # any child; signals interrupt and are handled (PEP 475)
        if pid not in left:
            continue
        left.discard(pid)
        code = returncode_to_exit(os.waitstatus_to_exitcode(raw))
        by_pid[pid].returncode = os.waitstatus_to_exitcode(raw)
        if code != EXIT_OK and status == EXIT_OK:
            status = code
            _log(f"local rank pid {pid} exited with {code}; stopping the other local ranks")
            for other in left:
                by_pid[other].terminate()
            _reap(by_pid, left, grace_s)
            break
    return status


def _reap(by_pid: dict[int, subprocess.Popen[Any]], left: set[int], grace_s: float) -> None:
    for pid in list(left):
        try:
            by_pid[pid].wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            by_pid[pid].kill()
            by_pid[pid].wait()


def run_rank() -> int:
    from spectrain_api import config
    from spectrain_workloads.shutdown import block_sigterm

    # SIGTERM goes to a sigwait thread (shutdown.py): block it before torch starts any thread.
    block_sigterm()
    cfg = config.load()
    require_valid(cfg)          # the rules `spectrain validate` applies, before any training
    mode_loop(cfg.mode)(cfg).train()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        local_world = _int_env("LOCAL_WORLD_SIZE", 1)
        if local_world > 1 and "LOCAL_RANK" not in os.environ:
            sys.exit(spawn_local_ranks(local_world))
        code = run_rank()
    except ConfigError as exc:
        from spectrain_api.exitcodes import fatal_message, write_termination_message

        _log(fatal_message(exc))
        write_termination_message(fatal_message(exc))   # the job's Failed/ConfigError condition shows it
        sys.exit(EXIT_CONFIG)
    except Exception as exc:  # noqa: BLE001 - the exit code classifies it for the operator
        from spectrain_api.exitcodes import fatal_message, write_termination_message

        traceback.print_exc()
        write_termination_message(fatal_message(exc))
        sys.exit(exit_code_for(exc))
    from spectrain_workloads import podstatus

    podstatus.drain()        # the last progress report reaches the job's status before the process goes
    sys.exit(code)


if __name__ == "__main__":
    main()
