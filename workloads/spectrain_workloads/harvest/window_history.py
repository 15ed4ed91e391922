"""What the Instrument learns from closed idle windows, and the predictions it caches from that.

`Window` is one open or closed window with what its prediction was made from; `record()` is its
line in metrics/windows-rank-<r>.jsonl. Instrument.end_step() (instrument.py) feeds the step's
closed windows to the two histories here once per step, and the hot path (a window's open) only
reads the predictions they cache. The predictors themselves are the pure functions of
window_predictors.py.

- Bubble (`BubbleHistory`, per schedule slot): the prediction is the schedule simulated with the
  EMA of the stage's measured forward/backward times (the Instrument's `record_compute`), times a
  per-slot correction: the median of recent actual / simulated for that slot. A stage only
  measures its own F/B, but its bubbles are the other stages' compute (the last stage's LM head
  and loss make it slower than the rest, for one); the correction learns that per slot, while the
  simulation still follows changes of F/B times at once. Per slot, the prediction switches to the
  median of the slot's recent actual lengths while that has had the lower median relative error
  over the slot's recent bubbles (`prefer_second`): on a shared CPU the stage's own F/B jitter,
  which the simulation follows, says little about the peer's compute that the bubble waits for.
- Communication (`CommHistory`): predicted from the recent durations of the same (channel, bytes,
  position) (position: the microbatch of a pipeline transfer, so a receive that regularly waits
  for a slower peer predicts that wait), by `min_relative_error_center` (the centre of the
  tightest half of them, below the median for these right-skewed durations); a key never seen is
  predicted from the channel's (one per direction) latency + bytes / bandwidth fit, and from
  `default_bytes_per_ns` before the channel has any sample. DDP bucket all-reduces are anchored
  instead (`comm_open(anchor="dp")`): an all-reduce ends when the slowest replica launches the
  same bucket (measured: the early replica's bucket k ends 0.2-3 ms after the late one's launch of
  k), so its duration is the peer's remaining backward, not bytes / bandwidth. The step's first
  bucket launch is the anchor; bucket k is predicted to end at anchor + the lower quartile of its
  recent (end - anchor) (`usual_end`: the on-time mode of a rotating straggler's bimodal history,
  not a wait between the modes), at least its shortest recent duration (the link alone, peer
  already there). Once a bucket of the step has completed, the peer's lag in this step is known
  (that bucket's end - its link time - its launch, `peer_lag_ns`), and the buckets launched after
  that are predicted as max(lag, 0) + their own link time (`lagged_prediction_ns`).

Medians rather than means: on a shared CPU, sub-millisecond transfers have a heavy tail of
scheduling delays that would pull a mean (and so the typical window's prediction) far off.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from spectrain_api.names import WINDOW_KINDS
from spectrain_workloads.harvest.window_predictors import (
    LinearFit,
    lagged_prediction_ns,
    min_relative_error_center,
    peer_lag_ns,
    prefer_second,
    usual_end,
)

BUBBLE, COMMUNICATION, _, _ = WINDOW_KINDS


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

    def record(self, stage: int, actual: int) -> dict[str, Any]:
        """The closed window's line in metrics/windows-rank-<r>.jsonl."""
        rec = {"window_id": self.ring_id or self.local_id, "kind": self.kind, "stage": stage, "step": self.step,
               "start_ns": self.start_ns, "predicted_ns": self.predicted_ns, "actual_ns": actual}
        if self.channel:
            rec["channel"], rec["bytes"] = self.channel, self.nbytes
        if self.slot >= 0:
            rec["slot"], rec["simulated_ns"] = self.slot, int(self.base_ns)
        if self.pos >= 0:
            rec["pos"] = self.pos
        return rec


class BubbleHistory:
    """Per bubble slot: recent actual / simulated ratios, recent actuals and both predictors'
    recent relative errors (`history` of each), and the cached (correction, median actual,
    use the history) the next bubble of the slot is predicted from."""

    def __init__(self, history: int) -> None:
        self._n = history
        self._slot_ratio: dict[int, deque[float]] = {}      # bubble slot -> recent actual / simulated
        self._slot_actual: dict[int, deque[float]] = {}     # bubble slot -> recent actual
        # bubble slot -> recent relative errors of (simulated x correction, slot history)
        self._slot_err: dict[int, tuple[deque[float], deque[float]]] = {}
        self._slot_pred: dict[int, tuple[float, float, bool]] = {}   # slot -> (correction, history, use history)

    def candidates(self, simulated_ns: float, slot: int) -> tuple[float, float, bool]:
        """(simulated x per-slot correction, median of the slot's recent actuals, whether the
        history has had the lower error); 0 where unknown."""
        corr, hist, use_hist = self._slot_pred.get(slot, (1.0, 0.0, False))
        return (simulated_ns * corr if simulated_ns > 0 else 0.0), hist, use_hist

    @staticmethod
    def choose(sim: float, hist: float, use_hist: bool) -> int:
        return int(hist if hist > 0 and (sim <= 0 or use_hist) else sim)

    def predict_ns(self, simulated_ns: float, slot: int) -> int:
        """Prediction of bubble `slot` from its simulated length (0: unknown) and its history: the
        schedule simulation (times the slot's correction) unless the slot's plain history of actual
        lengths has had the lower median relative error over the slot's recent bubbles."""
        return self.choose(*self.candidates(simulated_ns, slot))

    def learn(self, closed: list[tuple[Window, int]]) -> None:
        """Learn from a step's closed windows (window, actual ns): its usual bubbles of known slot."""
        for w, actual in closed:
            if actual > 0 and w.kind == BUBBLE and w.learn and w.slot >= 0:
                self._learn(w, actual)

    def _learn(self, w: Window, actual: int) -> None:
        n = self._n
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


class CommHistory:
    """Per transfer: recent durations by (channel, bytes, position), a latency + bandwidth fit per
    channel, and for anchored groups the recent end - anchor per (channel, bytes), each group's
    anchor and the peer's lag in the current step; plus the predictions cached from them."""

    def __init__(self, *, history: int, default_latency_ns: int, default_bytes_per_ns: float,
                 usual_end_quantile: float) -> None:
        self._n = history
        self._default_latency_ns = default_latency_ns
        self._default_bytes_per_ns = default_bytes_per_ns
        self._usual_end_quantile = usual_end_quantile
        # histories (learn() appends) and the predictions cached from them (the hot path reads)
        self._dur: dict[tuple[str, int, int], deque[float]] = {}   # (channel, bytes, pos) -> recent ns
        self._pred: dict[tuple[str, int, int], int] = {}           # ... -> min_relative_error_center
        self._link: dict[tuple[str, int], float] = {}              # (channel, bytes) -> shortest recent (pos -1)
        self._fit: dict[str, LinearFit] = {}                # channel -> latency + bytes / bandwidth
        self._rel_end: dict[tuple[str, int], deque[float]] = {}   # (channel, bytes) -> recent end - anchor
        self._rel_usual: dict[tuple[str, int], float] = {}        # ... -> their usual_end
        self._anchor: dict[str, tuple[int, int]] = {}        # anchor group -> (step, first launch ns)
        self._lag: dict[str, tuple[int, float]] = {}        # anchor group -> (step, peer lag ns in that step)

    def predict_ns(self, channel: str, nbytes: int, pos: int = -1) -> int:
        p = self._pred.get((channel, nbytes, pos))
        if p is not None:
            return p
        fit = self._fit.get(channel)
        if fit is not None and fit.ready:
            return max(1, int(fit.predict(nbytes)))
        return max(1, int(self._default_latency_ns + nbytes / self._default_bytes_per_ns))

    def predict_anchored_ns(self, channel: str, nbytes: int, group: str, step: int, now: int) -> tuple[int, int]:
        """(anchor ns, prediction or 0) of a transfer launched at `now` in `step` whose end is tied
        to its group's anchor (the group's first launch in the step).

        Once a transfer of the group has completed in this step, the peer's lag in this step is
        known (`peer_lag_ns`) and the transfer is predicted as lag (if the peer is behind) + its
        link time; before that, as anchor + the usual (`usual_end`) of its recent end - anchor."""
        a = self._anchor.get(group)
        if a is None or a[0] != step:
            a = self._anchor[group] = (step, now)
        link = self._link.get((channel, nbytes))
        lag = self._lag.get(group)
        if lag is not None and lag[0] == step and link is not None:
            return a[1], lagged_prediction_ns(lag[1], link)
        rel = self._rel_usual.get((channel, nbytes))
        if rel is None:
            return a[1], 0
        return a[1], max(1, int(max(a[1] + rel - now, link if link is not None else 1.0)))

    def note_lag(self, w: Window, actual: int) -> None:
        """At the close of anchored transfer `w`: the peer's lag in its step, for the group's next launches."""
        link = self._link.get((w.channel, w.nbytes))
        a = self._anchor.get(w.group)
        if link is not None and a is not None and a[0] == w.step:
            self._lag[w.group] = (w.step, peer_lag_ns(w.start_ns, w.start_ns + actual, link))

    def learn(self, closed: list[tuple[Window, int]]) -> None:
        """Learn from a step's closed windows (window, actual ns), then refresh the predictions of
        the keys they touched."""
        touched: set[tuple[str, int, int]] = set()
        touched_rel: set[tuple[str, int]] = set()
        for w, actual in closed:
            if actual > 0 and w.kind == COMMUNICATION:
                self._learn(w, actual, touched, touched_rel)
        for key in touched:
            d = self._dur[key]
            self._pred[key] = max(1, int(min_relative_error_center(d)))
            if key[2] == -1:
                self._link[key[:2]] = min(d)
        for k in touched_rel:
            self._rel_usual[k] = usual_end(self._rel_end[k], self._usual_end_quantile)

    def _learn(self, w: Window, actual: int, touched: set[tuple[str, int, int]],
               touched_rel: set[tuple[str, int]]) -> None:
        if w.anchor_ns:
            # The end relative to the anchor models the peer (when it launched the same bucket), so it
            # is learned whether or not the wait was long enough to count as imbalance.
            self._rel_end.setdefault((w.channel, w.nbytes), deque(maxlen=self._n)).append(
                float(w.start_ns + actual - w.anchor_ns))
            touched_rel.add((w.channel, w.nbytes))
        if not w.learn:
            return
        key = (w.channel, w.nbytes, w.pos)
        self._dur.setdefault(key, deque(maxlen=self._n)).append(float(actual))
        self._fit.setdefault(w.channel, LinearFit()).add(w.nbytes, float(actual))
        touched.add(key)
