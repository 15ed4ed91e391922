"""bench-rl: whole GRPO step time with speculative vs plain rollouts, and drafter acceptance per RL
step for a continually trained drafter vs a frozen one.

Setting (CPU): policy = preset `debug` (dim 64, 4 layers) warmed up by supervised steps on the `copy`
task (long-tailed answer lengths), then GRPO (group 8, 4 prompts, temperature 1). Drafter = 1-layer
LM (dim 64) distilled on the warmed-up policy's rollouts; the frozen copy stays there, the continual
one is distilled after every RL step on that step's rollout hidden states (in-process stand-in for
the sidecar training in the RolloutTail window; not counted in the step time). Each RL step is run
twice from the same state, plain then speculative (state restored in between; the speculative run
continues); rl_step_speedup = total plain step time / total speculative step time. Acceptance is
measured on fixed evaluation prompts with each drafter (Fixed k=4) after every step.
"""

from __future__ import annotations

import copy
import time

import torch

from bench.common import parse_args, print_table, write_results
from spectrain_workloads.model import Transformer, model_config
from spectrain_workloads.rl import GRPOConfig, GRPOTrainer, LMDistiller, sft_warmup
from spectrain_workloads.rollout import RolloutConfig, RolloutEngine
from spectrain_workloads.tasks import get_task


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(1)
    sft_steps, rl_steps, dsteps = (60, 4, 40) if args.quick else (300, 12, 100)
    task = get_task("copy", max_len=40)
    policy = Transformer(model_config("debug", {}, vocab_size=264))
    policy.init_weights(0)
    t0 = time.perf_counter()
    sft_warmup(policy, task, steps=sft_steps, batch=16, lr=3e-3)
    policy.eval()
    drafter = Transformer(model_config("debug", {"n_layers": 1}, vocab_size=264))
    drafter.init_weights(1)
    rcfg = RolloutConfig(max_new_tokens=48, temperature=1.0, max_draft_tokens=6, batch_threshold=16)
    trainer = GRPOTrainer(policy, task, GRPOConfig(group_size=8, prompts_per_step=4, lr=1e-3, seed=0), rcfg,
                          drafter=drafter, drafter_arch="LM", keep_hidden=True)
    distiller = LMDistiller(drafter)
    boot = trainer.engine.generate([task.prompt_ids(task.sample(trainer.rng)) for _ in range(32)], keep_hidden=True)
    distiller.train(LMDistiller.collect(policy, boot), steps=dsteps * 2)
    frozen = copy.deepcopy(drafter)
    print(f"setup {time.perf_counter() - t0:.1f}s")
    eval_prompts = [task.prompt_ids(task.sample(trainer.rng)) for _ in range(8)]
    fixed = RolloutConfig(max_new_tokens=48, temperature=1.0, max_draft_tokens=4, strategy="Fixed", seed=7)

    def acceptance(d: Transformer) -> float:
        return RolloutEngine(policy, fixed, d, drafter_arch="LM").generate(eval_prompts).stats.acceptance_length

    plain_s, spec_s, acc_c, acc_f = [], [], [], []
    for step in range(rl_steps):
        snap = (copy.deepcopy(policy.state_dict()), copy.deepcopy(trainer.opt.state_dict()),
                trainer.rng.getstate(), trainer.engine.gen.get_state(), trainer.step_idx)
        trainer.engine.cfg.speculative = False
        plain_s.append(trainer.step().step_s)
        policy.load_state_dict(snap[0])
        trainer.opt.load_state_dict(snap[1])
        trainer.rng.setstate(snap[2])
        trainer.engine.gen.set_state(snap[3])
        trainer.step_idx = snap[4]
        trainer.engine.cfg.speculative = True
        r = trainer.step()
        spec_s.append(r.step_s)
        assert trainer.last_rollout is not None
        distiller.train(LMDistiller.collect(policy, trainer.last_rollout[1]), steps=dsteps, seed=step)
        acc_c.append(acceptance(drafter))
        acc_f.append(acceptance(frozen))
        print(f"step {step}: plain {plain_s[-1]:.2f}s spec {spec_s[-1]:.2f}s reward {r.reward_mean:.3f} "
              f"len mean/max {r.response_len_mean:.1f}/{r.response_len_max} accept continual {acc_c[-1]:.2f} "
              f"frozen {acc_f[-1]:.2f}")
    results = {"rl_step_speedup": sum(plain_s) / sum(spec_s), "acceptance_continual_last": acc_c[-1],
               "acceptance_frozen_last": acc_f[-1]}
    write_results("rl", {**results, "acceptance_continual": acc_c, "acceptance_frozen": acc_f}, args.quick)
    print_table("bench-rl (policy debug on copy, drafter 1-layer LM)", results)


if __name__ == "__main__":
    main()
