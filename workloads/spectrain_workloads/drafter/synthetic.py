"""A synthetic target for drafter tests and benchmarks: real ring, real data, scripted windows.

It plays the target's part of the contracts without the trainer: writes
run_dir/target/shared/{embedding,lm_head}.safetensors + model_config.json from a small
model.Transformer, and per step: burns `compute_ms` of CPU (matmuls: the "target compute"
whose duration measures slowdown), publishes `data_per_step` sequences (the model's final-norm
hidden states and tokens of real text), then opens and closes the scripted windows, sleeping
through each (idle: the GPU would be free). Windows are logged like the target's
metrics/windows-rank-<r>.jsonl.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spectrain_api.fsio import atomic_write, atomic_write_json
from spectrain_workloads.model import ModelConfig, Transformer


@dataclass(kw_only=True)
class WindowSpec:
    kind: str                    # API name
    duration_ms: float           # actual duration (mean when jitter > 0)
    predicted: bool = True       # False: published open-ended (predicted 0)
    jitter: float = 0.0          # actual = duration * U(1 - jitter, 1 + jitter)


@dataclass(kw_only=True)
class SyntheticSpec:
    windows: list[WindowSpec] = field(default_factory=lambda: [WindowSpec(kind="Bubble", duration_ms=30.0)])
    compute_ms: float = 10.0
    data_per_step: int = 2
    seq_len: int = 64
    seed: int = 0


def write_target_shared(run_dir: str | os.PathLike[str], model: Transformer) -> None:
    """What the real target writes at each checkpoint (contracts.md), atomically per file."""
    from safetensors.torch import save_file

    d = Path(run_dir) / "target" / "shared"
    d.mkdir(parents=True, exist_ok=True)
    assert model.tok_embeddings is not None and model.output is not None
    for name, w in (("embedding", model.tok_embeddings.weight), ("lm_head", model.output.weight)):
        atomic_write(d / f"{name}.safetensors", lambda p, w=w: save_file({"weight": w.detach().contiguous()}, str(p)),
                     durable=False)
    atomic_write_json(d / "model_config.json", model.cfg.to_dict(), durable=False)


@functools.lru_cache(maxsize=1)
def _corpus() -> torch.Tensor:
    from spectrain_workloads.data import load_corpus

    return torch.from_numpy(load_corpus("builtin:python-stdlib", max_bytes=1 << 20).astype("int64"))


def text_sequences(n: int, seq_len: int, *, seed: int, offset: int = 0) -> torch.Tensor:
    """n token sequences [n, seq_len] of real text (the Python stdlib sources), deterministic."""
    corpus = _corpus()
    g = torch.Generator().manual_seed(seed * 1_000_003 + offset)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (n,), generator=g)
    return torch.stack([corpus[s:s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def target_hidden(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] (so logits = lm_head(hidden)), as the last stage publishes."""
    _, hidden = model(tokens, return_hidden=True)
    return hidden


def make_target(cfg: ModelConfig, seed: int) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    return model.eval()


class SyntheticTarget:
    def __init__(self, *, run_dir: Path, ring_path: Path, spec: SyntheticSpec, cfg: ModelConfig,
                 rank: int = 0, write_shared: bool = True) -> None:
        from spectrain_workloads.ring import RingLayout, RingProducer

        self.spec, self.rank = spec, rank
        self.model = make_target(cfg, spec.seed)
        if write_shared:
            write_target_shared(run_dir, self.model)
        self.producer = RingProducer.create(ring_path, layout=RingLayout(data_slots=64), rank=rank)
        self.rng = random.Random(spec.seed)
        self.step = 0
        self._a = torch.randn(96, 96, generator=torch.Generator().manual_seed(spec.seed))
        (Path(run_dir) / "metrics").mkdir(parents=True, exist_ok=True)
        self.windows_log = open(Path(run_dir) / "metrics" / f"windows-rank-{rank}.jsonl", "a", buffering=1)
        self.compute_s: list[float] = []

    def _compute(self) -> float:
        """Busy CPU for about compute_ms; returns its wall time (the figure slowdown compares)."""
        t0 = time.perf_counter()
        x = self._a
        while (time.perf_counter() - t0) * 1e3 < self.spec.compute_ms:
            x = torch.tanh(x @ self._a)
        return time.perf_counter() - t0

    def _fixed_compute(self, iters: int) -> float:
        """A fixed amount of CPU work (no deadline): its wall time grows if a drafter competes."""
        t0 = time.perf_counter()
        x = self._a
        for _ in range(iters):
            x = torch.tanh(x @ self._a)
        return time.perf_counter() - t0

    def publish_data(self) -> None:
        s = self.spec
        if s.data_per_step < 1:
            return
        tokens = text_sequences(s.data_per_step, s.seq_len, seed=s.seed, offset=self.step)
        hidden = target_hidden(self.model, tokens)
        for i in range(s.data_per_step):
            self.producer.publish_data({"step": self.step, "dtype": "float32", "stage": 0, "seq_index": i},
                                       {"hidden": hidden[i].numpy(), "tokens": tokens[i].numpy()})

    def window(self, w: WindowSpec) -> dict[str, Any]:
        from spectrain_workloads.ring import WindowKind

        dur = w.duration_ms * (1 + self.rng.uniform(-w.jitter, w.jitter)) if w.jitter else w.duration_ms
        start = time.monotonic_ns()      # the ring record carries exactly these timestamps
        predicted = int(dur * 1e6) if w.predicted else 0
        wid = self.producer.window_start(WindowKind.from_api_name(w.kind), stage=0, step=self.step,
                                         predicted_duration_ns=predicted, start_ns=start)
        deadline = start + int(dur * 1e6)
        while (left := deadline - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        end = time.monotonic_ns()
        self.producer.window_end(wid, end_ns=end)
        rec = {"window_id": wid, "kind": w.kind, "stage": 0, "step": self.step, "start_ns": start,
               "predicted_ns": predicted, "actual_ns": end - start}
        self.windows_log.write(json.dumps(rec) + "\n")
        return rec

    def run_step(self, *, fixed_iters: int | None = None) -> float:
        """One step; returns its compute time in seconds."""
        c = self._fixed_compute(fixed_iters) if fixed_iters is not None else self._compute()
        self.compute_s.append(c)
        self.publish_data()
        for w in self.spec.windows:
            self.window(w)
        self.step += 1
        return c

    def latest_back(self) -> dict[str, Any] | None:
        msg = self.producer.latest_back()
        return None if msg is None else msg.data

    def close(self) -> None:
        self.producer.close()
        self.windows_log.close()
