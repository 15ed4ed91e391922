"""spec.mode RL through the real entrypoint (`spectrain run`, the local backend): GRPO with
speculative rollouts, RolloutTail windows, the drafter sidecar training in them and exporting, the
rollouts picking up the exported drafter, checkpoints, and a resumed run that continues both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from spectrain_api import rundir
from spectrain_operator.local_layout import run_volume

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPECTRAIN = [sys.executable, "-m", "spectrain_operator.cli"]


def rl_manifest(tmp_path: Path, steps: int) -> Path:
    """examples/demo-rl.yaml, shrunk: fewer and shorter rollouts, a short supervised warm-up."""
    job = yaml.safe_load((ROOT / "examples" / "demo-rl.yaml").read_text())
    t = job["spec"]["target"]
    t["steps"] = steps
    t["checkpoint"] |= {"everySteps": 4, "keep": 2}
    t["data"]["batchSize"] = 4
    t["rl"].update(groupSize=4, maxNewTokens=32)
    t["env"] = [{"name": "SPECTRAIN_RL_WARMUP_STEPS", "value": "30"}, {"name": "SPECTRAIN_RL_PLAIN_EVERY", "value": "4"}]
    path = tmp_path / f"demo-rl-{steps}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run(manifest: Path, run_dir: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([*SPECTRAIN, "run", str(manifest), "--run-dir", str(run_dir), "-q", *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    logs = "".join(f"\n--- {p.name}\n" + p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert res.returncode == 0, res.stdout + res.stderr + logs


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def version(name: str | None) -> int:
    return int(name.removeprefix("v")) if name else 0


# Steps of the first run, and of the resumed one. The first six rollout tails are about 1 ms (the
# warmed-up policy's responses end together), so the sidecar measures its costs only in one of the
# first long tails. When its verification is already due by then (due counts from the sidecar's start,
# and it waits seconds for weights and data under load), it verifies version 0 (about 7 chunks, 2-4
# tails) before it trains: the first run goes on long enough for training tails after that (20 steps
# left 1-4 training tails here, and once none in the full suite).
FIRST, RESUMED = 28, 32


def test_rl_run_trains_the_drafter_in_rollout_tails_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run(rl_manifest(tmp_path, steps=FIRST), run_dir)
    data = run_volume(run_dir)

    # RolloutTail windows, closed with their measured length.
    windows = jsonl(data / "metrics" / "windows-rank-0.jsonl")
    tails = [w for w in windows if w["kind"] == "RolloutTail"]
    assert len(tails) >= 4 and all(w["actual_ns"] > 0 for w in tails)
    # The sidecar trained inside them, on the hidden states the rollouts published, and exported.
    events = jsonl(rundir.drafter_metrics(data, 0))
    work = [e for e in events if e["event"] == "work" and e["kind"] == "RolloutTail" and e["microsteps"] > 0]
    assert work, [e for e in events if e["event"] != "work"][-5:]
    tail_ids = {w["window_id"] for w in tails}
    assert {e["window_id"] for e in work} <= tail_ids
    latest = data / "drafter" / "LATEST"
    assert latest.exists(), sorted(p.name for p in (data / "drafter").iterdir()) if (data / "drafter").exists() else []
    exported = version(latest.read_text().strip())
    export = data / "drafter" / latest.read_text().strip()
    assert exported >= 1 and (export / "model.safetensors").stat().st_size > 0
    assert json.loads((export / "config.json").read_text())["arch"] == "Eagle"
    # Checkpoints (keep 2) and per-step metrics of the first run.
    assert sorted(int(p.name.split("-")[1]) for p in data.glob("target/rank-0/step-*")) == [FIRST - 4, FIRST]
    steps = jsonl(data / "metrics" / "target-rank-0.jsonl")
    assert [s["step"] for s in steps] == list(range(1, FIRST + 1))
    assert all(s["response_len_max"] >= 1 and 0.0 <= s["reward"] <= 1.0 for s in steps)
    assert all(s["rollout_tokens_per_s"] > 0 for s in steps)
    # Plain reruns (side by side) only on every 4th step, and only once a drafter is loaded.
    measured = [s["step"] for s in steps if "rl_step_speedup" in s]
    assert set(measured) <= set(range(4, FIRST + 1, 4)) and all(s["drafter_version"] for s in steps if s["step"] in measured)

    # Resume with more steps: the policy continues from step FIRST, the sidecar from its checkpoint, and the
    # first resumed rollout already speculates with the exported drafter (no version 0 restart).
    run(rl_manifest(tmp_path, steps=RESUMED), run_dir, "--resume")
    steps = jsonl(data / "metrics" / "target-rank-0.jsonl")
    assert [s["step"] for s in steps] == list(range(1, RESUMED + 1))
    resumed = steps[FIRST:]
    assert version(resumed[0]["drafter_version"]) >= exported
    assert all(version(s["drafter_version"]) >= 1 for s in resumed)
    assert sum(s["spec_steps"] for s in resumed) > 0 and max(s["acceptance_length"] for s in resumed) >= 1.0
    last = resumed[-1]              # step RESUMED, a multiple of 4: a drafter is loaded, so it was measured side by side
    assert last["plain_rollout_s"] > 0 and last["plain_rollout_tokens_per_s"] > 0 and last["rl_step_speedup"] > 0
    assert last["rl_step_speedup"] == pytest.approx((last["plain_rollout_s"] + last["train_s"]) / last["step_time_s"])
    setups = [e for e in jsonl(rundir.drafter_metrics(data, 0)) if e["event"] == "setup"]
    assert len(setups) == 2 and setups[1]["resumed_version"] >= exported
    assert sorted(int(p.name.split("-")[1]) for p in data.glob("target/rank-0/step-*")) == [FIRST, RESUMED]
    log = (run_dir / "logs").glob("*.target.log")
    assert any("rollouts use drafter" in p.read_text() for p in log)
