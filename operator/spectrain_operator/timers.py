"""The reconciler's requeue timers: every job's next pass in one heap, served by one thread.

kopf timers would put a finalizer on every job (reconciler.py says why they are not used).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

Key = tuple[str, str]
_TIMER_WORKERS = 16


class Timers:
    """Every job's next requeue in one heap, served by one thread; due passes run on a small pool.

    A key has at most one pending due time: scheduling it again keeps the earlier of the two.
    The pending entry is dropped before its pass runs, so the pass can schedule the next one.
    """

    def __init__(self, fire: Callable[[Key], None]):
        self._fire = fire
        self._heap: list[tuple[float, int, Key]] = []
        self._due: dict[Key, float] = {}
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._pool = ThreadPoolExecutor(_TIMER_WORKERS, thread_name_prefix="spectrain-requeue")
        threading.Thread(target=self._run, name="spectrain-timers", daemon=True).start()

    def schedule(self, key: Key, seconds: float) -> None:
        due = time.monotonic() + seconds
        with self._cv:
            if self._closed or self._due.get(key, float("inf")) <= due:
                return
            self._due[key] = due
            heapq.heappush(self._heap, (due, next(self._seq), key))
            self._cv.notify()

    def cancel(self, key: Key) -> None:
        with self._cv:
            self._due.pop(key, None)   # its heap entry is skipped when it comes up

    def pending(self, key: Key) -> float | None:
        with self._cv:
            due = self._due.get(key)
        return None if due is None else due - time.monotonic()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._due.clear()
            self._cv.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    due, _, key = heapq.heappop(self._heap)
                    if self._due.get(key) == due:
                        del self._due[key]
                        self._pool.submit(self._fire, key)
                self._cv.wait(self._heap[0][0] - now if self._heap else None)
