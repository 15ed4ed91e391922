"""The EAGLE-1 drafter of a Hugging Face target, in the shape vLLM and SGLang serve.

Same convention as `models.EagleDrafter` (contracts.md Eagle): at position t the inputs are the
target's final-norm hidden h_t [H] and the token x_{t+1}; fc: Linear(2H -> H) over
[embed(x_{t+1}); h_t]; one decoder layer; output hidden_pred ~ h_{t+1}; logits = lm_head(hidden_pred)
predict x_{t+2}. Embedding and LM head are frozen copies of the target's.

What differs from `EagleDrafter` is the layer: transformers' own decoder layer of the target's
family (`hf.arch.parts(arch).decoder_layer`), so its RoPE is the rotate-half convention, its
attention biases (Qwen2 q/k/v) and per-head q/k norms (Qwen3) are the target's, and its weights
are named as the serving engines name them (`layers.0.self_attn.q_proj.weight`, ...). As in the
serving loaders (vLLM llama_eagle.py, SGLang llama_eagle.py / qwen2_eagle.py, which follow EAGLE's
cnets.py), layer 0 has no input RMSNorm (fc's output enters attention directly) and there is no
final norm: hidden_pred is the layer's residual stream.

fc has no bias: vLLM's `EagleLlamaForCausalLM` builds fc without one (a bias in the checkpoint is
an unknown weight there), SGLang's builds it with one, so the export writes an exact zero bias for
SGLang and none for vLLM (serving_export.py); both then compute what this module computes.

Shapes: B batch, T positions, H target width, V vocab, n_kv key/value heads, d head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from spectrain_workloads.drafter.models import EagleDrafter
from spectrain_workloads.hf.arch import Rope, StaticKV, head_dim, hf_config, parts, rotary_positions
from spectrain_workloads.hf.source import sizes
from spectrain_workloads.model import causal_decode_mask


def rope_theta(cfg: Any) -> float:
    """rope_theta of a transformers config (rope_parameters in 5.x, a plain field before)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


class HFEagleDrafter(EagleDrafter):
    """EAGLE-1 head over an HF target; the interface of `EagleDrafter` (it is one, for isinstance).

    target_config: the target's config.json as a dict (architectures[0] one of HF_ARCHITECTURES).
    """

    arch = "Eagle"
    layers: nn.ModuleList
    _kv: StaticKV | None
    _kv_len: int

    def __init__(self, target_config: dict[str, Any]) -> None:
        nn.Module.__init__(self)   # not EagleDrafter.__init__: that builds the project's Block
        self.target_config = dict(target_config)   # kept for the export (target hash, serving config)
        self.hf_cfg = hf_config(self.target_config)
        self.hf_arch: str = self.target_config["architectures"][0]
        # the sizes `.cfg` readers use; RoPE theta as transformers resolves it (its defaults included)
        self.cfg = dataclasses.replace(sizes(self.target_config), n_layers=1, rope_theta=rope_theta(self.hf_cfg))
        H, V = self.cfg.dim, self.cfg.vocab_size
        p = parts(self.hf_arch)
        self.embed = nn.Embedding(V, H)
        self.fc = nn.Linear(2 * H, H, bias=False)
        layer = p.decoder_layer(self.hf_cfg, layer_idx=0)
        layer.input_layernorm = nn.Identity()   # EAGLE-1: fc's output is not normalised before attention
        self.layers = nn.ModuleList([layer])     # state_dict names `layers.0.*`, as the serving layouts
        self.lm_head = nn.Linear(H, V, bias=False)
        for w in (*self.embed.parameters(), *self.lm_head.parameters()):
            w.requires_grad_(False)   # frozen copies of the target's
        self._init_trainable()
        self._rope = Rope(p.rotary, self.hf_cfg)   # out of the module tree: RoPE angles stay fp32
        self._kv: StaticKV | None = None

    def _init_trainable(self) -> None:
        """HF's initialiser convention (normal(0, initializer_range), RMSNorm weights 1)."""
        std = float(getattr(self.hf_cfg, "initializer_range", 0.02))
        with torch.no_grad():
            for name, w in self.named_parameters():
                if not w.requires_grad:
                    continue
                if name.endswith("norm.weight"):
                    w.fill_(1.0)
                elif name.endswith(".bias"):
                    w.zero_()
                else:
                    w.normal_(0.0, std)

    # ------------------------------------------------------------ forward
    def forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (x_{t+1}), hidden [B, T, H] (h_t) -> (logits [B, T, V], hidden_pred [B, T, H]).

        Training: pos=None (positions 0..T-1, causal, no cache). Decoding after `setup_caches`:
        pos [T] or [B, T] absolute positions, mask [1 or B, 1, T, max_len] boolean
        (model.causal_decode_mask; built here when None).
        """
        x = self.fc(torch.cat([self.embed(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))   # [B, T, H]
        position_ids = rotary_positions(pos, x.size(1), x.device)                                # [1 or B, T]
        cos_sin = self._rope(x, position_ids)
        cache = self._kv if pos is not None else None
        if cache is not None:
            assert pos is not None
            cache.pos = pos
            if mask is None:
                mask = causal_decode_mask(pos, self._kv_len)
        elif pos is not None and mask is None:
            raise ValueError("HFEagleDrafter: pos without setup_caches needs an explicit mask")
        layer: nn.Module = self.layers[0]
        h = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                  position_embeddings=cos_sin)
        h = h[0] if isinstance(h, tuple) else h   # transformers < 5 returned a tuple
        return self.lm_head(h), h

    # ------------------------------------------------------------ decoding cache
    def setup_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.fc.weight.dtype
        n_kv = getattr(self.hf_cfg, "num_key_value_heads", None) or self.hf_cfg.num_attention_heads
        self._kv = StaticKV([0], batch, max_len, n_kv, head_dim(self.hf_cfg), dtype, self.fc.weight.device)
        self._kv_len = max_len

    def clear_caches(self) -> None:
        self._kv = None


def build_hf_eagle(target_config: dict[str, Any], embedding: torch.Tensor | None = None,
                   lm_head: torch.Tensor | None = None, *, seed: int | None = None) -> HFEagleDrafter:
    """A fresh drafter (deterministic for a seed), with the target's frozen weights when given."""
    if seed is not None:
        torch.manual_seed(seed)
    model = HFEagleDrafter(target_config)
    if embedding is not None and lm_head is not None:
        model.load_target_weights(embedding, lm_head)
    return model
