"""`spectrain report RUN_DIR`: what a run did, as markdown + PNGs + summary.json.

Reads only the files the workloads write (docs/contracts.md "Run directory layout"):
- `data`: the run's metrics, windows, drafter logs and summaries, per rank;
- `harvest`: idle and harvested seconds by kind per rank, the effective harvest (drafter work that
  reaches the exported model / idle time), exchange MB/s, the drafter's final and peak acceptance;
- `rl`: for mode RL, the reward per step and speculative vs plain rollouts and RL steps, measured
  side by side in the run (or against a `--baseline` run);
- `summary`: summary.json (target step time with and without the drafter when `spectrain run
  --baseline` ran both, where the drafter artifact is, and all of the above);
- `plots`: a timeline per rank with every rank's drafter, loss/acceptance curves, the RL curves;
- `render`: report.md and the headline lines `make demo` / `make demo-rl` print.
"""

from __future__ import annotations

from spectrain_workloads.report.data import RankData, data_dir, load, read_jsonl
from spectrain_workloads.report.harvest import acceptance, harvest
from spectrain_workloads.report.plots import KIND_COLORS, plot_curves, plot_rl, plot_timeline
from spectrain_workloads.report.render import build_report, headline, main, print_headline
from spectrain_workloads.report.rl import rl_figures
from spectrain_workloads.report.summary import artifact, step_times, summarize

__all__ = ["KIND_COLORS", "RankData", "acceptance", "artifact", "build_report", "data_dir", "harvest", "headline",
           "load", "main", "plot_curves", "plot_rl", "plot_timeline", "print_headline", "read_jsonl", "rl_figures",
           "step_times", "summarize"]
