"""harvest.schedule: pipeline schedules, their idle slots and the executor's receive order."""

from __future__ import annotations

import pytest

from spectrain_api.errors import ConfigError
from spectrain_workloads.harvest.schedule import Op, ScaledTimeline, Schedule, simulate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 3)])
def test_schedule_idles_the_formula_and_slots_are_structural(name: str, p: int, m: int) -> None:
    s = Schedule(name=name, n_stages=p, microbatches=m)
    for tf, tb in [(1.0, 2.0), (1.0, 1.0), (2.0, 1.5), (1.0, 3.0)]:
        tl = simulate(s.orders, tf, tb)
        for k in range(p):
            idle = sum(tl.gaps[k]) + tl.trailing[k]
            assert idle / tl.step_end == pytest.approx(s.formula_bubble_fraction())
            # bubble slots sit where the simulation idles, whatever the F/B ratio
            assert [i for i, g in enumerate(tl.gaps[k]) if g > 1e-9 or (i == 0 and tl.trailing[k] > 1e-9)] \
                == s.bubble_positions(k)
            preds = s.bubble_predictions(k, tf, tb, first_step=False)
            # the predictions simulate tb / tf quantised to 2 % steps (ScaledTimeline), exact at tb == tf
            assert sum(preds) == pytest.approx(idle, rel=0.0 if tf == tb else 0.02)
    for k in range(p):
        acts = s.stage_actions(k)
        assert [a.mb for a in acts if a.op is Op.F] == list(range(m))
        assert sorted(a.mb for a in acts if a.op is Op.B) == list(range(m))
        slots = [a.slot for a in acts if a.op is Op.BUBBLE]
        assert slots == list(range(len(slots)))
        assert (len(slots) > 0) == (p > 1)


@pytest.mark.parametrize("name,p,m", [("1F1B", 2, 4), ("GPipe", 3, 6), ("Interleaved1F1B", 2, 4)])
def test_scaled_timeline_is_the_simulation_at_the_quantised_ratio(name: str, p: int, m: int) -> None:
    orders = Schedule(name=name, n_stages=p, microbatches=m).orders
    st = ScaledTimeline(orders)
    for tf in (3.0, 7.5, 1e6):
        for ratio in (1.0, 1.02 ** 35, 1.02 ** -20):       # on the 2 % grid: exact
            gaps, trailing = st(tf, tf * ratio)
            tl = simulate(orders, tf, tf * ratio)
            assert gaps == [pytest.approx(row, rel=1e-9, abs=1e-9 * tf) for row in tl.gaps]
            assert trailing == pytest.approx(tl.trailing, rel=1e-9, abs=1e-9 * tf)
    assert len(st._unit) == 3                                 # one simulation per ratio, any tf
    gaps, _ = st(10.0, 10.0 * 1.02 ** 10.4)                   # off the grid: the nearest grid ratio
    assert gaps == [pytest.approx(row) for row in simulate(orders, 10.0, 10.0 * 1.02 ** 10).gaps]
    assert len(st._unit) == 4
    gaps, _ = st(0.0, 5.0)                                    # a zero time: simulated as given
    assert gaps == simulate(orders, 0.0, 5.0).gaps and len(st._unit) == 4


def test_1f1b_action_list_p2_m4() -> None:
    s = Schedule(name="1F1B", n_stages=2, microbatches=4)
    assert repr(s.stage_actions(0)) == "[F0, F1, BUBBLE0, B0, F2, B1, F3, B2, BUBBLE1, B3]"
    assert repr(s.stage_actions(1)) == "[BUBBLE0, F0, B0, F1, B1, F2, B2, F3, B3]"
    assert s.last_backward(0) == 3


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2), (4, 4, 3), (4, 12, 4)])
def test_interleaved_runs_every_chunk_once_in_dependency_order(p: int, m: int, v: int) -> None:
    s = Schedule(name="Interleaved1F1B", n_stages=p, microbatches=m, chunks=v)
    formula = (p - 1) / (v * m + p - 1)
    assert s.formula_bubble_fraction() == pytest.approx(formula)
    for tf, tb in [(1.0, 2.0), (1.0, 1.0), (2.0, 1.5), (1.0, 3.0), (1.0, 2.5), (1.0, 4.0)]:
        tl = simulate(s.orders, tf, tb)          # raises if the orders deadlock
        for k in range(p):
            assert (sum(tl.gaps[k]) + tl.trailing[k]) / tl.step_end == pytest.approx(formula)
            preds = s.bubble_predictions(k, tf, tb, first_step=False)
            assert sum(preds) == pytest.approx(sum(tl.gaps[k]) + tl.trailing[k], rel=0.0 if tf == tb else 0.02)
            # slots are structural (known before the step): every idle gap, at any of these F/B
            # ratios, sits at one of them (some of interleaving's gaps move with the ratio)
            idle = [i for i, g in enumerate(tl.gaps[k]) if g > 1e-9 or (i == 0 and tl.trailing[k] > 1e-9)]
            assert set(idle) <= set(s.bubble_positions(k))
        # dependencies, virtual stage j = chunk * p + rank: F(j, i) after F(j-1, i), B(j, i) after
        # B(j+1, i) and F(j, i)
        start, end = {}, {}
        for k, order in enumerate(s.orders):
            for a, st, en in zip(order, tl.starts[k], tl.ends[k], strict=True):
                start[(a.op, a.chunk * p + k, a.mb)], end[(a.op, a.chunk * p + k, a.mb)] = st, en
        for j in range(p * v):
            for i in range(m):
                if j:
                    assert start[(Op.F, j, i)] >= end[(Op.F, j - 1, i)] - 1e-9
                assert start[(Op.B, j, i)] >= end[(Op.F, j, i)] - 1e-9
                if j < p * v - 1:
                    assert start[(Op.B, j, i)] >= end[(Op.B, j + 1, i)] - 1e-9
    for k in range(p):
        acts = s.stage_actions(k)
        for op in (Op.F, Op.B):
            assert sorted((a.chunk, a.mb) for a in acts if a.op is op) == [(c, i) for c in range(v) for i in range(m)]
        slots = [a.slot for a in acts if a.op is Op.BUBBLE]
        assert slots == list(range(len(slots))) and slots
        assert s.last_backwards(k) == {c: m - 1 for c in range(v)}


def test_interleaved_action_list_p2_m4() -> None:
    s = Schedule(name="Interleaved1F1B", n_stages=2, microbatches=4)    # 2 chunks per rank by default
    assert s.chunks == 2 and s.formula_bubble_fraction() == pytest.approx(1 / 9)
    assert repr(s.stage_actions(0)) == ("[F0, F1, F0c1, F1c1, F2, BUBBLE0, B0c1, F3, B1c1, F2c1, B0, F3c1, B1, "
                                        "BUBBLE1, B2c1, BUBBLE2, B3c1, B2, B3]")
    assert repr(s.stage_actions(1)) == "[BUBBLE0, F0, F1, F0c1, B0c1, F1c1, B1c1, F2, B0, F3, B1, F2c1, B2c1, " \
                                       "F3c1, B3c1, B2, B3]"
    assert Schedule(name="1F1B", n_stages=2, microbatches=4).chunks == 1


@pytest.mark.parametrize("name,p,m,v", [("1F1B", 2, 4, 1), ("GPipe", 3, 3, 1), ("Interleaved1F1B", 2, 4, 2),
                                         ("Interleaved1F1B", 3, 6, 2), ("Interleaved1F1B", 4, 4, 3)])
def test_executor_posts_each_receive_once_in_the_order_its_peer_sends(name: str, p: int, m: int, v: int) -> None:
    from torch import nn

    from spectrain_workloads.harvest.instrument import Instrument, InstrumentOptions
    from spectrain_workloads.target.pipeline import StageExecutor

    s = Schedule(name=name, n_stages=p, microbatches=m, chunks=v if v > 1 else 0)
    # what each rank's sends deliver, in send order: F of virtual stage j -> j + 1, B of j -> j - 1
    sent: dict[tuple[Op, int], list[int]] = {}
    for r, order in enumerate(s.orders):
        for a in order:
            to = a.chunk * p + r + (1 if a.op is Op.F else -1)
            if 0 <= to < p * v:
                sent.setdefault((a.op, to % p), []).append((to // p) * m + a.mb)
    for r in range(p):
        ex = StageExecutor(module=[nn.Identity() for _ in range(v)] if v > 1 else nn.Identity(), schedule=s,
                           stage=r, instrument=Instrument(rank=r, stage=r, opts=InstrumentOptions(enabled=False)))
        assert ex.act_tags == sent.get((Op.F, r), []) and ex.grad_tags == sent.get((Op.B, r), [])
        expect = {c * m + i for c in range(v) for i in range(m)}
        assert set(ex.act_tags) == {t for t in expect if t // m * p + r > 0}
        assert set(ex.grad_tags) == {t for t in expect if t // m * p + r < p * v - 1}
        if v == 1 and r > 0:
            assert ex.act_tags == list(range(m))          # GPipe / 1F1B: tag = microbatch, in order
        ex.close()


def test_schedule_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="microbatches"):
        Schedule(name="1F1B", n_stages=4, microbatches=2)
    with pytest.raises(ConfigError, match="schedule 'Zigzag'"):
        Schedule(name="Zigzag", n_stages=2, microbatches=2)
    with pytest.raises(ConfigError, match=r"spec\.target\.parallelism\.microbatches \(6\) must be a multiple of "
                                          r"pipeline \(4\) with schedule Interleaved1F1B.*use e\.g\. 8"):
        Schedule(name="Interleaved1F1B", n_stages=4, microbatches=6)
    with pytest.raises(ConfigError, match=r"pipeline must be >= 2"):
        Schedule(name="Interleaved1F1B", n_stages=1, microbatches=4)
