"""EAGLE-3 features from a stage's own forward: the residual stream entering chosen layers.

An EAGLE-3 drafter reads the target's hidden state *before* three layers (low, mid, high; the
input of layer i is transformers' `hidden_states[i]`). In a pipeline those layers sit on different
stages, so each stage taps the ones it holds and publishes them into its own ring with the same
sampling as the last stage's data (the first ceil(fraction * b) sequences of each microbatch);
the drafters match the parts by (step, seq_index) (drafter.eagle3_assembly). Under
Interleaved1F1B a rank runs several chunks and another microbatch's forward can come between
them, so EAGLE-3 training is refused there (spectrain_api.rules).

The tap is a forward pre-hook on each chosen layer that keeps a reference to the layer's input
[b, T, H] (detached; no copy, no kernel): the publisher copies the first k sequences into the ring
after the microbatch's forward, as it does with the last stage's final hidden state. Nothing is
added to the training graph. Works on the project's stages (`layers`), Hugging Face stages
(`model.layers`) and DDP-wrapped modules (the hook sits on the inner layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn


def stage_layers(module: nn.Module) -> dict[int, nn.Module]:
    """Global layer id -> decoder layer of a stage (model.Transformer, hf.HFStage, or DDP around one)."""
    inner = getattr(module, "module", module)         # DistributedDataParallel keeps it as .module
    layers = getattr(inner, "layers", None)
    if layers is None and hasattr(inner, "model"):
        layers = getattr(inner.model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(f"{type(inner).__name__} has no `layers` ModuleDict keyed by global layer id")
    return {int(k): v for k, v in layers.items()}


class FeatureTap:
    """Keeps, per forward, the inputs of this rank's feature layers (a subset of `wanted`).

    modules: this rank's stage chunks. `held` lists the wanted layers they hold (increasing);
    after a forward that ran all of them, `take(k)` returns the first k rows of cat(inputs)
    [k, T, len(held) * H] in layer order and forgets them."""

    def __init__(self, modules: Sequence[nn.Module] | Mapping[int, nn.Module], wanted: Sequence[int]) -> None:
        """modules: this rank's stage chunks, or (the hooks API) its decoder layers by global id."""
        self._kept: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        found: dict[int, nn.Module] = {}
        if isinstance(modules, Mapping):
            found = {int(i): layer for i, layer in modules.items() if int(i) in set(wanted)}
        for m in modules if not isinstance(modules, Mapping) else ():
            found.update({i: layer for i, layer in stage_layers(m).items() if i in set(wanted)})
        self.held: tuple[int, ...] = tuple(sorted(found))
        for i in self.held:
            self._handles.append(found[i].register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, layer_id: int) -> Any:
        def keep(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                self._kept[layer_id] = x.detach()       # [b, T, H], a reference
        return keep

    def ready(self) -> bool:
        return bool(self.held) and all(i in self._kept for i in self.held)

    def take(self, k: int) -> torch.Tensor:
        """The first k sequences: [k, T, len(held) * H] (one copy of those rows only); the kept
        references are dropped (the activations stay the graph's)."""
        if not self.ready():
            missing = [i for i in self.held if i not in self._kept]
            raise RuntimeError(f"feature layers {missing} did not run in this forward")
        out = torch.cat([self._kept[i][:k] for i in self.held], dim=-1)
        self._kept.clear()
        return out

    def clear(self) -> None:
        self._kept.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._kept.clear()
