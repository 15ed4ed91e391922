"""`spectrain report RUN_DIR`: what a run did, as markdown + PNGs.

Reads only the files the workloads write (docs/contracts.md "Run directory layout"):
- a timeline per rank: target busy time, idle windows by kind, drafter work inside them;
- harvest efficiency, harvested seconds by kind, overruns;
- target step time with and without the drafter (when `spectrain run --baseline` ran both);
- drafter acceptance over time; target and drafter loss curves; where the drafter artifact is.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KIND_COLORS = {"Bubble": "#4C72B0", "Communication": "#55A868", "Imbalance": "#C44E52", "RolloutTail": "#8172B2"}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue          # a line cut by a kill mid-write
    except FileNotFoundError:
        pass
    return out


def data_dir(run_dir: Path) -> Path:
    """The directory holding metrics/: the run dir itself, or the one a local run recorded."""
    if (run_dir / "metrics").is_dir():
        return run_dir
    layout = run_dir / "layout.json"
    if layout.exists():
        for d in json.loads(layout.read_text()).get("data_dirs", []):
            if (Path(d) / "metrics").is_dir():
                return Path(d)
    raise SystemExit(f"{run_dir}: no metrics/ found; pass the --run-dir of a `spectrain run` or a run volume")


def _rank_of(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


@dataclass(kw_only=True)
class RankData:
    rank: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    drafter: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def load(run_dir: Path) -> dict[int, RankData]:
    d = data_dir(run_dir)
    ranks: dict[int, RankData] = {}
    for p in sorted((d / "metrics").glob("target-rank-*.jsonl")):
        ranks.setdefault(_rank_of(p), RankData(rank=_rank_of(p))).steps = read_jsonl(p)
    for p in sorted((d / "metrics").glob("windows-rank-*.jsonl")):
        ranks.setdefault(_rank_of(p), RankData(rank=_rank_of(p))).windows = read_jsonl(p)
    for p in sorted((d / "metrics").glob("drafter-rank-*.jsonl")):
        ranks.setdefault(_rank_of(p), RankData(rank=_rank_of(p))).drafter = read_jsonl(p)
    for p in sorted(d.glob("drafter-summary-rank-*.json")):
        try:
            ranks.setdefault(_rank_of(p), RankData(rank=_rank_of(p))).summary = json.loads(p.read_text())
        except json.JSONDecodeError:
            pass
    return ranks


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


def harvest(ranks: dict[int, RankData]) -> dict[str, Any]:
    idle = {k: 0.0 for k in KIND_COLORS}
    harvested = {k: 0.0 for k in KIND_COLORS}
    overruns: list[float] = []
    for rd in ranks.values():
        ends = {}
        for w in rd.windows:
            idle[w["kind"]] = idle.get(w["kind"], 0.0) + w.get("actual_ns", 0) / 1e9
            ends[w["window_id"]] = w["start_ns"] + w.get("actual_ns", 0)
        for ev in rd.drafter:
            if ev.get("event") != "work":
                continue
            kind = ev.get("kind", "Bubble")
            end = ends.get(ev.get("window_id"))
            busy_end = ev["end_ns"] if end is None else min(ev["end_ns"], end)
            harvested[kind] = harvested.get(kind, 0.0) + max(0, busy_end - ev["start_ns"]) / 1e9
            if end is not None:
                overruns.append(max(0, ev["end_ns"] - end) / 1e6)
    total_idle = sum(idle.values())
    total_h = sum(harvested.values())
    effs = [rd.summary["harvestEfficiency"] for rd in ranks.values()
            if isinstance(rd.summary.get("harvestEfficiency"), (int, float))]
    return {
        "idle_s_by_kind": idle, "harvested_s_by_kind": harvested,
        "idle_s": total_idle, "harvested_s": total_h,
        "harvested_fraction_of_idle": total_h / total_idle if total_idle else None,
        "harvest_efficiency": _median(effs),   # the drafter's own: busy / usable idle time
        "overrun_ms_p99": sorted(overruns)[int(0.99 * (len(overruns) - 1))] if overruns else None,
    }


def plot_timeline(ranks: dict[int, RankData], out: Path, max_seconds: float = 4.0) -> bool:
    """Timeline of the last `max_seconds` of the run per rank; False when nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = [w["start_ns"] for rd in ranks.values() for w in rd.windows]
    if not starts:
        return False
    t_end = max(w["start_ns"] + w.get("actual_ns", 0) for rd in ranks.values() for w in rd.windows)
    t0 = max(min(starts), t_end - int(max_seconds * 1e9))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(ranks)))
    for i, r in enumerate(sorted(ranks)):
        rd = ranks[r]
        y = len(ranks) - 1 - i
        ax.broken_barh([(0, (t_end - t0) / 1e9)], (y - 0.4, 0.8), facecolors="#DDDDDD")  # busy
        for kind, color in KIND_COLORS.items():
            bars = [((w["start_ns"] - t0) / 1e9, w.get("actual_ns", 0) / 1e9) for w in rd.windows
                    if w["kind"] == kind and w["start_ns"] >= t0]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.5), facecolors=color, label=kind if i == 0 else None)
        work = [((e["start_ns"] - t0) / 1e9, (e["end_ns"] - e["start_ns"]) / 1e9) for e in rd.drafter
                if e.get("event") == "work" and e["start_ns"] >= t0]
        if work:
            ax.broken_barh(work, (y + 0.12, 0.28), facecolors="#DD8452", label="drafter work" if i == 0 else None)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in sorted(ranks, reverse=True)])
    ax.set_xlabel("seconds (end of run); grey: target busy, lower bars: idle windows, upper: drafter")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper right", fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_curves(ranks: dict[int, RankData], out: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.5))
    drew = False
    for r, rd in sorted(ranks.items()):
        pts = [(s["step"], s["loss"]) for s in rd.steps if isinstance(s.get("loss"), (int, float))]
        if pts:
            a1.plot(*zip(*pts, strict=True), label=f"target rank {r}")
            drew = True
        acc = [(e.get("t_ns", 0), e.get("acceptance_length", e.get("acceptance"))) for e in rd.drafter
               if e.get("event") == "acceptance"]
        acc = [(t, a) for t, a in acc if isinstance(a, (int, float))]
        if acc:
            t0 = acc[0][0]
            a2.plot([(t - t0) / 1e9 for t, _ in acc], [a for _, a in acc], label=f"drafter rank {r}")
            drew = True
    a1.set_title("target loss")
    a1.set_xlabel("step")
    a2.set_title("drafter expected acceptance length")
    a2.set_xlabel("seconds")
    for a in (a1, a2):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drew


def artifact(run_dir: Path, ranks: dict[int, RankData]) -> str | None:
    d = data_dir(run_dir)
    for rd in ranks.values():
        if rd.summary.get("artifact"):
            return str(rd.summary["artifact"])
    for latest in d.rglob("LATEST"):
        return str(latest.parent / latest.read_text().strip())
    return None


def summarize(run_dir: Path, ranks: dict[int, RankData] | None = None) -> dict[str, Any]:
    ranks = load(run_dir) if ranks is None else ranks
    h = harvest(ranks)
    with_d = _median(step_times(ranks))
    base = run_dir / "baseline"
    without = _median(step_times(load(base))) if base.exists() else None
    accs: list[float] = [a for a in (rd.summary.get("acceptanceLength") for rd in ranks.values())
                         if isinstance(a, (int, float))]
    losses = [rd.steps[-1]["loss"] for rd in ranks.values() if rd.steps and "loss" in rd.steps[-1]]
    return {
        "ranks": len(ranks),
        # distinct step records (Pretrain counts from 0, RL from 1; a resume may repeat a step)
        "steps": max((len({s.get("step") for s in rd.steps}) for rd in ranks.values()), default=0),
        "final_loss": min(losses) if losses else None,
        "step_time_s_with_drafter": with_d,
        "step_time_s_without_drafter": without,
        "target_slowdown_ratio": with_d / without if with_d and without else None,
        "acceptance_length": max(accs) if accs else None,
        "artifact": artifact(run_dir, ranks),
        **h,
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x:.3g}" for k, x in v.items() if x)
    return "-" if v is None else str(v)


def build_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = load(run_dir)
    s = summarize(run_dir, ranks)
    has_tl = plot_timeline(ranks, out_dir / "timeline.png")
    has_curves = plot_curves(ranks, out_dir / "curves.png")
    lines = [f"# spectrain run report: {run_dir}", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in s.items()]
    if has_tl:
        lines += ["", "## Timeline (per rank)", "", "![timeline](timeline.png)"]
    if has_curves:
        lines += ["", "## Loss and acceptance", "", "![curves](curves.png)"]
    (out_dir / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def print_headline(run_dir: Path, report_path: Path) -> None:
    s = json.loads((report_path.parent / "summary.json").read_text())
    print("\nspectrain headline figures")
    for key in ("steps", "final_loss", "idle_s", "harvested_s", "harvest_efficiency",
                "acceptance_length", "target_slowdown_ratio", "artifact"):
        print(f"  {key:<24} {_fmt(s.get(key))}")
    print(f"  {'report':<24} {report_path}")


def main(args: argparse.Namespace) -> int:
    path = build_report(Path(args.run_dir))
    print_headline(Path(args.run_dir), path)
    return 0
