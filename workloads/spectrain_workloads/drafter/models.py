"""Drafter architectures, their losses, and the target weights they borrow.

Eagle (contracts.md): at position t the inputs are the target's final-norm hidden h_t [H] and
the token x_{t+1}; fc: Linear(2H -> H) over [embed(x_{t+1}); h_t], one decoder Block, output
hidden_pred ~ h_{t+1}, and logits = lm_head(hidden_pred) predict x_{t+2}. Embedding and LM head
are frozen copies of the target's (run_dir/target/shared/*.safetensors).

LM: a plain model.Transformer, small, distilled from the target's tokens (hard CE) and, when
the target's hidden states and head are available, its next-token distribution (soft CE).

Shapes: B batch, T positions, H target width, V vocab.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spectrain_api.errors import ConfigError
from spectrain_api.names import EAGLE
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.model import Block, KVCache, ModelConfig, Transformer, rope_cache


class EagleDrafter(nn.Module):
    """EAGLE-style head over the target's features; see the module docstring for the convention."""

    arch = "Eagle"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, V = cfg.dim, cfg.vocab_size
        self.embed = nn.Embedding(V, H)
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.block = Block(cfg)
        self.lm_head = nn.Linear(H, V, bias=False)
        for p in (*self.embed.parameters(), *self.lm_head.parameters()):
            p.requires_grad_(False)  # frozen copies of the target's
        self.register_buffer("rope", rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta), persistent=False)

    def load_target_weights(self, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        """embedding, lm_head: [V, H] from the target (any dtype); copied, stay frozen."""
        want = (self.cfg.vocab_size, self.cfg.dim)
        for name, w in (("embedding", embedding), ("lm_head", lm_head)):
            if tuple(w.shape) != want:
                raise ConfigError(f"target {name} has shape {tuple(w.shape)}, the drafter expects {want}; "
                                  "the target's model config changed under the drafter: restart it")
        with torch.no_grad():
            self.embed.weight.copy_(embedding)
            self.lm_head.weight.copy_(lm_head)

    def forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (x_{t+1}), hidden [B, T, H] (h_t) -> (logits [B, T, V], hidden_pred [B, T, H]).

        Training: pos=None (positions 0..T-1, causal). Decoding with `setup_caches`: pos [T]
        absolute positions and mask [1, 1, T, max_len] (model.causal_decode_mask).
        """
        x = self.fc(torch.cat([self.embed(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))  # [B, T, H]
        rope = self.rope[: x.size(1)] if pos is None else self.rope[pos]
        h = self.block(x, rope, pos, mask)
        return self.lm_head(h), h

    def setup_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.fc.weight.dtype
        self.block.attention.kv_cache = KVCache(batch, max_len, self.cfg.kv_heads, self.cfg.head_dim, dtype,
                                                self.rope.device)

    def clear_caches(self) -> None:
        self.block.attention.kv_cache = None


def lm_config(settings: DrafterSettings, target_cfg: ModelConfig) -> ModelConfig:
    """The LM drafter's config: the preset's size, the target's vocabulary and context."""
    return ModelConfig(vocab_size=target_cfg.vocab_size, dim=settings.lm_dim, n_layers=settings.lm_layers,
                       n_heads=settings.lm_heads, max_seq_len=target_cfg.max_seq_len,
                       rope_theta=target_cfg.rope_theta, norm_eps=target_cfg.norm_eps)


def build_drafter(settings: DrafterSettings, target_cfg: ModelConfig, *, seed: int | None = None,
                  hf_config: dict[str, Any] | None = None) -> nn.Module:
    """A freshly initialised drafter (deterministic for a seed). Eagle still needs load_target_weights.
    hf_config: an HF target's config.json; its Eagle drafter is built of the target's own layer
    class (drafter.hf_eagle), in the layout serving engines load."""
    torch.manual_seed(settings.seed if seed is None else seed)
    if settings.arch == EAGLE and hf_config is not None:
        from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter  # imports transformers

        return HFEagleDrafter(hf_config)
    if settings.arch == EAGLE:
        return EagleDrafter(target_cfg)
    model = Transformer(lm_config(settings, target_cfg))
    model.init_weights(settings.seed if seed is None else seed)
    return model


# ---------------------------------------------------------------- losses
# Each returns (per-sample loss summed over the batch, stats). Summing lets the combiner
# accumulate gradients over micro-batches of any size and divide once by the sample count.

def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against softmax(target_logits), averaged over positions: [B, T, V] x2 -> [B]."""
    p = target_logits.float().softmax(-1)
    return -(p * logits.float().log_softmax(-1)).sum(-1).mean(-1)


def eagle_loss(model: EagleDrafter, tokens: torch.Tensor, hidden: torch.Tensor, *, hidden_weight: float,
               ce_weight: float, stats: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """tokens [B, T] int64, hidden [B, T, H] target final-norm hidden states (T >= 2).

    stats=False skips the monitoring figures (an argmax over the vocabulary and three host syncs):
    the training micro-step in a short window does not read them.
    """
    hidden = hidden.to(model.fc.weight.dtype)
    logits, h_pred = model(tokens[:, 1:], hidden[:, :-1])      # position t: (x_{t+1}, h_t), t < T-1
    h_next = hidden[:, 1:]                                       # h_{t+1}: the regression target
    with torch.no_grad():
        target_logits = model.lm_head(h_next)                     # the target's distribution of x_{t+2}
    reg = F.smooth_l1_loss(h_pred, h_next, reduction="none").mean(dim=(1, 2))   # [B]
    ce = soft_ce(logits, target_logits)                                          # [B]
    loss = (hidden_weight * reg + ce_weight * ce).sum()
    if not stats:
        return loss, {}
    with torch.no_grad():
        top1 = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    return loss, {"reg": reg.mean().item(), "ce": ce.mean().item(), "top1": top1}


def lm_loss(model: Transformer, tokens: torch.Tensor, hidden: torch.Tensor | None, lm_head: torch.Tensor | None,
            *, soft_weight: float, hard_weight: float, stats: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """tokens [B, T]; hidden [B, T, H] and lm_head [V, H] when the target's distribution is known.
    stats=False: as in eagle_loss."""
    logits = model(tokens[:, :-1])                                                # [B, T-1, V] predicts tokens[:, 1:]
    hard = F.cross_entropy(logits.transpose(1, 2).float(), tokens[:, 1:], reduction="none").mean(-1)  # [B]
    loss = hard_weight * hard
    figures = {"hard_ce": hard.mean().item()} if stats else {}
    if hidden is not None and lm_head is not None:
        with torch.no_grad():
            target_logits = hidden[:, :-1].float() @ lm_head.float().T           # the target's view of tokens[t+1]
        soft = soft_ce(logits, target_logits)
        loss = loss + soft_weight * soft
        if stats:
            figures["ce"] = soft.mean().item()
            with torch.no_grad():
                figures["top1"] = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    elif hard_weight == 0:
        loss = hard  # without the target's distribution the hard CE is the only signal
    return loss.sum(), figures


# ---------------------------------------------------------------- target weights

@dataclass
class TargetShared:
    """The target's frozen pieces the drafter borrows (run_dir/target/shared/)."""

    embedding: torch.Tensor      # [V, H]
    lm_head: torch.Tensor        # [V, H]
    model_config: ModelConfig
    digest: str                  # sha256 of the target model config (the export records it)
    stamp: tuple[int, ...]       # mtimes of the files: a change means the target rewrote them
    hf_config: dict[str, Any] | None = None   # an HF target's config.json (target_model.TargetModel.shared_config)
    token_counts: torch.Tensor | None = None  # [V] int64: the job's data (EAGLE-3's draft vocabulary), if written


def shared_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "target" / "shared"


def config_digest(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def _stamp(d: Path) -> tuple[int, ...] | None:
    try:
        return tuple(os.stat(d / n).st_mtime_ns for n in ("embedding.safetensors", "lm_head.safetensors",
                                                           "model_config.json"))
    except FileNotFoundError:
        return None


def shared_stamp(run_dir: str | os.PathLike[str]) -> tuple[int, ...] | None:
    return _stamp(shared_dir(run_dir))


def load_target_shared(run_dir: str | os.PathLike[str]) -> TargetShared | None:
    """The target's embedding/head/config, or None while any of them is missing."""
    from safetensors.torch import load_file

    d = shared_dir(run_dir)
    stamp = _stamp(d)
    if stamp is None:
        return None
    try:
        raw = json.loads((d / "model_config.json").read_text())
        emb = load_file(str(d / "embedding.safetensors"))["weight"]
        head = load_file(str(d / "lm_head.safetensors"))["weight"]
    except FileNotFoundError:
        return None  # replaced between stat and open: the caller asks again
    counts_file = d / "token_counts.safetensors"
    counts = load_file(str(counts_file))["counts"] if counts_file.exists() else None
    known = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{k: v for k, v in raw.items() if k in known})
    return TargetShared(embedding=emb.float(), lm_head=head.float(), model_config=cfg, digest=config_digest(raw),
                        stamp=stamp, hf_config=raw.get("hf_config"), token_counts=counts)


def wait_target_shared(run_dir: str | os.PathLike[str], *, timeout_s: float | None = None,
                       stop: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> TargetShared | None:
    """Wait until the target has written its shared weights; None on timeout or when `stop()`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop():
        shared = load_target_shared(run_dir)
        if shared is not None:
            return shared
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(poll_s)  # waiting for a file another process writes: nothing to wake us
    return None
