"""EAGLE-3 training samples put together from the parts the pipeline stages publish.

Each stage holding feature layers publishes, per sampled sequence, tokens [T] and the inputs of
its layers [T, n * H] (meta "feature_layers"); the last stage also publishes the final-norm hidden
state [T, H] (the target's logits are lm_head of it). The same sequences are sampled on every
stage (harvest.data_publisher), so (step, seq_index) names one sequence across the stages.

The drafter of the replica's last stage assembles: its own ring's part and the parts the other
stages' drafters send over the fleet (`part` frames) meet here; a sequence is complete when the
three feature layers and the final hidden state are in, and becomes one sample
    tokens [T] int64, hidden [T, 4H] = cat(f_low, f_mid, f_high, final)   (SAMPLE_WIDTH = 4)
which trains here and goes to the other stages' drafters like any sample (drafter.fleet).

Memory is bounded: at most `max_pending` incomplete sequences are held; past it the oldest goes
(counted `unmatched`: a part lost or dropped on its way, or a stage that published fewer).
A part whose tokens disagree with the ones already held, whose layers are not the drafter's, or
that repeats a layer is dropped and counted (`rejected`): it is not the same sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

SAMPLE_WIDTH = 4          # hidden of an assembled sample: 3 feature layers + the final hidden state


@dataclass
class _Pending:
    tokens: torch.Tensor                                   # [T] int64
    parts: dict[int, torch.Tensor] = field(default_factory=dict)   # layer id -> [T, H]
    final: torch.Tensor | None = None                      # [T, H]


@dataclass
class AssemblyStats:
    parts: int = 0            # parts received (own ring and fleet)
    assembled: int = 0        # complete samples made
    unmatched: int = 0        # incomplete sequences evicted (a part never came)
    rejected: int = 0         # parts that contradicted the sequence or the layers

    def to_dict(self) -> dict[str, int]:
        return {"featureParts": self.parts, "featureSamplesAssembled": self.assembled,
                "featurePartsUnmatched": self.unmatched, "featurePartsRejected": self.rejected}


def part_meta(meta: dict) -> tuple[tuple[int, ...], int] | None:
    """(feature layers, seq_index) of a ring record's meta, or None when they are not well formed
    (the caller drops the record and counts it)."""
    layers, seq = meta.get("feature_layers", []), meta.get("seq_index")
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        return None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return None
    return tuple(layers), seq


class FeatureAssembler:
    def __init__(self, layers: tuple[int, int, int], hidden: int, *, max_pending: int = 256) -> None:
        self.layers, self.hidden, self.max_pending = layers, hidden, max_pending
        self.pending: OrderedDict[tuple[int, int], _Pending] = OrderedDict()
        self.stats = AssemblyStats()

    def add(self, step: int, seq_index: int, tokens: torch.Tensor, *, features: torch.Tensor | None = None,
            layers: tuple[int, ...] = (), final: torch.Tensor | None = None) -> torch.Tensor | None:
        """One stage's part: tokens [T], features [T, len(layers) * H] (the inputs of `layers`, in
        increasing order), final [T, H] or None. Returns the sample's hidden [T, 4H] when this part
        completed the sequence (its tokens are the ones given), else None."""
        self.stats.parts += 1
        H, T = self.hidden, tokens.numel()
        if (features is None) != (not layers) or any(i not in self.layers for i in layers) \
                or len(set(layers)) != len(layers) \
                or (features is not None and tuple(features.shape) != (T, len(layers) * H)) \
                or (final is not None and tuple(final.shape) != (T, H)):
            self.stats.rejected += 1
            return None
        key = (step, seq_index)
        p = self.pending.get(key)
        if p is None:
            p = self.pending[key] = _Pending(tokens=tokens)
            while len(self.pending) > self.max_pending:
                self.pending.popitem(last=False)
                self.stats.unmatched += 1
        elif not torch.equal(p.tokens, tokens) or any(i in p.parts for i in layers) \
                or (final is not None and p.final is not None):
            self.stats.rejected += 1
            return None
        for j, i in enumerate(layers):
            assert features is not None
            p.parts[i] = features[:, j * H:(j + 1) * H]
        if final is not None:
            p.final = final
        if len(p.parts) < len(self.layers) or p.final is None:
            return None
        del self.pending[key]
        self.stats.assembled += 1
        return torch.cat([p.parts[i] for i in self.layers] + [p.final], dim=-1)   # [T, 4H]
