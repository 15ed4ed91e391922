"""The engine's view of a drafter: which token a cache entry consumes, and whether it reads hidden states.

Two drafters fit the engine (contracts.md, `drafter.arch`):
- `LMDraft`: a small `model.Transformer` language model; cache entry t consumes token x_t.
- `EagleDraft`: the Eagle head; entry t consumes (x_{t+1}, h_t), h_t the target's final-norm hidden
  state at position t, and predicts (logits for x_{t+2}, h_{t+1}).

`offset` is that shift (0 or 1), so the engine's lazy catch-up feeds a row's committed tokens
[dlen, len) at cache positions [dlen - offset, len - offset). `keeps_drafts` says whether entries fed
with draft tokens stay valid once those drafts are accepted: an LM's do, an Eagle head's do not (they
were fed a *predicted* hidden state; the next step re-feeds them with the target's true one, as EAGLE
does). Shapes: B batch rows, T tokens per row, H hidden width, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from spectrain_api.errors import ConfigError
from spectrain_api.names import DRAFTER_ARCHS
from spectrain_workloads.model import Transformer


class DraftAdapter:
    """A drafter module behind the engine's one call: forward(tokens, hidden, pos, mask)."""

    offset = 0
    keeps_drafts = True        # entries fed with draft tokens stay valid once those tokens are accepted
    needs_hidden = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def setup_caches(self, batch: int, max_len: int) -> None:
        self.module.setup_caches(batch, max_len)  # type: ignore[operator]

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None, pos: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B, T], hidden [B, T, H] (needs_hidden) or None, pos [B, T] cache positions, mask: the
        decode mask over the cache -> (logits [B, T, V], predicted hidden [B, T, H] or None)."""
        raise NotImplementedError


class LMDraft(DraftAdapter):
    """A small model.Transformer: entry t is token x_t."""

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None, pos: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.module(tokens, pos, mask), None


class EagleDraft(DraftAdapter):
    """contracts.md Eagle head: entry t is (x_{t+1}, h_t) -> (logits for x_{t+2}, predicted h_{t+1}).

    Entries fed with a predicted hidden are never kept: the next step re-feeds them with the
    target's true hidden states (as EAGLE does)."""

    offset, keeps_drafts, needs_hidden = 1, False, True

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None, pos: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out: tuple[torch.Tensor, torch.Tensor | None] = self.module(tokens, hidden, pos, mask)
        return out


def as_drafter(drafter: nn.Module | DraftAdapter, arch: str | None = None) -> DraftAdapter:
    """Wrap a drafter module; arch "LM" | "Eagle" (default: LM for a model.Transformer, else Eagle)."""
    if isinstance(drafter, DraftAdapter):
        return drafter
    arch = arch or ("LM" if isinstance(drafter, Transformer) else "Eagle")
    if arch not in DRAFTER_ARCHS:
        raise ConfigError(f"drafter.arch must be {' or '.join(DRAFTER_ARCHS)}, got {arch!r}")
    return LMDraft(drafter) if arch == "LM" else EagleDraft(drafter)


__all__ = ["DraftAdapter", "EagleDraft", "LMDraft", "as_drafter"]
