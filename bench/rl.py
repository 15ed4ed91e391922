"""bench-rl: whole GRPO step time with speculative vs plain rollouts, and drafter acceptance per RL
step for a continually trained drafter vs a frozen one.

Setting (CPU): policy = 8 layers, dim 64 (`debug` preset with n_layers 8), warmed up by supervised
steps on the `copy` task and a third as many on `sort`, then GRPO on `sort` (answer lengths Pareto with tail index 0.8; group 4,
8 prompts, temperature 1, lr 1e-3, up to 64 new tokens): the policy keeps moving away from copying, which is the drift
a frozen drafter does not follow. Drafter = 1-layer LM, dim 32 (~1/8 of a policy forward on CPU),
distilled on the warmed-up policy's rollouts of the RL task; the frozen copy stays there, the
continual one is distilled after every RL step on that step's rollout (tokens + the policy head over
the hidden states the rollout already computed: the in-process stand-in for the sidecar training in
the RolloutTail window; not counted in the step time). Each RL step runs twice from the same state,
plain then speculative (Bandit, maxDraftTokens 6, batchThreshold 32; state restored in between; the
speculative run continues; whole steps, where the RL job reruns only the rollout: rl/sidebyside.py),
so both see the same policy; rl_step_speedup = total plain step time /
total speculative step time (rollout + policy update). Acceptance (tokens per verification, Fixed
k=4, temperature 1) is measured on fixed evaluation prompts with each drafter after every step.

SPECTRAIN_DEVICE=cuda (`make gpu-check`): policy and drafters on the GPU, rollouts with CUDA graphs;
the acceptance engines run on copies of the policy and the drafter there (a second engine on the same
modules would re-set up their KV caches and drop the trainer engine's graphs). Results in
bench/results/rl_gpu.json.
"""

from __future__ import annotations

import copy
import os
import random
import time

import torch

from bench.common import median, parse_args, print_table, write_results
from spectrain_workloads.model import Transformer, model_config
from spectrain_workloads.rl.grpo import GRPOConfig, GRPOTrainer, pad_batch, sft_warmup
from spectrain_workloads.rl.tasks import get_task
from spectrain_workloads.specdec.config import RolloutConfig, RolloutResult
from spectrain_workloads.specdec.engine import RolloutEngine

POLICY = {"n_layers": 8}
DRAFTER = {"dim": 32, "n_layers": 1, "n_heads": 2}
LR = 1e-3
ALPHA = 0.8          # answer-length tail index (tasks default 1.2): a heavier tail, as in reasoning RL
DEVICE = "cuda" if os.environ.get("SPECTRAIN_DEVICE") == "cuda" else "cpu"   # benches run on CPU by default


class LMDistiller:
    """In-process LM-drafter training on rollout outputs (soft targets = the policy head over the
    rollout's own hidden states, no extra prefill). Stands in for the drafter sidecar in this
    benchmark; the RL job itself loads the sidecar's exports."""

    def __init__(self, drafter: Transformer, *, lr: float = 2e-3) -> None:
        self.drafter = drafter
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=lr)

    @staticmethod
    def collect(policy: Transformer, res: RolloutResult) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens [T], target probs [T, V]) per row with kept hidden states."""
        out = []
        assert policy.output is not None
        with torch.no_grad():
            for seq, h in zip(res.sequences, res.hidden, strict=False):
                if h is not None and h.size(0) > 0:
                    out.append((torch.tensor(seq[: h.size(0)], device=h.device), torch.softmax(policy.output(h).float(), -1)))
        return out

    def train(self, data: list[tuple[torch.Tensor, torch.Tensor]], *, steps: int, batch: int = 16,
              seed: int = 0) -> float:
        rng = random.Random(seed)
        self.drafter.train()
        loss = torch.zeros(())
        for _ in range(steps):
            picks = [data[rng.randrange(len(data))] for _ in range(min(batch, len(data)))]
            toks = pad_batch([p[0].tolist() for p in picks], picks[0][0].device)                    # [b, T]
            probs = torch.zeros(*toks.shape, picks[0][1].size(-1), device=toks.device)
            mask = torch.zeros(toks.shape, device=toks.device)
            for i, (t, p) in enumerate(picks):
                probs[i, : t.numel()], mask[i, : t.numel()] = p, 1.0
            logp = torch.log_softmax(self.drafter(toks).float(), -1)                                  # [b, T, V]
            loss = -((probs * logp).sum(-1) * mask).sum() / mask.sum()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        self.drafter.eval()
        return float(loss.detach())


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    sft_steps, rl_steps, dsteps = (100, 6, 25) if args.quick else (300, 16, 60)
    warm_task, task = get_task("copy", max_len=56, alpha=ALPHA), get_task("sort", max_len=56, alpha=ALPHA)
    policy = Transformer(model_config("debug", POLICY, vocab_size=264))
    policy.init_weights(0)
    policy.to(DEVICE)
    t0 = time.perf_counter()
    sft_warmup(policy, warm_task, steps=sft_steps, batch=16, lr=3e-3)
    sft_warmup(policy, task, steps=sft_steps // 3, batch=16, lr=3e-3, seed=1)   # a first, partial grasp of sort
    policy.eval()
    drafter = Transformer(model_config("debug", DRAFTER, vocab_size=264))
    drafter.init_weights(1)
    drafter.to(DEVICE)
    rcfg = RolloutConfig(max_new_tokens=64, temperature=1.0, max_draft_tokens=6, batch_threshold=32)
    trainer = GRPOTrainer(policy, task, GRPOConfig(group_size=4, prompts_per_step=8, lr=LR, seed=0), rcfg,
                          drafter=drafter, drafter_arch="LM", keep_hidden=True)
    distiller = LMDistiller(drafter, lr=3e-3)
    boot = trainer.engine.generate([task.prompt_ids(task.sample(trainer.rng)) for _ in range(64)], keep_hidden=True,
                                   speculative=False)
    distiller.train(LMDistiller.collect(policy, boot), steps=dsteps * 4)
    trainer.set_drafter(drafter, "LM")           # a new drafter version: the engine's acceptance starts over
    frozen = copy.deepcopy(drafter)
    print(f"setup {time.perf_counter() - t0:.1f}s", flush=True)
    eval_prompts = [task.prompt_ids(task.sample(trainer.rng)) for _ in range(16)]
    fixed = RolloutConfig(max_new_tokens=64, temperature=1.0, max_draft_tokens=4, strategy="Fixed", seed=7)

    def acceptance(d: Transformer) -> float:
        p, d = (copy.deepcopy(policy), copy.deepcopy(d)) if DEVICE == "cuda" else (policy, d)
        return RolloutEngine(p, fixed, d, drafter_arch="LM").generate(eval_prompts).stats.acceptance_length

    acc_c, acc_f = [acceptance(drafter)], [acceptance(frozen)]
    print(f"step -: accept continual {acc_c[-1]:.2f} frozen {acc_f[-1]:.2f}", flush=True)
    plain_s, spec_s, plain_roll, spec_roll, rewards = [], [], [], [], []
    for step in range(rl_steps):
        snap = copy.deepcopy(trainer.state_dict())     # policy, optimizer, task and sampler RNGs, step
        trainer.engine.cfg.speculative = False
        rp = trainer.step()
        trainer.load_state_dict(snap)
        trainer.engine.cfg.speculative = True
        r = trainer.step()
        plain_s.append(rp.step_s)
        spec_s.append(r.step_s)
        plain_roll.append(rp.rollout_s)
        spec_roll.append(r.rollout_s)
        rewards.append(r.reward_mean)
        assert trainer.last_rollout is not None
        distiller.train(LMDistiller.collect(policy, trainer.last_rollout[1]), steps=dsteps, seed=step)
        trainer.set_drafter(drafter, "LM", new_version=True)   # as rl.run does when the sidecar exports a new version
        acc_c.append(acceptance(drafter))
        acc_f.append(acceptance(frozen))
        print(f"step {step}: plain {rp.step_s:.2f}s (rollout {rp.rollout_s:.2f}) spec {r.step_s:.2f}s "
              f"(rollout {r.rollout_s:.2f}, accept {r.acceptance_length:.2f}) reward {r.reward_mean:.3f} "
              f"len mean/max {r.response_len_mean:.1f}/{r.response_len_max} | accept continual {acc_c[-1]:.2f} "
              f"frozen {acc_f[-1]:.2f}", flush=True)
    results = {"rl_step_speedup": sum(plain_s) / sum(spec_s), "acceptance_continual_last": acc_c[-1],
               "acceptance_frozen_last": acc_f[-1]}
    extra = {"rollout_speedup": sum(plain_roll) / sum(spec_roll),
             "step_speedup_median": median([p / s for p, s in zip(plain_s, spec_s, strict=True)]),
             "acceptance_continual": acc_c, "acceptance_frozen": acc_f, "reward": rewards,
             "step_s_plain": plain_s, "step_s_spec": spec_s}
    write_results("rl" if DEVICE == "cpu" else "rl_gpu", {**results, **extra}, args.quick)
    print("per RL step (index 0 = before RL): acceptance continual / frozen")
    for i, (c, f) in enumerate(zip(acc_c, acc_f, strict=True)):
        print(f"  {i - 1 if i else '-':>3}  {c:.2f} / {f:.2f}")
    print_table("bench-rl (policy 8L dim64, copy warm-up -> GRPO on sort; drafter 1L dim32 LM)",
                {**results, "rollout_speedup": extra["rollout_speedup"]})


if __name__ == "__main__":
    main()
