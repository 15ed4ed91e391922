"""Drafter training data from the last pipeline stage to the ring's data channel (the built-in
trainer's `on_hidden`, and `pub.hidden_states` of the hooks API).

Per microbatch the last stage hands over hidden [b, T, H] (final-norm output) and tokens [b, T];
the first `ceil(fraction * b)` sequences are published, one ring record each: meta
{"step", "dtype", "stage", "seq_index"}, arrays hidden [T, H] and tokens [T] (docs/contracts.md).

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

import torch


class DataPublisher:
    def __init__(self, producer: Any, *, fraction: float, stage: int, lock: threading.Lock,
                 depth: int = 8) -> None:
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

    def count(self, b: int) -> int:
        return min(b, math.ceil(self.fraction * b)) if self.fraction > 0 else 0

    def submit(self, step: int, mb: int, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """hidden [b, T, H] (detached), tokens [b, T] int64."""
        k = self.count(hidden.size(0))
        if k == 0:
            return
        h, t = hidden[:k], tokens[:k]
        if not h.is_cuda:
            self._publish_safely(step, mb * hidden.size(0), h, t, None)
            return
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device=h.device)
        side = self._cuda_stream
        side.wait_stream(torch.cuda.current_stream(h.device))
        with torch.cuda.stream(side):
            h_host = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
            t_host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h_host.copy_(h, non_blocking=True)
            t_host.copy_(t, non_blocking=True)
            h.record_stream(side)
            t.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="spectrain-data-publisher", daemon=True)
            self._thread.start()
        try:
            self._q.put_nowait((step, mb * hidden.size(0), h_host, t_host, event))
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

    def _publish(self, step: int, base: int, h: torch.Tensor, t: torch.Tensor, event: Any) -> None:
        if event is not None:
            event.synchronize()
        dtype = str(h.dtype).removeprefix("torch.")
        if h.dtype == torch.bfloat16:
            h = h.view(torch.int16)     # numpy has no bfloat16; meta says so
        hn, tn = h.numpy(), t.numpy()
        for j in range(hn.shape[0]):
            meta = {"step": step, "dtype": dtype, "stage": self.stage, "seq_index": base + j}
            with self._lock:
                self.producer.publish_data(meta, {"hidden": hn[j], "tokens": tn[j]})
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
