"""The RL figures: the reward curve, and what speculation did to the rollouts and the RL step.

From the RL keys of the target's step lines (rl/grpo.py StepResult.metrics, docs/contracts.md):
- reward per step: the mean over ranks (each rank rolls out its own prompts) of the step's mean
  reward; "first" and "last" are means over the first and last n steps (a tenth of the run, at
  least 5 where the run has 10), since one step's reward is a noisy sample of few prompts;
- speedup, measured side by side in the run (`SPECTRAIN_RL_PLAIN_EVERY`, rl/sidebyside.py): on
  measured steps the plain rerun's rollout time and tokens/s next to the speculative one;
  rl_step_speedup is the median over measured steps of plain step time / speculative step time.
  Without measured steps, a `spectrain run --baseline` run (drafter off: plain rollouts) gives the
  ratio of median step times instead, and the summary says which source it is;
- acceptance of the continually trained drafter: tokens per verification in the rollouts
  themselves (steps that speculated), first and last n steps, as the drafter kept training;
- the draft-length controller's decisions (specdec/controller.py): the share of decode steps decoded
  plainly (k = 0), first and last n steps (it falls as the drafter learns to pay), and decode steps
  per draft length summed over the run.
"""

from __future__ import annotations

import statistics
from typing import Any

from spectrain_workloads.report.data import RankData
from spectrain_workloads.report.data import is_number as _num


def is_rl(ranks: dict[int, RankData]) -> bool:
    return any("reward" in s for rd in ranks.values() for s in rd.steps)


def step_records(ranks: dict[int, RankData]) -> list[dict[str, Any]]:
    """One record per (rank, step): a resumed run repeats steps after its checkpoint; the last wins."""
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    for r, rd in ranks.items():
        for s in rd.steps:
            if _num(s.get("step")):
                latest[(r, int(s["step"]))] = s
    return [latest[k] for k in sorted(latest, key=lambda k: (k[1], k[0]))]


def per_step(records: list[dict[str, Any]], key: str, *, where: str | None = None) -> dict[int, float]:
    """step -> mean over ranks of `key` (records where `where` is truthy, when given)."""
    acc: dict[int, list[float]] = {}
    for s in records:
        if _num(s.get(key)) and (where is None or s.get(where)):
            acc.setdefault(int(s["step"]), []).append(float(s[key]))
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


def window(n_steps: int) -> int:
    """How many steps "first" and "last" average over."""
    return max(1, min(n_steps // 2, max(5, n_steps // 10)))


def first_last(curve: dict[int, float]) -> tuple[float | None, float | None, int]:
    vals = list(curve.values())
    if not vals:
        return None, None, 0
    n = window(len(vals))
    return statistics.fmean(vals[:n]), statistics.fmean(vals[-n:]), n


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def rl_figures(ranks: dict[int, RankData], baseline: dict[int, RankData] | None = None) -> dict[str, Any]:
    recs = step_records(ranks)
    reward = per_step(recs, "reward")
    r_first, r_last, n = first_last(reward)
    acc = per_step(recs, "acceptance_length", where="spec_steps")
    a_first, a_last, _ = first_last(acc)
    plain_share = per_step(recs, "plain_share")
    p_first, p_last, _ = first_last(plain_share)
    k_hist: dict[int, int] = {}
    for s in recs:
        for k, count in (s.get("k_histogram") or {}).items():
            k_hist[int(k)] = k_hist.get(int(k), 0) + int(count)
    measured = [s for s in recs if _num(s.get("rl_step_speedup")) and _num(s.get("plain_rollout_s"))]
    # With vs without on the same steps: the speculative figures of measured steps only.
    sample = measured or recs
    out: dict[str, Any] = {
        "reward_first": r_first, "reward_last": r_last, "reward_window_steps": n,
        "reward_rise": r_last - r_first if r_first is not None and r_last is not None else None,
        "rollout_tokens_per_s": _median([s["rollout_tokens_per_s"] for s in sample if _num(s.get("rollout_tokens_per_s"))]),
        "plain_rollout_tokens_per_s": _median([s["plain_rollout_tokens_per_s"] for s in measured
                                               if _num(s.get("plain_rollout_tokens_per_s"))]),
        "rollout_speedup": _median([s["plain_rollout_s"] / s["rollout_s"] for s in measured if s.get("rollout_s")]),
        "rl_step_s": _median([s["step_time_s"] for s in sample if _num(s.get("step_time_s"))]),
        "rl_step_s_plain": _median([s["plain_rollout_s"] + s.get("train_s", 0.0) for s in measured]),
        "rl_step_speedup": _median([s["rl_step_speedup"] for s in measured]),
        "rl_step_speedup_source": "side-by-side" if measured else None,
        "rl_step_speedup_steps": len(measured),
        "rollout_acceptance_first": a_first, "rollout_acceptance_last": a_last,
        "rollout_plain_share_first": p_first, "rollout_plain_share_last": p_last,
        "rollout_k_histogram": {str(k): n for k, n in sorted(k_hist.items())},
        "reward_by_step": {str(k): v for k, v in reward.items()},
        "rollout_acceptance_by_step": {str(k): v for k, v in acc.items()},
    }
    if not measured and baseline:
        plain = _median([s["step_time_s"] for s in step_records(baseline) if _num(s.get("step_time_s"))])
        if plain and out["rl_step_s"]:
            out.update(rl_step_s_plain=plain, rl_step_speedup=plain / out["rl_step_s"], rl_step_speedup_source="baseline")
    return out


def step_rows(ranks: dict[int, RankData], max_rows: int = 40) -> list[dict[str, Any]]:
    """Rows of the report's RL table (rank means per step): the steps measured side by side when
    there are any (so every row has both columns), else all steps; of many, every k-th and the last."""
    recs = step_records(ranks)
    keys = ("reward", "rollout_s", "rollout_tokens_per_s", "plain_rollout_s", "plain_rollout_tokens_per_s",
            "rl_step_speedup", "acceptance_length", "plain_share")
    curves = {k: per_step(recs, k) for k in keys}
    curves["acceptance_length"] = per_step(recs, "acceptance_length", where="spec_steps")   # none: not speculated
    steps = sorted(curves["plain_rollout_s"] or curves["reward"])
    stride = max(1, -(-len(steps) // max_rows))
    picked = [s for i, s in enumerate(steps) if i % stride == 0 or i == len(steps) - 1]
    return [{"step": s, **{k: curves[k].get(s) for k in keys}} for s in picked]


__all__ = ["first_last", "is_rl", "per_step", "rl_figures", "step_records", "step_rows", "window"]
