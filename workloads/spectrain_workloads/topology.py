"""Every process group of a target rank, built in one place, with the degrees checked against WORLD_SIZE.

Rank layout: global rank r is stage `r % P` of replica `r // P` (P pipeline stages, D replicas,
D x P = WORLD_SIZE). Groups (torch.distributed.new_group is collective over the default group,
so every rank creates every group, in the same order, and keeps the ones it belongs to):

- dp: the D ranks of one stage, [s, P + s, ..., (D - 1) P + s] (DDP's gradient all-reduce); D > 1;
- fwd / bwd: all ranks, one each for activations and gradients, so that the two directions'
  point-to-point traffic does not serialise on one communicator; P > 1;
- fwd_wrap / bwd_wrap: all ranks again, for the wrap-around link (last stage -> stage 0) of an
  interleaved schedule's ring; P > 1 and chunks > 1;
- tied: [d P, d P + P - 1], the first and last stage of replica d, summing the gradients of an HF
  target's tied embedding / LM head when P > 1.

Modes RL (D = WORLD_SIZE replicas, P = 1) and AsyncPipeline (D = 1, one stage per rank) use the
default group only; they call `Topology.check` at build, so a spec whose degrees do not match the
ranks that started fails with the field named instead of training another layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from spectrain_api.errors import ConfigError
from spectrain_workloads.runtime import RankInfo


@dataclass(kw_only=True, frozen=True)
class Topology:
    """D x P ranks; `chunks` model chunks per rank (Interleaved1F1B: > 1)."""

    data: int
    pipeline: int
    chunks: int = 1

    def check(self, world: int, *, world_size_hint: int | None = None) -> None:
        """ConfigError naming the fields when D x P is not WORLD_SIZE."""
        if self.data * self.pipeline != world:
            hint = f"; run nodes x procsPerNode = {world_size_hint} ranks" if world_size_hint is not None else ""
            raise ConfigError(
                f"spec.target.parallelism: data ({self.data}) x pipeline ({self.pipeline}) = "
                f"{self.data * self.pipeline} but WORLD_SIZE is {world}{hint}")

    def stage(self, rank: int) -> int:
        return rank % self.pipeline

    def replica(self, rank: int) -> int:
        return rank // self.pipeline

    def build_groups(self, rank: RankInfo, *, tied: bool) -> StageGroups:
        """The groups of `rank` (collective: every rank calls it with the same arguments).
        `tied`: the first and last stage share a tied embedding / LM head."""
        self.check(rank.world)
        D, P = self.data, self.pipeline
        stage, replica = self.stage(rank.rank), self.replica(rank.rank)
        everyone = list(range(rank.world))
        out = StageGroups()
        for s in range(P):
            g = dist.new_group([d * P + s for d in range(D)]) if D > 1 else None
            if s == stage:
                out.dp = g
        if P > 1:
            out.fwd, out.bwd = dist.new_group(everyone), dist.new_group(everyone)
        if tied and P > 1:
            for d in range(D):
                g = dist.new_group([d * P, d * P + P - 1])
                if d == replica and stage in (0, P - 1):
                    out.tied = g
        if P > 1 and self.chunks > 1:
            out.fwd_wrap, out.bwd_wrap = dist.new_group(everyone), dist.new_group(everyone)
        return out


@dataclass
class StageGroups:
    """A rank's process groups (None: not needed, or not a member); see the module docstring."""

    dp: Any = None
    fwd: Any = None
    bwd: Any = None
    fwd_wrap: Any = None
    bwd_wrap: Any = None
    tied: Any = None
