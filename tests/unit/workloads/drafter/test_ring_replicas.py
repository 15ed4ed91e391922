"""drafter.ring_replicas: a ring result is checked as the star's combined versions are, rounds are
paced by the exchange's bandwidth, a worker late for its rounds holds nobody up (its thread takes
part on its last snapshot, real gloo on loopback) and keeps what it learnt meanwhile, and
spec.drafter.exchange.engine is validated by name."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from spectrain_api.config import from_manifest
from spectrain_api.rules import check_spec
from spectrain_workloads.drafter import checks
from spectrain_workloads.drafter.allreduce import Result
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import FleetConfig
from spectrain_workloads.drafter.ring_replicas import RingReplicas, check_result, pace_s, ring_timeout_s
from tests.fleet_ids import pod_identities
from tests.launch import free_ports
from tests.waiting import wait_for

Params = dict[str, torch.Tensor]


def _local() -> Params:
    g = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(8, 4, generator=g), "fc.bias": torch.randn(8, generator=g)}


def test_a_result_near_the_local_model_is_applied() -> None:
    local = _local()
    new = {n: p + 0.01 for n, p in local.items()}
    assert check_result(new, local, checks.param_table(local)) is None


@pytest.mark.parametrize(("bad", "cause"), [
    (lambda p: {**p, "fc.bias": torch.full_like(p["fc.bias"], float("nan"))}, "allreduce_nonfinite"),
    (lambda p: {"fc.weight": p["fc.weight"]}, "allreduce_keys"),
    (lambda p: {**p, "fc.bias": p["fc.bias"].to(torch.float64)}, "allreduce_shape"),
    (lambda p: {**p, "fc.weight": p["fc.weight"][:4]}, "allreduce_shape"),
    # one member's forged parameters move the sum far past UPDATE_NORM_FACTOR x the local norm
    (lambda p: {n: t * (2 + checks.UPDATE_NORM_FACTOR) for n, t in p.items()}, "allreduce_update"),
])
def test_a_bad_result_is_refused_with_its_cause(bad: Callable[[Params], Params], cause: str) -> None:
    local = _local()
    assert check_result(bad(local), local, checks.param_table(local)) == cause


def test_rounds_are_paced_by_the_bandwidth() -> None:
    # 1 GB fp32 model: 2 GB a round; at 64 MB/s that is 31.25 s, longer than the 10 s period
    assert pace_s(2_000_000_000, 64e6, 10.0) == pytest.approx(31.25)
    assert pace_s(1_000_000, 64e6, 10.0) == 10.0          # a small model: the period
    assert ring_timeout_s(1.0) == 5.0 and ring_timeout_s(30.0) == 30.0


def test_an_unknown_engine_names_the_field() -> None:
    cfg = from_manifest({"spec": {"drafter": {"exchange": {"engine": "Ring"}}}})
    errors = [e for e in check_spec(cfg) if "engine" in e]
    assert errors == ["spec.drafter.exchange.engine: 'Ring' is not one of: Star, AllReduce"]
    assert not [e for e in check_spec(from_manifest({"spec": {"drafter": {"exchange": {"engine": "AllReduce"}}}}))
                if "engine" in e]


class Recorded(RingReplicas):
    """Keeps the result it applied last (to compare the live parameters with)."""

    applied: Result | None = None

    def _apply(self, res: Result) -> Result | None:
        self.applied = res
        return super()._apply(res)


def _ring(n: int) -> tuple[list[Fleet], list[Recorded], list[torch.nn.Module], list[list[dict[str, Any]]]]:
    ports = free_ports(n + 1)
    key, pods = os.urandom(32), pod_identities(n, "job")
    fleets = [Fleet(FleetConfig(rank=r, world=n, pipeline=1, coordinator=n - 1,
                                addresses=[("127.0.0.1", p) for p in ports[:n]], key=key, pod=pods[r], job_uid="job",
                                combine_every_s=1.0, engine="AllReduce", store=("127.0.0.1", ports[n])))
              for r in range(n)]
    logs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    reps = [Recorded(f, r, log=lambda event, _l=logs[r], **kw: _l.append({"event": event, **kw}))
            for r, f in enumerate(fleets)]
    models = []
    for r in range(n):
        torch.manual_seed(0)                 # one initialisation, as the drafters' seeded one
        models.append(torch.nn.Linear(4, 2))
        reps[r].start(models[r], 0, 0)
    return fleets, reps, models, logs


def test_a_late_worker_holds_nobody_up_and_keeps_its_progress() -> None:
    fleets, reps, models, logs = _ring(3)
    late = 1
    try:
        def step(ranks: tuple[int, ...]) -> None:
            for r in ranks:          # a little training: every rank moves its own way
                with torch.no_grad():
                    models[r].weight.add_(0.001 * (r + 1))
                reps[r].work_ns += 50_000_000
                reps[r].round(0, 1)

        wait_for(lambda: (step((0, 1, 2)), all(r.version >= 1 for r in reps))[1], timeout=60,
                 interval=0.05, what="a version on every rank")
        # rank 1's worker is busy (a long measurement): no round from it for several periods
        with torch.no_grad():
            models[late].weight.add_(0.5)           # what it learns meanwhile
        before = len(logs[0])
        wait_for(lambda: (step((0, 2)), reps[late].idle_rounds >= 2 and reps[0].version >= 4)[1], timeout=60,
                 interval=0.05, what="rounds go on with the late rank taking part on its last snapshot")
        during = [e for e in logs[0][before:] if e["event"] == "combined"]
        assert during and all(e["members"] == 3 for e in during), during    # never re-formed without it
        # back: it applies the newest version on top of everything it learnt since its last snapshot
        last = {n: p.clone() for n, p in reps[late]._last.items()}   # type: ignore[union-attr]
        live = {n: p.detach().clone() for n, p in models[late].named_parameters()}
        reps[late].round(0, 1)
        got = reps[late].applied
        assert got is not None and got.version >= 4 and reps[late].version == got.version
        for n, p in models[late].named_parameters():
            assert torch.allclose(p.detach(), got.params[n] + live[n] - last[n], atol=1e-6), n
    finally:
        for r in reps:
            r.close()
        for f in fleets:
            f.close()
    assert not any(t.is_alive() for t in (r._thread for r in reps))
