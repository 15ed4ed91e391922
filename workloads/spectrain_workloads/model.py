"""Decoder-only transformer shared by the target, the drafter and the rollout engine.

RMSNorm, RoPE, SwiGLU and SDPA causal attention, in the style of gpt-fast / torchtitan.
Presets are the names API.md uses (`debug` runs in seconds on CPU). A pipeline stage is the
same module with a slice of `layers` (see `Transformer.stage`), so the single-process reference
and the pipelined run share every parameter initialisation.

Shapes: B batch, T tokens, H model dim, V vocab, n heads, d head dim (H = n * d).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spectrain_api.config import ModelConfig, model_config
from spectrain_api.errors import ConfigError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability; cast back so bf16 stays bf16.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cache(seq_len: int, head_dim: int, theta: float) -> torch.Tensor:
    """[seq_len, head_dim/2, 2] cos/sin table."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x: [B, T, n, d]; cache: [T, d/2, 2] (shared positions) or [B, T, d/2, 2] (per-row positions)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)           # [B, T, n, d/2, 2]
    c = cache.reshape(-1, xs.size(1), 1, xs.size(3), 2)     # [1 or B, T, 1, d/2, 2]
    out = torch.stack(
        [xs[..., 0] * c[..., 0] - xs[..., 1] * c[..., 1], xs[..., 1] * c[..., 0] + xs[..., 0] * c[..., 1]],
        dim=-1,
    )
    return out.flatten(3).type_as(x)


class KVCache(nn.Module):
    """Static per-layer cache [B, n_kv, max_T, d]; positions are written in place."""

    def __init__(self, batch: int, max_len: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        shape = (batch, n_kv, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pos: [T] positions shared by the batch, or [B, T] per-row positions; k, v: [B, n_kv, T, d]
        if pos.dim() == 1:
            self.k[:, :, pos] = k
            self.v[:, :, pos] = v
        else:
            rows = torch.arange(k.size(0), device=pos.device)[:, None]   # [B, 1]
            self.k[rows, :, pos] = k.transpose(1, 2)                      # indexed view [B, T, n_kv, d]
            self.v[rows, :, pos] = v.transpose(1, 2)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * d, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * d, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.n_heads * d, cfg.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        n, nkv, d = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.head_dim
        q = apply_rope(self.wq(x).view(B, T, n, d), rope).transpose(1, 2)      # [B, n, T, d]
        k = apply_rope(self.wk(x).view(B, T, nkv, d), rope).transpose(1, 2)    # [B, nkv, T, d]
        v = self.wv(x).view(B, T, nkv, d).transpose(1, 2)
        if self.kv_cache is not None and pos is not None:
            k, v = self.kv_cache.update(pos, k, v)                              # [B, nkv, maxT, d]
        if nkv != n:
            k = k.repeat_interleave(n // nkv, dim=1)
            v = v.repeat_interleave(n // nkv, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, n * d))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Full model, or one pipeline stage of it (missing parts are None).

    forward(tokens [B, T]) -> logits [B, T, V] on the last stage, hidden [B, T, H] otherwise.
    With return_hidden=True the last stage returns (logits, hidden_after_final_norm).
    """

    def __init__(self, cfg: ModelConfig, *, layers: range | None = None, first: bool = True, last: bool = True):
        super().__init__()
        self.cfg = cfg
        self.first, self.last = first, last
        self.layer_ids = list(layers if layers is not None else range(cfg.n_layers))
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if first else None
        # ModuleDict keyed by global layer id keeps state_dict keys identical to the full model.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in self.layer_ids})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if last else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None
        if last and first and cfg.tie_embeddings:
            assert self.output is not None and self.tok_embeddings is not None
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta), persistent=False)

    @classmethod
    def stage(cls, cfg: ModelConfig, stage: int, n_stages: int) -> Transformer:
        """Stage `stage` of an even `n_stages`-way split of the layers."""
        if n_stages < 1 or cfg.n_layers % n_stages:
            raise ConfigError(
                f"target.parallelism.pipeline ({n_stages}) must divide the model's n_layers ({cfg.n_layers}); "
                "pick a pipeline degree that divides it or override model.n_layers"
            )
        per = cfg.n_layers // n_stages
        return cls(cfg, layers=range(stage * per, (stage + 1) * per), first=stage == 0, last=stage == n_stages - 1)

    def init_weights(self, seed: int) -> None:
        """Initialise as the full model would, so stage k of a split equals the slice of the full model."""
        full_gen = torch.Generator().manual_seed(seed)
        std = 0.02
        # Draw every tensor of the full model in a fixed order; keep the ones this stage owns.
        names = ["tok_embeddings.weight"]
        for i in range(self.cfg.n_layers):
            for sub in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                        "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
                names.append(f"layers.{i}.{sub}.weight")
        names.append("output.weight")
        params = dict(self.named_parameters())
        shapes = _full_shapes(self.cfg)
        with torch.no_grad():
            for name in names:
                t = torch.empty(shapes[name]).normal_(0.0, std, generator=full_gen)
                if name.endswith(("wo.weight", "w2.weight")):
                    t.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))   # GPT-2 style residual scaling
                if name in params:
                    params[name].copy_(t)
            for name, p in params.items():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)

    def setup_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or next(self.parameters()).dtype
        device = self.rope.device
        for block in self.layers.values():
            block.attention.kv_cache = KVCache(batch, max_len, self.cfg.kv_heads, self.cfg.head_dim, dtype, device)

    def clear_caches(self) -> None:
        for block in self.layers.values():
            block.attention.kv_cache = None

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> Any:
        """x: tokens [B, T] on the first stage, hidden [B, T, H] otherwise.

        pos: [T] absolute positions when decoding with KV caches, or [B, T] per-row positions
        (then `mask` [B or 1, 1, T, maxT] must be given); None for training (positions 0..T-1, causal).
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        T = h.size(1)
        rope = self.rope[:T] if pos is None else self.rope[pos]
        for block in self.layers.values():
            h = block(h, rope, pos, mask)
        if self.norm is None or self.output is None:
            return h
        hidden = self.norm(h)
        logits = self.output(hidden)
        return (logits, hidden) if return_hidden else logits


def _full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.dim, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, d), "output.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention.wq.weight"] = (cfg.n_heads * hd, d)
        shapes[p + "attention.wk.weight"] = (cfg.kv_heads * hd, d)
        shapes[p + "attention.wv.weight"] = (cfg.kv_heads * hd, d)
        shapes[p + "attention.wo.weight"] = (d, cfg.n_heads * hd)
        shapes[p + "feed_forward.w1.weight"] = (cfg.hidden_dim, d)
        shapes[p + "feed_forward.w3.weight"] = (cfg.hidden_dim, d)
        shapes[p + "feed_forward.w2.weight"] = (d, cfg.hidden_dim)
    return shapes


def causal_decode_mask(pos: torch.Tensor, max_len: int) -> torch.Tensor:
    """Boolean mask: query at pos[i] sees cache slots <= pos[i].

    pos [T] -> [1, 1, T, max_len]; per-row pos [B, T] -> [B, 1, T, max_len].
    """
    m = torch.arange(max_len, device=pos.device) <= pos[..., None]   # [(B,) T, max_len]
    return m[None, None] if pos.dim() == 1 else m[:, None]


__all__ = [
    "ModelConfig", "model_config", "Transformer", "Block", "RMSNorm", "KVCache",
    "causal_decode_mask",
]
