"""drafter.links + drafter.fleet on real loopback sockets: the bandwidth cap, bounded queues,
sample fan-out, work-weighted combination, local progress kept, a dead peer (the channel's
authentication and the checks of what is received: test_fleet_auth.py, test_fleet_checks.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter.admission import Limits
from spectrain_workloads.drafter.auth import Identity, Session
from spectrain_workloads.drafter.checks import TargetSpec
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import Combined, FleetConfig, parse_peers
from spectrain_workloads.drafter.links import Frame, Link, Stats, TokenBucket
from spectrain_workloads.drafter.listener import Server
from spectrain_workloads.drafter.replicas import ModelSync
from tests.fleet_ids import pod_identities
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.unit


KEY = os.urandom(32)
PODS = pod_identities(4, "job")              # one rank per pod
TARGET = TargetSpec(vocab=1000, hidden=4, max_tokens=64)
WEIGHTS = {"weight": torch.zeros(1, 2)}


class Collect:
    """A links.Receiver that keeps the arrival time of every frame."""

    def __init__(self) -> None:
        self.got: list[float] = []

    def cap(self, kind: str) -> int:
        return 1 << 20

    def admit(self, kind: str, header: dict[str, Any], peer: Session) -> str | None:
        return None

    def handle(self, frame: Frame, peer: Session) -> None:
        self.got.append(time.monotonic())

    def defer(self, kind: str) -> bool:
        return False


def test_parse_peers() -> None:
    assert parse_peers("a:10,b:20", world=4, local_world=2) == [("a", 10), ("a", 11), ("b", 20), ("b", 21)]
    assert parse_peers("[fd00::1]:10", world=1, local_world=1) == [("fd00::1", 10)]
    with pytest.raises(ConfigError, match="SPECTRAIN_DRAFTER_PEERS lists 2 nodes x 1 local ranks, but WORLD_SIZE is 3"):
        parse_peers("a:10,b:20", world=3, local_world=1)
    with pytest.raises(ConfigError, match="'nohost' is not host:port"):
        parse_peers("nohost", world=1, local_world=1)


def test_bandwidth_cap_holds_and_a_full_queue_drops() -> None:
    recv, stats = Collect(), Stats()
    got = recv.got
    port = free_ports(1)[0]
    server = Server([("127.0.0.1", port)], recv, stats, ident=Identity(KEY, "job", 0, PODS[1]), rank=1, world=2,
                    limits=Limits.for_job(world=2, ranks_per_host=2, combine_every_s=10.0))
    rate = 2e6                                    # 2 MB/s, bursts of 0.25 s
    link = Link(("127.0.0.1", port), TokenBucket(rate, rate * 0.25), max_queue_bytes=3 << 20, stats=stats,
                ident=Identity(KEY, "job", 0, PODS[0]), rank=0, peer_rank=1, handshake_s=1.0)
    payload = b"x" * 400_000
    t0 = time.monotonic()
    sent = sum(link.send(Frame("sample", {}, payload)) for _ in range(20))
    assert 6 <= sent < 20 and stats.snapshot()["dropped"] == 20 - sent    # the queue holds ~3 MB: the rest dropped
    wait_for(lambda: len(got) == sent, timeout=30)
    elapsed = got[-1] - t0
    # `sent` frames of 0.4 MB; the first 0.5 MB go out as a burst, the rest at 2 MB/s
    assert elapsed >= (sent * 400_000 - rate * 0.25) / rate * 0.95, (sent, elapsed)
    link.close()
    server.close()


def _fleet(rank: int, ports: list[int], *, pipeline: int, coordinator: int, **kw: Any) -> Fleet:
    """A fleet member on loopback that expects TARGET's samples and WEIGHTS' table."""
    f = Fleet(FleetConfig(rank=rank, world=len(ports), pipeline=pipeline, coordinator=coordinator,
                          addresses=[("127.0.0.1", p) for p in ports], key=KEY, pod=PODS[rank], job_uid="job", **kw))
    f.expect(WEIGHTS, TARGET)
    return f


def test_last_stage_shares_samples_with_the_other_stages_of_its_replica() -> None:
    ports = free_ports(4)             # pipeline 2 x data 2: ranks 1 and 3 are last stages
    fleets = [_fleet(r, ports, pipeline=2, coordinator=3) for r in range(4)]
    try:
        assert [f.cfg.sample_ranks for f in fleets] == [[], [0], [], [2]]
        tokens, hidden = torch.arange(8), torch.ones(8, 4, dtype=torch.bfloat16)
        fleets[1].share(tokens, hidden, step=5)
        fleets[3].share(tokens + 1, None, step=6)
        wait_for(lambda: len(fleets[0].inbox) == 1 and len(fleets[2].inbox) == 1, timeout=10)
        (t0, h0, s0, src0), = fleets[0].take_samples(8)
        (t2, h2, s2, src2), = fleets[2].take_samples(8)
        assert (t0.tolist(), h0.shape, h0.dtype, s0, src0) == (list(range(8)), (8, 4), torch.bfloat16, 5, 1)
        assert torch.equal(h0, hidden)
        assert (t2.tolist(), h2, s2, src2) == (list(range(1, 9)), None, 6, 3)
        assert not fleets[1].inbox and not fleets[3].inbox
    finally:
        for f in fleets:
            f.close()


def test_samples_sent_before_a_drafter_is_ready_wait_for_it_and_are_checked_then() -> None:
    """A last stage's sample that reaches a first stage before its drafter has its model is kept
    (bounded) and checked when taken: a good one is trained on, one the target rejects is counted. A
    ready drafter with no target to check against refuses samples as not_ready."""
    ports = free_ports(2)             # pipeline 2: rank 1 (last stage) shares with rank 0
    sender = _fleet(1, ports, pipeline=2, coordinator=1)
    late = Fleet(FleetConfig(rank=0, world=2, pipeline=2, coordinator=1,
                             addresses=[("127.0.0.1", p) for p in ports], key=KEY, pod=PODS[0], job_uid="job"))
    try:
        tokens, hidden = torch.arange(8), torch.ones(8, 4, dtype=torch.bfloat16)
        sender.share(tokens, hidden, step=5)
        sender.share(torch.full((8,), TARGET.vocab), None, step=6)       # a token outside the vocabulary
        wait_for(lambda: late.stats.snapshot().get("samples_received", 0) == 2, timeout=10)
        assert late.take_samples(8) == [] and len(late.inbox) == 2       # no target to check against yet
        late.expect(WEIGHTS, TARGET)
        ((t, h, step, src),) = late.take_samples(8)
        assert torch.equal(t, tokens) and h is not None and torch.equal(h, hidden) and (step, src) == (5, 1)
        assert late.stats.rejected() == {"token": 1}, late.stats.rejected()
    finally:
        sender.close()
        late.close()
    ports = free_ports(2)             # ready, but with no target (no spec, no run_dir): refused, counted
    sender = _fleet(1, ports, pipeline=2, coordinator=1)
    blind = Fleet(FleetConfig(rank=0, world=2, pipeline=2, coordinator=1,
                              addresses=[("127.0.0.1", p) for p in ports], key=KEY, pod=PODS[0], job_uid="job"))
    blind.expect(WEIGHTS)
    try:
        sender.share(torch.arange(8), None, step=7)
        wait_for(lambda: blind.stats.rejected().get("not_ready", 0) == 1, timeout=10)
        assert len(blind.inbox) == 0 and blind.take_samples(8) == []
    finally:
        sender.close()
        blind.close()


def test_inbox_is_bounded_and_keeps_the_newest() -> None:
    ports = free_ports(2)
    fleets = [_fleet(r, ports, pipeline=2, coordinator=1, inbox_bytes=3 * 64) for r in range(2)]
    try:
        for step in range(6):
            fleets[1].share(torch.full((8,), step), None, step)
        wait_for(lambda: fleets[0].stats.snapshot().get("samples_received", 0) == 6, timeout=10)
        assert [s for _, _, s, _ in fleets[0].take_samples(10)] == [3, 4, 5]
        assert fleets[0].stats.snapshot()["inbox_dropped"] == 3
    finally:
        for f in fleets:
            f.close()


def test_combination_is_work_weighted_and_keeps_local_progress() -> None:
    ports = free_ports(3)
    fleets = [_fleet(r, ports, pipeline=1, coordinator=2) for r in range(3)]
    models = [torch.nn.Linear(2, 1, bias=False) for _ in range(3)]
    syncs = []
    for r, m in enumerate(models):
        with torch.no_grad():
            m.weight.fill_(float(r))
        syncs.append(ModelSync(m))
    try:
        seq0, p0 = syncs[0].contribution()
        fleets[0].contribute(seq0, p0, work_total_s=2.0)   # rank 0: weight 1.0, 2 s of work (robust_combine's cap)
        seq1, p1 = syncs[1].contribution()
        fleets[1].contribute(seq1, p1, work_total_s=0.0)   # rank 1 did no work: it must not dilute
        wait_for(lambda: len(fleets[2].contributions) == 2, timeout=10)
        with torch.no_grad():
            models[0].weight.add_(10.0)                 # progress after sending: kept on apply
        seq2, p2 = syncs[2].contribution()
        c = fleets[2].combine(p2, seq2, own_work_s=1.0, version=3)
        assert c is not None and c.version == 3 and c.included == {2: seq2, 0: seq0, 1: seq1}
        # (2 * 0 + 0 * 1 + 1 * 2) / 3
        assert torch.allclose(c.params["weight"], torch.full((1, 2), 2 / 3))
        wait_for(lambda: fleets[0].combined_in is not None and fleets[1].combined_in is not None, timeout=10)
        got = fleets[0].take_combined()
        assert got is not None and got.version == 3 and got.work_s == 3.0
        syncs[0].apply(got, rank=0)
        assert torch.allclose(models[0].weight, torch.full((1, 2), 10 + 2 / 3))
        assert fleets[2].combine(p2, seq2, own_work_s=1.0, version=4) is None    # nobody else contributed
    finally:
        for f in fleets:
            f.close()


def test_work_in_a_replaced_contribution_is_not_lost_and_a_restart_counts_from_zero() -> None:
    ports = free_ports(2)
    fleets = [_fleet(r, ports, pipeline=1, coordinator=1) for r in range(2)]
    member, coord = fleets
    w = {"weight": torch.zeros(1, 2)}
    try:
        member.contribute(1, w, work_total_s=2.0, samples_total=20)
        member.contribute(2, w, work_total_s=5.0, samples_total=50)   # before any round: replaces the first, holds it
        wait_for(lambda: coord.contributions.get(0) is not None and coord.contributions[0].seq == 2, timeout=10)
        c = coord.combine(w, 1, own_work_s=1.0, version=1, own_samples=10)
        assert c is not None and c.work_by_rank == {1: 1.0, 0: 5.0} and c.samples_by_rank == {1: 10, 0: 50}
        member.contribute(3, w, work_total_s=6.5, samples_total=65)
        wait_for(lambda: 0 in coord.contributions, timeout=10)
        c = coord.combine(w, 2, own_work_s=0.5, version=2)
        assert c is not None and c.work_by_rank == {1: 0.5, 0: 1.5}        # only what version 1 lacked
        assert c.samples_by_rank == {1: 0, 0: 15}
        member.incarnation = "restarted"                   # as a new process of rank 0: its totals start again
        member.contribute(1, w, work_total_s=0.75)
        wait_for(lambda: 0 in coord.contributions, timeout=10)
        c = coord.combine(w, 3, own_work_s=0.25, version=3)
        assert c is not None and c.work_by_rank == {1: 0.25, 0: 0.75}
    finally:
        for f in fleets:
            f.close()


def test_a_late_drafter_gets_the_newest_combined_version_and_a_dead_coordinator_blocks_nobody() -> None:
    ports = free_ports(2)
    coord = _fleet(1, ports, pipeline=1, coordinator=1)
    coord.latest = Combined(4, {"weight": torch.ones(1, 2)}, {1: 1}, 2.0)
    late = _fleet(0, ports, pipeline=1, coordinator=1)
    try:
        late.hello()
        wait_for(lambda: late.combined_in is not None, timeout=10)
        assert late.take_combined().version == 4    # type: ignore[union-attr]
        coord.close()
        t0 = time.monotonic()
        for seq in range(50):                       # the coordinator is gone: sending never blocks
            late.contribute(seq, {"weight": torch.zeros(1, 2)}, work_total_s=1.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        late.close()


def test_parts_sent_before_the_assembler_is_ready_wait_for_it() -> None:
    """A first stage's EAGLE-3 part that reaches the last stage before its drafter has its model is
    kept (bounded) and read once the model exists; a drafter without feature layers refuses parts."""
    ports = free_ports(2)             # pipeline 2: rank 1 (last stage) assembles
    spec = TargetSpec(vocab=1000, hidden=4, max_tokens=64)
    sender = _fleet(0, ports, pipeline=2, coordinator=1)
    sender.use_features((1,))
    late = Fleet(FleetConfig(rank=1, world=2, pipeline=2, coordinator=1,
                             addresses=[("127.0.0.1", p) for p in ports], key=KEY, pod=PODS[1], job_uid="job"))
    try:
        tokens, feats = torch.arange(8), torch.randn(8, 4).to(torch.bfloat16)
        sender.send_part(tokens, feats, (1,), step=4, seq_index=2)
        wait_for(lambda: late.stats.snapshot().get("parts_received", 0) == 1, timeout=10)
        late.use_features((1, 2, 3))
        late.expect(WEIGHTS, spec)
        ((t, f, layers, step, seq),) = late.take_parts(8)
        assert torch.equal(t, tokens) and torch.equal(f, feats) and (layers, step, seq) == ((1,), 4, 2)
        assert late.stats.rejected() == {}
    finally:
        sender.close()
        late.close()
    ports = free_ports(2)
    sender = _fleet(0, ports, pipeline=2, coordinator=1)
    eagle1 = _fleet(1, ports, pipeline=2, coordinator=1)          # ready, no feature layers
    try:
        sender.send_part(torch.arange(8), torch.randn(8, 4).to(torch.bfloat16), (1,), step=4, seq_index=2)
        wait_for(lambda: eagle1.stats.rejected().get("role", 0) == 1, timeout=10)
        assert eagle1.take_parts(8) == []
    finally:
        sender.close()
        eagle1.close()
