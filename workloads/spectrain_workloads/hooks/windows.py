"""Windows the user marks by hand (`with pub.idle(kind, expected_s)`): any of the four kinds.

A window is published on open with its prediction (the ring's start record: the drafter decides
from it whether its unit of work fits) and on close with its length. The prediction is
`expected_s` when the caller gives it; otherwise it is learned per call site, keyed by
(kind, name, ordinal of that (kind, name) within the step), from the site's recent lengths with
`min_relative_error_center` (the predictor the built-in trainer uses for transfers: the centre of
the tightest half of a short, right-skewed history). A site never seen predicts 0 (unknown: the
drafter does not start in it).

Like the Instrument, the hot path only takes the clock, reads a cached prediction and writes the
ring; learning and the metrics records wait for `end_step()` (once per step, training thread).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spectrain_workloads.harvest.window_predictors import min_relative_error_center
from spectrain_workloads.ring import WindowKind

# metrics window_id of a window with no ring record: far above the ring's ids and the Instrument's
_LOCAL_ID_BASE = 1 << 40


@dataclass(slots=True)
class ManualWindow:
    kind: str
    key: tuple[str, str, int]
    start_ns: int
    predicted_ns: int
    step: int
    window_id: int


class ManualWindows:
    def __init__(self, *, stage: int, producer: Any, lock: threading.Lock,
                 sink: Callable[[dict[str, Any]], None] | None, history: int = 8) -> None:
        self.stage, self.producer, self._lock, self.sink = stage, producer, lock, sink
        self.step = 0
        self._history = history
        self._ordinal: dict[tuple[str, str], int] = {}       # (kind, name) -> windows opened this step
        self._recent: dict[tuple[str, str, int], deque[float]] = {}
        self._pred: dict[tuple[str, str, int], int] = {}
        self._closed: list[tuple[ManualWindow, int]] = []
        self._next_local = 0

    def open(self, kind: str, name: str, expected_ns: int | None) -> ManualWindow:
        site = (kind, name)
        k = self._ordinal.get(site, 0)
        self._ordinal[site] = k + 1
        key = (kind, name, k)
        pred = self._pred.get(key, 0) if expected_ns is None else max(0, int(expected_ns))
        with self._lock:
            now = time.monotonic_ns()
            if self.producer is not None:
                wid = self.producer.window_start(WindowKind.from_api_name(kind), stage=self.stage, step=self.step,
                                                 predicted_duration_ns=pred, start_ns=now)
            else:
                self._next_local += 1
                wid = _LOCAL_ID_BASE + self._next_local
        return ManualWindow(kind, key, now, pred, self.step, wid)

    def close(self, w: ManualWindow) -> None:
        with self._lock:
            actual = max(0, time.monotonic_ns() - w.start_ns)
            if self.producer is not None:
                self.producer.window_end(w.window_id, actual_duration_ns=actual)
            self._closed.append((w, actual))

    def end_step(self, next_step: int) -> None:
        """Learn from the step's closed windows and hand their records to the sink."""
        with self._lock:
            closed, self._closed = self._closed, []
        touched = set()
        for w, actual in closed:
            if actual > 0:
                self._recent.setdefault(w.key, deque(maxlen=self._history)).append(float(actual))
                touched.add(w.key)
        for key in touched:
            self._pred[key] = max(1, int(min_relative_error_center(self._recent[key])))
        if self.sink is not None:
            for w, actual in closed:
                rec = {"window_id": w.window_id, "kind": w.kind, "stage": self.stage, "step": w.step,
                       "start_ns": w.start_ns, "predicted_ns": w.predicted_ns, "actual_ns": actual}
                if w.key[1]:
                    rec["channel"] = w.key[1]
                self.sink(rec)
        self._ordinal.clear()
        self.step = next_step
