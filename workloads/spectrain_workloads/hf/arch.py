"""The Hugging Face architectures a target may be, and the transformers pieces each is built from.

A target given by `spec.target.model.path` runs transformers' own decoder layers, norms and
rotary embeddings (so its numerics are transformers'), wrapped in this project's stage interface
(`hf.stage.HFStage`). The supported architectures are the Llama family whose modelling files
name their parts `<Family>DecoderLayer`, `<Family>RMSNorm`, `<Family>RotaryEmbedding`.

`StaticKV` is the KV cache the project's decoding engine (specdec.engine) uses, presented through
the one method of transformers' Cache protocol the attention layers call (`update`): static
buffers [B, n_kv, max_T, d] per layer, positions written in place, per-row positions allowed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spectrain_api.errors import ConfigError
from spectrain_api.names import HF_ARCHITECTURES
from spectrain_workloads.model import KVCache

ATTN_IMPLEMENTATION = "sdpa"   # transformers' default on CPU and CUDA; the same kernels as its generate()


@dataclass(frozen=True)
class ArchParts:
    decoder_layer: type[nn.Module]   # (config, layer_idx)
    norm: type[nn.Module]            # (hidden_size, eps)
    rotary: type[nn.Module]          # (config); forward(x, position_ids [B, T]) -> (cos, sin) [B, T, d]


def check_arch(arch: str, field: str = "spec.target.model.path") -> str:
    if arch not in HF_ARCHITECTURES:
        raise ConfigError(f"{field}: architecture {arch!r} is not supported; supported: "
                          f"{', '.join(HF_ARCHITECTURES)}")
    return arch


def parts(arch: str) -> ArchParts:
    family = check_arch(arch).removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{family.lower()}.modeling_{family.lower()}")
    return ArchParts(getattr(module, f"{family}DecoderLayer"), getattr(module, f"{family}RMSNorm"),
                     getattr(module, f"{family}RotaryEmbedding"))


def hf_config(raw: dict[str, Any]) -> Any:
    """transformers config object from a config.json dict, with the attention implementation fixed."""
    from transformers import AutoConfig

    archs = raw.get("architectures") or []
    check_arch(archs[0] if archs else "<none>")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    cfg = AutoConfig.for_model(raw["model_type"], **fields)
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    return cfg


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_window(cfg: Any) -> int | None:
    """The shortest attention window any layer uses, None when every layer attends to all positions."""
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


class StaticKV(nn.Module):
    """transformers' Cache protocol over model.KVCache buffers, one per layer id (registered as
    submodules, so the rollout engine finds, views and compacts them as it does its own).

    The caller sets `pos` ([T] shared or [B, T] per-row absolute positions) before each forward;
    each attention layer's `update(k [B, n_kv, T, d], v, layer_idx)` writes there and returns the
    whole buffers [B, n_kv, max_T, d], which the caller's boolean mask restricts.
    """

    def __init__(self, layer_ids: list[int], batch: int, max_len: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.kv = nn.ModuleDict({str(i): KVCache(batch, max_len, n_kv, head_dim, dtype, device) for i in layer_ids})
        self.pos: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pos is not None, "set StaticKV.pos before the forward"
        cache: KVCache = self.kv[str(layer_idx)]   # type: ignore[assignment]
        return cache.update(self.pos, key_states, value_states)


class Rope:
    """transformers' rotary embedding, kept out of the module tree: a model's `.to(torch.bfloat16)`
    would round inv_freq, while transformers and the serving engines compute the angles in fp32.
    Follows its input's device; returns (cos, sin) [1 or B, T, d] in the input's dtype."""

    def __init__(self, rotary: type[nn.Module], cfg: Any) -> None:
        self.module = rotary(config=cfg)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.module.inv_freq.device != x.device:   # type: ignore[union-attr]
            self.module.to(x.device)
        return self.module(x, position_ids)   # type: ignore[no-any-return]


def rotary_positions(pos: torch.Tensor | None, T: int, device: Any) -> torch.Tensor:
    """position_ids [1 or B, T] for transformers' rotary embedding: 0..T-1 when training."""
    if pos is None:
        return torch.arange(T, device=device)[None]
    return pos[None] if pos.dim() == 1 else pos
