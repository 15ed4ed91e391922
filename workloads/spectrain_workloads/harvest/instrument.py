"""Idle-window publishing for the target: Bubble, Communication and Imbalance windows.

- Bubble: pre-scheduled. The pipeline executor (target/pipeline.py, or hooks/pipelining.py around
  torch's schedules) opens a BUBBLE slot of the schedule (schedule.py) right after the previous
  action ends, before it blocks on the receive that ends the bubble. The prediction is the
  schedule simulated with the EMA of this stage's measured forward/backward times
  (`record_compute`), times a per-slot correction: the median of recent actual / simulated for that
  slot. A stage only measures its own F/B, but its bubbles are the other stages' compute (the
  last stage's LM head and loss make it slower than the rest, for one); the correction learns
  that per slot, while the simulation still follows changes of F/B times at once. Per slot, the
  prediction switches to the median of the slot's recent actual lengths while that has had the
  lower median relative error over the slot's recent bubbles (`prefer_second`): on a shared CPU the
  stage's own F/B jitter, which the simulation follows, says little about the peer's compute that
  the bubble waits for.
- Communication: opened when a collective is launched (DDP bucket all-reduce in comm_hook.py,
  pipeline isend, a pipeline receive the stage has to wait for), closed on completion. Predicted
  from the recent durations of the same (channel, bytes, position) (position: the microbatch
  of a pipeline transfer, so a receive that regularly waits for a slower peer predicts that wait),
  by `min_relative_error_center` (the centre of the tightest half of them, below the median for
  these right-skewed durations);
  a key never seen is predicted from the channel's (one per direction) latency + bytes / bandwidth
  fit, and from `default_bytes_per_ns` before the channel has any sample. DDP bucket all-reduces
  are anchored instead (`comm_open(anchor="dp")`): an all-reduce ends when the slowest replica
  launches the same bucket (measured: the early replica's bucket k ends 0.2-3 ms after the late
  one's launch of k), so its duration is the peer's remaining backward, not bytes / bandwidth. The
  step's first bucket launch is the anchor; bucket k is predicted to end at anchor + the lower
  quartile of its recent (end - anchor) (`usual_end`: the on-time mode of a rotating straggler's
  bimodal history, not a wait between the modes), at least its shortest recent duration (the link
  alone, peer already there).
  Once a bucket of the step has completed, the peer's lag in this step is known (that bucket's end -
  its link time - its launch, `peer_lag_ns`), and the buckets launched after that are predicted as
  max(lag, 0) + their own link time (`lagged_prediction_ns`).
- Imbalance: reactive and open-ended (predicted 0). Waiting is told from communicating by local
  timestamps only, no extra collective: when a rank reaches a sync point (its compute for the step
  is done, or it needs a tensor a peer has not sent), the transfers it still waits for are
  expected to end at `expected_comm_end()` (the latest start + prediction among the outstanding
  windows: bucket all-reduces overlap the backward and each other). A deadline is armed for that
  moment plus `imbalance_min_ns` (imbalance_watch.py: an interval timer on the main thread, which
  wakes no thread unless it passes; a sleeping thread elsewhere); if the rank is still blocked
  then, the rest of the wait is a peer's lateness, and the Imbalance window opens at once.
  `sync_end()` closes it. Communication samples that overlapped an Imbalance window are not fed
  to the duration history (they measured the peer, not the link). Medians rather than means: on
  a shared CPU, sub-millisecond transfers have a heavy tail of scheduling delays that would pull
  a mean (and so the typical window's prediction) far off.

Cost accounting (`InstrumentOptions.cost_path`, env SPECTRAIN_INSTRUMENT_COST_FILE; bench-target's
instrumentation_cost_fraction): the entry points are wrapped on the instance to sum wall and thread
CPU time per step; unset, nothing is wrapped.

Everything here only reads clocks and writes the ring / metrics: it never touches tensors, so
training with instrumentation on and off is bitwise identical. `enabled=False` turns every call
into a cheap no-op (returns None).

Thread safety: windows are opened/closed from the training thread, the gloo completion thread
(comm hook callbacks), the send-completion thread and the imbalance watch; one lock serialises them.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spectrain_workloads.contract import WINDOW_KINDS
from spectrain_workloads.harvest.imbalance_watch import Watch, make_watch
from spectrain_workloads.harvest.window_predictors import (
    LinearFit,
    lagged_prediction_ns,
    min_relative_error_center,
    peer_lag_ns,
    prefer_second,
    usual_end,
)

BUBBLE, COMMUNICATION, IMBALANCE, _ = WINDOW_KINDS
_RING_KIND = {BUBBLE: 1, COMMUNICATION: 2, IMBALANCE: 3}   # spectrain_workloads.ring.WindowKind values


@dataclass(kw_only=True, frozen=True)
class InstrumentOptions:
    enabled: bool = True
    ema_alpha: float = 0.3
    imbalance_min_ns: int = 5_000_000      # slack past the expected end of comm before "waiting"
    default_bytes_per_ns: float = 1.0      # 1 GB/s until a channel has been measured
    default_latency_ns: int = 50_000       # per-message latency until a channel has been measured
    history: int = 8                       # recent samples per bubble slot / transfer key (medians)
    usual_end_quantile: float = 0.25       # DDP bucket end - anchor: the quantile predicted (usual_end)
    # Instrumentation cost accounting (bench-target's instrumentation_cost_fraction): when set, the
    # time spent inside this class's entry points (wall: perf_counter, CPU: thread_time) is summed per
    # step and written to <cost_path>-rank-<r>.json by close(). Unset (the default), nothing is wrapped.
    cost_path: str = field(default_factory=lambda: os.environ.get("SPECTRAIN_INSTRUMENT_COST_FILE", ""))

    def __post_init__(self) -> None:
        if not 0.0 <= self.usual_end_quantile <= 1.0:
            raise ValueError(f"InstrumentOptions.usual_end_quantile must be in [0, 1], got {self.usual_end_quantile}")


def instrumented_step(step: int, interleave: int) -> bool:
    """Whether `step` is instrumented when steps are interleaved in blocks of `interleave` (0: all):
    blocks on, off, off, on, then again, so a load drifting linearly over 4 blocks cancels out."""
    return interleave <= 0 or (step // interleave) % 4 in (0, 3)


@dataclass(slots=True)
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
    learn: bool = True      # feed the predictors on close (Bubble: a usual slot; Communication: no Imbalance overlap)
    pos: int = -1           # Communication: position (pipeline microbatch), part of the history key
    anchor_ns: int = 0      # Communication: the anchor of its group in this step (0: none)
    group: str = ""         # Communication: the anchor group ("dp": the DDP buckets of a step)
    alt: tuple[float, float] = (0.0, 0.0)   # Bubble: (simulated x correction, slot history) predictions


class Instrument:
    """One per rank. `producer`: a RingProducer or None (metrics only); `sink(record)` receives
    every closed window as the dict written to metrics/windows-rank-<r>.jsonl, at `end_step()`.

    Hot path vs learning: a window's open and close run between the step's tensor operations, with
    the caches cold, so they only read a cached prediction, take the clock, write the ring record
    and queue the closed window (cold, each still costs 15-35 us, most of it cache misses and the
    ring write, not the work). `end_step()`, once per step on the
    training thread, learns from the step's closed windows in one warm loop (histories, medians,
    the next predictions) and hands their records to the sink. No prediction loses by that: every
    history key (a bubble slot, a transfer's (channel, bytes, position)) occurs at most once per
    step; the one same-step input, a DDP bucket's lag behind the peer, is still taken at close.
    """

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
        self._closed: list[tuple[Window, int]] = []   # (window, actual ns) closed since end_step()
        # histories (end_step() appends) and the predictions cached from them (the hot path reads)
        self._dur: dict[tuple[str, int, int], deque[float]] = {}   # (channel, bytes, pos) -> recent ns
        self._pred: dict[tuple[str, int, int], int] = {}           # ... -> min_relative_error_center
        self._link: dict[tuple[str, int], float] = {}              # (channel, bytes) -> shortest recent (pos -1)
        self._fit: dict[str, LinearFit] = {}                # channel -> latency + bytes / bandwidth
        self._rel_end: dict[tuple[str, int], deque[float]] = {}   # (channel, bytes) -> recent end - anchor
        self._rel_usual: dict[tuple[str, int], float] = {}        # ... -> their usual_end
        self._slot_ratio: dict[int, deque[float]] = {}      # bubble slot -> recent actual / simulated
        self._slot_actual: dict[int, deque[float]] = {}     # bubble slot -> recent actual
        # bubble slot -> recent relative errors of (simulated x correction, slot history)
        self._slot_err: dict[int, tuple[deque[float], deque[float]]] = {}
        self._slot_pred: dict[int, tuple[float, float, bool]] = {}   # slot -> (correction, history, use history)
        self._anchor: dict[str, tuple[int, int]] = {}        # anchor group -> (step, first launch ns)
        self._lag: dict[str, tuple[int, float]] = {}        # anchor group -> (step, peer lag ns in that step)
        self._outstanding: dict[int, Window] = {}     # open comm windows by local id
        self._imb_epoch = 0
        self._imbalance: Window | None = None
        self._watch: Watch | None = None
        # cost_path set only: step -> (wall ns, this thread's CPU ns) inside the instrumentation calls
        self._cost_ns: dict[int, list[int]] = {}
        self._cost_by_call: dict[str, list[int]] = {}   # entry point -> [calls, wall ns, CPU ns]
        self._cost_calls = 0
        if self.enabled and opts.cost_path:
            self._wrap_for_cost()
        if self.enabled:
            self._watch = make_watch(self._fire_imbalance)

    # -- cost accounting (only with opts.cost_path) ---------------------------------------------
    _COSTED = ("record_compute", "bubble_open", "bubble_close", "comm_open", "comm_close", "sync_begin",
               "sync_end", "_fire_imbalance", "end_step")

    def _wrap_for_cost(self) -> None:
        """Replace the entry points on this instance by timed wrappers (the class stays unwrapped).

        Two sums per step: wall time (perf_counter: includes waiting for this class's lock, the GIL
        or a CPU while inside a call, so it carries the machine's jitter) and the calling thread's
        CPU time (thread_time: only the work itself). Calls come from the training thread, gloo's
        completion thread, the send waiter and the imbalance watch, so the two sums are over all of them."""
        cost_lock = threading.Lock()

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt, dc = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
                    with cost_lock:
                        acc = self._cost_ns.setdefault(self.step, [0, 0])
                        acc[0] += dt
                        acc[1] += dc
                        self._cost_calls += 1
                        by = self._cost_by_call.setdefault(name, [0, 0, 0])
                        by[0] += 1
                        by[1] += dt
                        by[2] += dc
            return wrapper

        for name in self._COSTED:
            setattr(self, name, timed(name, getattr(self, name)))

    def _write_cost(self) -> None:
        if not self.opts.enabled or not self.opts.cost_path:
            return
        path = Path(f"{self.opts.cost_path}-rank-{self.rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        steps = sorted(self._cost_ns.items())
        path.write_text(json.dumps({"rank": self.rank, "stage": self.stage, "calls": self._cost_calls,
                                    "total_wall_ns": sum(v[0] for _, v in steps),
                                    "total_cpu_ns": sum(v[1] for _, v in steps),
                                    "per_step_wall_ns": {str(k): v[0] for k, v in steps},
                                    "per_step_cpu_ns": {str(k): v[1] for k, v in steps},
                                    "by_call": {k: {"calls": v[0], "wall_ns": v[1], "cpu_ns": v[2]}
                                                for k, v in sorted(self._cost_by_call.items())}}))

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

    # -- windows: the hot path --------------------------------------------------------------------
    def _open(self, kind: str, predicted_ns: int, channel: str = "", nbytes: int = 0, *,
              outstanding: bool = False) -> Window:
        with self._lock:
            now = time.monotonic_ns()
            self._next_local += 1
            w = Window(kind, now, max(0, int(predicted_ns)), self.step, channel, nbytes, 0, self._next_local,
                       self._imb_epoch)
            if self.producer is not None:
                w.ring_id = self.producer.window_start(_RING_KIND[kind], stage=self.stage, step=w.step,
                                                       predicted_duration_ns=w.predicted_ns, start_ns=now)
            if outstanding:
                self._outstanding[w.local_id] = w
            return w

    def _close(self, w: Window, end_ns: int | None = None) -> int:
        """Publish the end of `w` and queue it for end_step(); returns its actual ns. Caller holds the lock."""
        end = time.monotonic_ns() if end_ns is None else end_ns
        actual = max(0, end - w.start_ns)
        if self.producer is not None:
            self.producer.window_end(w.ring_id, actual_duration_ns=actual)
        self._closed.append((w, actual))
        return actual

    # -- bubble ---------------------------------------------------------------------------------
    def _bubble_candidates(self, simulated_ns: float, slot: int) -> tuple[float, float, bool]:
        """(simulated x per-slot correction, median of the slot's recent actuals, whether the
        history has had the lower error); 0 where unknown."""
        corr, hist, use_hist = self._slot_pred.get(slot, (1.0, 0.0, False))
        return (simulated_ns * corr if simulated_ns > 0 else 0.0), hist, use_hist

    @staticmethod
    def _choose_bubble(sim: float, hist: float, use_hist: bool) -> int:
        return int(hist if hist > 0 and (sim <= 0 or use_hist) else sim)

    def predict_bubble_ns(self, simulated_ns: float, slot: int) -> int:
        """Prediction of bubble `slot` from its simulated length (0: unknown) and its history: the
        schedule simulation (times the slot's correction) unless the slot's plain history of actual
        lengths has had the lower median relative error over the slot's recent bubbles."""
        return self._choose_bubble(*self._bubble_candidates(simulated_ns, slot))

    def bubble_open(self, predicted_ns: float, slot: int = -1, *, learn: bool = True) -> Window | None:
        """Open scheduled bubble `slot`; `predicted_ns` is the schedule's simulated length (0 until
        the stage has F/B measurements); `learn=False` for a slot whose structure is not the usual
        one (the first step's leading bubble has no trailing part)."""
        if not self.enabled:
            return None
        sim, hist, use_hist = self._bubble_candidates(predicted_ns, slot)
        w = self._open(BUBBLE, self._choose_bubble(sim, hist, use_hist))
        w.slot, w.base_ns, w.learn, w.alt = slot, float(predicted_ns), learn, (sim, hist)
        return w

    def bubble_close(self, w: Window | None) -> None:
        if w is None:
            return
        with self._lock:
            self._close(w)

    def _learn_bubble(self, w: Window, actual: int) -> None:
        n = self.opts.history
        sim, hist = w.alt
        if sim > 0 and hist > 0:
            e_sim, e_hist = self._slot_err.setdefault(w.slot, (deque(maxlen=n), deque(maxlen=n)))
            e_sim.append(abs(sim - actual) / actual)
            e_hist.append(abs(hist - actual) / actual)
        actuals = self._slot_actual.setdefault(w.slot, deque(maxlen=n))
        actuals.append(float(actual))
        ratios = self._slot_ratio.setdefault(w.slot, deque(maxlen=n))
        if w.base_ns > 0:
            ratios.append(min(max(actual / w.base_ns, 0.05), 20.0))
        errs = self._slot_err.get(w.slot)
        self._slot_pred[w.slot] = (statistics.median(ratios) if ratios else 1.0, float(statistics.median(actuals)),
                                   errs is not None and prefer_second(errs[0], errs[1]))

    # -- communication --------------------------------------------------------------------------
    def predict_comm_ns(self, channel: str, nbytes: int, pos: int = -1) -> int:
        p = self._pred.get((channel, nbytes, pos))
        if p is not None:
            return p
        fit = self._fit.get(channel)
        if fit is not None and fit.ready:
            return max(1, int(fit.predict(nbytes)))
        return max(1, int(self.opts.default_latency_ns + nbytes / self.opts.default_bytes_per_ns))

    def _predict_anchored_ns(self, channel: str, nbytes: int, group: str, now: int) -> tuple[int, int]:
        """(anchor ns, prediction or 0) of a transfer whose end is tied to its group's anchor.

        Once a transfer of the group has completed in this step, the peer's lag in this step is
        known (`peer_lag_ns`) and the transfer is predicted as lag (if the peer is behind) + its
        link time; before that, as anchor + the usual (`usual_end`) of its recent end - anchor."""
        a = self._anchor.get(group)
        if a is None or a[0] != self.step:
            a = self._anchor[group] = (self.step, now)
        link = self._link.get((channel, nbytes))
        lag = self._lag.get(group)
        if lag is not None and lag[0] == self.step and link is not None:
            return a[1], lagged_prediction_ns(lag[1], link)
        rel = self._rel_usual.get((channel, nbytes))
        if rel is None:
            return a[1], 0
        return a[1], max(1, int(max(a[1] + rel - now, link if link is not None else 1.0)))

    def comm_open(self, channel: str, nbytes: int, pos: int = -1, *, anchor: str = "") -> Window | None:
        """Open a Communication window. `anchor`: a group of transfers (the DDP buckets of a step)
        that all wait for the same peer event; the group's first launch in a step is its anchor, and
        each transfer is predicted to end at anchor + the usual (`usual_end`) of its recent end - anchor."""
        if not self.enabled:
            return None
        pred, anchor_ns = 0, 0
        if anchor:
            anchor_ns, pred = self._predict_anchored_ns(channel, nbytes, anchor, time.monotonic_ns())
        if pred <= 0:
            pred = self.predict_comm_ns(channel, nbytes, pos)
        w = self._open(COMMUNICATION, pred, channel, nbytes, outstanding=True)
        w.pos, w.anchor_ns, w.group = pos, anchor_ns, anchor
        return w

    def comm_close(self, w: Window | None, end_ns: int | None = None) -> None:
        if w is None:
            return
        with self._lock:
            self._outstanding.pop(w.local_id, None)
            # a wait that overlapped an Imbalance window measured the peer, not the link
            w.learn = w.imb_epoch == self._imb_epoch and self._imbalance is None
            actual = self._close(w, end_ns)
        if w.anchor_ns and actual > 0:
            link = self._link.get((w.channel, w.nbytes))
            a = self._anchor.get(w.group)
            if link is not None and a is not None and a[0] == w.step:
                self._lag[w.group] = (w.step, peer_lag_ns(w.start_ns, w.start_ns + actual, link))

    def _learn_comm(self, w: Window, actual: int, touched: set[tuple[str, int, int]],
                    touched_rel: set[tuple[str, int]]) -> None:
        if w.anchor_ns:
            # The end relative to the anchor models the peer (when it launched the same bucket), so it
            # is learned whether or not the wait was long enough to count as imbalance.
            self._rel_end.setdefault((w.channel, w.nbytes), deque(maxlen=self.opts.history)).append(
                float(w.start_ns + actual - w.anchor_ns))
            touched_rel.add((w.channel, w.nbytes))
        if not w.learn:
            return
        key = (w.channel, w.nbytes, w.pos)
        self._dur.setdefault(key, deque(maxlen=self.opts.history)).append(float(actual))
        self._fit.setdefault(w.channel, LinearFit()).add(w.nbytes, float(actual))
        touched.add(key)

    def expected_comm_end(self, now: int | None = None) -> int:
        """When the outstanding transfers are expected to be done: the latest start + prediction.

        Transfers launched during the backward overlap it and each other, so the latest end (not
        their sum) is the model; a peer that has not caught up shows as a wait past it.
        """
        now = time.monotonic_ns() if now is None else now
        with self._lock:
            ends = [w.start_ns + w.predicted_ns for w in self._outstanding.values()]
        return max([now, *ends])

    # -- once per step: learning and records ----------------------------------------------------
    def end_step(self) -> None:
        """Learn from the windows closed since the last call and hand their records to the sink
        (the training thread, between steps; close() calls it too)."""
        with self._lock:
            closed, self._closed = self._closed, []
        touched: set[tuple[str, int, int]] = set()
        touched_rel: set[tuple[str, int]] = set()
        for w, actual in closed:
            if actual <= 0:
                continue
            if w.kind == COMMUNICATION:
                self._learn_comm(w, actual, touched, touched_rel)
            elif w.kind == BUBBLE and w.learn and w.slot >= 0:
                self._learn_bubble(w, actual)
        for key in touched:
            d = self._dur[key]
            self._pred[key] = max(1, int(min_relative_error_center(d)))
            if key[2] == -1:
                self._link[key[:2]] = min(d)
        for k in touched_rel:
            self._rel_usual[k] = usual_end(self._rel_end[k], self.opts.usual_end_quantile)
        if self.sink is not None:
            for w, actual in closed:
                self.sink(self._record(w, actual))

    def _record(self, w: Window, actual: int) -> dict[str, Any]:
        rec = {"window_id": w.ring_id or w.local_id, "kind": w.kind, "stage": self.stage, "step": w.step,
               "start_ns": w.start_ns, "predicted_ns": w.predicted_ns, "actual_ns": actual}
        if w.channel:
            rec["channel"], rec["bytes"] = w.channel, w.nbytes
        if w.slot >= 0:
            rec["slot"], rec["simulated_ns"] = w.slot, int(w.base_ns)
        if w.pos >= 0:
            rec["pos"] = w.pos
        return rec

    # -- sync points / imbalance ----------------------------------------------------------------
    def sync_begin(self, extra_pred_ns: int = 0) -> None:
        """The rank has reached a sync point and is about to block on outstanding transfers."""
        if self._watch is None or not self.enabled:
            return
        self._watch.arm(self.expected_comm_end() + extra_pred_ns + self.opts.imbalance_min_ns)

    def sync_end(self) -> None:
        """The wait is over: close the Imbalance window if the watch opened one."""
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
        self.end_step()
        self._write_cost()
