"""bench-controller: the adaptive draft-length controller against plain decoding, over drafter quality x batch x temperature.

The claim under test: speculation never loses. For every cell of the grid the adaptive engine (Bandit,
maxDraftTokens 8, batchThreshold 64 so the controller alone decides at every batch size) and a plain
engine decode the same prompts; ratio = plain time / adaptive time.

Models: bench-rollout's (bench/rollout.py, trained once and cached under bench/results/cache/): the
greedy target and its distilled drafter for temperature 0, the temperature-1 target and its
sampling-distilled drafter for temperature 1. Drafter quality, reproducibly: the drafter's weights
interpolated between its untrained initialisation (bench-rollout's seed) and its trained weights,
theta = (1 - lam) * theta_init + lam * theta_trained, lam = QUALITY[name][temperature]:
untrained (lam 0: acceptance ~1 token per verification), partial (acceptance ~2), trained (lam 1:
~4 at temperature 1; the greedy target's continuations loop, so ~9 there). The acceptance measured
in each cell is recorded next to its ratio.

Protocol per cell: both engines warmed up once (the controller calibrates its cost model and learns
acceptance there, as a long-running engine does), then `reps` interleaved pairs in ABBA order (drift
on a shared machine cancels); ratio = median over pairs of plain / adaptive wall time, spread = (min,
max) of the pairs. ratio_cpu: the same with the process's CPU time (torch on one thread): what each
side computes, without the waits for a core that a loaded shared machine adds to wall time (the
controller itself decides on wall time). Greedy cells assert the adaptive output equals plain
decoding's.

Keys: min_ratio (goal >= 0.97 in every cell) and the cell it comes from; ratio_trained_bs1_t1 (goal
>= 1.6, bench-rollout's speedup_bs1_t1); the same two from CPU time (_cpu); plain_share_untrained (share of decode steps with k = 0
over the untrained cells); acceptance_{quality} (tokens per verification at batch 1, temperature 1);
detail.<quality>_bs<B>_t<T>: ratio, spread, pairs, times, acceptance, plain_share, k_histogram.
load_average: os.getloadavg() before and after (this machine is shared).

A/A control: the same protocol with a plain engine on both sides (aa_bs<B>_t<T>, every batch and
temperature): both sides do identical work, so aa_min_ratio / aa_max_ratio show how far a cell's median
strays from 1 by noise alone on this machine in this run. A cell below 0.97 by no more than the A/A
cells stray is not evidence of a loss.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch

from bench.common import median, parse_args, print_table, write_results
from bench.rollout import (
    DRAFTER,
    TRAIN_T1,
    build,
    sampling_drafter,
    text_prompts,
    trained_models,
)
from spectrain_workloads.model import Transformer
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.specdec.engine import RolloutEngine

# lam, the share of the trained weights, per temperature: partial gives ~2 tokens per verification at
# batch 16 with maxDraftTokens 8 (Fixed) on these models (0.4 greedy: 2.2-2.4; 0.7 at temperature 1: 1.96).
QUALITY = {"untrained": {0.0: 0.0, 1.0: 0.0}, "partial": {0.0: 0.4, 1.0: 0.7}, "trained": {0.0: 1.0, 1.0: 1.0}}
BATCHES = (1, 4, 16, 64)
TEMPERATURES = (0.0, 1.0)
MAX_DRAFT = 8
BATCH_THRESHOLD = 64        # the controller, not a fixed threshold, decides at every batch size here


def mixed(init: Transformer, trained: Transformer, lam: float) -> Transformer:
    """(1 - lam) * init + lam * trained, parameter by parameter."""
    out = copy.deepcopy(trained)
    with torch.no_grad():
        for p, a, b in zip(out.parameters(), init.parameters(), trained.parameters(), strict=True):
            p.copy_((1 - lam) * a + lam * b)
    return out.eval()


def cell(target: Transformer, drafter: Transformer | None, prompts: list[list[int]], *, temperature: float, new: int,
         reps: int) -> dict[str, Any]:
    cfg = RolloutConfig(max_new_tokens=new, temperature=temperature, eos_id=None, max_draft_tokens=MAX_DRAFT,
                        batch_threshold=BATCH_THRESHOLD, strategy="Bandit")
    plain = RolloutEngine(target, cfg, None)
    spec = RolloutEngine(target, cfg, drafter)
    ref = plain.generate(prompts)                                   # warm-up both
    out = spec.generate(prompts)
    if temperature == 0:
        assert out.sequences == ref.sequences, "adaptive greedy output differs from plain"
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "spec": []}     # (wall s, CPU s) per run
    acc, hist, steps, plain_steps = [], {}, 0, 0
    for i in range(reps):                                           # ABBA: drift cancels
        for which in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
            w0, c0 = time.perf_counter(), time.process_time()
            st = (plain if which == "plain" else spec).generate(prompts).stats
            times[which].append((time.perf_counter() - w0, time.process_time() - c0))
            if which == "plain":
                continue
            if st.verified_rows:
                acc.append(st.acceptance_length)
            for k, n in st.k_histogram.items():
                hist[k] = hist.get(k, 0) + n
            steps += st.decode_steps
            plain_steps += st.decode_steps - st.spec_steps
    ratios = [p[0] / s[0] for p, s in zip(times["plain"], times["spec"], strict=True)]
    cpu = [p[1] / s[1] for p, s in zip(times["plain"], times["spec"], strict=True)]
    return {"ratio": median(ratios), "spread": [min(ratios), max(ratios)], "pairs": [round(r, 3) for r in ratios],
            "ratio_cpu": median(cpu), "spread_cpu": [min(cpu), max(cpu)],
            "plain_ms": median([t[0] for t in times["plain"]]) * 1e3,
            "adaptive_ms": median([t[0] for t in times["spec"]]) * 1e3,
            "acceptance_length": median(acc) if acc else 1.0, "plain_share": plain_steps / steps,
            "k_histogram": {str(k): n for k, n in sorted(hist.items())}}


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    new, reps = (32, 5) if args.quick else (64, 21)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    target0, drafter0, corpus, _ = trained_models()
    target1, drafter_g1, _, _ = trained_models(TRAIN_T1)
    drafter1, _ = sampling_drafter(target1, drafter_g1, corpus, TRAIN_T1)
    init = build(DRAFTER, 1).eval()                 # bench-rollout's drafter initialisation (seed 1)
    models = {0.0: (target0, drafter0), 1.0: (target1, drafter1)}
    detail: dict[str, Any] = {}
    for temperature in TEMPERATURES:
        target, trained = models[temperature]
        for name, lam in QUALITY.items():
            drafter = mixed(init, trained, lam[temperature])
            for bs in BATCHES:
                key = f"{name}_bs{bs}_t{int(temperature)}"
                detail[key] = c = cell(target, drafter, text_prompts(corpus, bs, seed=100 + bs),
                                       temperature=temperature, new=new, reps=reps)
                print(f"{key}: ratio {c['ratio']:.3f} (pairs {c['spread'][0]:.2f}-{c['spread'][1]:.2f}), "
                      f"CPU-time ratio {c['ratio_cpu']:.3f} ({c['spread_cpu'][0]:.2f}-{c['spread_cpu'][1]:.2f}), "
                      f"acceptance {c['acceptance_length']:.2f}, plain share {c['plain_share']:.2f}, "
                      f"k {c['k_histogram']}", flush=True)
    aa: dict[str, Any] = {}
    for temperature in TEMPERATURES:
        for bs in BATCHES:
            key = f"aa_bs{bs}_t{int(temperature)}"
            aa[key] = c = cell(models[temperature][0], None, text_prompts(corpus, bs, seed=100 + bs),
                               temperature=temperature, new=new, reps=reps)
            print(f"{key} (plain vs plain): ratio {c['ratio']:.3f} (pairs {c['spread'][0]:.2f}-{c['spread'][1]:.2f})",
                  flush=True)
    worst = min(detail, key=lambda k: detail[k]["ratio"])
    worst_cpu = min(detail, key=lambda k: detail[k]["ratio_cpu"])
    untrained = [c for k, c in detail.items() if k.startswith("untrained")]
    results: dict[str, Any] = {
        "min_ratio": detail[worst]["ratio"], "min_ratio_cell": worst,
        "min_ratio_cpu": detail[worst_cpu]["ratio_cpu"], "min_ratio_cpu_cell": worst_cpu,
        "ratio_trained_bs1_t1": detail["trained_bs1_t1"]["ratio"],
        "ratio_trained_bs1_t1_cpu": detail["trained_bs1_t1"]["ratio_cpu"],
        "plain_share_untrained": sum(c["plain_share"] for c in untrained) / len(untrained),
        **{f"acceptance_{name}": detail[f"{name}_bs1_t1"]["acceptance_length"] for name in QUALITY},
        "cells_below_0.97": sorted(k for k, c in detail.items() if c["ratio"] < 0.97),
        "aa_min_ratio": min(c["ratio"] for c in aa.values()),
        "aa_max_ratio": max(c["ratio"] for c in aa.values()),
    }
    results["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    results["wall_s"] = time.perf_counter() - t_start
    write_results("controller", {**results, "detail": detail, "aa": aa, "quality_lambda": QUALITY, "new_tokens": new,
                                 "pairs": reps}, args.quick)
    print_table("bench-controller (adaptive vs plain; quality x batch x temperature)",
                {k: v for k, v in results.items() if k != "load_average"})


if __name__ == "__main__":
    main()
