"""Speculative decoding core: draft k tokens with a cheap model, verify them in one target forward.

Lossless by construction (Leviathan et al. 2023, Chen et al. 2023): draft token d_i ~ q_i is accepted
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the replacement is drawn from
norm(max(0, p_i - q_i)); if all k are accepted a bonus token is drawn from p_{k+1}. Every emitted
token is then distributed exactly as the target's p. Greedy decoding is the same rule with one-hot
p and q (accept iff the draft equals the target's argmax; the replacement is the target's argmax), so
greedy output is token for token what plain greedy decoding emits.

Shapes: B batch rows, k draft length, V vocab. Batching, KV caches and the drafter's catch-up live
in `engine`; this module is the rule itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spectrain_api.errors import ConfigError

# accept(p_d [B, k], q_d [B, k], u [B, k] ~ U[0, 1)) -> bool [B, k]; p_d, q_d: target / draft
# probability of each draft token. Swappable only so tests can prove a lossy rule is caught.
AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rejection_rule(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return u * q_d < p_d                                   # u < min(1, p/q), without dividing by q


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 1.0   # 0: greedy
    top_p: float = 1.0         # nucleus: keep the smallest prefix of sorted tokens with mass >= top_p

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"rl.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> the distribution plain decoding samples from [..., V] (float32)."""
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.size(-1)).float()
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= s.top_p   # mass before the token already reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(weights: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One index per row of unnormalised weights [..., V] -> [...] (exponential race = categorical)."""
    e = torch.empty_like(weights).exponential_(generator=gen)
    return (weights / e).argmax(-1)


def pick(probs: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    return probs.argmax(-1) if s.greedy else sample(probs, gen)


def verify(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, gen: torch.Generator | None,
           rule: AcceptRule = rejection_rule) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, k+1, V] target, q [B, k, V] drafter, draft [B, k] -> (n accepted [B], next token [B])."""
    B, k = draft.shape
    p_d = p[:, :k].gather(-1, draft[..., None])[..., 0]                    # [B, k]
    q_d = q.gather(-1, draft[..., None])[..., 0]                           # [B, k]
    u = torch.rand(B, k, generator=gen, device=p.device)
    n = rule(p_d, q_d, u).long().cumprod(1).sum(1)                         # [B] accepted prefix
    residual = (p - torch.cat([q, torch.zeros_like(p[:, :1])], 1)).clamp_min(0)   # [B, k+1, V]
    r = residual.gather(1, n[:, None, None].expand(B, 1, p.size(-1)))[:, 0]      # [B, V]
    p_n = p.gather(1, n[:, None, None].expand(B, 1, p.size(-1)))[:, 0]           # [B, V]
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, p_n)                   # p == q there: fall back to p
    return n, sample(r, gen)                                               # greedy: r is one-hot


def speculative_step(
    draft_next: Callable[[torch.Tensor], torch.Tensor],
    target_verify: Callable[[torch.Tensor], torch.Tensor],
    last: torch.Tensor, k: int, s: Sampling, gen: torch.Generator | None,
    rule: AcceptRule = rejection_rule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round for a batch whose newest committed token `last` [B] the target has not seen yet.

    draft_next(tok [B]) -> drafter logits [B, V] for the token after `tok` (advances the drafter).
    target_verify(tokens [B, k+1]) -> target logits [B, k+1, V] (one forward over last + drafts).
    Returns (draft [B, k], n accepted [B], next token [B]); emit draft[:, :n] then next.
    """
    toks, qs, tok = [], [], last
    for _ in range(k):
        q = to_probs(draft_next(tok), s)                                   # [B, V]
        tok = pick(q, s, gen)                                              # [B]
        toks.append(tok)
        qs.append(q)
    draft = torch.stack(toks, 1)                                           # [B, k]
    p = to_probs(target_verify(torch.cat([last[:, None], draft], 1)), s)  # [B, k+1, V]
    n, nxt = verify(p, torch.stack(qs, 1), draft, gen, rule)
    return draft, n, nxt


__all__ = ["AcceptRule", "Sampling", "pick", "rejection_rule", "sample", "speculative_step", "to_probs", "verify"]
