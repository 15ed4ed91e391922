"""spec.mode RL on the mode loop (loop.py): GRPO steps (grpo.GRPOTrainer) with speculative rollouts.

The policy starts from a short supervised warm-up on the task (the stand-in for a pretrained
policy, so rewards carry signal): SPECTRAIN_RL_WARMUP_STEPS steps (TargetOptions; set it through
spec.target.env), on a fresh start only; the warmed-up policy is checkpoint step 0, so a rank
resumed before its first RL step does not warm up again. At the start of every RL step the rollout
engine loads the newest drafter export ($SPECTRAIN_EXPORT_DIR/LATEST) if it moved; metrics record
its version per step. SPECTRAIN_RL_PLAIN_EVERY=n (0: off): every n-th step also rolls out plainly
from the same state, for the RL step speedup measured in this very run (sidebyside.py).

With WORLD_SIZE > 1 every rank is a data-parallel replica over the default process group: the
same initial policy (rank 0's, broadcast after the warm-up), gradients averaged with one
all-reduce per parameter, and a barrier at the end of each rollout (the wait is RolloutTail idle time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch import nn

from spectrain_api.config import JobConfig
from spectrain_api.errors import ConfigError
from spectrain_workloads.loop import ModeLoop, StepReport
from spectrain_workloads.rl.grpo import GRPOConfig, GRPOTrainer, sft_warmup
from spectrain_workloads.rl.tasks import get_task
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.target_model import resolve_target
from spectrain_workloads.topology import Topology


def run(cfg: JobConfig) -> list[float]:
    """spec.mode RL on this rank (env per docs/contracts.md); returns the per-step mean rewards."""
    loop = RLLoop(cfg)
    loop.train()
    return loop.rewards


class RLLoop(ModeLoop):
    """GRPO on one rank: a data-parallel replica of the whole policy."""

    leave_drafter_threads = True      # RL decodes many tiny steps; oversubscribed CPU threads slow them down

    def __init__(self, cfg: JobConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.rewards: list[float] = []

    def build(self) -> None:
        cfg, rank, t = self.cfg, self.rank, self.cfg.target
        assert t.rl is not None                 # check_spec: mode RL has spec.target.rl
        rl = t.rl
        Topology(data=t.parallelism.data, pipeline=1).check(rank.world, world_size_hint=cfg.world_size)
        self.target = resolve_target(cfg)       # a preset (seeded init) or an HF model directory (its weights)
        mcfg = self.target.config
        # A preset's Transformer or an HF model's HFStage: one stage interface, no common base class.
        self.policy: Any = cast(Any, self.target.build_stage(0, 1).to(self.rt.device))
        tokenizer = self.target.tokenizer()
        self.task = get_task(rl.task, max_len=max(2, min(48, rl.max_new_tokens - 1)), tokenizer=tokenizer)
        rcfg = RolloutConfig.from_rl(rl, seed=cfg.seed + rank.rank, eos_id=tokenizer.EOS)
        gcfg = GRPOConfig(group_size=rl.group_size, prompts_per_step=t.data.batch_size, lr=t.optimizer.lr,
                          plain_every=self.opts.rl_plain_every, seed=cfg.seed + rank.rank)
        self.producer = self.rt.ring_producer(hidden_dim=mcfg.dim, seq_len=mcfg.max_seq_len, publishes=True)
        self.export_dir = self.opts.export_dir or Path(self.opts.run_dir / cfg.drafter.export.path)
        self.follows_drafter = self.opts.drafter_enabled and rl.speculative.enabled
        many = rank.world > 1
        self.trainer = GRPOTrainer(self.policy, self.task, gcfg, rcfg, producer=self.producer,
                                   on_window=self.rt.metrics.window_closed, barrier=dist.barrier if many else None,
                                   grad_sync=self._grad_sync if many else None)

    def _grad_sync(self, m: nn.Module) -> None:
        """The replicas' mean gradient."""
        for p in m.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.rank.world)

    def fresh_start(self) -> None:
        # The drafter can set up and calibrate during the warm-up (each save refreshes these).
        self.write_shared()
        sft_warmup(self.policy, self.task, steps=self.opts.rl_warmup_steps, seed=self.cfg.seed)
        if self.rank.world > 1:   # identical start on every rank
            for p in self.policy.parameters():
                dist.broadcast(p.data, 0)
        self.save(0)

    def state(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def boundary_step(self) -> int:
        return self.trainer.step_idx

    def write_shared(self) -> None:
        if self.rank.rank != 0:
            return
        p = self.policy
        assert p.tok_embeddings is not None and p.output is not None   # a whole model (stage 0 of 1)
        self.rt.save_shared(embedding=p.tok_embeddings.weight, lm_head=p.output.weight,
                            model_config=self.target.shared_config())

    def train_step(self, step: int) -> StepReport:
        if self.follows_drafter:
            self._follow_drafter()
        with self.term.state_lock:      # the emergency save only ever sees a completed step
            r = self.trainer.step()
        self.rewards.append(r.reward_mean)
        return StepReport(loss=r.loss, step_time_s=r.step_s, tokens=r.tokens,
                          extra={**r.metrics(), "drafter_version": self.trainer.drafter_version})

    def _follow_drafter(self) -> None:
        tr = self.trainer
        try:
            if tr.reload_drafter(self.export_dir):
                print(f"[spectrain-target] RL step {tr.step_idx}: rollouts use drafter "
                      f"{tr.drafter_version} from {self.export_dir}", flush=True)
        except (ConfigError, OSError, RuntimeError, KeyError) as exc:   # a bad export must not stop RL
            print(f"spectrain rl: keeping the current drafter, cannot load {self.export_dir}: {exc}", flush=True)
