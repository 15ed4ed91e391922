"""What the export gate's paired measurement costs: the time of one gate decision's verification round
on the same held-back batch, three ways, interleaved in one process (ratios are side by side):

- plain: the candidate alone (what a gate comparing with a stored number measures);
- paired: what the gate runs, every chunk measured by the candidate and then by LATEST (two tasks,
  each the size of a plain chunk, so each fits the windows a plain chunk fits).

    PYTHONPATH=operator:workloads python scripts/export_gate_cost.py [--device cpu] [--arch Eagle] [--repeats 25]

The drafter is the real DrafterTrainer of the preset (debug: its eval_samples held-back sequences of
seq_cap positions) on a random target of the debug model config; LATEST is held by
drafter.export_latest.LatestDrafter. Prints one JSON line (median milliseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from spectrain_workloads.drafter.combiner import Sample
from spectrain_workloads.drafter.export_latest import LatestDrafter
from spectrain_workloads.drafter.models import TargetShared
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.model import model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arch", default="Eagle", choices=["Eagle", "LM"])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    cfg = model_config("debug", {"max_seq_len": 64})
    g = torch.Generator().manual_seed(0)
    shared = TargetShared(embedding=torch.randn(cfg.vocab_size, cfg.dim, generator=g),
                          lm_head=torch.randn(cfg.vocab_size, cfg.dim, generator=g), model_config=cfg,
                          digest="cost", stamp=(0,))
    s = DrafterSettings(arch=args.arch, preset=args.preset)
    tr = DrafterTrainer(s, shared, dev)
    held = [Sample(tokens=torch.randint(0, cfg.vocab_size, (s.seq_cap,), generator=g).to(dev),
                   hidden=torch.randn(s.seq_cap, cfg.dim, generator=g).to(dev), step=0)
            for _ in range(s.eval_samples)]
    latest = LatestDrafter()
    latest.take(tr.model, 1)

    def decision(reference: Any) -> tuple[float, int]:
        """Seconds and tasks of one verification round (a gate decision's measurement)."""
        t0, tasks, result = time.perf_counter(), 0, None
        tr.begin_verify(held, reference)
        while result is None:
            result, tasks = tr.verify_chunk(), tasks + 1
        return time.perf_counter() - t0, tasks

    runs: dict[str, list[tuple[float, int]]] = {"plain": [], "paired": []}
    for i in range(args.repeats + 2):            # the first two warm up
        for name, ref in (("plain", None), ("paired", latest.module)):
            if i >= 2:
                runs[name].append(decision(ref))
            else:
                decision(ref)
    out: dict[str, Any] = {"device": str(dev), "arch": args.arch, "held_back": len(held), "seq": s.seq_cap}
    for name, xs in runs.items():
        ms = statistics.median(t for t, _ in xs) * 1e3
        out[f"{name}_round_ms"], out[f"{name}_task_ms"] = round(ms, 2), round(ms / xs[0][1], 2)
    out["paired_over_plain"] = round(out["paired_round_ms"] / out["plain_round_ms"], 3)
    trainable = sum(p.numel() * p.element_size() for p in tr.model.parameters() if p.requires_grad)
    out["latest_copy_mb"] = round(trainable / 2**20, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
