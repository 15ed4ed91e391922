"""Optimizers for the target: AdamW, BasisRotation (staleness-robust, for AsyncPipeline) and the
PipeDream-LR baseline.

    opt = build_optimizer(stage_module, cfg.target.optimizer, stage=k, n_stages=P)

Parameter groups (the same for every optimizer, so comparisons are fair): 2-D weights of the
attention and MLP blocks (rotated by BasisRotation, weight decay), other 2-D weights (embedding,
LM head: AdamW maths, weight decay), everything else (norms: AdamW maths, no weight decay).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from spectrain_api.config import OptimizerSpec
from spectrain_api.errors import ConfigError
from spectrain_api.names import ADAMW, BASIS_GEOMETRIES, BASIS_ROTATION, BASIS_SOURCES, OPTIMIZERS
from spectrain_workloads.optim.basis_rotation import BasisRotation
from spectrain_workloads.optim.pipedream_lr import PipeDreamLR, staleness_lr_factor

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
ROTATED_BLOCKS = ("attention.", "feed_forward.")   # name fragments of the attention and MLP weights


def param_groups(params_or_model: Any, *, weight_decay: float = WEIGHT_DECAY) -> list[dict[str, Any]]:
    """Split a module, (name, param) pairs, or bare params into the groups described above.

    Bare params carry no names, so every 2-D one counts as a block weight (rotated).
    """
    if isinstance(params_or_model, nn.Module):
        named: list[tuple[str | None, nn.Parameter]] = list(params_or_model.named_parameters())
    else:
        named = [item if isinstance(item, tuple) else (None, item) for item in params_or_model]
    rotated, matrices, vectors = [], [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        if p.dim() == 2 and (name is None or any(f in name for f in ROTATED_BLOCKS)):
            rotated.append(p)
        elif p.dim() >= 2:
            matrices.append(p)
        else:
            vectors.append(p)
    groups = [
        {"params": rotated, "rotate": True, "weight_decay": weight_decay},
        {"params": matrices, "rotate": False, "weight_decay": weight_decay},
        {"params": vectors, "rotate": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def stage_refresh_every(refresh_every: float, stage: int, n_stages: int) -> float:
    """Refresh interval (steps, possibly fractional) of `stage` under stageAware.

    The total budget is that of the uniform schedule, n_stages / refresh_every refreshes per step,
    split across the stages in proportion to their staleness + 1 (P - k: gradient age in updates, so
    the synchronous last stage still refreshes, just least often; stage 0 is the stalest). A stage
    cannot refresh more than once per step: its excess goes to the others, in the same proportion
    (so with refresh_every 1 every stage refreshes every step, like uniform).
    """
    weights = [float(n_stages - k) for k in range(n_stages)]           # staleness d_k + 1
    rates = [0.0] * n_stages                                            # refreshes per step
    free, budget = set(range(n_stages)), n_stages / refresh_every
    while free:
        share = budget / sum(weights[k] for k in free)
        capped = {k for k in free if share * weights[k] >= 1.0}
        if not capped:
            for k in free:
                rates[k] = share * weights[k]
            break
        for k in capped:
            rates[k] = 1.0
        free -= capped
        budget -= len(capped)
    return 1.0 / rates[stage]


def _validate(spec: OptimizerSpec, stage: int, n_stages: int) -> None:
    if spec.name not in OPTIMIZERS:
        raise ConfigError(f"spec.target.optimizer.name {spec.name!r} is not one of {list(OPTIMIZERS)}")
    if not spec.lr > 0:
        raise ConfigError(f"spec.target.optimizer.lr must be > 0, got {spec.lr}")
    if n_stages < 1 or not 0 <= stage < n_stages:
        raise ConfigError(f"stage {stage} is not in [0, n_stages={n_stages}); check target.parallelism.pipeline")
    br = spec.basis_rotation
    if spec.name == BASIS_ROTATION:
        base = "spec.target.optimizer.basisRotation"
        if not isinstance(br.refresh_every, int) or br.refresh_every < 1:
            raise ConfigError(f"{base}.refreshEvery must be an integer >= 1, got {br.refresh_every!r}")
        if br.geometry not in BASIS_GEOMETRIES:
            raise ConfigError(f"{base}.geometry {br.geometry!r} is not one of {list(BASIS_GEOMETRIES)}")
        if br.source not in BASIS_SOURCES:
            raise ConfigError(f"{base}.source {br.source!r} is not one of {list(BASIS_SOURCES)}")
        if not isinstance(br.stage_aware, bool):
            raise ConfigError(f"{base}.stageAware must be true or false, got {br.stage_aware!r}")


def build_optimizer(
    params_or_model: nn.Module | Iterable[Any],
    spec: OptimizerSpec,
    *,
    stage: int = 0,
    n_stages: int = 1,
    weight_decay: float = WEIGHT_DECAY,
) -> torch.optim.Optimizer:
    """AdamW or BasisRotation for stage `stage` of an asynchronous pipeline of `n_stages`.

    The position only matters for BasisRotation with stageAware (stage k is P-1-k steps stale);
    synchronous training (Pretrain, any schedule without staleness) passes stage=0, n_stages=1.
    """
    _validate(spec, stage, n_stages)
    groups = param_groups(params_or_model, weight_decay=weight_decay)
    if spec.name == ADAMW:
        for g in groups:
            g.pop("rotate")
        return torch.optim.AdamW(groups, lr=spec.lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    br = spec.basis_rotation
    every = stage_refresh_every(br.refresh_every, stage, n_stages) if br.stage_aware else br.refresh_every
    return BasisRotation(groups, lr=spec.lr, betas=BETAS, eps=EPS, weight_decay=weight_decay,
                         refresh_every=every, geometry=br.geometry, source=br.source)


__all__ = [
    "BasisRotation", "PipeDreamLR", "build_optimizer", "param_groups", "stage_refresh_every",
    "staleness_lr_factor", "OPTIMIZERS",
]
