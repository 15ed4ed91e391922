"""`attach()` and the publisher it returns: what a user's trainer calls to feed its drafter sidecar.

Inside a SpecTrainJob pod (SPECTRAIN_RUN_DIR and SPECTRAIN_CONFIG set, docs/contracts.md) `attach()`
returns a `Publisher` for this rank: it creates the rank's ring (the drafter sidecar reads it),
the metrics files the report reads (metrics/target-rank-<r>.jsonl, windows-rank-<r>.jsonl), and
the Instrument the adapters drive (harvest/instrument.py: the built-in trainer's window
predictions). Anywhere else it returns `NOOP`, whose methods do nothing, so one script runs in
and out of a job. SPECTRAIN_INSTRUMENT=0 also gives `NOOP`; SPECTRAIN_DRAFTER_ENABLED=0 keeps the
windows in the metrics but creates no ring.

Three calls carry the drafter's inputs:
- `with pub.idle(kind, expected_s=None):` an idle window (hooks/windows.py predicts it when
  `expected_s` is not given);
- `pub.hidden_states(hidden [b, T, H], tokens [b, T])`: the final-norm hidden states of the last
  stage and the input ids; a share of the b sequences (SPECTRAIN_PUBLISH_FRACTION) goes into the
  ring (harvest/data_publisher.py: copied on the spot from CPU; from CUDA through pinned buffers and a
  thread with a bounded queue, dropped when full);
- `pub.step_end(step)`: once per optimizer step; the step's windows are learned from and written.
`pub.share_weights(embedding, lm_head)` writes the embedding and LM head ([V, H] each) the Eagle
drafter borrows, once (and again when they change); `pub.imbalance()` wraps a step's barrier.
An EAGLE-3 drafter also reads chosen layers' inputs: `pub.feature_layers(...)` and `pub.features(...)`
(hooks/features.py).

SPECTRAIN_INSTRUMENT_INTERLEAVE=k (bench-hooks): only steps in blocks of k in the order on off off
on are published; the others run with the publisher disabled, and each metrics line says which.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from spectrain_api.config import JobConfig, ModelConfig
from spectrain_api.config import load as load_config
from spectrain_api.names import EAGLE3, ENV_CONFIG, ENV_RUN_DIR, WINDOW_KINDS
from spectrain_workloads.drafter.eagle3_assembly import SAMPLE_WIDTH
from spectrain_workloads.harvest.instrument import Instrument, InstrumentOptions, instrumented_step
from spectrain_workloads.hooks.errors import HookError
from spectrain_workloads.hooks.features import FeatureCalls, NoopFeatureCalls
from spectrain_workloads.hooks.windows import ManualWindow, ManualWindows
from spectrain_workloads.runtime import RankInfo, TargetOptions, ring_layout


def _check_kind(kind: str) -> None:
    if kind not in WINDOW_KINDS:
        raise HookError(f"unknown window kind {kind!r}: use one of {', '.join(WINDOW_KINDS)}")


class _Null:
    """A reusable context manager that does nothing (NoopPublisher.idle / imbalance)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()


class NoopPublisher(NoopFeatureCalls):
    """What `attach()` returns outside a job: every call returns at once. `idle()` still rejects
    a kind that does not exist (a typo would otherwise only show inside a job)."""

    attached = False
    enabled = False

    def idle(self, kind: str, expected_s: float | None = None, *, name: str = "") -> _Null:
        if kind not in WINDOW_KINDS:
            _check_kind(kind)
        return _NULL

    def hidden_states(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        return None

    def step_end(self, step: int, *, loss: float | None = None, tokens: int = 0) -> None:
        return None

    def share_weights(self, embedding: torch.Tensor | None = None, lm_head: torch.Tensor | None = None, *,
                      n_heads: int | None = None, max_seq_len: int | None = None) -> None:
        return None

    def imbalance(self) -> _Null:
        return _NULL

    def close(self) -> None:
        return None


NOOP = NoopPublisher()


class _IdleWindow:
    """`with pub.idle(...)`: opens on enter, closes on exit (also on an exception)."""

    __slots__ = ("_pub", "_kind", "_name", "_expected_ns", "_w")

    def __init__(self, pub: Publisher, kind: str, name: str, expected_ns: int | None) -> None:
        self._pub, self._kind, self._name, self._expected_ns = pub, kind, name, expected_ns
        self._w: ManualWindow | None = None

    def __enter__(self) -> None:
        if self._pub.enabled:
            self._w = self._pub.manual.open(self._kind, self._name, self._expected_ns)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._w is not None:
            self._pub.manual.close(self._w)


class _SyncPoint:
    """`with pub.imbalance():` around a wait for the other ranks (a barrier, the step's last
    collective): the Instrument opens an Imbalance window if the wait outlasts the transfers still
    outstanding by SPECTRAIN_IMBALANCE_MIN_MS (harvest/instrument.py, sync points)."""

    __slots__ = ("_instr",)

    def __init__(self, instr: Instrument) -> None:
        self._instr = instr

    def __enter__(self) -> None:
        self._instr.sync_begin()

    def __exit__(self, *exc: object) -> None:
        self._instr.sync_end()


class Publisher(FeatureCalls):
    attached = True

    def __init__(self, cfg: JobConfig, opts: TargetOptions, rank: RankInfo, *, hidden_dim: int, seq_len: int) -> None:
        self.cfg, self.opts, self.rank_info = cfg, opts, rank
        self.rank = rank.rank
        pipeline = max(1, cfg.target.parallelism.pipeline)
        self.stage, self.replica = rank.rank % pipeline, rank.rank // pipeline
        self.kinds = tuple(cfg.drafter.activation.kinds)
        self.hidden_dim, self.seq_len = hidden_dim, seq_len
        self.step = 0
        self.enabled = instrumented_step(0, opts.instrument_interleave)
        self._lock = threading.Lock()            # one ring writer at a time (windows and data)
        self.producer = self._create_ring()
        from spectrain_workloads.metrics import MetricsWriter

        self.metrics = MetricsWriter(opts.run_dir, rank.rank, local_rank=rank.local_rank, port=opts.metrics_port,
                                     progress=rank.rank == 0, total_steps=cfg.target.steps)
        self.instrument = Instrument(rank=rank.rank, stage=self.stage, producer=self.producer,
                                     sink=self.metrics.window_closed, producer_lock=self._lock,
                                     opts=InstrumentOptions(enabled=self.enabled,
                                                            imbalance_min_ns=int(opts.imbalance_min_ms * 1e6)))
        self.manual = ManualWindows(stage=self.stage, producer=self.producer, lock=self._lock,
                                    sink=self.metrics.window_closed)
        self._data: Any = None                   # harvest.data_publisher.DataPublisher, on the first sample
        self.tap: Any = None                     # harvest.feature_tap.FeatureTap (EAGLE-3, hooks.features)
        self.num_layers: int | None = None       # the model's depth, from pub.feature_layers
        self._mb = 0                             # hidden_states calls this step (the sample's seq_index base)
        self._shared_dim: int | None = None
        self._checked: tuple[Any, ...] | None = None     # the sample shapes hidden_states last accepted
        self._last_end = time.monotonic()
        self._last_cpu = time.process_time()
        self._closed = False

    # ---------------------------------------------------------------- setup
    def _create_ring(self) -> Any:
        if not self.opts.drafter_enabled or self.opts.ring_dir is None:
            return None
        from spectrain_workloads.ring import RingProducer, ring_path

        self.opts.ring_dir.mkdir(parents=True, exist_ok=True)
        width = SAMPLE_WIDTH if self.cfg.drafter.arch == EAGLE3 else 1   # features beside the hidden states
        return RingProducer.create(ring_path(self.opts.ring_dir, self.rank_info.local_rank),
                                   layout=ring_layout(hidden_dim=self.hidden_dim, seq_len=self.seq_len, publishes=True,
                                                      width=width),
                                   rank=self.rank)

    def _data_publisher(self) -> Any:
        if self._data is None:
            from spectrain_workloads.harvest.data_publisher import DataPublisher

            self._data = DataPublisher(self.producer, fraction=self.opts.publish_fraction, stage=self.stage,
                                       lock=self._lock, tap=self.tap)
        return self._data

    def require_kind(self, kind: str, who: str) -> None:
        """HookError unless the job's drafter may use windows of `kind` (spec.drafter.activation.kinds)."""
        _check_kind(kind)
        if kind not in self.kinds:
            raise HookError(f"{who}: the job does not enable {kind} windows (spec.drafter.activation.kinds is "
                            f"{list(self.kinds)}); add {kind} there or do not mark {kind} windows")

    # ---------------------------------------------------------------- the three calls
    def idle(self, kind: str, expected_s: float | None = None, *, name: str = "") -> _IdleWindow:
        """A window of `kind` around the with-block; `expected_s` its expected length (None: learned
        from this call site's recent windows); `name` tells call sites of one kind apart."""
        if kind not in self.kinds:
            self.require_kind(kind, "pub.idle")
        return _IdleWindow(self, kind, name, None if expected_s is None else int(expected_s * 1e9))

    def hidden_states(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """hidden [b, T, H] (or [T, H]): final-norm output, so that logits = lm_head(hidden);
        tokens [b, T] (or [T]) int: the input ids of those positions. Never blocks: a share of the
        sequences goes into the ring (harvest/data_publisher.py: copied on the spot from CPU, from CUDA by a
        thread that drops samples when its queue is full)."""
        if not self.enabled:
            return
        if not isinstance(hidden, torch.Tensor) or not isinstance(tokens, torch.Tensor):
            raise HookError(f"pub.hidden_states(hidden, tokens) takes tensors, got {type(hidden).__name__} and "
                            f"{type(tokens).__name__}")
        if hidden.dim() == 2:
            hidden = hidden.unsqueeze(0)
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        sig = (hidden.shape, tokens.shape, tokens.dtype, self._shared_dim)
        if sig != self._checked:        # the same shapes every step: checked once
            self._check_sample(hidden, tokens)
            self._checked = sig
        if self.producer is None:
            return
        data = self._data_publisher()
        k = data.count(hidden.size(0))
        if k:
            # CUDA samples reach the ring later (a thread): their tokens are cloned, as a caller may
            # refill its batch buffer before then; CPU samples are copied into the ring right here
            data.submit(self.step, self._mb, hidden.detach(), tokens[:k].to(torch.int64, copy=hidden.is_cuda))
        self._mb += 1

    def _check_sample(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(tokens.shape):
            raise HookError(f"pub.hidden_states: hidden must be [b, T, H] and tokens [b, T] with the same b and T; "
                            f"got hidden {tuple(hidden.shape)} and tokens {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise HookError(f"pub.hidden_states: tokens must be integer token ids, got {tokens.dtype}")
        H, T = hidden.shape[2], hidden.shape[1]
        want = self._shared_dim or self.hidden_dim
        if H != want:
            raise HookError(f"pub.hidden_states: hidden has width H={H} but the drafter expects {want} (the "
                            "embedding / LM head width); publish the final-norm output of the last stage")
        if T > self.seq_len:
            raise HookError(f"pub.hidden_states: sequences of {T} positions exceed the ring's {self.seq_len}; "
                            f"call attach(seq_len={T}) (default: spec.target.data.seqLen)")

    def step_end(self, step: int, *, loss: float | None = None, tokens: int = 0) -> None:
        """Step `step` is done: learn from its windows, write them and the step's metrics line."""
        now = time.monotonic()
        self.instrument.end_step()
        self.manual.end_step(step + 1)
        # cpu_ms: this process's CPU time since the last step_end, all threads (bench-hooks compares it
        # between published and plain steps: less sensitive to other processes than wall time)
        cpu = time.process_time()
        self.metrics.step(step=step, loss=loss, step_time_s=now - self._last_end, tokens=tokens,
                          extra={"stage": self.stage, "replica": self.replica, "instrumented": self.enabled,
                                 "cpu_ms": (cpu - self._last_cpu) * 1e3},
                          final=step + 1 == self.cfg.target.steps)
        self._last_end, self._last_cpu = now, cpu
        self.step = step + 1
        self._mb = 0
        self.enabled = instrumented_step(self.step, self.opts.instrument_interleave)
        self.instrument.step = self.step
        self.instrument.enabled = self.enabled

    # ---------------------------------------------------------------- the drafter's borrowed weights
    def share_weights(self, embedding: torch.Tensor | None = None, lm_head: torch.Tensor | None = None, *,
                      n_heads: int | None = None, max_seq_len: int | None = None,
                      token_counts: torch.Tensor | None = None) -> None:
        """Write the target's token embedding and/or LM head weight ([V, H] each) for the drafter:
        the stage that holds each passes it (replica 0 writes; other replicas return). Call it
        before the first step and again whenever they change (e.g. at each checkpoint).
        `n_heads`: attention heads of the drafter's decoder layer (default: H / 64, head dim even).
        EAGLE-3: call `feature_layers` first (the model's depth goes into the shared config);
        `token_counts` [V] int64, your data's token frequencies, choose its draft vocabulary when
        spec.drafter.draftVocabSize is below the vocabulary (default min(32768, V))."""
        given = [(n, w) for n, w in (("embedding", embedding), ("lm_head", lm_head)) if w is not None]
        if not given:
            raise HookError("pub.share_weights: pass embedding=, lm_head= or both ([V, H] weights)")
        shapes = {n: tuple(w.shape) for n, w in given}
        if any(len(s) != 2 for s in shapes.values()) or len(set(shapes.values())) != 1:
            raise HookError(f"pub.share_weights: embedding and lm_head must be [V, H] weights of one shape, got {shapes}")
        vocab, dim = next(iter(shapes.values()))
        if dim != self.hidden_dim:
            raise HookError(f"pub.share_weights: width H={dim}, but the ring was sized for H={self.hidden_dim}; "
                            f"call attach(hidden_dim={dim})")
        mcfg = drafter_model_config(vocab, dim, n_heads=n_heads, max_seq_len=max_seq_len or self.seq_len,
                                    n_layers=self.num_layers or 1)
        self._shared_dim = dim
        if self.replica != 0:
            return
        from spectrain_workloads.checkpoint import save_shared

        save_shared(self.opts.run_dir, embedding=embedding, lm_head=lm_head, model_config=mcfg.to_dict(),
                    token_counts=token_counts)

    def imbalance(self) -> _SyncPoint | _Null:
        if not self.enabled:
            return _NULL
        self.require_kind("Imbalance", "pub.imbalance")
        return _SyncPoint(self.instrument)

    def close(self) -> None:
        """Flush queued samples, write the last windows, close the ring (also run at exit)."""
        if self._closed:
            return
        self._closed = True
        if self._data is not None:
            self._data.close()
        self.instrument.close()
        self.manual.end_step(self.step)
        self.metrics.close()
        if self.producer is not None:
            self.producer.close()


def drafter_model_config(vocab: int, dim: int, *, n_heads: int | None, max_seq_len: int,
                         n_layers: int = 1) -> ModelConfig:
    """The model config the drafter builds its Eagle layer from (target/shared/model_config.json):
    the target's vocabulary and width, `n_heads` heads (default: about 64 per head, head dim even),
    `n_layers` the target's depth where known (EAGLE-3 resolves its default feature layers with it)."""
    if n_heads is None:
        n_heads = max(1, dim // 64)
        while n_heads > 1 and (dim % n_heads or (dim // n_heads) % 2):
            n_heads -= 1
    if dim % n_heads or (dim // n_heads) % 2:
        raise HookError(f"pub.share_weights: n_heads={n_heads} must divide H={dim} into an even head dim")
    return ModelConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, max_seq_len=max_seq_len)


def attach(*, hidden_dim: int | None = None, seq_len: int | None = None,
           env: Mapping[str, str] | None = None) -> Publisher | NoopPublisher:
    """The publisher of this rank: a `Publisher` inside a SpecTrainJob pod, `NOOP` elsewhere.

    hidden_dim, seq_len: the width of the hidden states and the longest sequence this rank will
    publish (they size the ring's data slots); default: the manifest's model preset width and
    spec.target.data.seqLen. Call it once per process, after `init_process_group` if any.
    """
    e = os.environ if env is None else env
    if not e.get(ENV_RUN_DIR) or not e.get(ENV_CONFIG):
        return NOOP
    opts = TargetOptions.from_env(dict(e))
    if not opts.instrument:
        return NOOP
    cfg = load_config(e[ENV_CONFIG])
    t = cfg.target
    if hidden_dim is None:
        from spectrain_workloads.target_model import resolve_target

        hidden_dim = resolve_target(cfg).config.dim
    if seq_len is None:
        seq_len = t.data.seq_len
    if hidden_dim < 1 or seq_len < 1:
        raise HookError(f"attach: hidden_dim ({hidden_dim}) and seq_len ({seq_len}) must be >= 1")
    Path(opts.run_dir).mkdir(parents=True, exist_ok=True)
    pub = Publisher(cfg, opts, RankInfo.from_env(dict(e)), hidden_dim=hidden_dim, seq_len=seq_len)
    atexit.register(pub.close)
    return pub


__all__ = ["NOOP", "NoopPublisher", "Publisher", "attach", "drafter_model_config"]
