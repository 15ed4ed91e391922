"""The engine's adapter for an EAGLE-3 drafter (drafter/eagle3.py): the drafter's own static KV
cache per row, the target's fused features in, probabilities over the target's vocabulary out.

Contract (the engine's, as `adapters.EagleDraft`; offset 1): cache entry t consumes (x_{t+1}, g_t)
and predicts (logits for x_{t+2}, out_{t+1}). g_t = cat(f_low, f_mid, f_high)[t] [3H] is the
target's residual stream before the drafter's three feature layers at position t (transformers'
hidden_states[i]); the engine's target forwards return it at every position they verify (hf.stage,
`features=`) and the engine keeps it in `feat` [B, cache_len, 3H]. `hidden` comes in two widths:
- [B, T, 3H] features (the catch-up over committed tokens): fused by fc (3H -> H);
- [B, T, H] the previous draft step's `out` (the layer's output before the final norm), taken as
  is, the chain `eagle3.draft`, speculators and the serving engines run.
3H != H, so the width tells them apart.

Positions: cache slot t holds entry t at rotary position t + 1 (token x_{t+1} sits at position
t + 1: speculators' `position_ids = 1 + arange`, `eagle3.draft`).

Rollback: `keeps_drafts` is False, as for EAGLE-1. An entry fed a drafted token carries a predicted
`out` instead of the target's features, so after each verification the engine sets the row's
drafter length back to the length before that step, and the next catch-up re-feeds every newly
committed token with its true features: those cache slots are overwritten in place (the static
cache is written at `pos` before the attention reads it; slots past a query are masked). Nothing
is copied or truncated; rejected drafts' slots are simply rewritten or never visible.

Vocabulary: the head scores the Vd draft ids; `forward` returns logits over the target's V ids with
-inf outside the draft vocabulary (draft id j at target id j + d2t[j]). The rejection rule's q
(sampling.to_probs) is then the drafter's distribution over the target's vocabulary: positive on
every token it proposes, exactly zero where it cannot propose, so those tokens are never drafted and
the residual max(0, p - q) leaves them their whole p (lossless). At temperature 0 the argmax lies
in the draft vocabulary too.

Shapes: B rows, T tokens per row, S cache slots, H target width, V target vocab, Vd draft vocab,
n / n_kv heads, d head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from spectrain_workloads.model import KVCache
from spectrain_workloads.specdec.adapters import DraftAdapter


class _Decoding(nn.Module):
    """The drafter and its decoding cache in one module tree: the engine finds, views and compacts
    every KVCache under `adapter.module`, and the drafter itself stays as it was (no cache in it)."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.cache: KVCache | None = None

    def setup_caches(self, batch: int, max_len: int) -> None:
        d: Any = self.drafter
        attn, w = d.midlayer.self_attn, d.fc.weight
        self.cache = KVCache(batch, max_len, attn.n_kv, attn.d, w.dtype, w.device)   # [B, n_kv, S, d] x 2


class Eagle3Draft(DraftAdapter):
    """drafter.eagle3.Eagle3Drafter behind the engine's forward(tokens, hidden, pos, mask)."""

    offset, keeps_drafts, needs_hidden = 1, False, True

    def __init__(self, drafter: Any) -> None:
        super().__init__(_Decoding(drafter))
        self.drafter = drafter
        self.feature_layers = tuple(int(i) for i in drafter.feature_layers)
        self.width = int(drafter.cfg.hidden_size)      # H
        self.vocab = int(drafter.cfg.vocab_size)       # V, the target's

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None, pos: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B, T] target ids, hidden [B, T, 3H] features or [B, T, H] the previous `out`, pos
        [B, T] cache slots, mask [B, 1, T, S] -> (logits [B, T, V], -inf off the draft vocabulary;
        out [B, T, H])."""
        m = self.drafter
        assert hidden is not None, "an EAGLE-3 drafter reads the target's features"
        dt = m.fc.weight.dtype
        h = m.fuse(hidden) if hidden.size(-1) == 3 * self.width else hidden.to(dt)       # [B, T, H]
        out = self._layer(tokens, h, pos if pos.dim() == 2 else pos[None].expand(h.size(0), -1), mask)
        draft_logits = m.lm_head(m.norm(out))                                               # [B, T, Vd]
        logits = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab), float("-inf"))
        logits.index_copy_(-1, m.target_ids().to(logits.device), draft_logits)             # [B, T, V]
        return logits, out

    def _layer(self, tokens: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eagle3Layer's forward (drafter/eagle3.py) with the static cache in place of a growing one:
        the same modules and order of operations, so the chain equals `eagle3.draft`'s (tested)."""
        m, cache = self.drafter, self.module.cache
        assert isinstance(cache, KVCache), "setup_caches first"
        layer, attn = m.midlayer, m.midlayer.self_attn
        B, T, _ = h.shape
        embeds = F.embedding(tokens, m.embed_weight).to(h.dtype)                           # [B, T, H]
        cos, sin = m._rope(h, pos + 1)                                                      # [B, T, d]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], dim=-1)       # [B, T, 2H]
        q = attn.q_proj(x).view(B, T, attn.n, attn.d).transpose(1, 2)                      # [B, n, T, d]
        k = attn.k_proj(x).view(B, T, attn.n_kv, attn.d).transpose(1, 2)                   # [B, n_kv, T, d]
        v = attn.v_proj(x).view(B, T, attn.n_kv, attn.d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = cache.update(pos, k, v)                                              # [B, n_kv, S, d]
        rep = attn.n // attn.n_kv                                                           # GQA
        o = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                           attn_mask=mask)                                  # [B, n, T, d]
        r = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, attn.n * attn.d))              # residual: un-normed h
        out: torch.Tensor = r + layer.mlp(layer.post_attention_layernorm(r))               # [B, T, H]
        return out


__all__ = ["Eagle3Draft"]
