"""The engine's view of a drafter: which token a cache entry consumes, and whether it reads hidden states.

Three drafters fit the engine (contracts.md, `drafter.arch`):
- `LMDraft`: a small `model.Transformer` language model; cache entry t consumes token x_t.
- `EagleDraft`: the Eagle head; entry t consumes (x_{t+1}, h_t), h_t the target's final-norm hidden
  state at position t, and predicts (logits for x_{t+2}, h_{t+1}).
- `eagle3_draft.Eagle3Draft`: the EAGLE-3 head (drafter/eagle3.py); entry t consumes (x_{t+1}, g_t),
  g_t the target's residual stream before its `feature_layers` at position t [3H], as EagleDraft
  otherwise (the engine keeps g in `feat` only for it).

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
from spectrain_api.names import DRAFTER_ARCHS, EAGLE3, LM
from spectrain_workloads.model import Transformer


class DraftAdapter:
    """A drafter module behind the engine's one call: forward(tokens, hidden, pos, mask)."""

    offset = 0
    keeps_drafts = True        # entries fed with draft tokens stay valid once those tokens are accepted
    needs_hidden = False
    feature_layers: tuple[int, ...] | None = None   # EAGLE-3: the target layers whose inputs it reads

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
    """Wrap a drafter module; arch "LM" | "Eagle" | "Eagle3" (default: the module's own `arch`
    "Eagle3" for a drafter.eagle3.Eagle3Drafter, LM for a model.Transformer, else Eagle)."""
    if isinstance(drafter, DraftAdapter):
        return drafter
    is_eagle3 = getattr(drafter, "arch", None) == EAGLE3   # by name: specdec does not import drafter/
    if is_eagle3 or arch == EAGLE3:
        if not (is_eagle3 and arch in (None, EAGLE3)):
            raise ConfigError(f"drafter.arch {arch!r} does not fit a {type(drafter).__name__} drafter")
        from spectrain_workloads.specdec.eagle3_draft import Eagle3Draft

        return Eagle3Draft(drafter)
    arch = arch or ("LM" if isinstance(drafter, Transformer) else "Eagle")
    if arch not in DRAFTER_ARCHS:
        raise ConfigError(f"drafter.arch must be {' or '.join(DRAFTER_ARCHS)}, got {arch!r}")
    return LMDraft(drafter) if arch == LM else EagleDraft(drafter)


__all__ = ["DraftAdapter", "EagleDraft", "LMDraft", "as_drafter"]
