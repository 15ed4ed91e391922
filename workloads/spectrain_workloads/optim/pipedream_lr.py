"""PipeDream-LR: the asynchronous-pipeline baseline that fights staleness with the learning rate.

What is implemented (PipeMare-style learning-rate rescheduling on top of AdamW, the baseline the
basis-rotation paper compares against): a stage whose gradients are `delay` steps stale takes
    lr_k(t) = lr(t) * (delay + 1) ** -p(t),      p(t) = max(0, 1 - t / anneal_steps)
i.e. it starts at lr / (delay + 1) (the step size for which delayed gradient descent stays
stable shrinks like 1 / delay) and anneals back to the full lr over `anneal_steps` updates
(`anneal_steps=None`: keep the 1 / (delay + 1) scaling for the whole run). The last stage
(delay 0) is plain AdamW. Everything else (moments, bias correction, decoupled weight decay) is
torch.optim.AdamW unchanged; `lr(t)` is whatever an outer schedule wrote into the group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from spectrain_api.errors import ConfigError


def staleness_lr_factor(step: int, delay: int, anneal_steps: int | None) -> float:
    """Multiplier on the lr for update number `step` (0-based) of a stage `delay` steps stale."""
    p = 1.0 if anneal_steps is None else max(0.0, 1.0 - step / anneal_steps)
    return float((delay + 1) ** -p)


class PipeDreamLR(torch.optim.AdamW):
    def __init__(self, params: Iterable[Any], *, delay: int, anneal_steps: int | None = None, **adamw: Any) -> None:
        if delay < 0:
            raise ConfigError(f"PipeDreamLR delay must be >= 0 (the stage's staleness P-1-k), got {delay}")
        if anneal_steps is not None and anneal_steps < 1:
            raise ConfigError(f"PipeDreamLR anneal_steps must be >= 1 or None (no annealing), got {anneal_steps}")
        super().__init__(params, **adamw)
        for group in self.param_groups:  # kept in the groups so state_dict round-trips them
            group.setdefault("delay", delay)
            group.setdefault("anneal_steps", anneal_steps)
            group.setdefault("lr_step", 0)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        outer = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] * staleness_lr_factor(g["lr_step"], g["delay"], g["anneal_steps"])
        try:
            loss = super().step(closure)
        finally:
            for g, lr in zip(self.param_groups, outer, strict=True):
                g["lr"] = lr
                g["lr_step"] += 1
        return loss
