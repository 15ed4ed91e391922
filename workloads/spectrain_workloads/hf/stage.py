"""One pipeline stage of a Hugging Face target, built from transformers' own layers.

The module tree mirrors `<Arch>ForCausalLM` (`model.embed_tokens`, `model.layers.<i>`, `model.norm`,
`lm_head`), keyed by global layer id, so a stage's state_dict keys are the checkpoint's names and
its weights stream straight from the safetensors files (`load_weights`: only this stage's
tensors are read). It speaks the project's stage interface (model.Transformer's), so the
trainer's pipeline executor, the ring publisher and the rollout engine drive it unchanged:

    forward(x, pos=None, mask=None, return_hidden=False)
      x: tokens [B, T] on the first stage, hidden [B, T, H] otherwise
      -> logits [B, T, V] on the last stage ((logits, final-norm hidden) with return_hidden),
         hidden [B, T, H] otherwise
      pos: None when training (positions 0..T-1, causal); [T] or [B, T] absolute positions when
      decoding with `setup_caches`, with `mask` [1 or B, 1, T, max_T] (model.causal_decode_mask).

    forward(..., return_hidden=True, features=(i, j, k)) also returns the residual stream *before*
    global layers i, j, k (transformers' hidden_states[i]), concatenated in that order [B, T, 3H]:
    (logits, hidden, features). The rollout engine asks for it when it drives an EAGLE-3 drafter
    (specdec.eagle3): the states are the layer loop's own inputs, kept by reference, so the cost is
    one concatenation; without `features` nothing is kept.

Precision: fp32 weights (the optimizer's master copy); on CUDA the forward runs under bf16 autocast
(`amp`), so the matmuls are bf16 while the residual stream, the norms and the loss stay fp32 (the
activations sent between stages are fp32 either way); on the CPU everything is fp32.

Tied embeddings: on a single stage `lm_head.weight` is `embed_tokens.weight`; split across stages,
the last stage holds a copy loaded from the embedding, and the trainer keeps the two equal by
summing their gradients (target.trainer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from spectrain_api.errors import ConfigError
from spectrain_workloads.hf.arch import Rope, StaticKV, head_dim, hf_config, parts, rotary_positions
from spectrain_workloads.hf.source import ModelDir, sizes


class _Body(nn.Module):
    """`<Arch>ForCausalLM.model`'s parts this stage holds (the names give the checkpoint's keys)."""

    def __init__(self, embed_tokens: nn.Embedding | None, layers: nn.ModuleDict, norm: nn.Module | None) -> None:
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, layers, norm


class HFStage(nn.Module):
    def __init__(self, raw_config: dict[str, Any], *, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.hf_cfg = cfg = hf_config(raw_config)
        self.cfg = sizes(raw_config)      # the project's ModelConfig view (dim, vocab, max_seq_len)
        p = parts(raw_config["architectures"][0])
        self.first, self.last = first, last
        self.layer_ids = list(layers)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = _Body(nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first else None,
                           nn.ModuleDict({str(i): p.decoder_layer(cfg, i) for i in self.layer_ids}),
                           p.norm(cfg.hidden_size, eps=cfg.rms_norm_eps) if last else None)
        self.rope = Rope(p.rotary, cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if last else None
        if first and last and self.tied:
            assert self.lm_head is not None and self.model.embed_tokens is not None
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cache: StaticKV | None = None       # a submodule while set up (the engine finds its KVCaches)
        self.amp = True                          # bf16 autocast when the input is on CUDA

    # The names the trainer, the ring publisher and the hooks use for the project's own stages.
    @property
    def tok_embeddings(self) -> nn.Embedding | None:
        return self.model.embed_tokens

    @property
    def output(self) -> nn.Linear | None:
        return self.lm_head

    @property
    def norm(self) -> nn.Module | None:
        return self.model.norm

    @classmethod
    def stage(cls, source: ModelDir, stage: int, n_stages: int) -> HFStage:
        """Stage `stage` of an even `n_stages`-way split of the layers (embedding first, norm + head last)."""
        n = source.n_layers
        if n_stages < 1 or n % n_stages:
            raise ConfigError(f"spec.target.parallelism.pipeline ({n_stages}) must divide the model's "
                              f"num_hidden_layers ({n}, {source.root}/config.json)")
        per = n // n_stages
        return cls(source.config, layers=range(stage * per, (stage + 1) * per), first=stage == 0,
                   last=stage == n_stages - 1)

    def load_weights(self, source: ModelDir) -> None:
        """Copy this stage's tensors from the safetensors files (each file opened once, only the
        tensors this stage owns read); a missing or misshapen tensor is a ConfigError."""
        from safetensors import safe_open

        wanted: dict[str, str] = {}     # our name -> checkpoint name
        for name in self.state_dict():
            src = name
            if name == "lm_head.weight" and self.tied and name not in source.weight_map:
                src = "model.embed_tokens.weight"
            wanted[name] = src
        missing = [s for s in wanted.values() if s not in source.weight_map]
        if missing:
            raise ConfigError(f"spec.target.model.path: {source.root} lacks {missing[:3]} "
                              f"({len(missing)} tensors) that {source.arch} stage layers "
                              f"{self.layer_ids[0]}..{self.layer_ids[-1]} need")
        by_file: dict[str, list[str]] = {}
        for name, src in wanted.items():
            by_file.setdefault(source.weight_map[src], []).append(name)
        params = self.state_dict(keep_vars=True)
        with torch.no_grad():
            for fname, names in sorted(by_file.items()):
                with safe_open(str(source.root / fname), framework="pt") as fh:
                    for name in names:
                        t = fh.get_tensor(wanted[name])
                        if tuple(t.shape) != tuple(params[name].shape):
                            raise ConfigError(f"spec.target.model.path: {fname}:{wanted[name]} has shape "
                                              f"{tuple(t.shape)}, config.json implies {tuple(params[name].shape)}")
                        params[name].copy_(t)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under the checkpoint's names (a tied head is left to the embedding)."""
        out = {k: v.detach() for k, v in self.state_dict().items()}
        if self.tied:
            out.pop("lm_head.weight", None)
        return out

    def setup_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> None:
        cfg = self.hf_cfg
        ref = next(self.parameters())
        self.cache = StaticKV(self.layer_ids, batch, max_len, cfg.num_key_value_heads, head_dim(cfg),
                              dtype or ref.dtype, ref.device)

    def clear_caches(self) -> None:
        self.cache = None

    captures_features = True   # forward(..., features=...) works (the engine checks before an EAGLE-3 drafter)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                return_hidden: bool = False, features: Sequence[int] | None = None) -> Any:
        want = self._feature_ids(features)
        kept: dict[int, torch.Tensor] = {}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp and x.is_cuda):
            h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x   # [B, T, H]
            cache = self.cache if pos is not None else None
            if cache is not None:
                cache.pos = pos
            cos_sin = self.rope(h, rotary_positions(pos, h.size(1), h.device))  # ([B|1, T, d],) * 2
            for i, layer in self.model.layers.items():
                if int(i) in want:
                    kept[int(i)] = h                 # [B, T, H], the input of layer i (a reference, no copy)
                h = layer(h, attention_mask=mask, position_embeddings=cos_sin, past_key_values=cache)
            if self.model.norm is None or self.lm_head is None:
                return h
            hidden = self.model.norm(h)
            logits = self.lm_head(hidden)
        if features is not None:
            return logits, hidden, torch.cat([kept[i] for i in want], dim=-1)   # [B, T, len(want) * H]
        return (logits, hidden) if return_hidden else logits

    def _feature_ids(self, features: Sequence[int] | None) -> tuple[int, ...]:
        """The requested feature layers, each one this (last) stage runs; () for none."""
        if features is None:
            return ()
        ids = tuple(int(i) for i in features)
        missing = [i for i in ids if i not in self.layer_ids]
        if missing or self.lm_head is None:
            raise ConfigError(f"EAGLE-3 feature layers {list(ids)}: this stage runs layers "
                              f"{self.layer_ids[0]}..{self.layer_ids[-1]} and "
                              f"{'has' if self.lm_head is not None else 'lacks'} the LM head; decoding needs "
                              "one stage holding every feature layer and the head")
        return ids
