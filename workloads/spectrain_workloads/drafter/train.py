"""The drafter's own training state: model, optimizer, and the three tasks the worker runs.

Tasks (each one timed by the worker from launch to device synchronisation):
- micro_step(samples): forward + backward of one micro-batch, gradients summed into .grad
  (EAGLE-3: the unrolled TTT loss of drafter.eagle3_tasks);
- optimizer_step(n): average the accumulated gradients over the n samples, clip, AdamW step;
- verify_chunk(): a few held-out sequences (batched) of the current verification round.
Nothing here touches the target: its weights arrive as copies (models.TargetShared).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from spectrain_api.names import EAGLE3
from spectrain_workloads.drafter.combiner import Sample, collate
from spectrain_workloads.drafter.models import (
    EagleDrafter,
    TargetShared,
    build_drafter,
    eagle_loss,
    lm_loss,
)
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.verify import Acceptance, Verifier


class DrafterTrainer:
    def __init__(self, settings: DrafterSettings, target: TargetShared, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.target_digest = target.digest
        self.target_cfg = target.model_config
        self.eagle3 = settings.arch == EAGLE3
        self._e3: Any = None          # drafter.eagle3_tasks (imports transformers: only for EAGLE-3)
        if self.eagle3:
            from spectrain_workloads.drafter import eagle3_tasks

            self._e3 = eagle3_tasks
            self.model: nn.Module = eagle3_tasks.build(settings, target).to(device)
        else:
            self.model = build_drafter(settings, target.model_config, hf_config=target.hf_config).to(device)
        self.target_head = target.lm_head.to(device)          # [V, H]: the target's next-token distribution
        if isinstance(self.model, EagleDrafter):
            self.model.load_target_weights(target.embedding, target.lm_head)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # fused: one kernel (CPU or CUDA) for all parameters instead of ~10 ops each. The step is
        # the filler of windows' tails, so its fixed cost decides how much of a tail is usable.
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0, fused=True)
        self.verifier = Verifier(k=settings.verify_k, max_starts=2, batch=settings.verify_batch,
                                 measure=self._e3.measure_batch if self.eagle3 else None)

    @property
    def eagle(self) -> bool:
        """An EAGLE drafter (1 or 3): it trains on the target's hidden states only."""
        return self.eagle3 or isinstance(self.model, EagleDrafter)

    @property
    def feature_layers(self) -> tuple[int, int, int] | None:
        """EAGLE-3: the target layers whose inputs the drafter fuses (low, mid, high); else None."""
        return tuple(self.model.feature_layers) if self.eagle3 else None   # type: ignore[return-value]

    def sync(self) -> None:
        """Wait for the device: a task's measured time must include its kernels."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def refresh_target(self, target: TargetShared) -> None:
        """The target rewrote its embedding/head (a checkpoint): use the new frozen copies."""
        if target.model_config != self.target_cfg:
            return  # a different target model: the worker restarts rather than mixing
        self.target_head = target.lm_head.to(self.device)
        if isinstance(self.model, EagleDrafter):
            self.model.load_target_weights(target.embedding, target.lm_head)
        elif self.eagle3:
            self.model.embed_weight = target.embedding.to(self.device)     # borrowed, frozen (a buffer)

    def usable(self, sample: Sample) -> bool:
        """Eagle needs the target's hidden states; the LM arch trains on tokens alone if it must."""
        return sample.hidden is not None or not self.eagle

    # ------------------------------------------------------------ tasks
    def micro_step(self, samples: list[Sample]) -> float:
        """Forward + backward over len(samples) sequences; returns the mean per-sample loss."""
        tokens, hidden = collate(samples, self.device)
        s = self.settings
        if self.eagle3:
            assert hidden is not None
            loss = self._e3.micro_loss(self.model, tokens, hidden, self.target_head, s.ttt_steps)
        elif isinstance(self.model, EagleDrafter):
            assert hidden is not None
            loss, _ = eagle_loss(self.model, tokens, hidden, hidden_weight=s.hidden_loss_weight,
                                 ce_weight=s.ce_loss_weight, stats=False)
        else:
            loss, _ = lm_loss(self.model, tokens, hidden, self.target_head if hidden is not None else None,
                              soft_weight=s.ce_loss_weight, hard_weight=s.hard_ce_weight, stats=False)
        loss.backward()
        value = loss.item() / len(samples)   # .item() synchronises on CUDA
        self.sync()
        return value

    def optimizer_step(self, accumulated: int) -> None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if params:
            torch._foreach_div_([p.grad for p in params], float(max(accumulated, 1)))
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()

    def discard_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def begin_verify(self, samples: list[Sample], reference: nn.Module | None = None) -> None:
        """A verification round; with `reference` (the export gate's LATEST) a paired one (verify.Verifier)."""
        self.verifier.begin([(s.tokens, s.hidden) for s in samples], reference)

    def verify_chunk(self) -> Acceptance | None:
        result = self.verifier.run_chunk(self.model, self.target_head)
        self.sync()
        return result

    # ------------------------------------------------------------ setup
    def synthetic_samples(self, n: int, length: int) -> list[Sample]:
        """Random sequences shaped like the target's, for measuring costs before the first window."""
        g = torch.Generator().manual_seed(self.settings.seed)
        V, H = self.target_cfg.vocab_size, self.target_cfg.dim
        return [Sample(tokens=torch.randint(0, V, (length,), generator=g),
                       hidden=(self._e3.synthetic_hidden(length, H, g) if self.eagle3
                               else torch.randn(length, H, generator=g)), step=-1) for _ in range(n)]

    def memory_cap_samples(self, cap_bytes: int | None, length: int) -> int | None:
        """Largest micro-batch that fits `cap_bytes` of device memory (CUDA; measured), else None."""
        if cap_bytes is None or self.device.type != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.micro_step(self.synthetic_samples(2, length))
        per_sample = max(1, (torch.cuda.max_memory_allocated(self.device) - base) // 2)
        self.discard_grads()
        return max(1, math.floor(0.8 * (cap_bytes - base) / per_sample))

    def state_dict(self) -> dict[str, Any]:
        return {"arch": self.settings.arch, "target_digest": self.target_digest}
