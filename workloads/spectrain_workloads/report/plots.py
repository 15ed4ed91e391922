"""The report's PNGs: a timeline per rank, loss and acceptance curves, and the RL step curves.

matplotlib is imported inside each function (Agg backend): `spectrain` itself must start without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectrain_api.names import WINDOW_KINDS
from spectrain_workloads.report.data import RankData
from spectrain_workloads.report.harvest import rank_figures
from spectrain_workloads.report.rl import per_step, step_records

KIND_COLORS = dict(zip(WINDOW_KINDS, ("#4C72B0", "#55A868", "#C44E52", "#8172B2"), strict=True))
DRAFTER_COLOR = "#DD8452"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def view_end_ns(ranks: dict[int, RankData], max_seconds: float) -> int:
    """Where the timeline's view ends: the end of the run, or earlier so that every rank whose
    drafter worked at all has its last work in view (at three quarters of it): a rank whose drafter
    worked only now and then is drawn at work rather than idle."""
    run_end = max(w["start_ns"] + w.get("actual_ns", 0) for rd in ranks.values() for w in rd.windows)
    last_work = [max(e["end_ns"] for e in rd.events("work")) for rd in ranks.values() if rd.events("work")]
    if not last_work:
        return run_end
    return min(run_end, min(last_work) + int(0.25 * max_seconds * 1e9))


def plot_timeline(ranks: dict[int, RankData], out: Path, max_seconds: float = 4.0) -> bool:
    """`max_seconds` of the run (view_end_ns), one row per rank: target busy (grey), its idle windows
    by kind (lower bars) and its drafter's work (upper bars). Every rank gets its drafter lane, and a
    drafter that did no work in view says so with its state: an idle drafter is a finding, not a gap.
    False when there is nothing to draw."""
    starts = [w["start_ns"] for rd in ranks.values() for w in rd.windows]
    if not starts:
        return False
    plt = _pyplot()
    run_end = max(w["start_ns"] + w.get("actual_ns", 0) for rd in ranks.values() for w in rd.windows)
    t_end = view_end_ns(ranks, max_seconds)
    t0 = max(min(starts), t_end - int(max_seconds * 1e9))
    span = (t_end - t0) / 1e9
    order = sorted(ranks)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(order)))
    labels = []
    for i, r in enumerate(order):
        rd, y = ranks[r], len(order) - 1 - i
        fig_r = rank_figures(rd)
        ax.broken_barh([(0, span)], (y - 0.4, 0.8), facecolors="#DDDDDD")  # busy
        for kind, color in KIND_COLORS.items():
            bars = [((w["start_ns"] - t0) / 1e9, w.get("actual_ns", 0) / 1e9) for w in rd.windows
                    if w["kind"] == kind and t0 <= w["start_ns"] <= t_end]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.5), facecolors=color, label=kind if kind not in
                               ax.get_legend_handles_labels()[1] else None)
        work = [((e["start_ns"] - t0) / 1e9, (e["end_ns"] - e["start_ns"]) / 1e9) for e in rd.events("work")
                if t0 <= e["start_ns"] <= t_end]
        if work:
            ax.broken_barh(work, (y + 0.12, 0.28), facecolors=DRAFTER_COLOR,
                           label="drafter work" if "drafter work" not in ax.get_legend_handles_labels()[1] else None)
        else:
            ax.text(0.01 * span, y + 0.26, f"drafter: {fig_r['drafter']}, no work in view", fontsize=8,
                    va="center", color="#7A3E12")
        labels.append(f"rank {r}\nharvested {fig_r['harvested_s']:.3g}s\neffective {fig_r['effective_s']:.3g}s")
    ax.set_yticks(range(len(order)), list(reversed(labels)), fontsize=8)
    ax.set_xlim(0, span)
    before = (run_end - t_end) / 1e9
    ax.set_xlabel(f"seconds ({'end of run' if before < 0.5 else f'ending {before:.0f} s before the end of the run'}); "
                  "grey: target busy, lower bars: idle windows, upper: drafter")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_curves(ranks: dict[int, RankData], out: Path) -> bool:
    """Target loss per step and each drafter's measured acceptance length over time."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.5))
    drew = False
    for r, rd in sorted(ranks.items()):
        pts = [(s["step"], s["loss"]) for s in rd.steps if isinstance(s.get("loss"), (int, float))]
        if pts:
            a1.plot(*zip(*pts, strict=True), label=f"target rank {r}")
            drew = True
        acc = [(e.get("t_ns", 0), e.get("acceptance_length", e.get("acceptance"))) for e in rd.events("acceptance")]
        acc = [(t, a) for t, a in acc if isinstance(a, (int, float))]
        if acc:
            t0 = acc[0][0]
            a2.plot([(t - t0) / 1e9 for t, _ in acc], [a for _, a in acc], label=f"drafter rank {r}")
            drew = True
    a1.set_title("target loss")
    a1.set_xlabel("step")
    a2.set_title("drafter expected acceptance length")
    a2.set_xlabel("seconds")
    _save(plt, fig, (a1, a2), out)
    return drew


def _save(plt: Any, fig: Any, axes: tuple[Any, ...], out: Path) -> None:
    """Legends where there are labels, then the PNG."""
    for a in axes:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _smooth(ys: list[float], n: int) -> list[float]:
    """Trailing mean over n points: one step's reward is a noisy sample of few prompts."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def plot_rl(ranks: dict[int, RankData], out: Path) -> bool:
    """Reward per step (the curve a user watches), rollout tokens/s with and without speculation,
    and the rollouts' acceptance length per step. False when the run has no RL steps."""
    recs = step_records(ranks)
    reward = per_step(recs, "reward")
    if not reward:
        return False
    plt = _pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 3.6))
    xs, ys = list(reward), list(reward.values())
    a1.plot(xs, ys, color="#BBBBBB", lw=0.8, label="per step")
    a1.plot(xs, _smooth(ys, max(1, len(ys) // 20)), color="#4C72B0", label="running mean")
    a1.set_title("reward (mean over rollouts and ranks)")
    spec, plain = per_step(recs, "rollout_tokens_per_s"), per_step(recs, "plain_rollout_tokens_per_s")
    if spec:
        a2.plot(list(spec), list(spec.values()), color=DRAFTER_COLOR, lw=0.8, label="speculative")
    if plain:
        a2.plot(list(plain), list(plain.values()), "o", ms=3, color="#555555", label="plain (same steps, rerun)")
        spec_m = {k: spec[k] for k in plain if k in spec}
        a2.plot(list(spec_m), list(spec_m.values()), "o", ms=3, color=DRAFTER_COLOR)
    a2.set_title("rollout tokens/s")
    acc = per_step(recs, "acceptance_length", where="spec_steps")
    if acc:
        a3.plot(list(acc), list(acc.values()), color="#55A868", lw=0.8)
    a3.set_title("rollout acceptance (tokens per verification)")
    for a in (a1, a2, a3):
        a.set_xlabel("RL step")
    _save(plt, fig, (a1, a2, a3), out)
    return True


__all__ = ["KIND_COLORS", "plot_curves", "plot_rl", "plot_timeline"]
