"""Pure predictors of the target's idle windows (window_history.py drives them; no clocks, no state
beyond their arguments), so that each is readable and testable on its own.

- `min_relative_error_center`: the location a median-relative-error metric rewards for a skewed
  sample of recent durations (transfers);
- `prefer_second`: which of two predictors' recent errors is lower (per bubble slot);
- `peer_lag_ns` / `lagged_prediction_ns`: a DDP bucket's end from the peer replica's lag in this step;
- `usual_end`: a DDP bucket's end relative to its step's anchor, from its recent history;
- `LinearFit`: latency + bytes / bandwidth of a channel, exponentially weighted.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def min_relative_error_center(xs: Iterable[float]) -> float:
    """A location that keeps the median relative error |p - x| / x over the samples small: the
    shortest (in relative terms) run of half the sorted samples, [a, b], and p = 2ab / (a + b), the
    point equally far from both ends relative to them ((p - a) / a = (b - p) / b). For the skewed
    (long right tail) durations measured here it is the centre of the densest cluster of short
    samples, typically below the median: what a median-relative-error metric rewards, and what a
    mean or a median pulled up by the tail does not give. O(n log n); n is a short history."""
    v = sorted(x for x in xs if x > 0)
    n = len(v)
    if n == 0:
        return 0.0
    k = (n + 1) // 2                  # samples the run must hold
    best_i, best_w = 0, float("inf")
    for i in range(n - k + 1):
        a, b = v[i], v[i + k - 1]
        w = (b - a) / (a + b)         # the relative error at both ends when p = 2ab / (a + b)
        if w < best_w:
            best_i, best_w = i, w
    a, b = v[best_i], v[best_i + k - 1]
    return 2 * a * b / (a + b)


def prefer_second(errs_a: Iterable[float], errs_b: Iterable[float]) -> bool:
    """Whether predictor b's recent relative errors have a lower median than a's (ties: keep a)."""
    a, b = list(errs_a), list(errs_b)
    return bool(a) and bool(b) and statistics.median(b) < statistics.median(a)


def usual_end(xs: Iterable[float], quantile: float) -> float:
    """The end (relative to the step's anchor) that a 1 - `quantile` share of recent steps reached
    or passed: the lower `quantile` of the samples, by nearest rank (a sample that happened, not an
    interpolation).

    Not the median: a straggler that rotates over the replicas makes the history bimodal (on time,
    or a peer's whole extra backward late), and the median of that lies between the modes, a wait
    most steps do not have, so a drafter planning on it overruns the on-time steps. A low quantile
    predicts the on-time mode; the late steps then show as Imbalance, which a drafter treats as
    unplanned. A peer that is late in more than a 1 - `quantile` share of the steps moves it up to
    its lateness."""
    v = sorted(xs)
    if not v:
        return 0.0
    return v[int(quantile * (len(v) - 1))]


def peer_lag_ns(launch_ns: int, end_ns: int, link_ns: float) -> float:
    """How far the peer replica is behind this one in the current step, from a completed all-reduce:
    it ended `link_ns` (the link alone: the shortest recent duration) after the later of the two
    launches, so the peer launched at end - link; negative: the peer was there first."""
    return end_ns - link_ns - launch_ns


def lagged_prediction_ns(lag_ns: float, link_ns: float) -> int:
    """A bucket launched now ends when the peer launches it too (now + lag, if behind) + the link."""
    return max(1, int(max(lag_ns, 0.0) + link_ns))


class LinearFit:
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
