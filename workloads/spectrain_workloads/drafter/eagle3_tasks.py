"""What a drafter worker does with an EAGLE-3 drafter: build it for the job's target, the loss of
a micro-step, and the acceptance it measures on held-out samples.

A sample's hidden is [T, 4H] = cat(f_low, f_mid, f_high, final) (drafter.eagle3_assembly): the
three feature layers the drafter fuses, and the last stage's final-norm hidden state, whose
product with the target's LM head gives the target's logits (restricted to the draft vocabulary
before the product: [T, Vd], never [T, V]).

Acceptance (the worker's verification rounds and the export gate), on held-out sequences:
- top-1: teacher-forced step 0 (eagle3.unroll with one step): row i predicts x_{i+2}, checked
  against the target's greedy token g_{i+1} = argmax lm_head(final_{i+1});
- accepted length of a k-token greedy chain from a start t: eagle3.draft over the prefix
  (features 0..t, tokens 0..t+1), proposal j checked against g_{t+j}, counted until the first
  miss; as drafter.verify does for EAGLE-1 (the same Acceptance record and chain starts).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from spectrain_api.eagle3 import feature_layers, resolve_draft_vocab_size
from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter.eagle3 import (
    Eagle3Drafter,
    build_draft_vocab,
    draft,
    eagle3_layer_config,
    ttt_loss,
)
from spectrain_workloads.drafter.eagle3_assembly import SAMPLE_WIDTH
from spectrain_workloads.drafter.models import TargetShared
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.verify import Acceptance, chain_starts


def layer_config(shared: TargetShared) -> Any:
    """The drafter layer's LlamaConfig: from an HF target's config.json, else the preset's sizes."""
    if shared.hf_config is not None:
        from spectrain_workloads.hf.arch import hf_config

        return eagle3_layer_config(hf_config(shared.hf_config))
    c = shared.model_config
    return eagle3_layer_config(SimpleNamespace(
        hidden_size=c.dim, intermediate_size=c.hidden_dim, num_attention_heads=c.n_heads,
        num_key_value_heads=c.kv_heads, head_dim=c.head_dim, hidden_act="silu", rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_seq_len, vocab_size=c.vocab_size, rope_theta=c.rope_theta))


def build(settings: DrafterSettings, shared: TargetShared) -> Eagle3Drafter:
    """A fresh drafter (seeded) over the target's frozen embedding, its lm_head started from the
    target's rows of the draft vocabulary (the most frequent tokens of the job's data: the
    target's token counts, target/shared/token_counts.safetensors, when Vd < V)."""
    cfg = shared.model_config
    V, L = cfg.vocab_size, cfg.n_layers
    Vd = resolve_draft_vocab_size(settings.draft_vocab_size, V)
    d2t = t2d = None
    if Vd < V:
        if shared.token_counts is None:
            raise ConfigError(f"spec.drafter.draftVocabSize {Vd} < the target's vocab {V} needs the target's token "
                              "counts (target/shared/token_counts.safetensors), which the target has not written")
        d2t, t2d = build_draft_vocab(shared.token_counts, Vd)
    torch.manual_seed(settings.seed)
    model = Eagle3Drafter(layer_config(shared), shared.embedding, feature_layers(settings, L), target_num_layers=L,
                          d2t=d2t, t2d=t2d, target_lm_head=shared.lm_head)
    model.hf_target_config = shared.hf_config     # the serving layouts' verifier (worker_export)
    return model


def _split(model: Eagle3Drafter, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, 4H] -> features [B, T, 3H], final [B, T, H]."""
    H = int(model.cfg.hidden_size)
    if hidden.size(-1) != SAMPLE_WIDTH * H:
        raise ValueError(f"an EAGLE-3 sample's hidden is [T, {SAMPLE_WIDTH * H}], got {list(hidden.shape)}")
    return hidden[..., :3 * H], hidden[..., 3 * H:]


def micro_loss(model: Eagle3Drafter, tokens: torch.Tensor, hidden: torch.Tensor, target_head: torch.Tensor,
               steps: int) -> torch.Tensor:
    """The TTT loss of a micro-batch, summed over its B sequences (the combiner divides by the
    sample count): tokens [B, T], hidden [B, T, 4H], target_head [V, H]."""
    features, final = _split(model, hidden)
    head = target_head.index_select(0, model.target_ids().to(target_head.device))     # [Vd, H]
    target_logits = final.float() @ head.float().T                                     # [B, T, Vd]
    steps = max(1, min(steps, tokens.size(1) - 1))
    return ttt_loss(model, features, tokens, target_logits, steps=steps, restricted=True).loss * tokens.size(0)


@torch.no_grad()
def measure_batch(model: Eagle3Drafter, tokens: torch.Tensor, hidden: torch.Tensor, target_head: torch.Tensor, *,
                  k: int, max_starts: int = 4) -> Acceptance:
    """tokens [B, T], hidden [B, T, 4H], target_head [V, H] -> Acceptance (module docstring)."""
    acc = Acceptance(k=k, per_depth=[0] * k)
    B, T = tokens.shape
    if T < 3:
        return acc
    features, final = _split(model, hidden)
    greedy = (final.float() @ target_head.float().T).argmax(-1)                      # [B, T] g_p
    logits = model.unroll(features[:, :T - 1], tokens[:, 1:T], 1)[0]                 # [B, T-1, Vd]
    pred = model.to_target(logits.argmax(-1))
    acc.top1_hits += int((pred == greedy[:, 1:T]).sum())
    acc.top1_total += int(pred.numel())
    for t in chain_starts(T, k, max_starts):
        proposals = draft(model, features[:, :t + 1], tokens[:, :t + 2], k)          # [B, k]
        alive = torch.ones(B, dtype=torch.bool, device=tokens.device)
        for j in range(1, k + 1):
            alive &= proposals[:, j - 1] == greedy[:, t + j]
            n = int(alive.sum())
            if n == 0:
                break
            acc.accepted_sum += n
            acc.per_depth[j - 1] += n
        acc.chains += B
    return acc


def synthetic_hidden(length: int, H: int, generator: torch.Generator) -> torch.Tensor:
    """A random sample's hidden [length, 4H] (cost measurements before the first window)."""
    return torch.randn(length, SAMPLE_WIDTH * H, generator=generator)


@torch.no_grad()
def sampled_acceptance_rate(model: Eagle3Drafter, tokens: torch.Tensor, hidden: torch.Tensor,
                            target_head: torch.Tensor) -> float:
    """Teacher-forced alpha at temperature 1 (as drafter.verify.sampled_acceptance_rate for EAGLE-1):
    the mean over rows of sum_v min(p(v), q(v)), the probability that rejection sampling accepts
    the first draft. tokens [B, T], hidden [B, T, 4H], target_head [V, H]. Step 0 at row i predicts
    x_{i+2}: q = the drafter's softmax over the draft vocabulary (zero on the other target ids),
    p = softmax(final_{i+1} @ head.T) over the whole target vocabulary."""
    T = tokens.size(1)
    if T < 2:
        raise ValueError(f"sampled_acceptance_rate: sequences of {T} positions have no draft to score")
    features, final = _split(model, hidden)
    q = torch.softmax(model.unroll(features[:, :T - 1], tokens[:, 1:T], 1)[0].float(), -1)      # [B, T-1, Vd]
    p = torch.softmax(final[:, 1:].float() @ target_head.float().T.to(final.device), -1)          # [B, T-1, V]
    p = p.index_select(-1, model.target_ids().to(p.device))                                       # [B, T-1, Vd]
    return float(torch.minimum(p, q).sum(-1).mean())
