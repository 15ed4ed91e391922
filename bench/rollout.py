"""bench-rollout: adaptive speculative rollouts vs plain KV-cached decoding, batch 1/4/16/64.

Models (CPU debug setting): target = preset `small` (dim 256, 8 layers, random init, seed 0);
drafter = a 1-layer LM (dim 128) distilled from the target's logits on the target's own greedy
continuations. Greedy decoding of random byte prompts, no EOS (every row generates max_new tokens).
Plain and adaptive (Bandit, batchThreshold 32, maxDraftTokens 8) runs are interleaved after a
warm-up rollout each (the controller learns its cost table there, as a long-running engine does);
speedup = median plain time / median adaptive time.
"""

from __future__ import annotations

import random
import time

import torch

from bench.common import median, parse_args, print_table, write_results
from spectrain_workloads.model import Transformer, model_config
from spectrain_workloads.rollout import RolloutConfig, RolloutEngine


def distill(target: Transformer, drafter: Transformer, *, steps: int, seq_len: int, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[257] + [rng.randrange(256) for _ in range(7)] for _ in range(64)]
    data = RolloutEngine(target, RolloutConfig(max_new_tokens=seq_len, temperature=0, eos_id=None,
                                               speculative=False)).generate(prompts).sequences
    toks = torch.tensor(data)                                               # [64, 8 + seq_len]
    with torch.no_grad():
        soft = torch.softmax(target(toks), -1)                              # [64, L, V]
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    loss = torch.zeros(())
    for i in range(steps):
        idx = torch.randint(0, toks.size(0), (16,), generator=torch.Generator().manual_seed(i))
        loss = -(soft[idx] * torch.log_softmax(drafter(toks[idx]), -1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    quick = args.quick
    new, reps, dsteps = (40, 3, 150) if quick else (96, 5, 400)
    target = Transformer(model_config("small", {}, vocab_size=264))
    target.init_weights(0)
    target.eval()
    drafter = Transformer(model_config("small", {"dim": 128, "n_layers": 1, "n_heads": 4}, vocab_size=264))
    drafter.init_weights(1)
    t0 = time.perf_counter()
    dloss = distill(target, drafter, steps=dsteps, seq_len=new, seed=0)
    drafter.eval()
    print(f"drafter distilled in {time.perf_counter() - t0:.1f}s (loss {dloss:.3f})")
    results: dict[str, float] = {}
    rng = random.Random(1)
    for bs in (1, 4, 16, 64):
        prompts = [[257] + [rng.randrange(256) for _ in range(7)] for _ in range(bs)]
        cfg = RolloutConfig(max_new_tokens=new, temperature=0, eos_id=None, max_draft_tokens=8, batch_threshold=32)
        plain = RolloutEngine(target, cfg, None)
        spec = RolloutEngine(target, cfg, drafter)
        ref = plain.generate(prompts).sequences                  # warm-up both
        assert spec.generate(prompts).sequences == ref, "speculative greedy output differs from plain"
        tp, ts, acc = [], [], []
        for _ in range(reps):
            tp.append(plain.generate(prompts).stats.seconds)
            r = spec.generate(prompts)
            ts.append(r.stats.seconds)
            acc.append(r.stats.acceptance_length)
        results[f"speedup_bs{bs}"] = median(tp) / median(ts)
        if bs == 1:
            results["acceptance_length"] = median(acc)
        print(f"bs{bs}: plain {median(tp) * 1e3:.1f} ms, adaptive {median(ts) * 1e3:.1f} ms, "
              f"draft lengths used {sorted({k for _, _, k in r.stats.trace})}")
    results["min_speedup"] = min(results[f"speedup_bs{b}"] for b in (1, 4, 16, 64))
    write_results("rollout", results, quick)
    print_table("bench-rollout (target small, drafter 1-layer LM dim 128, greedy)", results)


if __name__ == "__main__":
    main()
