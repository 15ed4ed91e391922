"""Drafter training data from the last pipeline stage to the ring's data channel (the built-in
trainer's `on_hidden`, and `pub.hidden_states` of the hooks API).

Per microbatch the last stage hands over hidden [b, T, H] (final-norm output) and tokens [b, T];
the first `ceil(fraction * b)` sequences are published, one ring record each: meta
{"step", "dtype", "stage", "seq_index"}, arrays hidden [T, H] and tokens [T] (docs/contracts.md).
For an EAGLE-3 drafter every stage holding a feature layer also publishes, from its FeatureTap,
features [T, n * H] (the inputs of its n feature layers, meta "feature_layers"), the same
sequences (same seq_index) on every stage, so the drafters can match the parts.

Never blocks the step. On CPU, `submit` copies the sequences into the ring on the caller's
thread: one memcpy per sequence into a slot that overwrites the oldest, never a wait (a [128, 128]
fp32 sequence: ~20 us with warm caches, 100-200 us right after a forward has evicted them). A
thread does not make that cheaper where the ranks fill the cores: it competes with the training
thread for the GIL and a core (docs/benchmarks.md, hooks: no lower overhead with it).

On CUDA the tensors are first copied into pinned host buffers on a side stream (after an event on
the compute stream), and a thread (started on the first CUDA sample) waits on that copy's event
and copies into the ring, so the training stream is never synchronised; it drops samples when its
bounded queue is full.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
from typing import Any

import numpy as np
import torch

from spectrain_workloads.harvest.feature_tap import FeatureTap


def _to_pinned(x: torch.Tensor, side: Any) -> torch.Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    x.record_stream(side)
    return host


def _numpy(x: torch.Tensor | None) -> np.ndarray | None:
    """numpy has no bfloat16: it travels as an int16 view (meta "dtype" says so)."""
    if x is None:
        return None
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


class DataPublisher:
    def __init__(self, producer: Any, *, fraction: float, stage: int, lock: threading.Lock,
                 depth: int = 8, tap: FeatureTap | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"SPECTRAIN_PUBLISH_FRACTION must be in [0, 1], got {fraction}")
        self.producer = producer
        self.fraction = fraction
        self.stage = stage
        self._lock = lock                       # shared with the window publisher (one ring writer)
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.dropped = 0
        self.errors = 0
        self.published = 0
        self._cuda_stream: Any = None
        self._thread: threading.Thread | None = None     # CUDA samples only
        self.tap = tap if tap is not None and tap.held else None

    def count(self, b: int) -> int:
        return min(b, math.ceil(self.fraction * b)) if self.fraction > 0 else 0

    def submit(self, step: int, mb: int, hidden: torch.Tensor | None, tokens: torch.Tensor, *,
               batch: int | None = None) -> None:
        """After microbatch `mb`'s forward: hidden [b, T, H] (detached; None on a stage without the
        LM head), tokens [b, T] int64 (or already its first `count(b)` rows; then `batch` = b when
        hidden is None). Publishes hidden and/or the tap's features, whichever exist."""
        b = batch if batch is not None else hidden.size(0) if hidden is not None else tokens.size(0)
        k = self.count(b)
        f = self.tap.take(k) if self.tap is not None and self.tap.ready() else None
        if k == 0 or (hidden is None and f is None):
            return
        h, t = (None if hidden is None else hidden[:k]), tokens[:k]
        if h is not None and f is not None and f.dtype != h.dtype:
            f = f.to(h.dtype)                   # one "dtype" in the record's meta
        ref = h if h is not None else f
        assert ref is not None
        if not ref.is_cuda:
            self._publish_safely(step, mb * b, h, t, f, None)
            return
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device=ref.device)
        side = self._cuda_stream
        side.wait_stream(torch.cuda.current_stream(ref.device))
        with torch.cuda.stream(side):
            hosts = [None if x is None else _to_pinned(x, side) for x in (h, t, f)]
            event = torch.cuda.Event()
            event.record(side)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="spectrain-data-publisher", daemon=True)
            self._thread.start()
        try:
            self._q.put_nowait((step, mb * b, hosts[0], hosts[1], hosts[2], event))
        except queue.Full:
            self.dropped += k

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                self._publish_safely(*item)
            finally:
                self._q.task_done()

    def _publish_safely(self, *item: Any) -> None:
        try:
            self._publish(*item)
        except Exception as exc:  # noqa: BLE001 - a bad payload must not stop training
            self.errors += 1
            if self.errors == 1:
                print(f"[spectrain-target] data channel: {exc}", file=sys.stderr, flush=True)

    def _publish(self, step: int, base: int, h: torch.Tensor | None, t: torch.Tensor, f: torch.Tensor | None,
                 event: Any) -> None:
        if event is not None:
            event.synchronize()
        ref = h if h is not None else f
        assert ref is not None
        dtype = str(ref.dtype).removeprefix("torch.")
        named = {"hidden": _numpy(h), "features": _numpy(f)}
        tn = t.numpy()
        for j in range(tn.shape[0]):
            meta: dict[str, Any] = {"step": step, "dtype": dtype, "stage": self.stage, "seq_index": base + j}
            arrays = {"tokens": tn[j], **{k: v[j] for k, v in named.items() if v is not None}}
            if f is not None and self.tap is not None:
                meta["feature_layers"] = list(self.tap.held)
            with self._lock:
                self.producer.publish_data(meta, arrays)
            self.published += 1

    def flush(self) -> None:
        """Wait until everything submitted is in the ring (tests, shutdown)."""
        if self._thread is not None:
            self._q.join()

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
