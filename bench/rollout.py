"""bench-rollout: adaptive speculative rollouts vs plain KV-cached decoding, batch 1/4/16/64, greedy and temperature 1.

Models (CPU debug setting; trained once, cached under bench/results/cache/, keyed by their config):
- target: 8 layers, dim 128, 4 heads (the `debug` preset with n_layers 8, dim 128; 1.6M parameters),
  trained as a byte-level LM on Python standard-library source (builtin:python-stdlib) for a few
  hundred steps, so its greedy continuations are as predictable as a real (small) LM's;
- drafter: a 1-layer LM, dim 64 (~1/8 of the target's per-token cost on CPU), distilled from the
  target's logits on the target's own greedy continuations of held-out text (the tokens it must guess);
- temperature-1 target (TRAIN_T1; its own cache entry, the greedy one unchanged): the same model trained
  1000 steps instead of 200. The 200-step target samples near-random bytes at temperature 1, a
  distribution the drafter copies almost exactly (sum min(p, q) 0.95 per token), which would flatter
  speculation; this one's samples are sharper and harder to copy (0.76 per token);
- temperature-1 drafter (DISTIL_T1; cache file rollout-t1-<key>.pt): that target's greedy drafter
  further distilled with soft CE against the target's full distribution on the target's *sampled*
  (temperature 1) continuations of other training-text prompts: the contexts a rollout at temperature
  1 visits, and the objective rejection sampling rewards (acceptance = sum min(p, q)); what a drafter
  trained continually on RL rollouts would see.
Prompts are 32-byte snippets of held-out stdlib text; no EOS (every row generates max_new tokens, so the
batch stays full). For each temperature (0: greedy keys; 1: the `_t1` keys) and batch size, plain and
adaptive (Bandit, batchThreshold 32, maxDraftTokens 8) engines are warmed up once (the controller learns
its cost table there, as a long-running engine does), then run as `reps` interleaved pairs in ABBA
order; speedup = median over pairs of plain time / adaptive time (robust to the load of a shared
machine); min_cpu_speedup(_t1) and detail.*.cpu_speedup: the same from the process's CPU time (one torch
thread), which leaves out the waits for a core that a loaded machine adds to wall time. acceptance_length(_t1): tokens per row-verification at batch 1 (median over repetitions).
Greedy: speculative output == plain output is asserted (CPU). Temperature 1: the two engines sample
different (equally distributed: tests/unit/workloads/specdec/test_specdec.py) rows; distinct_4gram_fraction_t1 (mean over
the generated rows of distinct 4-grams / 4-grams; ~1: no repetition) shows that the sampled text does not
loop (distinct_4gram_fraction: the same for the greedy rows, which do). detail.acceptance_length_t1_
greedy_drafter: the greedy drafter's acceptance at temperature 1, batch 1, for comparison.

SPECTRAIN_DEVICE=cuda (`make gpu-check`): models trained (cached per device) and run on the GPU, where
the engine replays its decode steps as CUDA graphs. The plain engine gets its own copy of the target
there: engines that take turns on one module re-set up its KV caches, which drops their captured graphs,
and a long-running engine keeps them. Results in bench/results/rollout_gpu.json, plus
cuda_graphs_captured(_t1) and greedy_rows_identical (the fraction of rows whose speculative output equals
plain decoding: on the GPU, kernels for different query lengths may round differently, so a near-tie
can flip a greedy token; recorded there, asserted on the CPU).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS_DIR, median, parse_args, print_table, write_results
from spectrain_workloads.data import load_corpus
from spectrain_workloads.model import Transformer, model_config
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.specdec.engine import RolloutEngine

CACHE_DIR = RESULTS_DIR / "cache"
TARGET = {"preset": "debug", "overrides": {"dim": 128, "n_layers": 8, "n_heads": 4}}
DRAFTER = {"preset": "debug", "overrides": {"dim": 64, "n_layers": 1, "n_heads": 4}}
TRAIN = {"source": "builtin:python-stdlib", "max_bytes": 4 << 20, "seq": 96, "batch": 16, "steps": 200,
         "lr": 3e-3, "seed": 0, "distil_prompts": 192, "distil_new": 96, "distil_steps": 600, "distil_lr": 3e-3}
# The temperature-1 rows' target: the same model trained 5x longer (loss ~1.4 vs ~2.45). The 200-step one
# samples near-random bytes at temperature 1 whose distribution a 1-layer drafter copies almost exactly
# (sum min(p, q) 0.95 per token, acceptance 7 of 9), which would flatter speculation; this one's is
# sharper and harder to copy (0.76 per token).
TRAIN_T1 = {**TRAIN, "steps": 1000}
# The temperature-1 drafter: that target's greedy drafter, further distilled on its *sampled* continuations
# (other prompts; overrides the distil_* and seed). Cached in a file of its own, keyed by this + the above.
DISTIL_T1 = {"temperature": 1.0, "init": "greedy drafter", "seed": 10, "distil_prompts": 384, "distil_new": 96,
             "distil_steps": 600, "distil_lr": 2e-3}
PROMPT_LEN = 32
DEVICE = "cuda" if os.environ.get("SPECTRAIN_DEVICE") == "cuda" else "cpu"   # benches run on CPU by default


def build(spec: dict[str, Any], seed: int) -> Transformer:
    m = Transformer(model_config(spec["preset"], spec["overrides"], vocab_size=264))
    m.init_weights(seed)
    return m.to(DEVICE)


def text_prompts(corpus: torch.Tensor, n: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """n snippets of the held-out last 10% of the corpus (BOS + `length` bytes)."""
    rng = random.Random(seed)
    lo = int(corpus.numel() * 0.9)
    starts = [rng.randrange(lo, corpus.numel() - length) for _ in range(n)]
    return [[257] + corpus[s: s + length].tolist() for s in starts]


def train_target(target: Transformer, corpus: torch.Tensor, cfg: dict[str, Any]) -> float:
    gen = torch.Generator().manual_seed(cfg["seed"])
    train_end = int(corpus.numel() * 0.9) - cfg["seq"] - 1
    opt = torch.optim.AdamW(target.parameters(), lr=cfg["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=cfg["steps"], pct_start=0.1)
    target.train()
    loss = torch.zeros(())
    for i in range(cfg["steps"]):
        idx = torch.randint(0, train_end, (cfg["batch"],), generator=gen)
        x = torch.stack([corpus[j: j + cfg["seq"] + 1] for j in idx.tolist()]).to(DEVICE)
        loss = torch.nn.functional.cross_entropy(target(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if i % 50 == 0:
            print(f"  target step {i}: loss {float(loss):.3f}", flush=True)
    target.eval()
    return float(loss.detach())


def distil(target: Transformer, drafter: Transformer, corpus: torch.Tensor, cfg: dict[str, Any],
           temperature: float = 0.0) -> float:
    """Soft CE of the drafter against the target's full distribution (softmax at temperature 1, the one
    rejection sampling compares the drafter with: acceptance = sum min(p, q)) on the target's own
    continuations of training-text prompts: greedy ones (temperature 0) or sampled ones (temperature 1)."""
    rng = random.Random(cfg["seed"] + 1)
    train_end = int(corpus.numel() * 0.9) - PROMPT_LEN - 1
    prompts = [[257] + corpus[s: s + PROMPT_LEN].tolist()
               for s in (rng.randrange(0, train_end) for _ in range(cfg["distil_prompts"]))]
    eng = RolloutEngine(target, RolloutConfig(max_new_tokens=cfg["distil_new"], temperature=temperature,
                                              eos_id=None, speculative=False, seed=cfg["seed"] + 3))
    rows = [s for i in range(0, len(prompts), 64) for s in eng.generate(prompts[i: i + 64]).sequences]
    seqs = torch.tensor(rows, device=DEVICE)
    with torch.no_grad():
        soft = torch.cat([torch.softmax(target(seqs[i: i + 32]).float(), -1) for i in range(0, len(seqs), 32)])
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg["distil_lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg["seed"] + 2)
    drafter.train()
    loss = torch.zeros(())
    for _ in range(cfg["distil_steps"]):
        idx = torch.randint(0, seqs.size(0), (32,), generator=gen)
        loss = -(soft[idx] * torch.log_softmax(drafter(seqs[idx]).float(), -1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    drafter.eval()
    return float(loss.detach())


def _cache_key(**parts: Any) -> str:
    on_gpu = {"device": "cuda"} if DEVICE == "cuda" else {}     # GPU-trained weights differ: their own entry
    return hashlib.sha1(json.dumps({**parts, **on_gpu}, sort_keys=True).encode()).hexdigest()[:12]


def _save(path: Path, blob: dict[str, Any]) -> None:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)


def trained_models(train: dict[str, Any] = TRAIN) -> tuple[Transformer, Transformer, torch.Tensor, dict[str, Any]]:
    """(target, drafter, corpus, info), from the cache when this exact configuration was trained before."""
    path: Path = CACHE_DIR / f"rollout-{_cache_key(target=TARGET, drafter=DRAFTER, train=train, v=1)}.pt"
    corpus = torch.from_numpy(load_corpus(train["source"], max_bytes=train["max_bytes"]).astype("int64"))
    target, drafter = build(TARGET, 0), build(DRAFTER, 1)
    if path.exists():
        blob = torch.load(path, weights_only=True, map_location=DEVICE)
        target.load_state_dict(blob["target"])
        drafter.load_state_dict(blob["drafter"])
        info = {**json.loads(blob["info"]), "cached": True}
    else:
        print(f"training the bench models once (cached as {path.name}) ...", flush=True)
        t0 = time.perf_counter()
        tloss = train_target(target, corpus, train)
        t1 = time.perf_counter()
        dloss = distil(target, drafter, corpus, train)
        info = {"target_loss": tloss, "drafter_loss": dloss, "target_train_s": t1 - t0,
                "distil_s": time.perf_counter() - t1}
        _save(path, {"target": target.state_dict(), "drafter": drafter.state_dict(), "info": json.dumps(info)})
        info["cached"] = False
    target.eval()
    drafter.eval()
    return target, drafter, corpus, info


def sampling_drafter(target: Transformer, drafter: Transformer, corpus: torch.Tensor,
                     train: dict[str, Any] = TRAIN) -> tuple[Transformer, dict]:
    """The temperature-1 drafter (DISTIL_T1): a copy of the greedy `drafter` further distilled on the target's
    sampled continuations; cached in its own file, so the greedy models' cache entry stays as it was."""
    key = _cache_key(target=TARGET, drafter=DRAFTER, train=train, v=1, distil_t1=DISTIL_T1)
    path: Path = CACHE_DIR / f"rollout-t1-{key}.pt"
    d1 = copy.deepcopy(drafter)
    if path.exists():
        blob = torch.load(path, weights_only=True, map_location=DEVICE)
        d1.load_state_dict(blob["drafter"])
        info = {**json.loads(blob["info"]), "cached": True}
    else:
        print(f"distilling the temperature-1 drafter once (cached as {path.name}) ...", flush=True)
        t0 = time.perf_counter()
        cfg = {**train, **{k: v for k, v in DISTIL_T1.items() if k not in ("temperature", "init")}}
        dloss = distil(target, d1, corpus, cfg, temperature=DISTIL_T1["temperature"])
        info = {"drafter_loss": dloss, "distil_s": time.perf_counter() - t0}
        _save(path, {"drafter": d1.state_dict(), "info": json.dumps(info)})
        info["cached"] = False
    d1.eval()
    return d1, info


BATCHES = (1, 4, 16, 64)


def distinct_4gram_fraction(rows: list[list[int]]) -> float:
    """Mean over rows of distinct 4-grams / 4-grams of the generated tokens: ~1 for text that does not repeat
    itself, far lower for a continuation caught in a loop."""
    fr = [len({tuple(r[i: i + 4]) for i in range(len(r) - 3)}) / (len(r) - 3) for r in rows if len(r) >= 4]
    return sum(fr) / len(fr) if fr else float("nan")


def measure(target: Transformer, drafter: Transformer, corpus: torch.Tensor, *, temperature: float, new: int,
            reps: int, suffix: str) -> tuple[dict[str, float], dict[str, Any], dict[str, Any]]:
    """Plain vs adaptive rows for every batch size at one temperature -> (keys, detail, extra)."""
    results: dict[str, float] = {}
    detail: dict[str, Any] = {}
    extra: dict[str, Any] = {"rows_identical": 0, "graphs": 0, "responses": []}
    for bs in BATCHES:
        prompts = text_prompts(corpus, bs, seed=100 + bs)
        cfg = RolloutConfig(max_new_tokens=new, temperature=temperature, eos_id=None, max_draft_tokens=8,
                            batch_threshold=32)
        plain = RolloutEngine(copy.deepcopy(target) if DEVICE == "cuda" else target, cfg, None)
        spec = RolloutEngine(target, cfg, drafter)
        ref = plain.generate(prompts)                             # warm-up both
        out = spec.generate(prompts)
        if temperature == 0:
            assert DEVICE == "cuda" or out.sequences == ref.sequences, "speculative greedy output differs from plain"
            extra["rows_identical"] += sum(a == b for a, b in zip(out.sequences, ref.sequences, strict=True))
        extra["responses"] += ref.responses + out.responses
        tp, ts, acc, ks = [], [], [], []
        cpu: dict[str, list[float]] = {"plain": [], "spec": []}   # process CPU seconds per run (1 torch thread)
        for i in range(reps):                                   # pairs in ABBA order: drift cancels
            for which in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                c0 = time.process_time()
                if which == "plain":
                    tp.append(plain.generate(prompts).stats.seconds)
                    cpu["plain"].append(time.process_time() - c0)
                    continue
                r = spec.generate(prompts)
                cpu["spec"].append(time.process_time() - c0)
                ts.append(r.stats.seconds)
                acc.append(r.stats.acceptance_length)
                ks.extend(k for _, _, k in r.stats.trace)
        ratios = [p / q for p, q in zip(tp, ts, strict=True)]
        cpu_ratios = [p / q for p, q in zip(cpu["plain"], cpu["spec"], strict=True)]
        results[f"speedup_bs{bs}{suffix}"] = median(ratios)
        if bs == 1:
            results[f"acceptance_length{suffix}"] = median(acc)
        used = {k: ks.count(k) for k in sorted(set(ks))}
        extra["graphs"] += sum(len(e.graphs.graphs) for e in (plain, spec) if e.graphs is not None)
        detail[f"bs{bs}{suffix}"] = {"plain_ms": median(tp) * 1e3, "adaptive_ms": median(ts) * 1e3,
                                     "acceptance_length": median(acc), "draft_lengths_used": used,
                                     "pair_speedups": [round(r, 3) for r in ratios],   # the spread: this machine's noise
                                     "cpu_speedup": median(cpu_ratios), "pair_cpu_speedups": [round(r, 3) for r in cpu_ratios]}
        print(f"bs{bs}{suffix}: plain {median(tp) * 1e3:.1f} ms, adaptive {median(ts) * 1e3:.1f} ms, "
              f"acceptance {median(acc):.2f}, draft length: steps {used}", flush=True)
    results[f"min_speedup{suffix}"] = min(results[f"speedup_bs{b}{suffix}"] for b in BATCHES)
    results[f"min_cpu_speedup{suffix}"] = min(detail[f"bs{b}{suffix}"]["cpu_speedup"] for b in BATCHES)
    return results, detail, extra


def acceptance_at_bs1(target: Transformer, drafter: Transformer, corpus: torch.Tensor, *, temperature: float,
                      new: int, reps: int) -> float:
    """Median acceptance length of `drafter` at batch 1 (for the record: the greedy drafter at temperature 1)."""
    cfg = RolloutConfig(max_new_tokens=new, temperature=temperature, eos_id=None, max_draft_tokens=8,
                        batch_threshold=32)
    eng = RolloutEngine(target, cfg, drafter)
    prompts = text_prompts(corpus, 1, seed=101)
    eng.generate(prompts)
    return median([eng.generate(prompts).stats.acceptance_length for _ in range(reps)])


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    quick = args.quick
    new, reps = (32, 4) if quick else (96, 10)          # quick: both temperatures in < 60 s
    target, drafter, corpus, info = trained_models()
    target_t1, drafter_g1, _, info_t1 = trained_models(TRAIN_T1)
    drafter_t1, info_t1["drafter_t1"] = sampling_drafter(target_t1, drafter_g1, corpus, TRAIN_T1)
    info["t1"] = info_t1
    print(f"models: {info}")
    results, detail, greedy = measure(target, drafter, corpus, temperature=0, new=new, reps=reps, suffix="")
    r1, d1, sampled = measure(target_t1, drafter_t1, corpus, temperature=1.0, new=new, reps=reps, suffix="_t1")
    results.update(r1)
    detail.update(d1)
    results["distinct_4gram_fraction_t1"] = distinct_4gram_fraction(sampled["responses"])
    results["distinct_4gram_fraction"] = distinct_4gram_fraction(greedy["responses"])     # greedy, for contrast
    detail["acceptance_length_t1_greedy_drafter"] = acceptance_at_bs1(target_t1, drafter_g1, corpus, temperature=1.0,
                                                                      new=new, reps=3)
    if DEVICE == "cuda":
        results["cuda_graphs_captured"] = greedy["graphs"]
        results["cuda_graphs_captured_t1"] = sampled["graphs"]
        results["greedy_rows_identical"] = greedy["rows_identical"] / sum(BATCHES)
    name = "rollout" if DEVICE == "cpu" else "rollout_gpu"
    write_results(name, {**results, "detail": detail, "models": info}, quick)
    print_table("bench-rollout (target 8L dim128 trained on stdlib text, drafters 1L dim64 distilled; "
                "greedy, then temperature 1 (_t1))", results)


if __name__ == "__main__":
    main()
