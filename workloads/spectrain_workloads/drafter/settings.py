"""Validated drafter settings: spec.drafter (API.md) merged with a drafter preset.

The API exposes arch, preset, activation, optimizer.lr; the rest (loss weights, accumulation,
buffer sizes, cadences) comes from the preset and can be overridden programmatically
(`DrafterSettings.from_spec(spec, **overrides)`), e.g. by tests and benchmarks.
Every check raises ConfigError naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from spectrain_api.config import DrafterSpec
from spectrain_api.errors import ConfigError
from spectrain_api.names import ACTIVATION_POLICIES, DRAFTER_ARCHS, DRAFTER_PRESETS, WINDOW_KINDS
from spectrain_api.rules import min_acceptance_errors


@dataclass(kw_only=True)
class DrafterSettings:
    arch: str = "Eagle"
    preset: str = "debug"
    # activation (API.md spec.drafter.activation)
    policy: str = "IdleOnly"
    kinds: list[str] = field(default_factory=lambda: list(WINDOW_KINDS))
    min_window_ms: float = 0.0          # 0: the drafter measures its own unit of work
    safety_margin_ms: float = 2.0
    # model / loss
    lr: float = 1e-3
    hidden_loss_weight: float = 1.0     # SmoothL1 on the next hidden state (EAGLE: 1.0)
    ce_loss_weight: float = 0.1         # soft CE vs the target's next-token distribution (EAGLE: 0.1)
    hard_ce_weight: float = 0.5         # LM arch only: CE on the data tokens
    lm_dim: int = 32
    lm_layers: int = 1
    lm_heads: int = 2
    # EAGLE-3 (spec.drafter.featureLayers / draftVocabSize / tttSteps); None: the defaults of
    # spectrain_api.eagle3, resolved against the target's layer count and vocabulary
    feature_layers: list[int] | None = None
    draft_vocab_size: int | None = None
    ttt_steps: int = 3
    # combiner
    samples_per_step: int = 8           # sequences per optimizer step (accumulated across windows)
    max_micro_batch: int = 8
    buffer_mb: float = 64               # bound on buffered training samples (CPU memory cap)
    max_reuse: int = 32                 # a buffered sample trains at most this many times (replay fills
                                        # windows when the target publishes less than the drafter can use)
    seq_cap: int = 32                   # sequences are cut into chunks of this many positions: one
                                        # chunk is the unit of work, so short chunks use short windows
    eval_every: int = 8                 # every n-th received sequence is held out for verification
    eval_samples: int = 16              # held-out chunks kept (the newest)
    # verification / checkpoints / liveness
    verify_k: int = 4                   # draft length for the expected accepted length
    verify_batch: int = 8               # held-out chunks measured together in one verification task
    verify_every_s: float = 5.0
    checkpoint_every_s: float = 30.0
    keep_checkpoints: int = 3
    # the exporting rank's gate (worker_export): a candidate's acceptance length must be at least LATEST's,
    # both measured on the same held-back samples in the same verification round (False: no comparison
    # with LATEST; tests and benchmarks that want every version exported), and at least min_acceptance
    # (spec.drafter.export.minAcceptance; 0: no floor)
    export_vs_latest: bool = True
    min_acceptance: float = 0.0
    heartbeat_every_s: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in DRAFTER_ARCHS:
            raise ConfigError(f"spec.drafter.arch {self.arch!r} is unknown; use one of {list(DRAFTER_ARCHS)}")
        if self.preset not in DRAFTER_PRESETS:
            raise ConfigError(f"spec.drafter.preset {self.preset!r} is unknown; use one of {sorted(DRAFTER_PRESETS)}")
        if self.policy not in ACTIVATION_POLICIES:
            raise ConfigError(
                f"spec.drafter.activation.policy {self.policy!r} is unknown; use one of {list(ACTIVATION_POLICIES)}")
        if not self.kinds:
            raise ConfigError("spec.drafter.activation.kinds is empty; list at least one of " f"{list(WINDOW_KINDS)}")
        bad = [k for k in self.kinds if k not in WINDOW_KINDS]
        if bad:
            raise ConfigError(f"spec.drafter.activation.kinds has unknown kinds {bad}; use {list(WINDOW_KINDS)}")
        if len(set(self.kinds)) != len(self.kinds):
            raise ConfigError("spec.drafter.activation.kinds has duplicates; list each kind once")
        if self.min_window_ms < 0:
            raise ConfigError("spec.drafter.activation.minWindowMs must be 0 (measured) or >= 1")
        if self.safety_margin_ms < 0:
            raise ConfigError("spec.drafter.activation.safetyMarginMs must be >= 0")
        if not self.lr > 0:
            raise ConfigError(f"spec.drafter.optimizer.lr must be > 0, got {self.lr}")
        for name in ("hidden_loss_weight", "ce_loss_weight", "hard_ce_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"drafter setting {name} must be >= 0, got {getattr(self, name)}")
        if self.hidden_loss_weight + self.ce_loss_weight == 0:
            raise ConfigError("drafter loss weights are all 0; set hidden_loss_weight or ce_loss_weight > 0")
        for name in ("lm_dim", "lm_layers", "lm_heads", "samples_per_step", "max_micro_batch", "max_reuse",
                     "seq_cap", "eval_every", "eval_samples", "verify_k", "verify_batch", "keep_checkpoints",
                     "ttt_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter setting {name} must be >= 1, got {getattr(self, name)}")
        for error in min_acceptance_errors(self.min_acceptance):
            raise ConfigError(error)
        if self.seq_cap < 4:
            raise ConfigError(f"drafter setting seq_cap must be >= 4, got {self.seq_cap}")
        for name in ("buffer_mb", "verify_every_s", "checkpoint_every_s", "heartbeat_every_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"drafter setting {name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_spec(cls, spec: DrafterSpec, *, seed: int = 0, **overrides: Any) -> DrafterSettings:
        """spec.drafter + its preset + explicit overrides (unknown override keys are errors)."""
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ConfigError(f"unknown drafter settings {bad}; valid: {sorted(known)}")
        if spec.preset not in DRAFTER_PRESETS:
            raise ConfigError(f"spec.drafter.preset {spec.preset!r} is unknown; use one of {sorted(DRAFTER_PRESETS)}")
        act = spec.activation
        base: dict[str, Any] = dict(
            arch=spec.arch, preset=spec.preset, policy=act.policy, kinds=list(act.kinds),
            min_window_ms=float(act.min_window_ms), safety_margin_ms=float(act.safety_margin_ms),
            lr=float(spec.optimizer.lr), seed=seed,
            feature_layers=None if spec.feature_layers is None else [int(i) for i in spec.feature_layers],
            draft_vocab_size=spec.draft_vocab_size, ttt_steps=int(spec.ttt_steps),
            min_acceptance=spec.export.min_acceptance,
        )
        return cls(**{**base, **DRAFTER_PRESETS[spec.preset], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
