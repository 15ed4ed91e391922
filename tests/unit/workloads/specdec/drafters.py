"""Drafters the rollout tests build themselves: a contracts.md-shaped Eagle head (one model.Block,
fc over [embed(x_{t+1}); h_t], frozen copies of the target's embedding and LM head)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from spectrain_workloads.model import Block, KVCache, Transformer, model_config, rope_cache


def tiny_model(seed: int, preset: str = "debug", dtype: torch.dtype = torch.float64, **overrides: object) -> Transformer:
    m = Transformer(model_config(preset, overrides, vocab_size=264))  # type: ignore[arg-type]
    m.init_weights(seed)
    return m.to(dtype).eval()


class TinyEagle(nn.Module):
    def __init__(self, target: Transformer, seed: int = 0) -> None:
        super().__init__()
        cfg = self.cfg = target.cfg
        torch.manual_seed(seed)
        assert target.tok_embeddings is not None and target.output is not None
        self.embed = copy.deepcopy(target.tok_embeddings).requires_grad_(False)
        self.lm_head = copy.deepcopy(target.output).requires_grad_(False)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg)
        self.register_buffer("rope", rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta), persistent=False)
        self.to(next(target.parameters()).dtype)

    def setup_caches(self, batch: int, max_len: int) -> None:
        p = self.fc.weight
        self.block.attention.kv_cache = KVCache(batch, max_len, self.cfg.kv_heads, self.cfg.head_dim, p.dtype, p.device)

    def clear_caches(self) -> None:
        self.block.attention.kv_cache = None

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([self.embed(tokens), hidden], -1))                   # [B, T, H]
        rope = self.rope[: tokens.size(1)] if pos is None else self.rope[pos]
        h = self.block(x, rope, pos, mask)
        return self.lm_head(h), h
