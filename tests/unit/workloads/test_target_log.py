"""The target's container log: `kubectl logs` of a healthy run shows its progress (a line at the
first step, one every LOG_INTERVAL_S, and the last), not nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectrain_workloads import metrics

pytestmark = pytest.mark.unit


def test_progress_lines_at_the_first_and_last_step_and_every_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    w = metrics.MetricsWriter(tmp_path, rank=1, total_steps=50)
    for step in range(50):
        w.window_closed({"kind": "PipelineBubble", "actual_ns": 250_000_000, "predicted_ns": 250_000_000})
        w.step(step=step, loss=3.0 - step / 100, step_time_s=1.0, tokens=512, final=step == 49)
        clock[0] += 1.0
    w.close()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[spectrain-target rank 1]")]
    # steps 1, 31 (30 s later) and 50 (the last)
    assert [ln.split()[4] for ln in lines] == ["1/50", "31/50", "50/50"], lines
    assert "loss 2.7000" in lines[1] and "idle 25% of the last 30 s" in lines[1]


@pytest.mark.parametrize("offset", [0, 1], ids=["pretrain-0-based", "rl-1-based"])
def test_progress_counts_completed_steps_whatever_the_metrics_key(tmp_path: Path, offset: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """status.progress.step is the number of steps done (docs/api.md), so a finished job shows
    totalSteps/totalSteps: the metrics lines' key is 0-based for Pretrain and 1-based for RL."""
    monkeypatch.delenv(metrics.ENV_RUN_DIR, raising=False)
    w = metrics.MetricsWriter(tmp_path, rank=0, progress=True, total_steps=5)
    for step in range(5):
        w.step(step=step + offset, loss=1.0, step_time_s=0.1, tokens=8, final=step == 4, completed=step + 1)
    w.close()
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 5
