"""What the engine is asked and what it returns: `RolloutConfig` in, `RolloutResult` (with its
`RolloutStats`) out.

`RolloutConfig` is the engine's own view of `JobConfig.target.rl` (`from_rl`); `spectrain generate`
and the benches build it directly. Its error messages name the job spec's fields, since that is
where a user sets them. `RolloutStats` are the counters a report reads (acceptance length, the draft
lengths the controller chose, the plain share); `RolloutResult` holds each row's tokens and, on
request, the target's hidden states the RL loop publishes for drafter training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from spectrain_api.errors import ConfigError
from spectrain_api.names import DRAFT_STRATEGIES
from spectrain_workloads.specdec.sampling import Sampling
from spectrain_workloads.tokenizer import ByteTokenizer


@dataclass(kw_only=True)
class RolloutConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0            # 0: greedy
    top_p: float = 1.0
    eos_id: int | None = ByteTokenizer.EOS
    speculative: bool = True
    max_draft_tokens: int = 8
    batch_threshold: int = 32           # speculative only while the active batch is <= this
    strategy: str = "Bandit"            # Bandit: adaptive k per bucket; Fixed: k = max_draft_tokens
    cuda_graphs: bool = True            # only used on CUDA
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"rl.maxNewTokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.max_draft_tokens <= 32:
            raise ConfigError(f"rl.speculative.maxDraftTokens must be in 1..32, got {self.max_draft_tokens}")
        if self.batch_threshold < 0:
            raise ConfigError(f"rl.speculative.batchThreshold must be >= 0, got {self.batch_threshold}")
        if self.strategy not in DRAFT_STRATEGIES:
            raise ConfigError(f"rl.speculative.strategy must be one of {DRAFT_STRATEGIES}, got {self.strategy!r}")
        Sampling(temperature=self.temperature, top_p=self.top_p)   # validates both

    @property
    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p)

    @classmethod
    def from_rl(cls, rl: Any, **overrides: Any) -> RolloutConfig:
        """From `JobConfig.target.rl` (config.RLSpec)."""
        sp = rl.speculative
        return cls(**{"max_new_tokens": rl.max_new_tokens, "temperature": rl.temperature,
                      "speculative": sp.enabled, "max_draft_tokens": sp.max_draft_tokens,
                      "batch_threshold": sp.batch_threshold, "strategy": sp.strategy, **overrides})


@dataclass
class RolloutStats:
    decode_steps: int = 0
    spec_steps: int = 0
    verified_rows: int = 0      # row-verifications (one per active row per speculative step)
    accepted: int = 0           # draft tokens accepted
    drafted: int = 0
    committed: int = 0          # generated tokens
    seconds: float = 0.0
    trace: list[tuple[int, int, int]] = field(default_factory=list)   # (n_active, bucket, k) per step

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per row-verification (accepted drafts + the target's token)."""
        return (self.accepted + self.verified_rows) / self.verified_rows if self.verified_rows else 0.0

    @property
    def k_histogram(self) -> dict[int, int]:
        """Decode steps per draft length chosen (0: plain), ascending k."""
        counts: dict[int, int] = {}
        for _, _, k in self.trace:
            counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def plain_share(self) -> float:
        """Share of decode steps decoded plainly (k = 0)."""
        return (self.decode_steps - self.spec_steps) / self.decode_steps if self.decode_steps else 0.0


@dataclass
class RolloutResult:
    sequences: list[list[int]]          # per row: prompt + response (EOS included when emitted)
    prompt_lens: list[int]
    hidden: list[torch.Tensor | None]   # per row [len-1, H]: target final-norm hidden at positions 0..len-2
    stats: RolloutStats

    @property
    def responses(self) -> list[list[int]]:
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lens, strict=False)]


__all__ = ["RolloutConfig", "RolloutResult", "RolloutStats"]
