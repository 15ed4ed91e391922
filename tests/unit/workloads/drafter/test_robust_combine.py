"""The coordinator's combine against one bad rank (drafter.robust_combine through StarWeights.combine).

The honest-fleet test sends every contribution over loopback through the real fleet. The attack
tests put Contribution records (real tensors) straight into the coordinator's round, with the
receive and handshake times a long-running job would have: what they check is the combine's
arithmetic, which needs those clock values and no waiting; the frames' own checks are covered by
test_fleet_checks and the loopback fleet tests.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from spectrain_workloads.drafter import robust_combine
from spectrain_workloads.drafter.checks import TargetSpec
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import Contribution, FleetConfig
from spectrain_workloads.drafter.replicas import Replicas
from tests.fleet_ids import pod_identities
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.unit

KEY = os.urandom(32)
PODS = pod_identities(8, "job")              # one rank per pod
TARGET = TargetSpec(vocab=1000, hidden=4, max_tokens=64)
SHAPES = {"a.weight": (16, 8), "b.weight": (8,)}
COORD = 3


def _fleet(rank: int, ports: list[int]) -> Fleet:
    f = Fleet(FleetConfig(rank=rank, world=len(ports), pipeline=1, coordinator=COORD,
                          addresses=[("127.0.0.1", p) for p in ports], key=KEY, pod=PODS[rank], job_uid="job"))
    f.expect({n: torch.zeros(s) for n, s in SHAPES.items()}, TARGET)
    return f


def _models(seed: int, n: int, noise: float) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A seeded base model and n honest ranks' parameters: the base plus their own small update."""
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    return base, [{k: v + noise * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(n)]


def _average(parts: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    total = sum(weights)
    return {k: sum(w / total * p[k] for w, p in zip(weights, parts, strict=True)) for k in parts[0]}  # type: ignore[misc]


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum((a[k].double() - b[k].double()).square().sum() for k in a)) ** 0.5


def _put(coord: Fleet, rank: int, params: dict[str, torch.Tensor], work_total_s: float, *, incarnation: str,
         received_at: float, session_started: float) -> None:
    with coord.lock:
        coord.contributions[rank] = Contribution(1, params, work_total_s, incarnation, 0, received_at, session_started)


def test_an_honest_fleet_gets_the_plain_work_weighted_average() -> None:
    ports = free_ports(4)
    fleets = [_fleet(r, ports) for r in range(4)]
    _, (p0, p1, p2, own) = _models(1, 4, noise=0.01)
    work = [1.0, 1.3, 0.8]           # truthful, uneven as pipeline stages' idle time is
    try:
        for r, p in enumerate((p0, p1, p2)):
            fleets[r].contribute(1, p, work_total_s=work[r])
        wait_for(lambda: len(fleets[COORD].contributions) == 3, timeout=10)
        c = fleets[COORD].combine(own, 1, own_work_s=1.1, version=1)
        assert c is not None and c.work_by_rank == {COORD: 1.1, 0: 1.0, 1: 1.3, 2: 0.8}
        plain = _average([own, p0, p1, p2], [1.1, *work])
        for k in SHAPES:
            assert torch.allclose(c.params[k], plain[k], rtol=1e-6, atol=1e-7)
        assert fleets[COORD].stats.snapshot().get("combine_outlier_clipped", 0) == 0
        assert fleets[COORD].stats.snapshot().get("combine_weight_capped", 0) == 0
    finally:
        for f in fleets:
            f.close()


def test_claimed_work_counts_from_the_ranks_last_credit_whatever_its_incarnation() -> None:
    ports = free_ports(4)
    coord = _fleet(COORD, ports)
    _, (p0, p1, p2, own) = _models(2, 4, noise=0.01)
    now = time.monotonic()
    try:
        # a session open for 100 s: the first claim of 1e9 s counts as those 100 s (+ a round's slack)
        _put(coord, 2, p2, 1e9, incarnation="x0", received_at=now, session_started=now - 100.0)
        c = coord.combine(own, 1, own_work_s=1.0, version=1)
        assert c is not None and c.work_by_rank[2] <= 100.0 + coord.cfg.combine_every_s + 2.0 + 1e-9
        # 1 s later, a fresh incarnation on the same session: only that second (+ slack), not the
        # session's 101 s again
        _put(coord, 2, p2, 1e9, incarnation="x1", received_at=now + 1.0, session_started=now - 100.0)
        c = coord.combine(own, 2, own_work_s=1.0, version=2)
        assert c is not None and c.work_by_rank[2] <= 1.0 + coord.cfg.combine_every_s + 2.0 + 1e-9
        assert coord.stats.snapshot()["combine_work_capped"] == 2
    finally:
        coord.close()


def test_one_rank_claiming_more_work_gets_at_most_twice_the_others_median_weight() -> None:
    ports = free_ports(4)
    coord = _fleet(COORD, ports)
    _, (p0, p1, p2, own) = _models(3, 4, noise=0.01)
    now = time.monotonic()
    try:
        _put(coord, 0, p0, 1.0, incarnation="a", received_at=now, session_started=now - 10.0)
        _put(coord, 1, p1, 1.0, incarnation="b", received_at=now, session_started=now - 10.0)
        _put(coord, 2, p2, 1e9, incarnation="x", received_at=now, session_started=now - 10.0)   # credited ~22 s
        c = coord.combine(own, 1, own_work_s=1.0, version=1)
        assert c is not None and c.work_by_rank[2] > 20.0
        capped = _average([own, p0, p1, p2], [1.0, 1.0, 1.0, robust_combine.WEIGHT_CAP_FACTOR * 1.0])
        for k in SHAPES:   # rank 2's share: 2 / 5, not 22 / 25
            assert torch.allclose(c.params[k], capped[k], rtol=1e-6, atol=1e-7)
        assert coord.stats.snapshot()["combine_weight_capped"] == 1
    finally:
        coord.close()


def test_an_outlier_update_is_clipped_and_the_result_stays_near_the_honest_average() -> None:
    ports = free_ports(4)
    coord = _fleet(COORD, ports)
    base, (p0, p1, p2, own) = _models(4, 4, noise=0.01)
    forged = {k: base[k] + 100.0 * (p2[k] - base[k]) for k in base}     # x100 the norm of an honest update
    now = time.monotonic()
    try:
        for r, p in ((0, p0), (1, p1), (2, forged)):
            _put(coord, r, p, 1.0, incarnation=str(r), received_at=now, session_started=now - 10.0)
        c = coord.combine(own, 1, own_work_s=1.0, version=1)
        assert c is not None
        honest = _average([own, p0, p1], [1.0, 1.0, 1.0])
        plain = _average([own, p0, p1, forged], [1.0] * 4)
        assert _distance(c.params, honest) < 0.1 * _distance(plain, honest)
        assert coord.stats.snapshot()["combine_outlier_clipped"] == 1
        replicas = Replicas(coord, COORD, lambda *a, **k: None)
        assert replicas.summary()["combineAdjustedByCause"] == {"work_capped": 0, "outlier_clipped": 1,
                                                                 "weight_capped": 0}
    finally:
        coord.close()
