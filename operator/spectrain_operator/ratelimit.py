"""How hard the operator may push the API server: a token bucket (client QPS and burst) and
exponential backoff with full jitter that honours the server's Retry-After.

Full jitter (a uniform draw in [0, min(cap, base * 2**attempt)]) rather than a fixed delay: after
an apiserver hiccup every failed request of every job would otherwise come back in the same
instant and cause the next one. A Retry-After from the server (429 under API Priority and Fairness,
503 while it starts) is a lower bound on the wait: the server knows better than the client.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime

# client-go's defaults are QPS 5 / burst 10, sized for kubectl; controllers raise them (Kueue 50/100,
# KubeRay 100/200). A burst of 64 new jobs costs ~700 requests in its first passes, which a small
# apiserver answers at ~200/s (bench-operator_scale), so the limit does not slow that burst down
# while still bounding a runaway loop. Lower both on a shared control plane (chart: api.qps/burst).
DEFAULT_QPS = 200.0
DEFAULT_BURST = 400
# Retry an individual request a few times inside one pass (a 429 or a 5xx is usually momentary),
# then give up to the reconciler, whose per-job requeue backs off further.
DEFAULT_ATTEMPTS = 4
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 10.0
# The per-job requeue after a failed pass: same law, a longer reach.
REQUEUE_BASE_S = 1.0
REQUEUE_CAP_S = 60.0


@dataclass
class Backoff:
    """Exponential backoff with full jitter; `delay(attempt)` for attempt 0, 1, 2, ..."""

    base_s: float = BACKOFF_BASE_S
    cap_s: float = BACKOFF_CAP_S
    rng: random.Random = field(default_factory=random.Random)

    def ceiling(self, attempt: int) -> float:
        """The largest delay `attempt` may draw: base * 2**attempt, at most cap."""
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt, 62))

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """A uniform draw in [0, ceiling(attempt)], raised to `retry_after` when the server gave one
        (even above the cap: waiting less than the server asked only earns another 429)."""
        drawn = self.rng.uniform(0.0, self.ceiling(attempt))
        return drawn if retry_after is None else max(drawn, retry_after)


def parse_retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """Seconds from a Retry-After header: delta-seconds ("3") or an HTTP date; None if absent or
    unreadable; never negative."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - now())


class TokenBucket:
    """At most `burst` requests at once, refilled at `qps` per second: over any interval of T
    seconds at most burst + qps * T requests pass. qps <= 0 means unlimited. Thread-safe; callers
    wait in `acquire` (outside the lock) until their token is due."""

    def __init__(self, qps: float, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if qps > 0 and burst < 1:
            raise ValueError(f"burst must be >= 1 with a QPS limit, not {burst}")
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = threading.Lock()
        self.waited_s = 0.0   # total time callers spent waiting for a token

    def reserve(self) -> float:
        """Take a token now, possibly one not yet refilled: the seconds until it is due."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            self._tokens -= 1.0
            wait = 0.0 if self._tokens >= 0 else -self._tokens / self.qps
            self.waited_s += wait
            return wait

    def acquire(self) -> None:
        wait = self.reserve()
        if wait > 0:
            self._sleep(wait)
