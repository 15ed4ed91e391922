"""Acceptance of the drafter against the target, on held-out fresh target data.

For a sequence with the target's hidden states h_0..h_{T-1} (final-norm, logits = lm_head(h)),
the target's greedy token after position p is g_p = argmax lm_head(h_p).

- top-1 agreement: teacher-forced, the fraction of positions where the drafter's first draft
  equals the target's greedy token (Eagle: argmax logits(h_t, x_{t+1}) == g_{t+1}).
- expected accepted length of a k-token greedy draft: from a start t the drafter drafts
  d_1..d_k autoregressively (Eagle feeds back its own predicted hidden states and tokens,
  as in speculative decoding), draft d_j is checked against g_{t+j}; the accepted length is
  the number of leading matches (0..k). The reference g_{t+j} comes from the target's hidden
  states of the data path, so this is exact where the accepted drafts equal the data tokens and
  an approximation otherwise (the drafter cannot run the target's middle layers).
  `acceptance_length` = accepted + 1 (EAGLE's tau: tokens per verification, incl. the target's own).
For tokens-only data (LM arch without the target's hidden states) the reference is the data token.
- sampled acceptance rate (`sampled_acceptance_rate`, Eagle): teacher-forced, the mean over positions of
  sum_v min(p(v), q(v)) at temperature 1, the probability that rejection sampling accepts the first
  draft (Leviathan et al.'s alpha). Greedy agreement saturates on a target that puts nearly all its
  mass on a few tokens (an early debug target); alpha still tells drafters apart there.

Work is split into chunks of a few sequences, batched, so the gate can fit verification into short windows.
A paired round measures a second model (the export gate's LATEST) on every chunk too: each chunk is
measured by the model, then by the reference, as two tasks of a plain chunk's size (each fits the
windows a plain chunk fits), so the two figures come from the same sequences and chains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from spectrain_workloads.drafter.models import EagleDrafter
from spectrain_workloads.model import causal_decode_mask


@dataclass
class Acceptance:
    k: int
    top1_hits: int = 0
    top1_total: int = 0
    accepted_sum: int = 0
    chains: int = 0
    per_depth: list[int] = field(default_factory=list)   # chains whose first j+1 drafts were accepted
    # a paired round (Verifier.begin with a reference model): the reference's on the same chunks
    reference: Acceptance | None = None

    def merge(self, other: Acceptance) -> None:
        self.top1_hits += other.top1_hits
        self.top1_total += other.top1_total
        self.accepted_sum += other.accepted_sum
        self.chains += other.chains
        if len(self.per_depth) < len(other.per_depth):
            self.per_depth += [0] * (len(other.per_depth) - len(self.per_depth))
        for i, v in enumerate(other.per_depth):
            self.per_depth[i] += v

    @property
    def top1(self) -> float:
        return self.top1_hits / self.top1_total if self.top1_total else 0.0

    @property
    def accepted(self) -> float:
        return self.accepted_sum / self.chains if self.chains else 0.0

    @property
    def acceptance_length(self) -> float:
        return self.accepted + 1.0

    def to_dict(self) -> dict[str, float | int]:
        return {"k": self.k, "top1": self.top1, "accepted": self.accepted,
                "acceptance_length": self.acceptance_length, "chains": self.chains, "positions": self.top1_total}


def chain_starts(T: int, k: int, max_starts: int) -> list[int]:
    """Evenly spread chain starts t with t + k <= T - 1, chains not overlapping."""
    last = T - 1 - k
    if last < 0:
        return []
    cands = list(range(0, last + 1, k))
    if len(cands) <= max_starts:
        return cands
    step = len(cands) / max_starts
    return [cands[int(i * step)] for i in range(max_starts)]


@torch.no_grad()
def measure_batch(model: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor | None,
                  target_head: torch.Tensor | None, *, k: int, max_starts: int = 4) -> Acceptance:
    """Sequences of one length at once: tokens [B, T] int64, hidden [B, T, H] (None: tokens only),
    target_head [V, H] (LM arch). Equal to the sum of the rows measured one by one; batching turns
    B x (1 + chains x (k + 1)) small forwards into 1 + chains x (k + 1) forwards of B rows."""
    acc = Acceptance(k=k, per_depth=[0] * k)
    B, T = tokens.shape
    eagle = isinstance(model, EagleDrafter)
    if eagle and hidden is None:
        return acc
    if hidden is not None:
        hid = hidden.float()
        head = model.lm_head.weight if eagle else target_head
        greedy = (hid @ head.float().T).argmax(-1) if head is not None else None      # [B, T]: g_p
    else:
        hid, greedy = None, None
    # Reference for the draft that predicts token p+1: the target's greedy g_p, else the data token.
    ref = greedy if greedy is not None else torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)   # [B, T]

    # top-1, teacher-forced
    if eagle:
        logits, _ = model(tokens[:, 1:], hid[:, :-1])     # [B, T-1, V]; position t predicts token t+2
        pred, want = logits.argmax(-1), ref[:, 1:T]
    else:
        logits = model(tokens[:, :-1])                     # position t predicts token t+1
        pred, want = logits.argmax(-1), ref[:, : T - 1]
    acc.top1_hits += int((pred == want).sum())
    acc.top1_total += int(want.numel())

    # k-token greedy chains with the drafter's KV cache, prefilling the true prefix incrementally
    starts = chain_starts(T, k, max_starts)
    if not starts:
        return acc
    model.setup_caches(B, T)
    try:
        filled = 0   # true positions [0, filled) are in the cache; drafted ones after a chain are overwritten
        for t in starts:
            last_in = t if eagle else t + 1            # last true input position before drafting
            pos = torch.arange(filled, last_in + 1)
            mask = causal_decode_mask(pos, T)
            if eagle:
                logits, h = model(tokens[:, pos + 1], hid[:, pos], pos, mask)
                h_last = h[:, -1:]
            else:
                logits = model(tokens[:, pos], pos, mask)
            filled = last_in + 1
            d = logits[:, -1].argmax(-1)                # [B] d_1: predicts token t+2
            alive = torch.ones(B, dtype=torch.bool)     # rows whose drafts all matched so far
            for j in range(1, k + 1):
                alive &= d == ref[:, t + j]
                n = int(alive.sum())
                if n == 0:
                    break
                acc.accepted_sum += n
                acc.per_depth[j - 1] += n
                if j == k:
                    break
                p = torch.tensor([last_in + j])
                mask = causal_decode_mask(p, T)
                if eagle:
                    logits, h = model(d.view(B, 1), h_last, p, mask)
                    h_last = h
                else:
                    logits = model(d.view(B, 1), p, mask)
                d = logits[:, -1].argmax(-1)
            # The chain left drafted entries in slots after last_in; the next start (>= t + k)
            # prefills from `filled` = last_in + 1 and so overwrites them with true ones.
            acc.chains += B
    finally:
        model.clear_caches()
    return acc


def measure_sample(model: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor | None,
                   target_head: torch.Tensor | None, *, k: int, max_starts: int = 4) -> Acceptance:
    """One sequence: tokens [T] int64, hidden [T, H] (None: tokens only), target_head [V, H] (LM arch)."""
    return measure_batch(model, tokens.view(1, -1), None if hidden is None else hidden.unsqueeze(0),
                         target_head, k=k, max_starts=max_starts)


@torch.no_grad()
def sampled_acceptance_rate(model: EagleDrafter, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean sum_v min(p, q) over positions, temperature 1: samples of (tokens [T], hidden [T, H])."""
    rates = []
    for tokens, hidden in samples:
        hid = hidden.float()[None]                                     # [1, T, H]
        logits, _ = model(tokens[None, 1:], hid[:, :-1].to(model.fc.weight.dtype))   # [1, T-1, V]: q of x_{t+2}
        p = torch.softmax(hid[:, 1:] @ model.lm_head.weight.float().T, -1)          # the target's p of x_{t+2}
        q = torch.softmax(logits.float(), -1)
        rates.append(torch.minimum(p, q).sum(-1).flatten())            # [T-1]
    return float(torch.cat(rates).mean())


def measure(model: nn.Module, samples: list[tuple[torch.Tensor, torch.Tensor | None]],
            target_head: torch.Tensor | None, *, k: int, max_starts: int = 4) -> Acceptance:
    """Acceptance over several (tokens [T], hidden [T, H] | None) sequences."""
    total = Acceptance(k=k, per_depth=[0] * k)
    for tokens, hidden in samples:
        total.merge(measure_sample(model, tokens, hidden, target_head, k=k, max_starts=max_starts))
    return total


class Verifier:
    """A verification round split into chunks of up to `batch` sequences of one length (each chunk a
    gated task of its own)."""

    def __init__(self, *, k: int, max_starts: int = 4, batch: int = 1, measure: Callable[..., Acceptance] | None = None,
                 ) -> None:
        self.k, self.max_starts, self.batch = k, max_starts, batch
        self.measure = measure or measure_batch     # eagle3_tasks.measure_batch for an EAGLE-3 drafter
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._acc = Acceptance(k=k, per_depth=[0] * k)
        self._reference: nn.Module | None = None
        self._reference_due: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None   # the chunk it measures next
        self.last: Acceptance | None = None
        self.rounds = 0

    def begin(self, samples: list[tuple[torch.Tensor, torch.Tensor | None]], reference: nn.Module | None = None,
              ) -> None:
        """A new round over `samples`; with `reference`, a paired one: the round's result carries the
        reference model's acceptance on the same chunks (`.reference`)."""
        self._pending = list(samples)
        self._acc = Acceptance(k=self.k, per_depth=[0] * self.k)
        self._reference, self._reference_due = reference, None
        if reference is not None:
            self._acc.reference = Acceptance(k=self.k, per_depth=[0] * self.k)

    @property
    def paired(self) -> bool:
        """The round in progress measures a reference model too."""
        return self._reference is not None and self.in_progress

    @property
    def in_progress(self) -> bool:
        return bool(self._pending) or self._reference_due is not None

    def _take(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Up to `batch` pending sequences of the last one's length and kind (hidden or not)."""
        tokens, hidden = self._pending[-1]
        same = [i for i in range(len(self._pending) - 1, -1, -1)
                if self._pending[i][0].numel() == tokens.numel() and (self._pending[i][1] is None) == (hidden is None)]
        chosen = same[: self.batch]
        taken = [self._pending[i] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self._pending[i]
        return taken

    def run_chunk(self, model: nn.Module, target_head: torch.Tensor | None) -> Acceptance | None:
        """Verify one chunk with `model` (in a paired round, every other call: the reference on the chunk
        `model` measured last); returns the round's result when this call completed it."""
        acc, measured = self._acc, model
        if self._reference_due is not None and self._reference is not None and self._acc.reference is not None:
            taken, self._reference_due = self._reference_due, None
            acc, measured = self._acc.reference, self._reference
        else:
            taken = self._take()
            if self._reference is not None:
                self._reference_due = taken
        tokens = torch.stack([t for t, _ in taken])
        hidden = None if taken[0][1] is None else torch.stack([h for _, h in taken])   # type: ignore[misc]
        acc.merge(self.measure(measured, tokens, hidden, target_head, k=self.k, max_starts=self.max_starts))
        if self.in_progress:
            return None
        self._reference = None
        self.last, self.rounds = self._acc, self.rounds + 1
        return self._acc
