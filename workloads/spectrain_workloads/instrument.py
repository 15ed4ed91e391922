"""Idle-window publishing for the target: Bubble, Communication and Imbalance windows.

- Bubble: pre-scheduled. The pipeline executor opens a BUBBLE slot of the schedule (schedule.py)
  right after the previous action ends, before it blocks on the receive that ends the bubble. The
  prediction is the schedule simulated with the EMA of this stage's measured forward/backward
  times (`record_compute`), times a per-slot correction: the median of recent actual / simulated for that
  slot. A stage only measures its own F/B, but its bubbles are the other stages' compute (the
  last stage's LM head and loss make it slower than the rest, for one); the correction learns
  that per slot, while the simulation still follows changes of F/B times at once.
- Communication: opened when a collective is launched (DDP bucket all-reduce in the comm hook,
  pipeline isend, a pipeline receive the stage has to wait for), closed on completion. Predicted
  as the median of the recent durations of the same (channel, bytes, position) (position: the microbatch
  of a pipeline transfer, so a receive that regularly waits for a slower peer predicts that wait);
  a key never seen is predicted from the channel's (one per direction) latency + bytes / bandwidth
  fit, and from `default_bytes_per_ns` before the channel has any sample. DDP bucket all-reduces
  are anchored instead (`comm_open(anchor="dp")`): an all-reduce ends when the slowest replica
  launches the same bucket (measured: the early replica's bucket k ends 0.2-3 ms after the late
  one's launch of k), so its duration is the peer's remaining backward, not bytes / bandwidth. The
  step's first bucket launch is the anchor; bucket k is predicted to end at anchor + the median of
  its recent (end - anchor), at least its shortest recent duration (the link alone, peer already there).
- Imbalance: reactive and open-ended (predicted 0). Waiting is told from communicating by local
  timestamps only, no extra collective: when a rank reaches a sync point (its compute for the step
  is done, or it needs a tensor a peer has not sent), the transfers it still waits for are
  expected to end at `expected_comm_end()` (the latest start + prediction among the outstanding
  windows: bucket all-reduces overlap the backward and each other). A watchdog thread is armed
  for that moment plus `imbalance_min_ns`; if the rank is still
  blocked then, the rest of the wait is a peer's lateness, and the Imbalance window opens at once.
  `sync_end()` closes it. Communication samples that overlapped an Imbalance window are not fed
  to the duration history (they measured the peer, not the link). Medians rather than means: on
  a shared CPU, sub-millisecond transfers have a heavy tail of scheduling delays that would pull
  a mean (and so the typical window's prediction) far off.

Everything here only reads clocks and writes the ring / metrics: it never touches tensors, so
training with instrumentation on and off is bitwise identical. `enabled=False` turns every call
into a cheap no-op (returns None).

Thread safety: windows are opened/closed from the training thread, the gloo completion thread
(comm hook callbacks), the send-completion thread and the watchdog; one lock serialises them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUBBLE, COMMUNICATION, IMBALANCE = "Bubble", "Communication", "Imbalance"
_RING_KIND = {BUBBLE: 1, COMMUNICATION: 2, IMBALANCE: 3}   # spectrain_workloads.ring.WindowKind values


@dataclass(kw_only=True, frozen=True)
class InstrumentOptions:
    enabled: bool = True
    ema_alpha: float = 0.3
    imbalance_min_ns: int = 5_000_000      # slack past the expected end of comm before "waiting"
    default_bytes_per_ns: float = 1.0      # 1 GB/s until a channel has been measured
    default_latency_ns: int = 50_000       # per-message latency until a channel has been measured
    history: int = 8                       # recent samples per bubble slot / transfer key (medians)


@dataclass
class Window:
    kind: str
    start_ns: int
    predicted_ns: int
    step: int
    channel: str = ""
    nbytes: int = 0
    ring_id: int = 0
    local_id: int = 0
    imb_epoch: int = 0
    slot: int = -1          # schedule slot of a Bubble
    base_ns: float = 0.0    # Bubble: the simulated length before the per-slot correction
    learn: bool = True      # Bubble: feed the per-slot correction on close
    pos: int = -1           # Communication: position (pipeline microbatch), part of the EMA key
    anchor_ns: int = 0      # Communication: the anchor of its group in this step (0: none)


class Instrument:
    """One per rank. `producer`: a RingProducer or None (metrics only); `sink(record)` receives
    every closed window as the dict written to metrics/windows-rank-<r>.jsonl."""

    def __init__(self, *, rank: int, stage: int, opts: InstrumentOptions, producer: Any = None,
                 sink: Callable[[dict[str, Any]], None] | None = None,
                 producer_lock: threading.Lock | None = None) -> None:
        self.rank, self.stage, self.opts = rank, stage, opts
        self.enabled = opts.enabled
        self.producer = producer
        self.sink = sink
        self.step = 0
        self._lock = producer_lock or threading.Lock()
        self._next_local = 0
        self._tf: float | None = None    # EMA forward ns per microbatch
        self._tb: float | None = None    # EMA backward ns per microbatch
        self._dur: dict[tuple[str, int, int], deque[float]] = {}   # (channel, bytes, pos) -> recent ns
        self._fit: dict[str, _LinearFit] = {}                # channel -> latency + bytes / bandwidth
        self._anchor: dict[str, tuple[int, int]] = {}        # anchor group -> (step, first launch ns)
        self._rel_end: dict[tuple[str, int], deque[float]] = {}   # (channel, bytes) -> recent end - anchor
        self._slot_ratio: dict[int, deque[float]] = {}      # bubble slot -> recent actual / simulated
        self._slot_actual: dict[int, deque[float]] = {}     # bubble slot -> recent actual (no simulation yet)
        self._outstanding: dict[int, Window] = {}     # open comm windows by local id
        self._imb_epoch = 0
        self._imbalance: Window | None = None
        self._watch: _Watchdog | None = None
        if self.enabled:
            self._watch = _Watchdog(self._fire_imbalance)
            self._watch.start()

    # -- compute EMA ----------------------------------------------------------------------------
    def record_compute(self, op: str, ns: int) -> None:
        if not self.enabled:
            return
        a = self.opts.ema_alpha
        if op == "F":
            self._tf = ns if self._tf is None else (1 - a) * self._tf + a * ns
        else:
            self._tb = ns if self._tb is None else (1 - a) * self._tb + a * ns

    @property
    def compute_ema_ns(self) -> tuple[float, float] | None:
        """(tf, tb) EMA in ns, or None before both have been measured."""
        if self._tf is None or self._tb is None:
            return None
        return self._tf, self._tb

    # -- windows --------------------------------------------------------------------------------
    def _open(self, kind: str, predicted_ns: int, *, channel: str = "", nbytes: int = 0) -> Window:
        with self._lock:
            now = time.monotonic_ns()
            self._next_local += 1
            w = Window(kind=kind, start_ns=now, predicted_ns=max(0, int(predicted_ns)), step=self.step,
                       channel=channel, nbytes=nbytes, local_id=self._next_local, imb_epoch=self._imb_epoch)
            if self.producer is not None:
                w.ring_id = self.producer.window_start(_RING_KIND[kind], stage=self.stage, step=w.step,
                                                       predicted_duration_ns=w.predicted_ns, start_ns=now)
            return w

    def _close(self, w: Window, end_ns: int | None = None) -> dict[str, Any]:
        with self._lock:
            end = time.monotonic_ns() if end_ns is None else end_ns
            actual = max(0, end - w.start_ns)
            if self.producer is not None:
                self.producer.window_end(w.ring_id, actual_duration_ns=actual)
            rec = {"window_id": w.ring_id or w.local_id, "kind": w.kind, "stage": self.stage, "step": w.step,
                   "start_ns": w.start_ns, "predicted_ns": w.predicted_ns, "actual_ns": actual}
            if w.channel:
                rec["channel"], rec["bytes"] = w.channel, w.nbytes
            if w.slot >= 0:
                rec["slot"] = w.slot
        if self.sink is not None:
            self.sink(rec)
        return rec

    # -- bubble ---------------------------------------------------------------------------------
    def predict_bubble_ns(self, simulated_ns: float, slot: int) -> int:
        """Prediction of bubble `slot` from its simulated length (0: unknown) and its history."""
        with self._lock:
            ratios, actuals = self._slot_ratio.get(slot), self._slot_actual.get(slot)
            if simulated_ns > 0:
                return int(simulated_ns * (statistics.median(ratios) if ratios else 1.0))
            return int(statistics.median(actuals)) if actuals else 0

    def bubble_open(self, predicted_ns: float, slot: int = -1, *, learn: bool = True) -> Window | None:
        """Open scheduled bubble `slot`; `predicted_ns` is the schedule's simulated length (0 until
        the stage has F/B measurements); `learn=False` for a slot whose structure is not the usual
        one (the first step's leading bubble has no trailing part)."""
        if not self.enabled:
            return None
        w = self._open(BUBBLE, self.predict_bubble_ns(predicted_ns, slot))
        w.slot, w.base_ns, w.learn = slot, float(predicted_ns), learn
        return w

    def bubble_close(self, w: Window | None) -> None:
        if w is None:
            return
        rec = self._close(w)
        actual = rec["actual_ns"]
        if not w.learn or actual <= 0 or w.slot < 0:
            return
        n = self.opts.history
        with self._lock:
            self._slot_actual.setdefault(w.slot, deque(maxlen=n)).append(float(actual))
            if w.base_ns > 0:
                self._slot_ratio.setdefault(w.slot, deque(maxlen=n)).append(min(max(actual / w.base_ns, 0.05), 20.0))

    # -- communication --------------------------------------------------------------------------
    def predict_comm_ns(self, channel: str, nbytes: int, pos: int = -1) -> int:
        with self._lock:
            d = self._dur.get((channel, nbytes, pos))
            if d:
                return max(1, int(statistics.median(d)))
            fit = self._fit.get(channel)
            if fit is not None and fit.ready:
                return max(1, int(fit.predict(nbytes)))
        return max(1, int(self.opts.default_latency_ns + nbytes / self.opts.default_bytes_per_ns))

    def _predict_anchored_ns(self, channel: str, nbytes: int, group: str, now: int) -> tuple[int, int]:
        """(anchor ns, prediction or 0) of a transfer whose end is tied to its group's anchor."""
        with self._lock:
            a = self._anchor.get(group)
            if a is None or a[0] != self.step:
                a = self._anchor[group] = (self.step, now)
            rel = self._rel_end.get((channel, nbytes))
            if not rel:
                return a[1], 0
            d = self._dur.get((channel, nbytes, -1))
            floor = min(d) if d else 1.0
            return a[1], max(1, int(max(a[1] + statistics.median(rel) - now, floor)))

    def comm_open(self, channel: str, nbytes: int, pos: int = -1, *, anchor: str = "") -> Window | None:
        """Open a Communication window. `anchor`: a group of transfers (the DDP buckets of a step)
        that all wait for the same peer event; the group's first launch in a step is its anchor, and
        each transfer is predicted to end at anchor + the median of its recent end - anchor."""
        if not self.enabled:
            return None
        pred, anchor_ns = 0, 0
        if anchor:
            anchor_ns, pred = self._predict_anchored_ns(channel, nbytes, anchor, time.monotonic_ns())
        if pred <= 0:
            pred = self.predict_comm_ns(channel, nbytes, pos)
        w = self._open(COMMUNICATION, pred, channel=channel, nbytes=nbytes)
        w.pos, w.anchor_ns = pos, anchor_ns
        with self._lock:
            self._outstanding[w.local_id] = w
        return w

    def comm_close(self, w: Window | None, end_ns: int | None = None) -> None:
        if w is None:
            return
        with self._lock:
            self._outstanding.pop(w.local_id, None)
            contaminated = w.imb_epoch != self._imb_epoch or self._imbalance is not None
        rec = self._close(w, end_ns)
        actual = rec["actual_ns"]
        if w.anchor_ns and actual > 0:
            # The end relative to the anchor models the peer (when it launched the same bucket), so it
            # is learned whether or not the wait was long enough to count as imbalance.
            with self._lock:
                self._rel_end.setdefault((w.channel, w.nbytes), deque(maxlen=self.opts.history)).append(
                    float(w.start_ns + actual - w.anchor_ns))
        if contaminated or actual <= 0:
            return
        key = (w.channel, w.nbytes, w.pos)
        with self._lock:
            self._dur.setdefault(key, deque(maxlen=self.opts.history)).append(float(actual))
            self._fit.setdefault(w.channel, _LinearFit()).add(w.nbytes, float(actual))

    def expected_comm_end(self, now: int | None = None) -> int:
        """When the outstanding transfers are expected to be done: the latest start + prediction.

        Transfers launched during the backward overlap it and each other, so the latest end (not
        their sum) is the model; a peer that has not caught up shows as a wait past it.
        """
        now = time.monotonic_ns() if now is None else now
        with self._lock:
            ends = [w.start_ns + w.predicted_ns for w in self._outstanding.values()]
        return max([now, *ends])

    # -- sync points / imbalance ----------------------------------------------------------------
    def sync_begin(self, extra_pred_ns: int = 0) -> None:
        """The rank has reached a sync point and is about to block on outstanding transfers."""
        if self._watch is None:
            return
        self._watch.arm(self.expected_comm_end() + extra_pred_ns + self.opts.imbalance_min_ns)

    def sync_end(self) -> None:
        """The wait is over: close the Imbalance window if the watchdog opened one."""
        if self._watch is None:
            return
        self._watch.disarm()
        with self._lock:
            w, self._imbalance = self._imbalance, None
        if w is not None:
            self._close(w)

    def _fire_imbalance(self) -> None:
        w = self._open(IMBALANCE, 0)
        with self._lock:
            self._imb_epoch += 1
            self._imbalance = w

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        with self._lock:
            open_ws = list(self._outstanding.values())
            self._outstanding.clear()
        for w in open_ws:
            self._close(w)
        self.sync_end()


class _Watchdog(threading.Thread):
    """Fires `fire()` once when an armed deadline passes before `disarm()`."""

    def __init__(self, fire: Callable[[], None]) -> None:
        super().__init__(name="spectrain-imbalance-watchdog", daemon=True)
        self._fire = fire
        self._cond = threading.Condition()
        self._deadline: int | None = None
        self._stopped = False

    def arm(self, deadline_ns: int) -> None:
        with self._cond:
            self._deadline = deadline_ns
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self.join(timeout=5)

    def run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic_ns()
                if left > 0:
                    self._cond.wait(left / 1e9)
                    continue
                self._deadline = None
                # Open the window while holding the condition: disarm() cannot slip between the
                # deadline check and the window, so sync_end() always sees and closes it.
                self._fire()


class _LinearFit:
    """Exponentially weighted least squares of duration = latency + bytes / bandwidth."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    @property
    def ready(self) -> bool:
        return self.w > 0

    def predict(self, x: float) -> float:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1.0):      # one message size seen so far: pure bandwidth
            return my * x / mx if mx > 0 else my
        slope = max((self.xy / self.w - mx * my) / var, 0.0)
        return max(my + slope * (x - mx), 0.0)
