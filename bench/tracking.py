"""bench-tracking: does the demo's drafter keep up with the target it drafts for?

Runs examples/demo.yaml (`spectrain run`, as `make demo`), then on the run's final target:
- export_on_final_target   expected accepted length (k=4) of the exported drafter on held-out text
- ceiling_on_final_target  the same for a fresh drafter of the same preset and optimizer trained
                           offline on the final target alone until it plateaus (median of its last
                           five measurements): what any drafter of this size can reach on this target
- tracking_ratio           export / ceiling (1.0: the continually trained drafter lost nothing to
                           the target moving under it)
- acceptance_final, acceptance_peak, final_over_peak   the drafter's own in-run measurements (the
                           job's held-out chunks, the target of the moment), as the demo prints them
- peak_over_ceiling        the in-run peak / the ceiling: above 1 when the peak was measured against
                           a target that was still predicting near-constant tokens

Run: python -m bench.tracking [--quick] [--drafter-lr LR]   (make bench-tracking [QUICK=1])
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.combine import grads, new_drafter, step, trainable
from bench.common import print_table, write_results
from bench.fleet import acceptance, final_target, heldout
from spectrain_api import rundir
from spectrain_operator.local_layout import run_volume

ROOT = Path(__file__).resolve().parents[1]


def run_demo(root: Path, drafter_lr: float | None) -> tuple[Path, int]:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    if drafter_lr is not None:
        job["spec"]["drafter"]["optimizer"] = {"lr": drafter_lr}
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(job))
    res = subprocess.run([sys.executable, "-m", "spectrain_operator.cli", "run", str(path), "--run-dir",
                          str(root / "run")], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"demo run failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return run_volume(root / "run"), int(job["spec"]["target"]["model"]["overrides"]["n_layers"])


def in_run_acceptance(data: Path) -> list[float]:
    """The exporting drafter's acceptance measurements in order (drafter/metrics-rank-<last>.jsonl)."""
    _, log = rundir.drafter_metrics_files(data)[-1]
    return [float(e["acceptance_length"]) for e in map(json.loads, log.open()) if e.get("event") == "acceptance"]


def ceiling(target: Any, samples: int) -> tuple[float, list[float]]:
    """A fresh drafter trained offline on the final target: (plateau acceptance, curve)."""
    from spectrain_workloads.drafter.settings import DrafterSettings
    from spectrain_workloads.drafter.synthetic import target_hidden, text_sequences
    from spectrain_workloads.drafter.verify import measure

    s = DrafterSettings()
    model = new_drafter(target)
    opt = torch.optim.AdamW(trainable(model), lr=s.lr, weight_decay=0.0)
    held, curve, seen, i = heldout(target), [], 0, 0
    b = s.samples_per_step
    while seen < samples:
        x = text_sequences(64, s.seq_cap + 1, seed=1000 + i)   # training text, disjoint seeds from held-out
        h = target_hidden(target, x)
        for j in range(0, len(x), b):
            grads(model, (x[j:j + b], h[j:j + b]))
            step(model, opt)
        seen, i = seen + len(x), i + 1
        if i % 10 == 0:
            curve.append(float(measure(model, held, None, k=4).acceptance_length))
    return statistics.median(curve[-5:]), curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter offline ceiling (the demo runs whole)")
    ap.add_argument("--drafter-lr", type=float, default=None, help="override spec.drafter.optimizer.lr")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="spectrain-bench-tracking-") as tmp:
        t0 = time.monotonic()
        data, n_layers = run_demo(Path(tmp), args.drafter_lr)
        wall = time.monotonic() - t0
        target = final_target(data, n_layers)
        export, _ = acceptance(data, target)
        in_run = in_run_acceptance(data)
    plateau, curve = ceiling(target, 6_400 if args.quick else 25_600)
    keys = {
        "export_on_final_target": export,
        "ceiling_on_final_target": plateau,
        "tracking_ratio": export / plateau,
        "acceptance_final": in_run[-1],
        "acceptance_peak": max(in_run),
        "final_over_peak": in_run[-1] / max(in_run),
        "peak_over_ceiling": max(in_run) / plateau,
        "demo_wall_s": wall,
        "drafter_lr": args.drafter_lr,
        "ceiling_curve": [round(c, 3) for c in curve],
    }
    print_table("bench-tracking (examples/demo.yaml)", {k: v for k, v in keys.items() if k != "ceiling_curve"})
    write_results("tracking", keys, args.quick)


if __name__ == "__main__":
    main()
