"""Exit code 2 end to end on the workload side: `spectrain-target`, the drafter sidecar and the
SingleContainer supervisor given a configuration that cannot run exit 2 (names.EXIT_CONFIG)
and write one line, "configuration error: ...", as the container's termination message
($SPECTRAIN_TERMINATION_LOG); the operator's faults read it back into Failed/ConfigError; the
local backend (`spectrain run`) ends such a run Failed/ConfigError without restarting anything.
Real processes; every config error is raised before torch is imported, so each takes ~0.1 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from spectrain_api.names import ENV_TERMINATION_LOG, EXIT_CONFIG
from spectrain_operator import builders, faults, local, local_layout, spec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60
TARGET = [sys.executable, "-m", "spectrain_workloads.target"]     # what `spectrain-target` runs
DRAFTER = [sys.executable, "-m", "spectrain_workloads.drafter.sidecar"]
BATCH_ERROR = ("configuration error: spec.target.data.batchSize: 6 must be a multiple of "
               "spec.target.parallelism.microbatches (4)")


def demo(**target: Any) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["target"].update(target)
    return job


def unrunnable_config(tmp: Path) -> Path:
    """The workload config of a Pretrain job whose batchSize 6 is not a multiple of its 4
    microbatches: check_spec refuses it (an operator that validated it would not have started it;
    a workload is the last line of defence)."""
    job = demo()
    job["spec"]["target"]["data"]["batchSize"] = 6
    path = tmp / "config.json"
    path.write_text(json.dumps(builders.workload_config(spec.apply_defaults(job))))
    return path


def run(argv: list[str], tmp: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], str | None]:
    log = tmp / "termination-log"
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPECTRAIN_")}
    full.update({"SPECTRAIN_TERMINATION_LOG": str(log), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                 **env})
    out = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp)
    return out, (log.read_text() if log.exists() else None)


def target_pod(code: int, message: str) -> dict[str, Any]:
    return {"metadata": {"name": "demo-0"}, "status": {"phase": "Failed", "containerStatuses": [{
        "name": "target", "restartCount": 0,
        "state": {"terminated": {"exitCode": code, "reason": "Error", "message": message,
                                 "finishedAt": "2026-01-01T00:00:00Z"}}}]}}


@pytest.mark.parametrize("local_world", ["1", "2"])
def test_spectrain_target_exits_2_and_writes_the_termination_message(tmp_path: Path, local_world: str) -> None:
    out, message = run(TARGET, tmp_path, SPECTRAIN_CONFIG=str(unrunnable_config(tmp_path)),
                       LOCAL_WORLD_SIZE=local_world)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert BATCH_ERROR in out.stderr
    # one line, the first failing local rank's
    assert message is not None and message.startswith(BATCH_ERROR) and "\n" not in message, message
    fault = faults.classify_pod(target_pod(out.returncode, message))
    assert fault is not None and BATCH_ERROR in fault.message
    assert faults.action_for(fault, spec.apply_defaults(demo())) == faults.CONFIG_ERROR


def test_spectrain_target_without_a_config_is_a_config_error(tmp_path: Path) -> None:
    out, message = run(TARGET, tmp_path)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert message == "configuration error: SPECTRAIN_CONFIG is not set; point it at the rendered workload config file"


def test_drafter_sidecar_exits_2_with_the_termination_message(tmp_path: Path) -> None:
    out, message = run(DRAFTER, tmp_path, LOCAL_WORLD_SIZE="two")
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert message == "configuration error: LOCAL_WORLD_SIZE='two' is not an integer"


def test_supervisor_carries_the_targets_config_error_in_its_verdict(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "spectrain_workloads.supervisor", "--termination-log",
            str(tmp_path / "verdict"), "--", *TARGET]
    out, own = run(argv, tmp_path, SPECTRAIN_CONFIG=str(unrunnable_config(tmp_path)), TMPDIR=str(tmp_path))
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert own is None, "the target wrote into its private termination log, not the container's"
    message = (tmp_path / "verdict").read_text()
    verdict = json.loads(message)["spectrainSupervisor"]
    assert verdict["cause"] == "target" and verdict["targetExitCode"] == EXIT_CONFIG
    assert verdict["targetMessage"].startswith(BATCH_ERROR)
    fault = faults.classify_pod(target_pod(EXIT_CONFIG, message))
    assert fault is not None and fault.container == "target" and BATCH_ERROR in fault.message
    assert faults.action_for(fault, spec.apply_defaults(demo())) == faults.CONFIG_ERROR
    assert not list(tmp_path.glob("spectrain-supervisor-*")), "the children's termination logs are cleaned up"


def test_supervisor_usage_error_is_a_config_error(tmp_path: Path) -> None:
    out, message = run([sys.executable, "-m", "spectrain_workloads.supervisor", "--mps-command", "[]"], tmp_path)
    assert out.returncode == EXIT_CONFIG and "after '--'" in out.stderr
    assert message is not None and message.startswith("configuration error: spectrain-supervisor: the target command")


def test_local_backend_ends_a_config_error_failed_without_restarting(tmp_path: Path) -> None:
    manifest = demo(command=TARGET)
    manifest["spec"]["drafter"]["enabled"] = False
    run_dir = tmp_path / "run"
    # the spec itself is valid; the config the targets read is not (SPECTRAIN_CONFIG overridden)
    plan = local_layout.plan(manifest, run_dir, env_overrides={"SPECTRAIN_CONFIG": str(unrunnable_config(tmp_path))})
    assert [c.name for c in plan.containers] == ["target", "target"]
    for c in plan.containers:
        assert c.env[ENV_TERMINATION_LOG] == str(run_dir / "logs" / f"{c.pod}.target.termination-log")
    code = local.execute(plan, poll_s=0.05)
    assert code == EXIT_CONFIG
    assert plan.outcome is not None
    assert (plan.outcome["phase"], plan.outcome["reason"], plan.outcome["exitCode"]) == ("Failed", "ConfigError", 2)
    assert plan.outcome["message"].startswith("demo-") and BATCH_ERROR in plan.outcome["message"]
    assert json.loads((run_dir / "status.json").read_text()) == plan.outcome
    failed = [c for c in plan.targets if c.exit_code == EXIT_CONFIG]
    assert failed and all(c.restarts == 0 for c in plan.containers)
    for c in failed:
        assert c.termination_log is not None and c.termination_log.read_text().startswith(BATCH_ERROR)
        assert c.log.read_text().count("configuration error") == 1, "started once, never restarted"
