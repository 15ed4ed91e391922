"""When the drafter may work: its own unit of work, the target's open windows, and the gate.

- CostModel: online durations (ns) of the drafter's tasks, measured around the task including
  launch and device synchronisation; the unit of work is one training micro-step of one sample.
- WindowTracker: the open windows seen on the ring and, per kind, the observed durations of
  closed ones (for open-ended windows) and actual/predicted ratios (to temper optimistic predictions).
- Gate: activation.policy / kinds / minWindowMs / safetyMarginMs. Work starts in a window only if
  its predicted remaining time >= unit + margin, and each further task only if remaining >= its
  cost + margin; the worker checks for the window's end before every task, so it overruns by
  at most one task.

No torch here: everything is integers in CLOCK_MONOTONIC nanoseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from spectrain_api.names import ALWAYS, OFF

MS = 1_000_000
MAX_SITES = 64         # call sites told apart per kind and step (the rest share the last one)


def quantile(xs: Iterable[float], q: float) -> float:
    """Lower-interpolated quantile of a non-empty iterable (q in [0, 1])."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(q * (len(s) - 1) + 1e-9)))]


class CostModel:
    """Robust recent cost (ns) per task key: the `q` quantile of the last `window` measurements.

    A high quantile bounds overruns when costs are noisy; a quantile rather than the max keeps one
    preempted measurement on a loaded machine from
    shutting the drafter out of every window until it is forgotten.
    """

    def __init__(self, *, window: int = 16, q: float = 0.9) -> None:
        self.window, self.q = window, q
        self._samples: dict[Hashable, deque[int]] = {}
        self._estimates: dict[Hashable, int] = {}     # per key, until its next measurement

    def observe(self, key: Hashable, ns: int) -> None:
        self._samples.setdefault(key, deque(maxlen=self.window)).append(int(ns))
        self._estimates.pop(key, None)

    def forget(self) -> None:
        """Drop every measurement (costs are measured again, e.g. after a busy spell inflated them)."""
        self._samples, self._estimates = {}, {}

    def estimate(self, key: Hashable) -> int | None:
        e = self._estimates.get(key)
        if e is None:
            s = self._samples.get(key)
            if not s:
                return None
            e = self._estimates[key] = int(quantile(s, self.q))
        return e

    def estimate_sized(self, name: str, size: int) -> int | None:
        """The estimate of task (name, size), never above that of a larger measured size of the same
        task: a size that runs rarely (the smallest, which fills windows' tails) keeps the estimate
        of a busy moment until it runs again, and a stale high one would keep it out of the tails
        it is for. None when (name, size) itself was never measured."""
        own = self.estimate((name, size))
        if own is None:
            return None
        larger = [e for k in self._samples
                  if isinstance(k, tuple) and k[0] == name and k[1] > size and (e := self.estimate(k)) is not None]
        return min([own, *larger])

    def keys(self) -> list[Hashable]:
        return list(self._samples)

    def state_dict(self) -> dict[str, Any]:
        return {"samples": [[list(k) if isinstance(k, tuple) else k, list(v)] for k, v in self._samples.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._samples, self._estimates = {}, {}
        for key, values in state.get("samples", []):
            k = tuple(key) if isinstance(key, list) else key
            self._samples[k] = deque((int(v) for v in values), maxlen=self.window)


@dataclass
class OpenWindow:
    window_id: int
    kind: str                 # API name: Bubble | Communication | Imbalance | RolloutTail
    stage: int
    step: int
    start_ns: int
    predicted_ns: int         # 0: open-ended
    site: int = -1            # its ordinal among its step's windows of its kind (-1: unknown)


@dataclass
class ClosedWindow:
    window_id: int
    kind: str
    stage: int
    step: int
    start_ns: int
    predicted_ns: int
    actual_ns: int

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.actual_ns


class WindowTracker:
    """Open windows and per-kind history, fed with the ring's window events."""

    def __init__(self, *, history: int = 256, stale_factor: float = 4.0, stale_open_ended_ns: int = 60_000 * MS):
        self.open: dict[int, OpenWindow] = {}
        self.durations: dict[str, deque[int]] = {}
        self.ratios: dict[str, deque[float]] = {}
        # actual / predicted per call site, (kind, ordinal within the step): the sites of one kind
        # can differ (a pipeline stage's long first bubble is predicted well, its short second one
        # poorly), and the kind's pooled quantile would cut the good site's promise to the bad one's
        self.site_ratios: dict[tuple[str, int], deque[float]] = {}
        self._next_site: dict[str, tuple[int, int]] = {}     # kind -> (step, next ordinal)
        self._history = history
        self._stale_factor = stale_factor
        self._stale_open_ended_ns = stale_open_ended_ns

    def update(self, events: Iterable[Any]) -> list[ClosedWindow]:
        """Apply ring WindowEvents (start and end records); return the windows they closed."""
        closed: list[ClosedWindow] = []
        for ev in events:
            kind = ev.kind.api_name
            if not ev.is_end:
                step, n = self._next_site.get(kind, (ev.step, 0))
                n = n if step == ev.step else 0
                self._next_site[kind] = (ev.step, n + 1)
                self.open[ev.window_id] = OpenWindow(ev.window_id, kind, ev.stage, ev.step, ev.start_ns,
                                                     ev.predicted_duration_ns, min(n, MAX_SITES - 1))
                continue
            ow = self.open.pop(ev.window_id, None)
            cw = ClosedWindow(ev.window_id, kind, ev.stage, ev.step, ev.start_ns, ev.predicted_duration_ns,
                              ev.actual_duration_ns)
            self.durations.setdefault(kind, deque(maxlen=self._history)).append(cw.actual_ns)
            if cw.predicted_ns > 0:
                ratio = cw.actual_ns / cw.predicted_ns
                self.ratios.setdefault(kind, deque(maxlen=self._history)).append(ratio)
                if ow is not None:
                    self.site_ratios.setdefault((kind, ow.site), deque(maxlen=self._history)).append(ratio)
            closed.append(cw)
        return closed

    def expire(self, now_ns: int) -> list[OpenWindow]:
        """Forget windows whose end record was lost (ring overrun, restarted producer)."""
        gone = []
        for wid, w in list(self.open.items()):
            limit = (self._stale_factor * w.predicted_ns + 100 * MS) if w.predicted_ns else self._stale_open_ended_ns
            if now_ns - w.start_ns > limit:
                gone.append(self.open.pop(wid))
        return gone

    def clear_open(self) -> None:
        self.open.clear()

    def predicted_end_ns(self, w: OpenWindow, now_ns: int, *, confidence: float = 0.8,
                         min_history: int = 5) -> int | None:
        """A conservative end time for an open window, or None when nothing can be said.

        Known duration: start + predicted, shortened when this call site's windows (this kind's,
        until the site has `min_history`) have tended to end early (the (1-confidence) quantile of
        actual/predicted, if below 1). Open-ended: of the
        past windows of this kind that outlived the current elapsed time, the duration that a
        `confidence` fraction of them reached. A window with a known duration that is still open
        past that end is treated as open-ended from then on (it outlived its prediction: how long
        windows of its kind that lasted as long went on is the better guess).
        """
        if w.predicted_ns > 0:
            ratios = self.site_ratios.get((w.kind, w.site))
            if ratios is None or len(ratios) < min_history:
                ratios = self.ratios.get(w.kind)
            scale = 1.0
            if ratios and len(ratios) >= min_history:
                scale = min(1.0, quantile(ratios, 1.0 - confidence))
            end = w.start_ns + int(w.predicted_ns * scale)
            if end > now_ns:
                return end
        elapsed = now_ns - w.start_ns
        survivors = [d for d in self.durations.get(w.kind, ()) if d > elapsed]
        if len(survivors) < min_history:
            return None
        return w.start_ns + int(quantile(survivors, 1.0 - confidence))

    def state_dict(self) -> dict[str, Any]:
        return {"durations": {k: list(v) for k, v in self.durations.items()},
                "ratios": {k: list(v) for k, v in self.ratios.items()},
                "siteRatios": [[k, n, list(v)] for (k, n), v in self.site_ratios.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.durations = {k: deque(v, maxlen=self._history) for k, v in state.get("durations", {}).items()}
        self.ratios = {k: deque(v, maxlen=self._history) for k, v in state.get("ratios", {}).items()}
        self.site_ratios = {(k, int(n)): deque(v, maxlen=self._history) for k, n, v in state.get("siteRatios", [])}


@dataclass
class Budget:
    """What the gate allows right now."""

    window: OpenWindow | None      # the window worked in (None under policy Always)
    remaining_ns: int              # predicted time left minus the safety margin (may be < 0)
    reason: str                    # why not, when remaining_ns says no


UNLIMITED_NS = 1 << 62
UNIT_KEY: tuple[str, int] = ("train", 1)   # one training micro-step of one sample: the unit of work


class Gate:
    """`confidence`: how sure the gate must be that a window is still open when a task ends (the
    quantile WindowTracker.predicted_end_ns promises); lower harvests more of each window's tail and
    overruns more often (scripts/gate_replay.py replays a run's windows to weigh the two)."""

    def __init__(self, *, policy: str, kinds: Iterable[str], safety_margin_ms: float, min_window_ms: float,
                 cost: CostModel, tracker: WindowTracker, confidence: float = 0.8) -> None:
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"gate confidence must be in (0, 1), got {confidence}")
        self.policy = policy
        self.confidence = confidence
        self.kinds = frozenset(kinds)
        self.margin_ns = int(safety_margin_ms * MS)
        self.min_window_ns = int(min_window_ms * MS)
        self.cost = cost
        self.tracker = tracker

    def unit_ns(self) -> int | None:
        """The minimum unit of work: minWindowMs when set, else the measured one-sample micro-step,
        or a larger micro-step's estimate where that is lower (the one-sample size runs rarely once
        larger ones pay off, so its estimate can be stale from a busy moment)."""
        if self.min_window_ns > 0:
            return self.min_window_ns
        name, size = UNIT_KEY
        return self.cost.estimate_sized(name, size)

    def budget(self, now_ns: int) -> Budget:
        """The best usable open window and its predicted remaining time minus the margin."""
        if self.policy == OFF:
            return Budget(None, -1, "policy Off")
        if self.policy == ALWAYS:
            return Budget(None, UNLIMITED_NS, "")
        best: Budget = Budget(None, -1, "no open window")
        for w in self.tracker.open.values():
            if w.kind not in self.kinds:
                if best.window is None:
                    best = Budget(None, -1, f"kind {w.kind} not in activation.kinds")
                continue
            end = self.tracker.predicted_end_ns(w, now_ns, confidence=self.confidence)
            if end is None:
                if best.window is None:
                    best = Budget(None, -1, f"open-ended {w.kind} window without enough history")
                continue
            remaining = end - now_ns - self.margin_ns
            if best.window is None or remaining > best.remaining_ns:
                best = Budget(w, remaining, "")
        return best

    def allows(self, budget: Budget, cost_ns: int | None, *, starting: bool) -> bool:
        """May a task of `cost_ns` (None: not yet measured) run within `budget`?

        Starting work in a window additionally needs room for one unit of work (the rule that
        keeps the drafter out of windows shorter than what it can do).
        """
        if self.policy == ALWAYS:
            return True
        if self.policy == OFF or budget.remaining_ns < 0:
            return False
        need = cost_ns or 0
        if starting:
            unit = self.unit_ns()
            if unit is None:
                return False  # never measured (the worker measures before the first window)
            need = max(need, unit)
        return budget.remaining_ns >= need


Task = tuple[str, Hashable, int | None, int]   # (name, cost key, predicted ns or None: unmeasured, micro-batch)


def pick_task(gate: Gate, budget: Budget, *, starting: bool, optim: Task | None, optim_due: bool,
              verify: Task | None, train: Task | None) -> Task | None:
    """The first task, in this order, that the gate allows in `budget`, or None.

    - the optimizer step, when due (`optim`: given whenever gradients are accumulated);
    - the verification chunk (given when one is due or in progress);
    - the training micro-step (the largest the budget fits);
    - the optimizer step again, when not yet due: with nothing else fitting, the gradients
      accumulated so far are applied early. The optimizer step is the drafter's cheapest task, so
      it uses a window's tail that would otherwise be lost, and the next window starts with
      training instead of with the step.
    A task that does not fit does not block the ones after it. Any task starts a window only with
    room for a unit of work (Gate.allows): what is done in windows shorter than that stays out of the
    windows the report counts as too short.
    """
    for task in (optim if optim_due else None, verify, train, None if optim_due else optim):
        if task is not None and gate.allows(budget, task[2], starting=starting):
            return task
    return None
