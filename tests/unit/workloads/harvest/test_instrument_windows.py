"""Window predictors of the target's instrumentation: the pure functions (window_predictors.py) and the
Instrument driven by a fake clock (synthetic timestamps, no sleeps, no peers)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from spectrain_workloads.harvest import instrument as im
from spectrain_workloads.harvest.instrument import Instrument, InstrumentOptions
from spectrain_workloads.harvest.window_predictors import (
    lagged_prediction_ns,
    min_relative_error_center,
    peer_lag_ns,
    prefer_second,
    usual_end,
)

pytestmark = pytest.mark.unit

MS = 1_000_000


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000 * MS

    def __call__(self) -> int:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    ticks = iter(range(0, 1 << 40, 1000))          # cost clocks: 1 us further at every reading
    monkeypatch.setattr(im, "time", types.SimpleNamespace(monotonic_ns=c, perf_counter_ns=lambda: next(ticks),
                                                          thread_time_ns=lambda: next(ticks)))
    return c


def _instr(**kw: object) -> Instrument:
    return Instrument(rank=0, stage=0, opts=InstrumentOptions(cost_path="", **kw))  # type: ignore[arg-type]


def test_min_relative_error_center_sits_in_the_dense_short_cluster() -> None:
    xs = [1.0, 1.1, 1.2, 1.15, 6.0, 9.0, 12.0]        # median 1.15, mean ~4.5
    c = min_relative_error_center(xs)
    # the shortest run of 4 is [1.0, 1.2]: p = 2 * 1.0 * 1.2 / 2.2, 1/11 from both ends
    assert c == pytest.approx(2 * 1.0 * 1.2 / 2.2)
    errs = sorted(abs(c - x) / x for x in xs)
    for p in (1.15, sum(xs) / len(xs)):                # median and mean do no better on this metric
        assert errs[3] <= sorted(abs(p - x) / x for x in xs)[3]
    assert min_relative_error_center([]) == 0.0
    assert min_relative_error_center([5.0]) == 5.0
    assert min_relative_error_center([0.0, 3.0]) == 3.0   # zeros are left out (no relative error)
    assert min_relative_error_center([2.0, 2.0, 2.0, 50.0]) == 2.0


def test_prefer_second_needs_both_histories_and_a_strictly_lower_median() -> None:
    assert prefer_second([0.5, 0.6, 0.7], [0.1, 0.2, 0.9])
    assert not prefer_second([0.1, 0.2], [0.1, 0.2])
    assert not prefer_second([], [0.1])
    assert not prefer_second([0.5], [])


def test_peer_lag_and_lagged_prediction() -> None:
    # launched at 10 ms, ended at 25 ms, link 1 ms: the peer launched at 24 ms, 14 ms behind
    assert peer_lag_ns(10 * MS, 25 * MS, 1 * MS) == 14 * MS
    assert lagged_prediction_ns(14 * MS, 1 * MS) == 15 * MS
    # the peer was there first: the link time alone
    assert peer_lag_ns(10 * MS, 11 * MS, 1 * MS) == 0
    assert lagged_prediction_ns(-3 * MS, 1 * MS) == 1 * MS
    assert lagged_prediction_ns(0, 0) == 1


def _step(ins: Instrument, step: int) -> None:
    """What the executor does between steps: the last step's windows are learned, the next begins."""
    ins.end_step()
    ins.step = step


def _bucket(ins: Instrument, clock: _Clock, k: int, launch: int, end: int) -> int:
    """Open dp bucket k at `launch`, close it at `end`; returns its prediction."""
    clock.t = launch
    w = ins.comm_open(f"dp-bucket-{k}", 1000, anchor="dp")
    assert w is not None
    clock.t = end
    ins.comm_close(w)
    return w.predicted_ns


def test_dp_buckets_after_the_first_completion_use_the_steps_lag(clock: _Clock) -> None:
    ins = _instr()
    try:
        base = 1_000 * MS
        for step in range(3):      # history: the peer on time, each bucket's link 1 ms
            _step(ins, step)
            t = base + step * 100 * MS
            _bucket(ins, clock, 0, t, t + 1 * MS)
            _bucket(ins, clock, 1, t + 2 * MS, t + 3 * MS)
            _bucket(ins, clock, 2, t + 4 * MS, t + 5 * MS)
        # step 3: the peer is 10 ms behind; bucket 0 shows it, buckets 1 and 2 (opened after it
        # completed) are predicted as lag + link
        _step(ins, 3)
        t = base + 300 * MS
        clock.t = t
        w0 = ins.comm_open("dp-bucket-0", 1000, anchor="dp")
        clock.t = t + 11 * MS
        ins.comm_close(w0)
        p1 = _bucket(ins, clock, 1, t + 12 * MS, t + 12 * MS + 1 * MS)
        # bucket 0 ended 11 ms after its launch with a 1 ms link: the peer is 10 ms behind, so
        # bucket 1 ends 10 ms (the peer's launch of it) + 1 ms (link) after its own launch
        assert p1 == 11 * MS
        # a new step starts without a lag: back to the anchored history (end - anchor = 1 ms)
        _step(ins, 4)
        t = base + 400 * MS
        assert _bucket(ins, clock, 0, t, t + 1 * MS) == 1 * MS
    finally:
        ins.close()


def test_usual_end_is_the_on_time_mode_of_a_bimodal_history() -> None:
    on_time, late = [2.0, 2.5, 3.0, 2.2], [160.0, 170.0, 181.0, 175.0]
    assert usual_end(on_time + late, 0.25) == 2.2      # nearest rank: sample 1 of 8 (0-based)
    assert usual_end([late[0], on_time[0]], 0.25) == 2.0
    assert usual_end(late + [3.0], 0.25) == 160.0       # a peer late in most steps is learned
    assert usual_end([4.0], 0.25) == 4.0 and usual_end([], 0.25) == 0.0
    assert usual_end(on_time + late, 1.0) == 181.0
    with pytest.raises(ValueError, match="usual_end_quantile"):
        InstrumentOptions(cost_path="", usual_end_quantile=1.5)


def test_dp_rotating_straggler_predicts_the_on_time_end_and_the_late_steps_wait(clock: _Clock) -> None:
    """Replicas take turns being slow: this one waits ~100 ms in every other step. The bucket is
    predicted to end on time (its 1 ms link after the anchor), not between the modes, so the late
    steps' wait is left to the Imbalance watch (it arms at the expected end + imbalance_min)."""
    ins = _instr()
    try:
        for step in range(6):
            _step(ins, step)
            t = 1_000 * MS + step * 500 * MS
            _bucket(ins, clock, 0, t, t + (101 if step % 2 else 1) * MS)
        _step(ins, 6)
        t = 4_000 * MS
        assert _bucket(ins, clock, 0, t, t + 1 * MS) == 1 * MS
        clock.t = t + 1 * MS
        assert ins.expected_comm_end() == t + 1 * MS
        for step in range(7, 13):       # then the peer is late in every step: that is learned
            _step(ins, step)
            t = 1_000 * MS + step * 500 * MS
            _bucket(ins, clock, 0, t, t + 101 * MS)
        _step(ins, 13)
        assert _bucket(ins, clock, 0, 8_000 * MS, 8_101 * MS) == 101 * MS
    finally:
        ins.close()


def test_dp_lag_when_this_replica_is_the_late_one_predicts_the_link(clock: _Clock) -> None:
    ins = _instr()
    try:
        for step, d1 in enumerate((1 * MS, 6 * MS)):      # bucket 1: once on time, once the peer late
            _step(ins, step)
            t = 1_000 * MS + step * 100 * MS
            _bucket(ins, clock, 0, t, t + 2 * MS)
            _bucket(ins, clock, 1, t + 3 * MS, t + 3 * MS + d1)
        _step(ins, 2)
        t = 1_300 * MS
        _bucket(ins, clock, 0, t, t + 2 * MS)               # as short as its link (2 ms): lag 0
        # the anchored history alone would say anchor + median(4, 9 ms) - launch = 3.5 ms; with the
        # step's lag known (0: the peer is not behind) it is the link alone, bucket 1's shortest: 1 ms
        assert _bucket(ins, clock, 1, t + 3 * MS, t + 4 * MS) == 1 * MS
    finally:
        ins.close()


def test_bubble_switches_to_slot_history_when_the_simulation_keeps_missing(clock: _Clock) -> None:
    ins = _instr(history=4)
    try:
        sims = [10 * MS, 30 * MS, 10 * MS, 30 * MS, 10 * MS, 30 * MS, 10 * MS, 30 * MS]   # own F/B jitter
        preds = []
        for step, sim in enumerate(sims):
            _step(ins, step)
            w = ins.bubble_open(sim, slot=0)
            assert w is not None
            preds.append(w.predicted_ns)
            clock.t += 20 * MS                                # the peer's bubble is always 20 ms
            ins.bubble_close(w)
        assert preds[0] == 10 * MS                            # no history: the simulation
        assert preds[-1] == 20 * MS                           # the slot's history won
        # a slot where the simulation is right keeps it
        for step, sim in enumerate(sims):
            _step(ins, step)
            w = ins.bubble_open(sim, slot=1)
            assert w is not None
            last = w.predicted_ns
            clock.t += int(sim)
            ins.bubble_close(w)
        assert last == sims[-1]
    finally:
        ins.close()


def test_comm_history_prediction_is_the_min_relative_error_center(clock: _Clock) -> None:
    ins = _instr()
    try:
        for d in (1 * MS, 1 * MS, 8 * MS, 1.1 * MS, 9 * MS):
            w = ins.comm_open("pp-recv-act", 64, pos=1)
            clock.t += int(d)
            ins.comm_close(w)
        ins.end_step()
        # the shortest run of 3 of (1, 1, 1.1, 8, 9 ms) is 1-1.1 ms: 2 * 1 * 1.1 / 2.1 ms; the median
        # would say 1.1 ms, the mean 4 ms
        assert ins.predict_comm_ns("pp-recv-act", 64, 1) == int(2 * MS * 1.1 * MS / (2.1 * MS))
    finally:
        ins.close()


def test_cost_accounting_only_with_a_cost_path(clock: _Clock, tmp_path: Path) -> None:
    plain = _instr()
    assert "comm_open" not in vars(plain)              # nothing wrapped: the normal path is unchanged
    plain.close()
    assert not list(tmp_path.iterdir())

    ins = Instrument(rank=3, stage=1, opts=InstrumentOptions(cost_path=str(tmp_path / "cost")))
    assert "comm_open" in vars(ins)
    ins.step = 5
    w = ins.comm_open("pp-send-act", 64, pos=0)
    ins.comm_close(w)
    ins.record_compute("F", 1000)
    ins.close()
    rec = json.loads((tmp_path / "cost-rank-3.json").read_text())
    assert rec["rank"] == 3 and rec["calls"] == 5       # + the sync_end() and end_step() that close() makes
    assert set(rec["per_step_wall_ns"]) == set(rec["per_step_cpu_ns"]) == {"5"}
    assert rec["total_wall_ns"] == rec["per_step_wall_ns"]["5"] > 0
    assert rec["total_cpu_ns"] == rec["per_step_cpu_ns"]["5"] > 0


def test_disabled_instrument_ignores_the_cost_path(tmp_path: Path) -> None:
    ins = Instrument(rank=0, stage=0, opts=InstrumentOptions(enabled=False, cost_path=str(tmp_path / "c")))
    assert ins.comm_open("x", 1) is None
    ins.close()
    assert not list(tmp_path.iterdir())
