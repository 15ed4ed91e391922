"""The API-pressure math: full-jitter backoff, Retry-After, the token bucket, and kube.Kube's
in-place retries of 429/5xx over a fake transport."""

from __future__ import annotations

import random
from typing import Any

import pytest

from spectrain_operator.kube import Kube, RejectedError, TransientError
from spectrain_operator.ratelimit import Backoff, TokenBucket, parse_retry_after

pytestmark = pytest.mark.unit


def test_backoff_ceiling_doubles_up_to_the_cap() -> None:
    b = Backoff(0.2, 10.0)
    assert [b.ceiling(n) for n in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]
    assert b.ceiling(10_000) == 10.0   # no overflow for a long outage


def test_full_jitter_spans_zero_to_the_ceiling() -> None:
    b = Backoff(1.0, 60.0, random.Random(1))
    draws = [b.delay(3) for _ in range(4000)]
    assert 0.0 <= min(draws) < 0.1 and 7.9 < max(draws) <= 8.0
    assert 3.8 < sum(draws) / len(draws) < 4.2   # uniform: mean ceiling / 2


def test_retry_after_is_a_lower_bound_even_above_the_cap() -> None:
    b = Backoff(0.2, 1.0, random.Random(2))
    assert all(b.delay(0, retry_after=3.0) == 3.0 for _ in range(100))
    assert all(2.0 <= b.delay(5, retry_after=2.0) for _ in range(100))


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    now = 1_767_225_600.0   # 2026-01-01T00:00:00Z
    assert parse_retry_after("Thu, 01 Jan 2026 00:00:07 GMT", now=lambda: now) == 7.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10.0, 5, clock=clock, sleep=clock.sleep)
    stamps = []
    for _ in range(25):
        bucket.acquire()
        stamps.append(clock.t)
    assert stamps[:5] == [0.0] * 5                            # the burst
    assert stamps[5:] == pytest.approx([0.1 * k for k in range(1, 21)])   # then one per 1/qps
    # any window of T seconds holds at most burst + qps * T
    for i, t in enumerate(stamps):
        assert sum(1 for u in stamps[i:] if u < t + 1.0) <= 5 + 10


def test_token_bucket_refills_while_idle_but_not_above_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(2.0, 3, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        bucket.acquire()
    clock.t += 100.0
    for _ in range(3):
        bucket.acquire()
    assert clock.slept == []
    bucket.acquire()
    assert clock.slept == [pytest.approx(0.5)]


def test_unlimited_and_invalid_buckets() -> None:
    assert TokenBucket(0, 0).reserve() == 0.0
    with pytest.raises(ValueError):
        TokenBucket(5.0, 0)


class _Resp:
    def __init__(self, status: int, data: bytes = b"{}", headers: dict[str, str] | None = None):
        self.status, self.data, self.headers = status, data, headers or {}


class _Api:
    """Just enough of kubernetes.client.ApiClient for Kube.request: answers from a script."""

    def __init__(self, answers: list[_Resp]):
        self.answers = answers
        self.rest_client = self
        self.pool_manager = self

    def param_serialize(self, **kw: Any) -> tuple[Any, ...]:
        return "GET", "https://x" + kw["resource_path"], {}, None, None

    def request(self, *a: Any, **kw: Any) -> _Resp:
        return self.answers.pop(0)


def test_kube_retries_429_and_5xx_honouring_retry_after() -> None:
    slept: list[float] = []
    api = _Api([_Resp(429, b'{"message":"slow down"}', {"Retry-After": "2"}), _Resp(500), _Resp(200, b'{"ok":1}')])
    kube = Kube(api, qps=0, burst=0, backoff=Backoff(0.2, 10.0, random.Random(3)), sleep=slept.append)
    assert kube.request("GET", "/api/v1/pods") == {"ok": 1}
    assert len(slept) == 2 and slept[0] >= 2.0 and 0.0 <= slept[1] <= 0.4
    assert kube.calls["GET"] == 3


def test_kube_gives_up_after_its_attempts_and_never_retries_409_or_400() -> None:
    slept: list[float] = []
    kube = Kube(_Api([_Resp(503, headers={"Retry-After": "1"})] * 4), qps=0, burst=0, attempts=4, sleep=slept.append)
    with pytest.raises(TransientError) as exc:
        kube.request("GET", "/x")
    assert exc.value.status == 503 and exc.value.retry_after == 1.0 and len(slept) == 3
    kube = Kube(_Api([_Resp(409)]), qps=0, burst=0, sleep=slept.append)
    with pytest.raises(TransientError):
        kube.request("PUT", "/x")
    kube = Kube(_Api([_Resp(422)]), qps=0, burst=0, sleep=slept.append)
    with pytest.raises(RejectedError):
        kube.request("POST", "/x")
    assert len(slept) == 3
