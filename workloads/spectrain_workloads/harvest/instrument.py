"""Idle-window publishing for the target: Bubble, Communication and Imbalance windows.

- Bubble: pre-scheduled. The pipeline executor (target/pipeline.py, or hooks/pipelining.py around
  torch's schedules) opens a BUBBLE slot of the schedule (schedule.py) right after the previous
  action ends, before it blocks on the receive that ends the bubble. Predicted from the schedule
  simulated with the EMA of this stage's measured forward/backward times (`record_compute`) and
  from the slot's recent bubbles (window_history.py).
- Communication: opened when a collective is launched (DDP bucket all-reduce in comm_hook.py,
  pipeline isend, a pipeline receive the stage has to wait for), closed on completion. Predicted
  from the recent durations of the same transfer, or, for the DDP bucket all-reduces
  (`comm_open(anchor="dp")`), from the step's first bucket launch (window_history.py).
- Imbalance: reactive and open-ended (predicted 0). Waiting is told from communicating by local
  timestamps only, no extra collective: when a rank reaches a sync point (its compute for the step
  is done, or it needs a tensor a peer has not sent), the transfers it still waits for are
  expected to end at `expected_comm_end()` (the latest start + prediction among the outstanding
  windows: bucket all-reduces overlap the backward and each other). A deadline is armed for that
  moment plus `imbalance_min_ns` (imbalance_watch.py: an interval timer on the main thread, which
  wakes no thread unless it passes; a sleeping thread elsewhere); if the rank is still blocked
  then, the rest of the wait is a peer's lateness, and the Imbalance window opens at once.
  `sync_end()` closes it. Communication samples that overlapped an Imbalance window are not fed
  to the duration history (they measured the peer, not the link).

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spectrain_api.names import WINDOW_KINDS
from spectrain_workloads.harvest.imbalance_watch import Watch, make_watch
from spectrain_workloads.harvest.window_history import BubbleHistory, CommHistory, Window

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
        # what end_step() learns from the closed windows, and the predictions the hot path reads
        self._bubbles = BubbleHistory(opts.history)
        self._comms = CommHistory(history=opts.history, default_latency_ns=opts.default_latency_ns,
                                  default_bytes_per_ns=opts.default_bytes_per_ns,
                                  usual_end_quantile=opts.usual_end_quantile)
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
    def predict_bubble_ns(self, simulated_ns: float, slot: int) -> int:
        """Prediction of bubble `slot` from its simulated length (0: unknown) and its history
        (window_history.py's BubbleHistory)."""
        return self._bubbles.predict_ns(simulated_ns, slot)

    def bubble_open(self, predicted_ns: float, slot: int = -1, *, learn: bool = True) -> Window | None:
        """Open scheduled bubble `slot`; `predicted_ns` is the schedule's simulated length (0 until
        the stage has F/B measurements); `learn=False` for a slot whose structure is not the usual
        one (the first step's leading bubble has no trailing part)."""
        if not self.enabled:
            return None
        sim, hist, use_hist = self._bubbles.candidates(predicted_ns, slot)
        w = self._open(BUBBLE, self._bubbles.choose(sim, hist, use_hist))
        w.slot, w.base_ns, w.learn, w.alt = slot, float(predicted_ns), learn, (sim, hist)
        return w

    def bubble_close(self, w: Window | None) -> None:
        if w is None:
            return
        with self._lock:
            self._close(w)

    # -- communication --------------------------------------------------------------------------
    def predict_comm_ns(self, channel: str, nbytes: int, pos: int = -1) -> int:
        return self._comms.predict_ns(channel, nbytes, pos)

    def comm_open(self, channel: str, nbytes: int, pos: int = -1, *, anchor: str = "") -> Window | None:
        """Open a Communication window. `anchor`: a group of transfers (the DDP buckets of a step)
        that all wait for the same peer event; the group's first launch in a step is its anchor, and
        each transfer is predicted to end at anchor + the usual (`usual_end`) of its recent end - anchor."""
        if not self.enabled:
            return None
        pred, anchor_ns = 0, 0
        if anchor:
            anchor_ns, pred = self._comms.predict_anchored_ns(channel, nbytes, anchor, self.step,
                                                              time.monotonic_ns())
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
            self._comms.note_lag(w, actual)

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
        self._bubbles.learn(closed)
        self._comms.learn(closed)
        if self.sink is not None:
            for w, actual in closed:
                self.sink(w.record(self.stage, actual))

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
