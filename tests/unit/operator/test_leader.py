"""Leader election over a fake Lease store that, like the apiserver, rejects a PUT carrying a stale
resourceVersion with 409: acquire, renew, expiry by the follower's own clock, handover, release."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import pytest

from spectrain_operator.kube import TransientError
from spectrain_operator.leader import LeaderElector

pytestmark = pytest.mark.unit
Obj = dict[str, Any]


class LeaseStore:
    def __init__(self) -> None:
        self.lease: Obj | None = None
        self.rv = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        return copy.deepcopy(self.lease)

    def request(self, method: str, path: str, *, body: Obj) -> Obj:
        assert method == "POST"
        if self.lease is not None:
            raise TransientError("exists", 409)
        self.rv += 1
        self.lease = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return copy.deepcopy(self.lease)

    def replace(self, obj: Obj) -> Obj:
        assert self.lease is not None
        if obj["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise TransientError("conflict", 409)
        self.rv += 1
        self.lease = {**copy.deepcopy(obj), "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        return copy.deepcopy(self.lease)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(store: LeaseStore, clock: Clock, who: str, events: list[str] | None = None) -> LeaderElector:
    log = events if events is not None else []
    return LeaderElector(store, "ops", "lease", who, 15, clock=clock,  # type: ignore[arg-type]
                         wall=lambda: datetime(2026, 1, 1, tzinfo=timezone.utc),
                         on_started=lambda: log.append(f"{who} started"),
                         on_stopped=lambda: log.append(f"{who} stopped"))


def test_first_candidate_creates_the_lease_and_the_second_follows() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False
    spec = store.lease["spec"]  # type: ignore[index]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15 and spec["leaseTransitions"] == 0
    assert spec["renewTime"] == "2026-01-01T00:00:00.000000Z"
    assert a.try_acquire_or_renew() is True      # renewal
    clock.t += 14.0                              # b saw a renewal just now: not expired yet
    assert b.try_acquire_or_renew() is False


def test_a_dead_holder_is_replaced_after_the_lease_duration_by_the_followers_clock() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()          # b observes the record at t
    clock.t += 14.9
    assert not b.try_acquire_or_renew()
    clock.t += 0.2
    assert b.try_acquire_or_renew()
    spec = store.lease["spec"]  # type: ignore[index]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


def test_two_followers_racing_for_an_expired_lease_one_wins() -> None:
    store, clock = LeaseStore(), Clock()
    a, b, c = (elector(store, clock, n) for n in "abc")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock.t += 16.0
    stale = store.get("", "", "", "")
    assert b.try_acquire_or_renew()
    store_get = store.get
    store.get = lambda *args: copy.deepcopy(stale)  # type: ignore[method-assign]  # c read before b wrote
    assert not c.try_acquire_or_renew()            # its PUT carries the old resourceVersion: 409
    store.get = store_get  # type: ignore[method-assign]
    assert store.lease["spec"]["holderIdentity"] == "b"  # type: ignore[index]


def test_leadership_ends_at_the_renew_deadline_and_a_release_hands_over_at_once() -> None:
    store, clock = LeaseStore(), Clock()
    events: list[str] = []
    a, b = elector(store, clock, "a", events), elector(store, clock, "b", events)
    a._leading_until = clock() + a.renew_deadline_s
    a._set_leading(True)
    assert a.is_leader() and events == ["a started"]
    clock.t += a.renew_deadline_s + 0.01
    assert not a.is_leader()                      # no renewal within the deadline: stop acting
    assert a.try_acquire_or_renew()
    a._leading_until = clock() + a.renew_deadline_s
    assert not b.try_acquire_or_renew()
    a.stop(release=True)
    assert events[-1] == "a stopped" and store.lease["spec"]["holderIdentity"] is None  # type: ignore[index]
    assert b.try_acquire_or_renew()               # an emptied holder is free at once
    assert store.lease["spec"]["leaseTransitions"] == 1  # type: ignore[index]
