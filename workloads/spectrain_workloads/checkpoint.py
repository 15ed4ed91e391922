"""Per-rank atomic checkpoints with keep-last-N, exact resume, and the shared embedding/head files.

Layout (docs/contracts.md): `$RUN_DIR/target/rank-<r>/step-<N>/state.pt`. A checkpoint is written
into a hidden temp dir next to it, fsynced, then renamed: a reader sees either no step-<N> or a
complete one, never half a file. `state.pt` holds what resuming bitwise needs: the stage's
weights, the optimizer state, every RNG state (torch CPU/CUDA, numpy, python) and the loader's
position, as tensors and plain data only: it is read with `torch.load(weights_only=True)`, so a
file that names code to run is refused (`CheckpointRefused`), never executed.

Ranks agree on the step to resume from with one MIN all-reduce at start-up (before training, so
it cannot change any step's maths): a crash between two ranks' saves leaves them at different
latest steps, and the older one is still kept (keep >= 1 plus the rename order).

Shared files for the Eagle drafter: `target/shared/{embedding,lm_head}.safetensors` ("weight"
[V, H]) and `model_config.json`, each replaced atomically (temp + rename).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spectrain_api.fsio import atomic_dir, atomic_write

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointRefused(RuntimeError):
    """A checkpoint file that a weights-only load refuses (it names code to run)."""


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain data (what `torch.load(weights_only=True)` reads)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                                       "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, run_dir: str | os.PathLike[str], rank: int, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"spec.target.checkpoint.keep must be >= 1, got {keep}")
        self.dir = Path(run_dir) / "target" / f"rank-{rank}"
        self.keep = keep

    def steps(self) -> list[int]:
        """Completed checkpoint steps, ascending."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / "state.pt").is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step}"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        final = self.path(step)
        if final.exists():
            return final            # e.g. SIGTERM right after a periodic save of the same step
        atomic_dir(final, lambda tmp: torch.save(state, tmp / "state.pt"))
        self.prune()
        return final

    def prune(self) -> None:
        for step in self.steps()[:-self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)
        for p in self.dir.glob(".tmp-step-*"):          # leftovers of killed saves (fsio.atomic_dir)
            if not p.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(p, ignore_errors=True)

    def load(self, step: int) -> dict[str, Any]:
        path = self.path(step) / "state.pt"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} is missing; the ranks' checkpoints disagree "
                                    "(raise checkpoint.keep or clear the run directory)")
        # weights_only: tensors and plain data only. The run volume is shared with the drafter
        # container (read-only there but for drafter/, except in SingleContainer mode and locally);
        # a full unpickler would run whatever code a file there names.
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointRefused(
                f"checkpoint {path} holds objects other than tensors and plain data, so it is not loaded "
                f"(loading it could run code): {str(exc).splitlines()[0]}. Delete the step directory "
                f"{path.parent} to resume from the one before, or clear the run directory") from exc


def save_shared(run_dir: str | os.PathLike[str], *, embedding: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None, model_config: dict[str, Any] | None = None,
                token_counts: torch.Tensor | None = None) -> None:
    """Rewrite the drafter's shared embedding / LM head ("weight" [V, H]) atomically; token_counts
    [V] int64 ("counts"): the job's data, from which an EAGLE-3 drafter picks its draft vocabulary."""
    from safetensors.torch import save_file

    shared = Path(run_dir) / "target" / "shared"
    if token_counts is not None:   # before the model config: the drafter starts once that exists
        c = token_counts.detach().to("cpu", torch.int64).contiguous()
        atomic_write(shared / "token_counts.safetensors", lambda p: save_file({"counts": c}, str(p)))
    if embedding is not None:
        w = embedding.detach().to("cpu", copy=True).contiguous()
        atomic_write(shared / "embedding.safetensors", lambda p: save_file({"weight": w}, str(p)))
    if lm_head is not None:
        w = lm_head.detach().to("cpu", copy=True).contiguous()
        atomic_write(shared / "lm_head.safetensors", lambda p: save_file({"weight": w}, str(p)))
    if model_config is not None:
        atomic_write(shared / "model_config.json", lambda p: p.write_text(json.dumps(model_config)))
