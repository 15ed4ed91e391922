"""report.md, summary.json and the PNGs of a run, and the headline lines `spectrain run --report` prints."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from spectrain_workloads.report.data import load
from spectrain_workloads.report.plots import plot_curves, plot_rl, plot_timeline
from spectrain_workloads.report.rl import step_rows
from spectrain_workloads.report.summary import summarize

# Shown in report.md's own sections (or only in summary.json), not in the figures table.
_SECTIONED = ("per_rank", "harvested_s_by_rank", "effective_s_by_rank", "reward_by_step", "rollout_acceptance_by_step")


def _fmt(v: Any, unit: str = "") -> str:
    if isinstance(v, float):
        return f"{v:.4g}{unit}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x:.3g}{unit}" for k, x in v.items() if x) or "-"
    return "-" if v is None else f"{v}{unit}"


def _unusable(p: dict[str, Any]) -> str:
    u, v = p.get("unusable_s"), p.get("windows_verify_only")
    return "-" if u is None else f"{u:.3g} s" + (f", {v} windows verify-only" if v else "")


def _rank_line(p: dict[str, Any]) -> str:
    mbs = p.get("exchange_mb_per_s")
    return (f"idle {_fmt(p['idle_s_by_kind'], ' s')} | harvested {_fmt(p['harvested_s_by_kind'], ' s')} | "
            f"too short {_unusable(p)} | "
            f"effective {p['effective_s']:.3g} s{' (exports)' if p.get('exports') else ''} | "
            f"exchange {'-' if mbs is None else f'{mbs:.3g} MB/s'} | drafter {p['drafter']}")


def _rl_lines(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of the RL headline: the reward curve, the speedup, the drafter's acceptance."""
    if s.get("reward_first") is None:
        return []
    n = s.get("reward_window_steps")
    lines = [("reward", f"{s['reward_first']:.3f} -> {s['reward_last']:.3f} (mean of first / last {n} steps)")]
    if s.get("rl_step_speedup") is not None:
        how = (f"median of {s['rl_step_speedup_steps']} steps measured side by side"
               if s.get("rl_step_speedup_source") == "side-by-side" else "vs the --baseline run")
        lines.append(("rl_step_speedup", f"{s['rl_step_speedup']:.3f}x with speculation ({how}; step "
                                         f"{_fmt(s.get('rl_step_s'), ' s')} vs {_fmt(s.get('rl_step_s_plain'), ' s')} plain)"))
    else:
        lines.append(("rl_step_speedup", "- (no step measured plainly: SPECTRAIN_RL_PLAIN_EVERY or --baseline)"))
    if s.get("rollout_tokens_per_s") is not None:
        plain = s.get("plain_rollout_tokens_per_s")
        lines.append(("rollout_tokens_per_s", f"{s['rollout_tokens_per_s']:.4g} speculative"
                                              + (f", {plain:.4g} plain" if plain is not None else "")))
    if s.get("rollout_acceptance_last") is not None:
        lines.append(("rollout_acceptance", f"{s['rollout_acceptance_first']:.3g} -> {s['rollout_acceptance_last']:.3g} "
                                            f"tokens per verification (first / last {n} steps)"))
    return lines


def build_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = load(run_dir)
    s = summarize(run_dir, ranks)
    has_tl = plot_timeline(ranks, out_dir / "timeline.png")
    has_curves = plot_curves(ranks, out_dir / "curves.png")
    has_rl = plot_rl(ranks, out_dir / "rl.png")
    lines = [f"# spectrain run report: {run_dir}", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in s.items() if k not in _SECTIONED]
    lines += ["", "## Per rank", "",
              "Effective: harvested seconds whose result reaches the exported drafter. Too short: idle "
              "seconds in windows shorter than the drafter's unit of work + margin (or of kinds it does not "
              "use); verify-only: windows used for an acceptance measurement only.", "",
              "| rank | idle by kind (s) | harvested by kind (s) | too short | effective (s) | exchange (MB/s) | drafter |",
              "|---|---|---|---|---|---|---|"]
    for r, p in s["per_rank"].items():
        mbs = p.get("exchange_mb_per_s")
        lines.append(f"| {r} | {_fmt(p['idle_s_by_kind'])} | {_fmt(p['harvested_s_by_kind'])} | {_unusable(p)} | "
                     f"{p['effective_s']:.3g}{' (exports)' if p['exports'] else ''} | {_fmt(mbs)} | {p['drafter']} |")
    if has_rl:
        lines += ["", "## RL", ""] + [f"- {label}: {text}" for label, text in _rl_lines(s)]
        lines += ["", "![rl](rl.png)", "",
                  "| step | reward | rollout s | tokens/s | plain rollout s | plain tokens/s | step speedup | acceptance |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in step_rows(ranks):
            lines.append(f"| {row['step']} | " + " | ".join(_fmt(row[k]) for k in (
                "reward", "rollout_s", "rollout_tokens_per_s", "plain_rollout_s", "plain_rollout_tokens_per_s",
                "rl_step_speedup", "acceptance_length")) + " |")
    if has_tl:
        lines += ["", "## Timeline (per rank)", "", "![timeline](timeline.png)"]
    if has_curves:
        lines += ["", "## Loss and acceptance", "", "![curves](curves.png)"]
    (out_dir / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def headline(s: dict[str, Any]) -> list[str]:
    """The lines printed at the end of `make demo` / `make demo-rl` (from summary.json)."""
    rows: list[tuple[str, str]] = [(k, _fmt(s.get(k))) for k in ("steps", "final_loss", "idle_s", "harvested_s")]
    eff = s.get("effective_harvest_fraction")
    rows.append(("effective_harvest", "-" if eff is None else
                 f"{s.get('effective_harvest_s', 0.0):.3g} s = {eff:.3g} of idle (reaches the exported drafter)"))
    rows.append(("harvest_efficiency", _fmt(s.get("harvest_efficiency"))))
    acc, peak = s.get("acceptance_length"), s.get("acceptance_length_peak")
    rows.append(("acceptance_length", "-" if acc is None else f"{acc:.3g} final, {_fmt(peak)} peak"))
    rows += [(k, _fmt(s.get(k))) for k in ("target_slowdown_ratio", "artifact")]
    rejected = s.get("exports_rejected_by_cause") or {}
    rows.append(("exports_rejected", ", ".join(f"{n} {c}" for c, n in rejected.items() if n) or "none"))
    adjusted = s.get("combine_adjusted_by_cause") or {}
    rows.append(("combine_adjusted", ", ".join(f"{n} {c}" for c, n in adjusted.items() if n) or "none"))
    if s.get("serving_layouts"):
        rows.append(("serving_layouts", ", ".join(s["serving_layouts"])))
    rows += [(f"rank {r}", _rank_line(p)) for r, p in (s.get("per_rank") or {}).items()]
    rows += _rl_lines(s)
    return [f"  {k:<24} {v}" for k, v in rows]


def print_headline(run_dir: Path, report_path: Path) -> None:
    s = json.loads((report_path.parent / "summary.json").read_text())
    print("\nspectrain headline figures")
    for line in headline(s):
        print(line)
    print(f"  {'report':<24} {report_path}")


def main(args: argparse.Namespace) -> int:
    path = build_report(Path(args.run_dir))
    print_headline(Path(args.run_dir), path)
    return 0


__all__ = ["build_report", "headline", "main", "print_headline"]
