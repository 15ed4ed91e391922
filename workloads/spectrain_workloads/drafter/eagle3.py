"""The EAGLE-3 drafter: three target feature layers fused, one Llama-style layer, a draft vocabulary.

Convention (the serving engines' and speculators'; eagle3-formats.md). Target of width H, vocab V,
L layers; draft vocabulary Vd. At drafter position i the inputs are
  g_i = cat(f_low, f_mid, f_high)[i]  [3H]: the target's residual stream *before* its layers
        (low, mid, high), i.e. transformers' `hidden_states[layer]` (index 0 = the embeddings),
        which is what vLLM's and SGLang's Llama forwards capture (`hidden_states + residual` in
        front of layer `idx`);
  x_{i+1}: the next token, embedded with the target's embedding (borrowed and frozen; only the
        speculators export writes a copy, since its loader does not refill a missing one: SGLang
        installs the target's (`set_embed`), vLLM shares it when the file has none).
and the output logits [Vd] predict x_{i+2}, the token the target's logits at position i+1 give.
The token x_{i+1} sits at rotary position i+1 (speculators' `position_ids = 1 + arange`).

The layer (SGLang python/sglang/srt/models/llama_eagle3.py LlamaDecoderLayer, vLLM
vllm/model_executor/models/llama_eagle3.py with norm_before_residual=False, speculators
models/eagle3/model_definitions.py Eagle3FirstLayerMixin):
    h        = fc(g)                                                  [B, T, H]   (fc: 3H -> H, no bias)
    a        = attn(cat(input_layernorm(embed(x)), hidden_norm(h)))   q/k/v read 2H
    r        = h + a                                                  (the residual is the *un-normed* h)
    out      = r + mlp(post_attention_layernorm(r))                   [B, T, H]
    logits   = lm_head(norm(out))                                     [B, T, Vd]
`out` (before the final norm) is what the next draft step takes in place of fc(g).

Training-time test (TTT), as speculators' Eagle3DraftModel.forward and SpecForge unroll it: step 0
runs all positions causally over the fused features; step k > 0 feeds step k-1's `out` at the
same row i with the token x_{i+1+k} at position i+1+k, and row i attends to the step-0 keys j <= i
plus its own keys of steps 1..k (a diagonal per step). The last row's keys are the whole prefix
and its own chain: the training mask *is* the decode-time attention of a chain (`draft`; tested). Loss per step k: forward KL(target || drafter) over the draft vocabulary
against the target's logits at row i+1+k, weighted 0.8**k (SpecForge `ploss_weight`) and
normalised by the weights' sum; speculators' default (`ttt_step_loss_decay` 1.0) is decay=1.

Draft vocabulary (SpecForge / speculators / SGLang / vLLM agree): `d2t` [Vd] int64 holds offsets,
target_id = draft_id + d2t[draft_id] (SGLang: `hot_token_id = d2t + arange`; vLLM:
`targets = base + draft_id_to_target_id`); `t2d` [V] bool marks the target ids in the draft
vocabulary. Draft ids are the chosen target ids in increasing order, so `target_logits[..., t2d]`
lists them in draft-id order (speculators' `verifier_lm_head = lm_head[t2d]` relies on it).

Shapes: B batch, T positions, H width, V target vocab, Vd draft vocab, n/n_kv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from spectrain_api.eagle3 import (  # defined once, re-exported
    TTT_STEPS_DEFAULT,
    check_feature_layers,
    default_feature_layers,
)
from spectrain_api.errors import ConfigError
from spectrain_api.names import EAGLE3

KV = tuple[torch.Tensor, torch.Tensor]   # keys, values [B, n_kv, S, d] (RoPE applied)
STEP_DECAY = 0.8                         # SpecForge's ploss_weight = [0.8**i ...]
TTT_STEPS = TTT_STEPS_DEFAULT            # speculators' `ttt_steps` default (spec.drafter.tttSteps)


# ---------------------------------------------------------------- configuration

def eagle3_layer_config(target: Any) -> LlamaConfig:
    """The drafter layer's LlamaConfig from the target's transformers config (any Llama-family
    target: the anchors' Qwen3 drafters are Llama layers too). One layer, no biases."""
    rope = dict(getattr(target, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(getattr(target, "rope_theta", None) or 10000.0))
    n = int(target.num_attention_heads)
    return LlamaConfig(
        hidden_size=int(target.hidden_size), intermediate_size=int(target.intermediate_size),
        num_attention_heads=n, num_key_value_heads=int(getattr(target, "num_key_value_heads", None) or n),
        head_dim=int(getattr(target, "head_dim", None) or target.hidden_size // n),
        hidden_act=str(target.hidden_act), rms_norm_eps=float(target.rms_norm_eps),
        max_position_embeddings=int(target.max_position_embeddings), vocab_size=int(target.vocab_size),
        num_hidden_layers=1, rope_parameters=rope, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, initializer_range=float(getattr(target, "initializer_range", 0.02)),
    )


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_counts [V] -> (d2t [Vd] int64 offsets, t2d [V] bool) of the Vd most frequent target
    ids (ties: the lower id), draft ids in increasing target-id order."""
    if token_counts.dim() != 1:
        raise ConfigError(f"token_counts must be 1-D [V], got shape {list(token_counts.shape)}")
    V = token_counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ConfigError(f"draftVocabSize {draft_vocab_size} must be in [1, {V}] (the target's vocab)")
    order = torch.argsort(-token_counts.to(torch.float64), stable=True)    # most frequent first, id ties low first
    ids = torch.sort(order[:draft_vocab_size]).values                       # [Vd] target ids, increasing
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t.to(torch.int64), t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """d2t and t2d describe the same increasing set of target ids."""
    Vd, V = d2t.numel(), t2d.numel()
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ConfigError(f"d2t must be int64 and t2d bool, got {d2t.dtype} / {t2d.dtype}")
    ids = d2t + torch.arange(Vd, device=d2t.device)
    hot = torch.nonzero(t2d).flatten().to(ids.device)
    if hot.numel() != Vd or not torch.equal(ids, hot):
        raise ConfigError(f"d2t ({Vd} draft ids) and t2d ({hot.numel()} of {V} target ids) disagree")


# ---------------------------------------------------------------- the layer

class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concatenation; o_proj writes H."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        H = int(cfg.hidden_size)
        self.n, self.n_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.d = int(cfg.head_dim or H // self.n)
        self.q_proj = nn.Linear(2 * H, self.n * self.d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: KV | None,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """x [B, T, 2H], cos/sin [1 or B, T, d], past keys/values [B, n_kv, S0, d], mask bool
        [1 or B, 1, T, S0+T] (None: every key visible) -> ([B, T, H], keys/values incl. these)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n, self.d).transpose(1, 2)      # [B, n, T, d]
        k = self.k_proj(x).view(B, T, self.n_kv, self.d).transpose(1, 2)   # [B, n_kv, T, d]
        v = self.v_proj(x).view(B, T, self.n_kv, self.d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        rep = self.n // self.n_kv                                           # GQA: each kv head serves rep q heads
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=mask)                 # [B, n, T, d], scale d**-0.5
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n * self.d)), (k, v)


class Eagle3Layer(nn.Module):
    """SGLang's `midlayer`: names input_layernorm, hidden_norm, self_attn, post_attention_layernorm, mlp."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)   # on the token embedding
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)       # on the fused features / previous step's output
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: KV | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """embeds, hidden [B, T, H] -> (out [B, T, H] before the final norm, keys/values)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)   # [B, T, 2H]
        a, kv = self.self_attn(x, cos, sin, past, mask)
        r = hidden + a                                     # norm_before_residual=False: residual is raw
        return r + self.mlp(self.post_attention_layernorm(r)), kv


# ---------------------------------------------------------------- the drafter

class Eagle3Drafter(nn.Module):
    """EAGLE-3 head over a target (module docstring). Trainable: fc, midlayer, norm, lm_head.

    embedding [V, H]: the target's, held as a non-persistent buffer (frozen, never in state_dict).
    d2t/t2d: the draft vocabulary (`build_draft_vocab`); None: the full vocabulary (Vd = V).
    target_lm_head [V, H]: when given, lm_head starts as its draft-vocabulary rows (as speculators
    fills it); otherwise HF's normal(0, initializer_range) init.
    """

    arch = EAGLE3
    embed_weight: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor
    hf_target_config: dict[str, Any] | None = None   # an HF target's config.json: its exports' serving layouts

    def __init__(self, cfg: LlamaConfig, embedding: torch.Tensor, feature_layers: Sequence[int], *,
                 target_num_layers: int, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None,
                 target_lm_head: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        if tuple(embedding.shape) != (V, H):
            raise ConfigError(f"target embedding has shape {list(embedding.shape)}, the config gives [{V}, {H}]")
        self.feature_layers = check_feature_layers(feature_layers, target_num_layers)
        self.target_num_layers = target_num_layers
        if (d2t is None) != (t2d is None):
            raise ConfigError("d2t and t2d go together (build_draft_vocab gives both)")
        if d2t is None or t2d is None:   # neither: the full vocabulary
            d2t, t2d = torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
        check_vocab_maps(d2t, t2d)
        if t2d.numel() != V:
            raise ConfigError(f"t2d covers {t2d.numel()} target ids, the target's vocab is {V}")
        self.draft_vocab_size = d2t.numel()
        self.register_buffer("embed_weight", embedding.detach(), persistent=False)   # borrowed, no copy
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        # Out of the module tree (a tuple is not registered): a `.to(bfloat16)` would round
        # inv_freq, while the engines keep the angles in fp32.
        self._rotary = (LlamaRotaryEmbedding(config=cfg),)
        self._init_weights(target_lm_head)

    def _init_weights(self, target_lm_head: torch.Tensor | None) -> None:
        std = float(self.cfg.initializer_range)
        with torch.no_grad():
            for name, w in self.named_parameters():
                if name.endswith("norm.weight"):
                    w.fill_(1.0)
                else:
                    w.normal_(0.0, std)
            if target_lm_head is not None:
                self.lm_head.weight.copy_(self.restrict(target_lm_head.T).T)   # [Vd, H]

    # ------------------------------------------------------------ vocabulary
    def target_ids(self) -> torch.Tensor:   # [Vd] the target id of each draft id
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:   # any shape: draft + d2t[draft]
        return draft_ids + self.d2t[draft_ids]

    def restrict(self, target_logits: torch.Tensor) -> torch.Tensor:
        """[..., V] -> [..., Vd]: the draft vocabulary's columns, in draft-id order."""
        return target_logits.index_select(-1, self.target_ids().to(target_logits.device))

    # ------------------------------------------------------------ forward pieces
    def _rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rot = self._rotary[0]
        if rot.inv_freq.device != like.device:
            rot.to(like.device)
        cos, sin = rot(like, positions)
        return cos, sin

    def fuse(self, features: torch.Tensor) -> torch.Tensor:   # [B, T, 3H] = cat(low, mid, high) -> [B, T, H]
        return self.fc(features.to(self.fc.weight.dtype))

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, past: KV | None = None,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """One pass of the layer. tokens [B, T] target ids, hidden [B, T, H] (fc(g) or the previous
        step's out), positions [1 or B, T] -> (logits [B, T, Vd], out [B, T, H], keys/values)."""
        embeds = F.embedding(tokens, self.embed_weight).to(hidden.dtype)     # [B, T, H], no grad (a buffer)
        cos, sin = self._rope(hidden, positions)
        out, kv = self.midlayer(embeds, hidden, cos, sin, past, mask)
        return self.lm_head(self.norm(out)), out, kv

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, steps: int = TTT_STEPS) -> list[torch.Tensor]:
        """Training-time test over N rows. features [B, N, 3H] (g_0..g_{N-1}); tokens [B, N + e]
        (x_1..x_N, then e >= 0 later tokens; missing ones are 0 and only reach rows the loss
        drops). Step k reads tokens[:, k:k+N] at positions 1+k..N+k -> [steps x [B, N, Vd]]."""
        B, N, _ = features.shape
        if tokens.size(1) < N + steps - 1:
            tokens = F.pad(tokens, (0, N + steps - 1 - tokens.size(1)))
        causal = torch.ones(N, N, dtype=torch.bool, device=features.device).tril()   # step-0 keys
        diag = torch.eye(N, dtype=torch.bool, device=features.device)                 # a later step's own key
        hidden, past, out = self.fuse(features), None, []
        for k in range(steps):
            positions = torch.arange(1 + k, N + 1 + k, device=features.device)[None]   # [1, N]
            mask = torch.cat([causal] + [diag] * k, dim=-1)[None, None]               # [1, 1, N, (k+1)N]
            logits, hidden, past = self.step(tokens[:, k:k + N], hidden, positions, past, mask)
            out.append(logits)
        return out


# ---------------------------------------------------------------- training

@dataclass(frozen=True)
class TTTResult:
    loss: torch.Tensor              # scalar, the weighted mean over steps (differentiable)
    step_losses: list[float]        # per step k, mean over its rows
    step_agreement: list[float]     # per step k, top-1(drafter) == top-1(target restricted to Vd)


def ttt_loss(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor, target_logits: torch.Tensor,
             *, steps: int = TTT_STEPS, step_decay: float = STEP_DECAY, loss: Literal["kl", "ce"] = "kl",
             loss_mask: torch.Tensor | None = None, restricted: bool = False) -> TTTResult:
    """The unrolled loss on one target forward. features [B, T, 3H] (at positions 0..T-1),
    input_ids [B, T] (x_0..x_{T-1}), target_logits [B, T, V] (the target's, predicting x_{t+1};
    with `restricted` already [B, T, Vd], the draft vocabulary's columns in draft-id order),
    loss_mask [B, T] over the target positions (None: all).

    Row i of step k predicts the token after x_{i+1+k}, scored against target_logits[:, i+1+k]
    restricted to the draft vocabulary ("kl": KL(target || drafter); "ce": CE on its argmax);
    rows i >= T-1-k have no target and are dropped (speculators' `align_for_step`)."""
    T = input_ids.size(1)
    if T < steps + 1:
        raise ValueError(f"ttt_loss: {T} positions cannot train {steps} steps")
    N = T - 1
    step_logits = drafter.unroll(features[:, :N], input_ids[:, 1:], steps)
    with torch.no_grad():
        targets = target_logits.float() if restricted else drafter.restrict(target_logits.float())   # [B, T, Vd]
    total, weights, losses, agree = features.new_zeros((), dtype=torch.float32), 0.0, [], []
    for k, logits in enumerate(step_logits):
        s_logits = logits[:, :N - k].float()                                       # [B, N-k, Vd]
        s_target = targets[:, 1 + k:]                                              # [B, N-k, Vd]
        s_mask = (torch.ones_like(s_logits[..., 0], dtype=torch.bool) if loss_mask is None
                  else loss_mask[:, 1 + k:].bool())
        logq = F.log_softmax(s_logits, dim=-1)
        if loss == "kl":
            p = F.softmax(s_target, dim=-1)
            per_row = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)     # [B, N-k]
        else:
            per_row = -logq.gather(-1, s_target.argmax(-1, keepdim=True)).squeeze(-1)
        n = s_mask.sum().clamp_min(1)
        step_loss = (per_row * s_mask).sum() / n
        w = step_decay ** k
        total, weights = total + w * step_loss, weights + w
        losses.append(float(step_loss.detach()))
        agree.append(float(((s_logits.argmax(-1) == s_target.argmax(-1)) & s_mask).sum() / n))
    return TTTResult(total / weights, losses, agree)


def train_step(drafter: Eagle3Drafter, optimizer: torch.optim.Optimizer, features: torch.Tensor,
               input_ids: torch.Tensor, target_logits: torch.Tensor, **kw: Any) -> TTTResult:
    """zero_grad, `ttt_loss`, backward, step."""
    optimizer.zero_grad(set_to_none=True)
    (result := ttt_loss(drafter, features, input_ids, target_logits, **kw)).loss.backward()
    optimizer.step()
    return result


# ---------------------------------------------------------------- decoding

@torch.no_grad()
def draft(drafter: Eagle3Drafter, features: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy chain of k proposals after a verified prefix. features [B, T, 3H] at positions
    0..T-1; tokens [B, T+1] = x_0..x_T (x_T: the token the target emitted at position T-1)
    -> [B, k] target ids. Step 0 runs the prefix causally; step j > 0 runs the last row alone at
    position T+j over every key so far (the `unroll` mask's last row)."""
    T = features.size(1)
    positions = torch.arange(1, T + 1, device=features.device)[None]
    causal = torch.ones(T, T, dtype=torch.bool, device=features.device).tril()[None, None]
    logits, out, past = drafter.step(tokens[:, 1:T + 1], drafter.fuse(features), positions, None, causal)
    hidden, proposals = out[:, -1:], []
    nxt = drafter.to_target(logits[:, -1].argmax(-1))                              # [B]
    for j in range(1, k + 1):
        proposals.append(nxt)
        if j == k:
            break
        pos = torch.full((1, 1), T + j, device=features.device)
        logits, hidden, past = drafter.step(nxt[:, None], hidden, pos, past, None)
        nxt = drafter.to_target(logits[:, -1].argmax(-1))
    return torch.stack(proposals, dim=1)


# ---------------------------------------------------------------- building from a target

def features_from_hidden_states(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """transformers' output_hidden_states tuple (index i = the input of layer i) -> [B, T, 3H]."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def build_eagle3(target: Any, *, token_counts: torch.Tensor | None = None, draft_vocab_size: int | None = None,
                 feature_layers: Sequence[int] | None = None, seed: int | None = None) -> Eagle3Drafter:
    """A fresh drafter for a transformers causal LM `target` (its embedding borrowed, lm_head
    initialised from the target's draft-vocabulary rows). draft_vocab_size defaults to
    min(32768, V); a draft vocabulary smaller than V needs token_counts [V]."""
    if seed is not None:
        torch.manual_seed(seed)
    tcfg = target.config
    V, L = int(tcfg.vocab_size), int(tcfg.num_hidden_layers)
    Vd = min(32768, V) if draft_vocab_size is None else int(draft_vocab_size)
    d2t = t2d = None
    if Vd != V:
        if token_counts is None:
            raise ConfigError(f"a draft vocabulary of {Vd} < {V} needs token counts to choose it")
        d2t, t2d = build_draft_vocab(token_counts, Vd)
    layers = default_feature_layers(L) if feature_layers is None else feature_layers
    return Eagle3Drafter(eagle3_layer_config(tcfg), target.get_input_embeddings().weight, layers,
                         target_num_layers=L, d2t=d2t, t2d=t2d,
                         target_lm_head=target.get_output_embeddings().weight.detach())
