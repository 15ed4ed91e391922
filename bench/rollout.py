"""bench-rollout: adaptive speculative rollouts vs plain KV-cached decoding, batch 1/4/16/64.

Models (CPU debug setting; trained once, cached under bench/results/cache/, keyed by their config):
- target: 8 layers, dim 128, 4 heads (the `debug` preset with n_layers 8, dim 128; 1.6M parameters),
  trained as a byte-level LM on Python standard-library source (builtin:python-stdlib) for a few
  hundred steps, so its greedy continuations are as predictable as a real (small) LM's;
- drafter: a 1-layer LM, dim 64 (~1/8 of the target's per-token cost on CPU), distilled from the
  target's logits on the target's own greedy continuations of held-out text (the tokens it must guess).
Prompts are 32-byte snippets of held-out stdlib text; greedy decoding, no EOS (every row generates
max_new tokens, so the batch stays full). For each batch size, plain and adaptive (Bandit,
batchThreshold 32, maxDraftTokens 8) engines are warmed up once (the controller learns its cost
table there, as a long-running engine does), then run as `reps` interleaved pairs in ABBA order;
speedup = median over pairs of plain time / adaptive time (robust to the load of a shared machine).
acceptance_length: tokens per row-verification at batch 1 (median over repetitions).

SPECTRAIN_DEVICE=cuda (`make gpu-check`): models trained (cached per device) and run on the GPU, where
the engine replays its decode steps as CUDA graphs. The plain engine gets its own copy of the target
there: engines that take turns on one module re-set up its KV caches, which drops their captured graphs,
and a long-running engine keeps them. Results in bench/results/rollout_gpu.json, plus
cuda_graphs_captured and greedy_rows_identical (the fraction of rows whose speculative output equals
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
from spectrain_workloads.rl.rollout import RolloutConfig, RolloutEngine

CACHE_DIR = RESULTS_DIR / "cache"
TARGET = {"preset": "debug", "overrides": {"dim": 128, "n_layers": 8, "n_heads": 4}}
DRAFTER = {"preset": "debug", "overrides": {"dim": 64, "n_layers": 1, "n_heads": 4}}
TRAIN = {"source": "builtin:python-stdlib", "max_bytes": 4 << 20, "seq": 96, "batch": 16, "steps": 200,
         "lr": 3e-3, "seed": 0, "distil_prompts": 192, "distil_new": 96, "distil_steps": 600, "distil_lr": 3e-3}
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


def distil(target: Transformer, drafter: Transformer, corpus: torch.Tensor, cfg: dict[str, Any]) -> float:
    """Soft CE of the drafter on the target's greedy continuations of training-text prompts."""
    rng = random.Random(cfg["seed"] + 1)
    train_end = int(corpus.numel() * 0.9) - PROMPT_LEN - 1
    prompts = [[257] + corpus[s: s + PROMPT_LEN].tolist()
               for s in (rng.randrange(0, train_end) for _ in range(cfg["distil_prompts"]))]
    eng = RolloutEngine(target, RolloutConfig(max_new_tokens=cfg["distil_new"], temperature=0, eos_id=None,
                                              speculative=False))
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


def trained_models() -> tuple[Transformer, Transformer, torch.Tensor, dict[str, Any]]:
    """(target, drafter, corpus, info), from the cache when this exact configuration was trained before."""
    on_gpu = {"device": "cuda"} if DEVICE == "cuda" else {}     # GPU-trained weights differ: their own entry
    key = hashlib.sha1(json.dumps({"target": TARGET, "drafter": DRAFTER, "train": TRAIN, "v": 1, **on_gpu},
                                  sort_keys=True).encode()).hexdigest()[:12]
    path: Path = CACHE_DIR / f"rollout-{key}.pt"
    corpus = torch.from_numpy(load_corpus(TRAIN["source"], max_bytes=TRAIN["max_bytes"]).astype("int64"))
    target, drafter = build(TARGET, 0), build(DRAFTER, 1)
    if path.exists():
        blob = torch.load(path, weights_only=True, map_location=DEVICE)
        target.load_state_dict(blob["target"])
        drafter.load_state_dict(blob["drafter"])
        info = {**json.loads(blob["info"]), "cached": True}
    else:
        print(f"training the bench models once (cached as {path.name}) ...", flush=True)
        t0 = time.perf_counter()
        tloss = train_target(target, corpus, TRAIN)
        t1 = time.perf_counter()
        dloss = distil(target, drafter, corpus, TRAIN)
        info = {"target_loss": tloss, "drafter_loss": dloss, "target_train_s": t1 - t0,
                "distil_s": time.perf_counter() - t1}
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"target": target.state_dict(), "drafter": drafter.state_dict(), "info": json.dumps(info)}, tmp)
        tmp.replace(path)
        info["cached"] = False
    target.eval()
    drafter.eval()
    return target, drafter, corpus, info


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    quick = args.quick
    new, reps = (40, 6) if quick else (96, 10)
    target, drafter, corpus, info = trained_models()
    print(f"models: {info}")
    results: dict[str, float] = {}
    detail: dict[str, Any] = {}
    rows_identical, graphs = 0, 0
    for bs in (1, 4, 16, 64):
        prompts = text_prompts(corpus, bs, seed=100 + bs)
        cfg = RolloutConfig(max_new_tokens=new, temperature=0, eos_id=None, max_draft_tokens=8, batch_threshold=32)
        plain = RolloutEngine(copy.deepcopy(target) if DEVICE == "cuda" else target, cfg, None)
        spec = RolloutEngine(target, cfg, drafter)
        ref = plain.generate(prompts).sequences                  # warm-up both
        out = spec.generate(prompts).sequences
        assert DEVICE == "cuda" or out == ref, "speculative greedy output differs from plain"
        rows_identical += sum(a == b for a, b in zip(out, ref, strict=True))
        tp, ts, acc, ks = [], [], [], []
        for i in range(reps):                                   # pairs in ABBA order: drift cancels
            for which in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                if which == "plain":
                    tp.append(plain.generate(prompts).stats.seconds)
                    continue
                r = spec.generate(prompts)
                ts.append(r.stats.seconds)
                acc.append(r.stats.acceptance_length)
                ks.extend(k for _, _, k in r.stats.trace)
        results[f"speedup_bs{bs}"] = median([p / q for p, q in zip(tp, ts, strict=True)])
        if bs == 1:
            results["acceptance_length"] = median(acc)
        used = {k: ks.count(k) for k in sorted(set(ks))}
        graphs += sum(len(e.graphs.graphs) for e in (plain, spec) if e.graphs is not None)
        detail[f"bs{bs}"] = {"plain_ms": median(tp) * 1e3, "adaptive_ms": median(ts) * 1e3,
                             "acceptance_length": median(acc), "draft_lengths_used": used}
        print(f"bs{bs}: plain {median(tp) * 1e3:.1f} ms, adaptive {median(ts) * 1e3:.1f} ms, "
              f"acceptance {median(acc):.2f}, draft length: steps {used}", flush=True)
    results["min_speedup"] = min(results[f"speedup_bs{b}"] for b in (1, 4, 16, 64))
    if DEVICE == "cuda":
        results["cuda_graphs_captured"] = graphs
        results["greedy_rows_identical"] = rows_identical / sum((1, 4, 16, 64))
    name = "rollout" if DEVICE == "cpu" else "rollout_gpu"
    write_results(name, {**results, "detail": detail, "models": info}, quick)
    print_table("bench-rollout (target 8L dim128 trained on stdlib text, drafter 1L dim64 distilled, greedy)",
                results)


if __name__ == "__main__":
    main()
