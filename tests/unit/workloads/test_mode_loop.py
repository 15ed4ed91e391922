"""loop.ModeLoop: what train() owns for every mode (resume, cadence, SIGTERM, metrics, close), on a
toy mode in one process; the MODES registry; the RL knobs of TargetOptions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spectrain_api.config import JobConfig
from spectrain_api.errors import ConfigError
from spectrain_api.names import MODES as MODE_NAMES
from spectrain_workloads.loop import ModeLoop, StepReport
from spectrain_workloads.runtime import RankInfo, Runtime, TargetOptions

pytestmark = pytest.mark.unit


class _Stop(Exception):
    """Stands in for exit 143 (Runtime.exit_terminated ends the process)."""


class Counter(ModeLoop):
    """State: the sum of the steps run; loss of step s: s / 10."""

    def __init__(self, cfg: JobConfig, opts: TargetOptions, *, sigterm_at: int | None = None,
                 fail_at: int | None = None) -> None:
        super().__init__(cfg, opts, RankInfo())
        self.total = self.done = 0
        self.sigterm_at, self.fail_at = sigterm_at, fail_at
        self.calls: list[str] = []

    def build(self) -> None:
        self.calls.append("build")

    def fresh_start(self) -> None:
        self.calls.append("fresh")

    def load_state(self, state: dict[str, Any]) -> None:
        self.calls.append(f"load {state['step']}")
        self.total, self.done = state["total"], state["step"]

    def state(self) -> dict[str, Any]:
        return {"step": self.done, "total": self.total}

    def boundary_step(self) -> int:
        return self.done

    def train_step(self, step: int) -> StepReport:
        if step == self.fail_at:
            raise RuntimeError("boom")
        with self.term.state_lock:
            self.total += step
            self.done = step + 1
        if step == self.sigterm_at:
            self.term.requested.set()
        return StepReport(loss=step / 10, step_time_s=1.0, tokens=4)

    def close(self) -> None:
        self.calls.append("close")


def _setup(tmp_path: Path, steps: int, every: int) -> tuple[JobConfig, TargetOptions]:
    cfg = JobConfig()
    cfg.target.steps, cfg.target.checkpoint.every_steps, cfg.target.checkpoint.keep = steps, every, 2
    return cfg, TargetOptions(run_dir=tmp_path, device="cpu", drafter_enabled=False)


def _metric_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics" / "target-rank-0.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_cadence_metrics_and_resume(tmp_path: Path) -> None:
    cfg, opts = _setup(tmp_path, steps=7, every=3)
    loop = Counter(cfg, opts)
    assert loop.train() == [s / 10 for s in range(7)]
    assert loop.calls == ["build", "fresh", "close"]
    ckpt_dir = tmp_path / "target" / "rank-0"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-6", "step-7"]   # 3 pruned (keep 2)
    assert _metric_steps(tmp_path) == list(range(1, 8))        # steps done

    cfg.target.steps = 10
    again = Counter(cfg, opts)
    assert again.train() == [s / 10 for s in range(7, 10)]
    assert again.calls == ["build", "load 7", "close"] and again.start_step == 7
    assert again.total == sum(range(10))


def test_sigterm_is_seen_after_the_step_and_its_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def exit_terminated(self: Runtime, term: Any, save: Any, step: int) -> None:
        save(step)
        seen.append(step)
        raise _Stop

    monkeypatch.setattr(Runtime, "exit_terminated", exit_terminated)
    cfg, opts = _setup(tmp_path, steps=10, every=3)
    loop = Counter(cfg, opts, sigterm_at=4)
    with pytest.raises(_Stop):
        loop.train()
    assert seen == [5] and loop.done == 5
    assert _metric_steps(tmp_path) == [1, 2, 3, 4, 5]          # step 4's line is written before the exit
    assert (tmp_path / "target" / "rank-0" / "step-5").is_dir()


def test_an_error_closes_the_local_resources_and_propagates(tmp_path: Path) -> None:
    class Ring:
        closed = False

        def close(self) -> None:
            Ring.closed = True

    cfg, opts = _setup(tmp_path, steps=5, every=2)
    loop = Counter(cfg, opts, fail_at=3)
    loop.producer = Ring()
    with pytest.raises(RuntimeError, match="boom"):
        loop.train()
    assert loop.calls[-1] == "close" and Ring.closed
    assert _metric_steps(tmp_path) == [1, 2, 3]


def test_resume_step_counts_a_step_zero_checkpoint(tmp_path: Path) -> None:
    cfg, opts = _setup(tmp_path, steps=1, every=1)
    rt = Runtime.start(cfg, opts, RankInfo())
    assert rt.resume_step() is None
    rt.ckpt.save(0, {"step": 0})
    assert rt.resume_step() == 0
    rt.close()


def test_every_mode_has_a_loop() -> None:
    from spectrain_workloads.target.entry import MODES, mode_loop

    assert set(MODES) == set(MODE_NAMES)
    for mode in MODE_NAMES:
        assert issubclass(mode_loop(mode), ModeLoop)


def test_rl_knobs_are_target_options() -> None:
    env = {"SPECTRAIN_RUN_DIR": "/tmp/x", "SPECTRAIN_RL_WARMUP_STEPS": "30", "SPECTRAIN_RL_PLAIN_EVERY": "4",
           "SPECTRAIN_EXPORT_DIR": "/tmp/exports"}
    opts = TargetOptions.from_env(env)
    assert (opts.rl_warmup_steps, opts.rl_plain_every, opts.export_dir) == (30, 4, Path("/tmp/exports"))
    assert TargetOptions.from_env({"SPECTRAIN_RUN_DIR": "/tmp/x"}).rl_warmup_steps == 200
    with pytest.raises(ConfigError, match="SPECTRAIN_RL_WARMUP_STEPS"):
        TargetOptions.from_env({**env, "SPECTRAIN_RL_WARMUP_STEPS": "-1"})


@pytest.mark.parametrize(("mode", "data", "pipeline", "says"), [
    ("RL", 2, 1, r"data \(2\) x pipeline \(1\) = 2 but WORLD_SIZE is 1; run nodes x procsPerNode = 2"),
    ("AsyncPipeline", 1, 2, r"data \(1\) x pipeline \(2\) = 2 but WORLD_SIZE is 1; run nodes x procsPerNode = 2"),
])
def test_rl_and_async_pipeline_check_their_degrees_against_the_ranks_that_started(
        tmp_path: Path, mode: str, data: int, pipeline: int, says: str) -> None:
    """A spec whose degrees do not match WORLD_SIZE fails naming the fields, in every mode (the
    Pretrain check is test_trainer's), before any model is built."""
    from spectrain_api.config import RLSpec
    from spectrain_workloads.target.entry import mode_loop

    cfg = JobConfig(mode=mode)
    cfg.target.parallelism.data, cfg.target.parallelism.pipeline = data, pipeline
    cfg.target.procs_per_node = 2           # the spec asks for 2 ranks; 1 started
    cfg.target.rl = RLSpec() if mode == "RL" else None
    loop = mode_loop(mode)(cfg, TargetOptions(run_dir=tmp_path, device="cpu", drafter_enabled=False), RankInfo())
    with pytest.raises(ConfigError, match=says):
        loop.train()
