"""The hooks API's EAGLE-3 calls: which decoder layers of a user's model feed the drafter, and the
call that publishes their inputs on a stage without the final norm.

An EAGLE-3 drafter (`spec.drafter.arch: Eagle3`) reads the residual stream entering three target
layers (default (2, L//2, L-3); spectrain_api.eagle3). In a user's trainer:

    pub.feature_layers({i: layer for i, layer in my_layers_by_global_id}, num_layers=L)
    ...
    pub.hidden_states(hidden, tokens)   # the last stage, as before: its tapped layers ride along
    pub.features(tokens)                # a stage without the final norm, after each microbatch's forward

`feature_layers` installs a forward pre-hook on each of this rank's layers that the drafter reads
(harvest.feature_tap: a reference to the layer's input, no copy in the forward); `features` and
`hidden_states` copy the first ceil(fraction * b) sequences into the ring (harvest.data_publisher),
the same sequences on every stage, numbered by the call's order in the step, so the drafters can
match the stages' parts. `instrument_schedule(..., feature_layers=..., num_layers=...)` does both for
torch.distributed.pipelining. With another arch both calls do nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from spectrain_api import eagle3
from spectrain_api.errors import ConfigError
from spectrain_api.names import EAGLE3
from spectrain_workloads.harvest.feature_tap import FeatureTap
from spectrain_workloads.hooks.errors import HookError


class FeatureCalls:
    """The EAGLE-3 part of hooks.publisher.Publisher (which sets these attributes)."""

    cfg: Any
    enabled: bool
    producer: Any
    step: int
    _mb: int
    tap: FeatureTap | None
    num_layers: int | None

    def _data_publisher(self) -> Any:   # Publisher's: created on the first sample
        raise NotImplementedError

    def feature_layers(self, layers: Mapping[int, nn.Module], *, num_layers: int) -> tuple[int, ...]:
        """layers: this rank's decoder layers by global layer id (0 .. num_layers - 1); num_layers: the
        model's depth. Taps the ones the drafter's feature layers name; returns their ids (() for an
        arch other than Eagle3, or when this rank holds none)."""
        if self.cfg.drafter.arch != EAGLE3:
            return ()
        if not isinstance(layers, Mapping) or not all(isinstance(m, nn.Module) for m in layers.values()):
            raise HookError("pub.feature_layers(layers, num_layers=L): layers maps global layer ids to the "
                            "nn.Module of each decoder layer this rank runs")
        bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
        if bad:
            raise HookError(f"pub.feature_layers: layer ids {bad} are not global layer ids in [0, {num_layers})")
        try:
            wanted = eagle3.feature_layers(self.cfg.drafter, num_layers)
        except ConfigError as exc:
            raise HookError(f"pub.feature_layers: {exc}") from exc
        if self.tap is not None:
            self.tap.remove()
        self.tap = FeatureTap(layers, wanted)
        self.num_layers = num_layers
        return self.tap.held

    def features(self, tokens: torch.Tensor) -> None:
        """After a microbatch's forward on a stage without the final norm: tokens [b, T] (or [T]),
        the microbatch's input ids. Publishes the inputs of the tapped layers (`feature_layers`)."""
        if not self.enabled or self.tap is None:
            if self.enabled and self.cfg.drafter.arch == EAGLE3:
                raise HookError("pub.features: call pub.feature_layers(...) first (the layers whose inputs "
                                "the EAGLE-3 drafter reads)")
            return
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise HookError(f"pub.features: tokens must be integer token ids [b, T], got {tokens.dtype}")
        if self.producer is not None and self.tap.ready():
            data = self._data_publisher()
            k = data.count(tokens.size(0))
            data.submit(self.step, self._mb, None, tokens[:k].to(torch.int64, copy=True), batch=tokens.size(0))
        self.tap.clear()
        self._mb += 1


class NoopFeatureCalls:
    """NoopPublisher's: nothing to tap outside a job."""

    def feature_layers(self, layers: Mapping[int, nn.Module], *, num_layers: int) -> tuple[int, ...]:
        return ()

    def features(self, tokens: torch.Tensor) -> None:
        return None
