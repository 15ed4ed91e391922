"""Drafter sample buffer and adaptive batch combiner."""

from __future__ import annotations

import pytest
import torch

from spectrain_workloads.drafter.combiner import (
    BatchCombiner,
    Sample,
    SampleBuffer,
    collate,
    micro_key,
)
from spectrain_workloads.drafter.gating import MS, CostModel

pytestmark = pytest.mark.unit


def sample(i: int, length: int = 8, dim: int = 4) -> Sample:
    return Sample(tokens=torch.full((length,), i, dtype=torch.int64), hidden=torch.zeros(length, dim), step=i)


def test_buffer_holds_out_every_nth_sample_and_is_bounded_in_bytes() -> None:
    per = sample(0).nbytes
    buf = SampleBuffer(max_bytes=5 * per, max_reuse=2, eval_every=4, eval_samples=2)
    for i in range(1, 21):
        buf.add(sample(i))
    assert [int(s.tokens[0]) for s in buf.eval] == [16, 20]          # every 4th, newest 2 kept
    assert all(int(s.tokens[0]) % 4 for s in buf.train)              # held-out never trained on
    assert buf.bytes <= 5 * per and buf.trainable() == 5
    assert buf.evicted_unused == 15 - 5                               # dropped before any use


def test_take_prefers_fresh_newest_then_least_used_and_retires_worn_samples() -> None:
    buf = SampleBuffer(max_bytes=1 << 20, max_reuse=2, eval_every=1000, eval_samples=1)
    for i in range(4):
        buf.add(sample(i))
    assert [int(s.tokens[0]) for s in buf.take(2)] == [3, 2]
    got = [int(s.tokens[0]) for s in buf.take(3)]
    assert got[:2] == [1, 0] and got[2] in (2, 3)                      # fresh first, then replay
    assert buf.fresh_count() == 0
    assert buf.trainable() == 3                                        # the twice-used one is retired
    rest = sorted(int(s.tokens[0]) for s in buf.take(4))
    assert rest == sorted({0, 1, 2, 3} - {got[2]})
    assert buf.trainable() == 0                                        # all reached max_reuse
    assert buf.take(1) == []


def test_take_batches_one_length_only() -> None:
    buf = SampleBuffer(max_bytes=1 << 20, max_reuse=4, eval_every=1000, eval_samples=1)
    buf.add(sample(1, length=8))
    buf.add(sample(2, length=6))
    buf.add(sample(3, length=8))
    got = buf.take(3)
    assert {s.length for s in got} == {8} and len(got) == 2
    tokens, hidden = collate(got, torch.device("cpu"))
    assert tokens.shape == (2, 8) and hidden is not None and hidden.shape == (2, 8, 4)


def test_plan_maximises_samples_in_budget_within_memory_cap() -> None:
    cost = CostModel()
    comb = BatchCombiner(max_micro_batch=8, samples_per_step=16, cost=cost)
    assert comb.sizes == [1, 2, 4, 8]
    assert comb.plan(100 * MS, available=8).micro_batch == 1            # nothing measured: the unit
    cost.observe(micro_key(1), 2 * MS)
    # 2, 4 and 8 are priced by scaling the measured size 1 (pessimistic): 8 samples need 16 ms
    assert comb.micro_cost(8) == 16 * MS
    p = comb.plan(20 * MS, available=100)
    assert (p.micro_batch, p.micro_steps) == (2, 5)          # the next unmeasured size is explored
    cost.observe(micro_key(2), 2 * MS)
    cost.observe(micro_key(4), 3 * MS)                       # batching pays off ...
    p = comb.plan(20 * MS, available=100)
    assert (p.micro_batch, p.micro_steps) == (8, 3)          # ... 8 priced from 4: 6 ms, explored
    cost.observe(micro_key(8), 10 * MS)                      # ... but not beyond 4
    p = comb.plan(20 * MS, available=100)
    assert (p.micro_batch, p.micro_steps) == (4, 6)
    p = comb.plan(3 * MS, available=100)                     # a short tail: fill it
    assert (p.micro_batch, p.micro_steps) == (4, 1)
    p = comb.plan(int(2.5 * MS), available=100)
    assert (p.micro_batch, p.micro_steps) == (2, 1)
    assert comb.plan(int(1.5 * MS), available=100) is None               # not even the unit fits
    assert comb.plan(20 * MS, available=3).micro_batch <= 3              # not more than is buffered
    comb.memory_cap_samples = 2
    assert comb.plan(20 * MS, available=100).micro_batch == 2


def test_a_stale_high_estimate_of_a_small_size_does_not_keep_it_out_of_tails() -> None:
    cost = CostModel()
    comb = BatchCombiner(max_micro_batch=8, samples_per_step=16, cost=cost)
    cost.observe(micro_key(1), 7 * MS)                       # measured once while the machine was busy
    cost.observe(micro_key(2), 3 * MS)
    for _ in range(4):
        cost.observe(micro_key(4), 4 * MS)
    assert comb.micro_cost(1) == 3 * MS and comb.micro_cost(2) == 3 * MS and comb.micro_cost(4) == 4 * MS
    p = comb.plan(int(3.5 * MS), available=100)              # a 3.5 ms tail fits the size 2, priced at 3 ms
    assert (p.micro_batch, p.micro_steps) == (2, 1)
    assert comb.plan(int(2.5 * MS), available=100) is None   # below every estimate: nothing is guessed


def test_gradient_accumulation_spans_calls_and_survives_state_roundtrip() -> None:
    comb = BatchCombiner(max_micro_batch=4, samples_per_step=6, cost=CostModel())
    comb.note_micro_step(4)
    assert not comb.step_due()
    comb.note_micro_step(4)          # e.g. in the next window
    assert comb.step_due() and comb.accumulated == 8
    comb.note_optimizer_step()
    assert not comb.step_due() and comb.optimizer_steps == 1
    other = BatchCombiner(max_micro_batch=4, samples_per_step=6, cost=CostModel())
    other.load_state_dict(comb.state_dict())
    assert (other.samples_trained, other.micro_steps, other.optimizer_steps) == (8, 2, 1)


def test_take_against_a_reference_over_random_adds_takes_and_evictions() -> None:
    """The buffer's pools and heaps against a plain list kept by the rules of SampleBuffer's
    docstring: fresh newest first, then the least used; one length per take; a sample retires at
    max_reuse; the byte cap evicts the oldest; counts and bytes always agree."""
    import random

    rng = random.Random(0)
    per = sample(0, length=8).nbytes
    buf = SampleBuffer(max_bytes=40 * per, max_reuse=3, eval_every=10**9, eval_samples=1)
    live: list[Sample] = []                       # the reference: arrival order
    for i in range(3000):
        if i < 200 or rng.random() < 0.45:        # a backlog first: the cap evicts unused samples
            s = sample(i, length=rng.choice([8, 8, 8, 6]))
            buf.add(s)
            live.append(s)
            while sum(x.nbytes for x in live) > 40 * per and len(live) > 1:
                live.pop(0)
        else:
            want = [x.uses for x in live]
            got = buf.take(rng.choice([1, 2, 4, 8]))
            if not live:
                assert got == []
                continue
            assert got and len({x.length for x in got}) == 1
            before = {id(x): u for x, u in zip(live, want, strict=True)}
            # fresh newest first, then by (uses, arrival); the length is that of the first
            order = sorted(live, key=lambda x: (before[id(x)], -x.arrival if before[id(x)] == 0 else x.arrival))
            first = order[0]
            same = [x for x in order if x.length == first.length]
            assert [id(x) for x in got] == [id(x) for x in same[:len(got)]]
            live = [x for x in live if x.uses < 3]
        assert buf.trainable() == len(live)
        assert buf.fresh_count() == sum(x.uses == 0 for x in live)
        assert buf.bytes == sum(x.nbytes for x in live)
    assert buf.evicted_unused > 0 and len(buf.train) <= 2 * buf.trainable() + 70
