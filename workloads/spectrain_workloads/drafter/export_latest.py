"""LATEST, held as a model on the exporting rank, for the export gate's paired measurement.

The gate (worker_export) compares a candidate with LATEST re-measured on the same held-back samples in
the same verification round (verify.Verifier, paired), never with a number stored at LATEST's own
export: the held-back samples move with the target's training, and a stored number lets each export
be compared with a figure from other data. `LatestDrafter.module` is a copy of the training model's
structure whose trainable parameters hold LATEST's weights and whose frozen tensors (the target's
embedding and head; EAGLE-3's borrowed embedding and vocabulary maps) are the training model's own
objects, shared, not copied: both score against the same greedy tokens of the current target, and the
memory it costs is one copy of the drafter's trainable parameters (no optimizer state, no gradients).
After an export the exported weights are copied in (`take`); after a restart they are read from
LATEST's model.safetensors, its sha256 checked (`load`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from spectrain_api.errors import ConfigError


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _frozen(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is a parameter) of every frozen parameter and buffer, persistent or not."""
    params = [(n, p, True) for n, p in model.named_parameters() if not p.requires_grad]
    return params + [(n, b, False) for n, b in model.named_buffers()]


class LatestDrafter:
    """LATEST's weights in a model beside the training one (None until there is a LATEST to hold)."""

    def __init__(self) -> None:
        self.module: nn.Module | None = None
        self.version = 0

    def _shell(self, model: nn.Module) -> nn.Module:
        """A copy of `model` sharing its frozen tensors (deepcopy's memo maps them to themselves); the
        gradients accumulated on `model` are neither copied nor touched."""
        keep = {id(t): t for _, t, _ in _frozen(model)}
        grads = {p: p.grad for p in model.parameters() if p.grad is not None}
        for p in grads:
            p.grad = None
        try:
            shell = copy.deepcopy(model, keep)
        finally:
            for p, g in grads.items():
                p.grad = g
        for p in shell.parameters():
            p.requires_grad_(False)
        return shell

    def share_frozen(self, model: nn.Module) -> None:
        """Point the held module's frozen tensors at `model`'s current ones (the target may have rewritten
        its embedding and head since: drafter.train.refresh_target replaces some of them)."""
        if self.module is None:
            return
        for name, tensor, is_param in _frozen(model):
            path, _, leaf = name.rpartition(".")
            sub = self.module.get_submodule(path)
            store = sub._parameters if is_param else sub._buffers
            if store.get(leaf) is not tensor:
                store[leaf] = tensor  # type: ignore[assignment]

    def _fill(self, model: nn.Module, tensors: dict[str, torch.Tensor], version: int) -> None:
        if self.module is None:
            self.module = self._shell(model)
        self.share_frozen(model)
        held = dict(self.module.named_parameters())
        with torch.no_grad():
            for name in _trainable(model):
                held[name].copy_(tensors[name])
        self.version = version

    def take(self, model: nn.Module, version: int) -> None:
        """LATEST is now `model`'s current weights (just exported as `version`)."""
        self._fill(model, {n: p.detach() for n, p in _trainable(model).items()}, version)

    def load(self, export_dir: str | os.PathLike[str], model: nn.Module) -> str | None:
        """Hold the version LATEST names in `export_dir`, in `model`'s structure; None when held, else why
        not (no LATEST, an unreadable or damaged file, weights of another drafter's shape)."""
        from safetensors.torch import load

        from spectrain_workloads.drafter.export import latest_export_meta, resolve_export, verified_bytes

        root = Path(export_dir)
        meta = latest_export_meta(root)
        if meta is None:
            return "no LATEST in the export directory"
        try:
            tensors = load(verified_bytes(resolve_export(root), meta, "model.safetensors"))
        except (OSError, ConfigError, ValueError) as exc:
            return f"LATEST is unreadable: {exc}"
        want = _trainable(model)
        wrong = [n for n, p in want.items() if n not in tensors or tensors[n].shape != p.shape]
        if wrong:
            return f"LATEST's weights do not fit this drafter ({', '.join(wrong[:3])})"
        self._fill(model, tensors, int(meta.get("version", 0)))
        return None
