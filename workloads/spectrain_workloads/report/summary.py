"""summary.json: every figure of the report, computed from the run's files.

Keys (the ones `make demo` / `make demo-rl` print are in render.HEADLINE):
- ranks, steps, final_loss; step_time_s_with/without_drafter and target_slowdown_ratio (the latter
  when `spectrain run --baseline` ran the job with the drafter off too);
- acceptance_length (final: the exported drafter's newest measurement), acceptance_length_peak;
- artifact: where the deployable drafter is; exports_rejected_by_cause: candidate exports the export
  gate kept from LATEST, by cause (names.EXPORT_REJECT_CAUSES, summed over the drafters' summaries);
  combine_adjusted_by_cause: contributions the robust combine capped or clipped (names.COMBINE_ADJUST_CAUSES);
- harvest.py: idle_s(_by_kind), harvested_s(_by_kind), harvested_fraction_of_idle,
  effective_harvest_s, effective_harvest_fraction, harvest_efficiency, overrun_ms_p99,
  harvested_s_by_rank, effective_s_by_rank, per_rank (rank -> idle/harvested by kind, effective,
  exchange MB/s, drafter state);
- RL runs, rl.py: reward_first/last/rise (+ reward_window_steps), rollout_tokens_per_s,
  plain_rollout_tokens_per_s, rollout_speedup, rl_step_s(_plain), rl_step_speedup (+ _source,
  _steps), rollout_acceptance_first/last, reward_by_step, rollout_acceptance_by_step.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from spectrain_api.names import COMBINE_ADJUST_CAUSES, EXPORT_REJECT_CAUSES
from spectrain_workloads.report.data import RankData, data_dir, load
from spectrain_workloads.report.harvest import acceptance, harvest
from spectrain_workloads.report.rl import is_rl, rl_figures


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def step_times(ranks: dict[int, RankData], skip: int = 2) -> list[float]:
    """Per-step wall time (max over ranks: the job is as slow as its slowest rank), warm-up skipped."""
    by_step: dict[int, float] = {}
    for rd in ranks.values():
        for rec in rd.steps:
            if "step_time_s" in rec and rec.get("step", 0) > skip:
                by_step[rec["step"]] = max(by_step.get(rec["step"], 0.0), float(rec["step_time_s"]))
    return [by_step[s] for s in sorted(by_step)]


def artifact(run_dir: Path, ranks: dict[int, RankData]) -> str | None:
    d = data_dir(run_dir)
    for rd in ranks.values():
        if rd.summary.get("artifact"):
            return str(rd.summary["artifact"])
    for latest in d.rglob("LATEST"):
        return str(latest.parent / latest.read_text().strip())
    return None


def exports_rejected(ranks: dict[int, RankData]) -> dict[str, int]:
    """The export gate's rejections by cause over every drafter's summary (the exporting rank's gate)."""
    return _by_cause(ranks, "exportsRejectedByCause", EXPORT_REJECT_CAUSES)


def combine_adjusted(ranks: dict[int, RankData]) -> dict[str, int]:
    """The robust combine's adjustments by cause over every drafter's summary (the coordinator's)."""
    return _by_cause(ranks, "combineAdjustedByCause", COMBINE_ADJUST_CAUSES)


def _by_cause(ranks: dict[int, RankData], key: str, causes: tuple[str, ...]) -> dict[str, int]:
    """Per cause, the sum of the positive integer counts the summaries give under `key`."""
    out = dict.fromkeys(causes, 0)
    for rd in ranks.values():
        by = rd.summary.get(key)
        for cause in out:
            n = by.get(cause) if isinstance(by, dict) else None
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                out[cause] += n
    return out


def serving_layouts(art: str | None) -> list[str]:
    """The layouts vLLM and SGLang load beside the artifact (its sglang/, speculators/, vllm/)."""
    if not art or not Path(art).is_dir():
        return []
    return sorted(str(p) for p in Path(art).iterdir() if p.is_dir() and (p / "config.json").is_file())


def _baseline(run_dir: Path) -> dict[int, RankData] | None:
    base = run_dir / "baseline"
    if not base.exists():
        return None
    try:
        return load(base)
    except SystemExit:          # a baseline run that failed before writing metrics
        return None


def summarize(run_dir: Path, ranks: dict[int, RankData] | None = None) -> dict[str, Any]:
    run_dir = Path(run_dir)
    ranks = load(run_dir) if ranks is None else ranks
    base = _baseline(run_dir)
    with_d = _median(step_times(ranks))
    without = _median(step_times(base)) if base else None
    losses = [rd.steps[-1]["loss"] for rd in ranks.values() if rd.steps and "loss" in rd.steps[-1]]
    out: dict[str, Any] = {
        "ranks": len(ranks),
        # distinct step records (Pretrain counts from 0, RL from 1; a resume may repeat a step)
        "steps": max((len({s.get("step") for s in rd.steps}) for rd in ranks.values()), default=0),
        "final_loss": min(losses) if losses else None,
        "step_time_s_with_drafter": with_d,
        "step_time_s_without_drafter": without,
        "target_slowdown_ratio": with_d / without if with_d and without else None,
        **acceptance(ranks),
        "artifact": (art := artifact(run_dir, ranks)),
        "serving_layouts": serving_layouts(art),
        "exports_rejected_by_cause": exports_rejected(ranks),
        "combine_adjusted_by_cause": combine_adjusted(ranks),
        **harvest(ranks),
    }
    if is_rl(ranks):
        out.update(rl_figures(ranks, base))
    return out


__all__ = ["artifact", "combine_adjusted", "exports_rejected", "serving_layouts", "step_times", "summarize"]
