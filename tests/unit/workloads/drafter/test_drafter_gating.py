"""Drafter gating: unit-of-work estimate, window tracking, and the gate's start/continue rules."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from spectrain_workloads.drafter.gating import (
    MS,
    UNIT_KEY,
    CostModel,
    Gate,
    WindowTracker,
    quantile,
)
from spectrain_workloads.ring import WindowEvent, WindowKind

pytestmark = pytest.mark.unit


def start(wid: int, kind: WindowKind, at_ms: float, predicted_ms: float) -> WindowEvent:
    return WindowEvent(seq=wid, kind=kind, rank=0, stage=0, step=0, window_id=wid, start_ns=int(at_ms * MS),
                       predicted_duration_ns=int(predicted_ms * MS), actual_duration_ns=0, flags=0, is_end=False)


def end(ev: WindowEvent, actual_ms: float) -> WindowEvent:
    return WindowEvent(seq=ev.seq + 1, kind=ev.kind, rank=0, stage=0, step=0, window_id=ev.window_id,
                       start_ns=ev.start_ns, predicted_duration_ns=ev.predicted_duration_ns,
                       actual_duration_ns=int(actual_ms * MS), flags=0, is_end=True)


def make_gate(**kw: object) -> Gate:
    args: dict = dict(policy="IdleOnly", kinds=["Bubble", "Communication", "Imbalance", "RolloutTail"],
                      safety_margin_ms=2.0, min_window_ms=0.0, cost=CostModel(), tracker=WindowTracker())
    args.update(kw)
    return Gate(**args)


def test_cost_model_quantile_ignores_a_single_outlier_and_forgets_old_samples() -> None:
    c = CostModel(window=8, q=0.75)
    assert c.estimate(UNIT_KEY) is None
    for v in [5, 5, 5, 5, 5, 5, 5, 500]:
        c.observe(UNIT_KEY, v * MS)
    assert c.estimate(UNIT_KEY) == 5 * MS          # one preempted measurement does not lock us out
    for _ in range(8):
        c.observe(UNIT_KEY, 3 * MS)
    assert c.estimate(UNIT_KEY) == 3 * MS          # the window slides
    restored = CostModel(window=8, q=0.75)
    restored.load_state_dict(c.state_dict())
    assert restored.estimate(UNIT_KEY) == 3 * MS


def test_quantile_bounds() -> None:
    xs = list(range(101))
    assert quantile(xs, 0.0) == 0 and quantile(xs, 1.0) == 100 and quantile(xs, 0.5) == 50


def test_start_needs_unit_plus_margin_and_continue_needs_task_cost() -> None:
    g = make_gate()
    g.cost.observe(UNIT_KEY, 10 * MS)
    ev = start(1, WindowKind.BUBBLE, 0, predicted_ms=11.5)
    g.tracker.update([ev])
    b = g.budget(0)
    assert b.window is not None and b.remaining_ns == int(9.5 * MS)
    assert not g.allows(b, 10 * MS, starting=True)          # 11.5 ms < 10 unit + 2 margin
    g.tracker.update([start(2, WindowKind.BUBBLE, 0, predicted_ms=12.5)])
    b = g.budget(0)
    assert b.window is not None and b.window.window_id == 2   # the window with the most time left
    assert g.allows(b, 10 * MS, starting=True)
    # Continuing inside a window: a cheaper task (e.g. an optimizer step) fits where a unit does not.
    b = g.budget(int(5 * MS))
    assert not g.allows(b, 10 * MS, starting=False)
    assert g.allows(b, 4 * MS, starting=False)
    assert not g.allows(b, 4 * MS, starting=True)            # but it may not start work there


def test_window_end_closes_it_and_feeds_history() -> None:
    t = WindowTracker()
    ev = start(7, WindowKind.COMMUNICATION, 100, 20)
    t.update([ev])
    assert 7 in t.open
    closed = t.update([end(ev, 15)])
    assert not t.open and closed[0].actual_ns == 15 * MS and closed[0].end_ns == 115 * MS
    assert list(t.durations["Communication"]) == [15 * MS]
    assert list(t.ratios["Communication"]) == [0.75]


def test_optimistic_predictions_are_tempered_by_history() -> None:
    t = WindowTracker()
    for i in range(10):   # this kind always ends at half its prediction
        ev = start(i, WindowKind.COMMUNICATION, 0, 20)
        t.update([ev, end(ev, 10)])
    ev = start(99, WindowKind.COMMUNICATION, 1000, 20)
    t.update([ev])
    assert t.predicted_end_ns(t.open[99], 1000 * MS) == 1010 * MS
    # Pessimistic predictions are not stretched: the window is only promised what was predicted.
    t2 = WindowTracker()
    for i in range(10):
        ev = start(i, WindowKind.BUBBLE, 0, 10)
        t2.update([ev, end(ev, 20)])
    t2.update([start(99, WindowKind.BUBBLE, 0, 10)])
    assert t2.predicted_end_ns(t2.open[99], 0) == 10 * MS


def step_start(wid: int, kind: WindowKind, step: int, at_ms: float, predicted_ms: float) -> WindowEvent:
    return dataclasses.replace(start(wid, kind, at_ms, predicted_ms), step=step)


def test_each_call_site_is_tempered_by_its_own_history() -> None:
    """A stage with two bubbles per step: the first ends as predicted, the second at 0.3 of its
    prediction. The first keeps its full promise; the second is cut to its own early ends."""
    t = WindowTracker()
    wid = 0
    for step in range(10):
        for predicted, actual in ((40, 40), (20, 6)):
            wid += 1
            ev = step_start(wid, WindowKind.BUBBLE, step, 100 * wid, predicted)
            t.update([ev, end(ev, actual)])
    first = step_start(1000, WindowKind.BUBBLE, 10, 5000, 40)
    t.update([first])
    assert t.open[1000].site == 0
    assert t.predicted_end_ns(t.open[1000], 5000 * MS) == 5040 * MS
    second = step_start(1001, WindowKind.BUBBLE, 10, 5100, 20)
    t.update([end(first, 40), second])
    assert t.open[1001].site == 1
    assert t.predicted_end_ns(t.open[1001], 5100 * MS) == 5106 * MS
    # the kind's pooled history alone would have cut the first one to 0.3 of its promise too
    assert min(t.ratios["Bubble"]) == pytest.approx(0.3)
    # and the per-site history survives a checkpoint of the tracker
    t2 = WindowTracker()
    t2.load_state_dict(json.loads(json.dumps(t.state_dict())))
    assert t2.site_ratios == t.site_ratios


def test_open_ended_windows_use_the_distribution_of_past_windows() -> None:
    g = make_gate(safety_margin_ms=0.0)
    g.cost.observe(UNIT_KEY, 5 * MS)
    first = start(1, WindowKind.IMBALANCE, 0, 0)
    g.tracker.update([first])
    b = g.budget(0)
    assert b.window is None and "history" in b.reason       # nothing known yet: do not start
    g.tracker.update([end(first, 1)])
    durations = [2, 3, 40, 42, 44, 46, 48, 50, 52, 54]     # mostly long, some very short
    for i, d in enumerate(durations):
        ev = start(10 + i, WindowKind.IMBALANCE, 0, 0)
        g.tracker.update([ev, end(ev, d)])
    g.tracker.update([start(100, WindowKind.IMBALANCE, 1000, 0)])
    b = g.budget(1000 * MS)
    # 3 of the 11 past windows were very short: only 3 ms are promised with 80% confidence
    assert b.window is not None and b.remaining_ns == 3 * MS
    b = g.budget(1010 * MS)      # after 10 ms elapsed only the long ones are candidates
    assert b.remaining_ns == 32 * MS and g.allows(b, 5 * MS, starting=True)
    b = g.budget(1053 * MS)      # outlived nearly all: fewer than 5 survivors, nothing promised
    assert b.window is None


def test_policy_and_kind_filters() -> None:
    off = make_gate(policy="Off")
    off.cost.observe(UNIT_KEY, MS)
    off.tracker.update([start(1, WindowKind.BUBBLE, 0, 100)])
    assert not off.allows(off.budget(0), MS, starting=True)
    always = make_gate(policy="Always")
    assert always.allows(always.budget(0), 10**9, starting=True)     # no window needed
    kinds = make_gate(kinds=["Bubble"])
    kinds.cost.observe(UNIT_KEY, MS)
    kinds.tracker.update([start(1, WindowKind.ROLLOUT_TAIL, 0, 100)])
    b = kinds.budget(0)
    assert b.window is None and "RolloutTail" in b.reason and not kinds.allows(b, MS, starting=True)


def test_min_window_override_replaces_the_measured_unit() -> None:
    g = make_gate(min_window_ms=30.0, safety_margin_ms=0.0)
    g.cost.observe(UNIT_KEY, MS)
    assert g.unit_ns() == 30 * MS
    g.tracker.update([start(1, WindowKind.BUBBLE, 0, 25)])
    assert not g.allows(g.budget(0), MS, starting=True)
    g.tracker.update([start(2, WindowKind.BUBBLE, 0, 31)])
    assert g.allows(g.budget(0), MS, starting=True)


def test_unmeasured_unit_never_starts_and_lost_windows_expire() -> None:
    g = make_gate()
    g.tracker.update([start(1, WindowKind.BUBBLE, 0, 100)])
    assert not g.allows(g.budget(0), None, starting=True)
    assert g.tracker.expire(50 * MS) == []
    gone = g.tracker.expire(10_000 * MS)
    assert [w.window_id for w in gone] == [1] and not g.tracker.open


def test_unit_is_no_higher_than_a_larger_measured_micro_step() -> None:
    g = make_gate()
    g.cost.observe(("train", 2), 3 * MS)
    assert g.unit_ns() is None                               # the unit itself was never measured
    g.cost.observe(UNIT_KEY, 9 * MS)                         # measured at a busy moment
    g.cost.observe(("optim", 0), 1 * MS)                     # not a unit of training work
    assert g.unit_ns() == 3 * MS
    g.tracker.update([start(1, WindowKind.BUBBLE, 0, predicted_ms=6)])
    assert g.allows(g.budget(0), None, starting=True)       # 6 ms fits 3 + 2 margin, not 9 + 2


def test_the_gate_confidence_is_checked_and_passed_to_the_tracker() -> None:
    cost, tracker = CostModel(), WindowTracker()
    with pytest.raises(ValueError, match="confidence"):
        Gate(policy="IdleOnly", kinds=["Bubble"], safety_margin_ms=0, min_window_ms=0, cost=cost, tracker=tracker,
             confidence=1.0)
    for i in range(10):                      # windows end at 0.5, 0.6, ... 1.4 x their prediction
        ev = start(i + 1, WindowKind.BUBBLE, 100.0 * i, 50.0)
        tracker.update([ev, end(ev, 50.0 * (0.5 + 0.1 * i))])
    tracker.update([start(99, WindowKind.BUBBLE, 2000.0, 50.0)])
    remaining = {c: Gate(policy="IdleOnly", kinds=["Bubble"], safety_margin_ms=0, min_window_ms=0, cost=cost,
                         tracker=tracker, confidence=c).budget(int(2000 * MS)).remaining_ns for c in (0.8, 0.5)}
    assert remaining == {0.8: int(50 * 0.6 * MS), 0.5: int(50 * 0.9 * MS)}


def _gate_replay():  # type: ignore[no-untyped-def]
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[4] / "scripts" / "gate_replay.py"
    spec = importlib.util.spec_from_file_location("gate_replay", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gate_replay_fills_exactly_predicted_windows_without_overrun_and_trades_tail_for_overrun() -> None:
    """scripts/gate_replay.py drives the real tracker and gate: windows predicted exactly are filled
    up to the last task that fits, never past their end; windows that end 0.6-1.4 x their prediction
    are filled more, and overrun more often, as the confidence is lowered."""
    import random

    replay = _gate_replay().replay
    rng = random.Random(3)

    def log(ratio: object) -> list[dict[str, object]]:
        return [{"kind": "Bubble", "window_id": i, "step": i, "start_ns": i * 100 * MS, "predicted_ns": 40 * MS,
                 "actual_ns": int(40 * MS * (ratio() if callable(ratio) else ratio))} for i in range(300)]

    exact = replay(log(1.0), kind="Bubble", confidence=0.8, margin_ms=1.0, task_ms=5.0)
    assert exact["overrun_s"] == 0 and 0.7 < exact["harvested_fraction"] < 0.95
    noisy = log(lambda: rng.uniform(0.6, 1.4))
    runs = [replay(noisy, kind="Bubble", confidence=c, margin_ms=1.0, task_ms=5.0) for c in (0.9, 0.7, 0.5)]
    fill = [r["harvested_fraction"] for r in runs]
    late = [r["windows_overrun_fraction"] for r in runs]
    assert fill[0] < fill[1] < fill[2] and late[0] < late[1] < late[2]


def test_pick_task_order_and_the_optimizer_step_as_the_tail_filler() -> None:
    """A due optimizer step first, then verification, then training; with nothing else fitting, the
    gradients accumulated so far are applied early; no task starts a window without room for a unit."""
    from spectrain_workloads.drafter.gating import Budget, OpenWindow, pick_task

    cost = CostModel()
    cost.observe(UNIT_KEY, 5 * MS)
    gate = Gate(policy="IdleOnly", kinds=["Bubble"], safety_margin_ms=0, min_window_ms=0, cost=cost,
                tracker=WindowTracker())
    w = OpenWindow(1, "Bubble", 0, 0, 0, 40 * MS)

    def budget(ms: float) -> Budget:
        return Budget(w, int(ms * MS), "")

    optim, verify, train = ("optim", "o", 2 * MS, 0), ("verify", "v", 20 * MS, 0), ("train", ("train", 8), 8 * MS, 8)
    pick = functools.partial(pick_task, gate, verify=verify, train=train)
    assert pick(budget(30), starting=True, optim=optim, optim_due=True) == optim
    assert pick(budget(30), starting=True, optim=optim, optim_due=False) == verify
    assert pick(budget(10), starting=True, optim=optim, optim_due=False) == train
    assert pick(budget(10), starting=False, optim=optim, optim_due=True) == optim
    # the tail: no micro-step fits, the accumulated gradients are applied early
    assert pick(budget(3), starting=False, optim=optim, optim_due=False) == optim
    assert pick(budget(3), starting=False, optim=None, optim_due=False) is None
    assert pick(budget(1), starting=False, optim=optim, optim_due=False) is None
    # a window of 3 ms is shorter than the unit (5 ms): not started, not even for the optimizer step
    assert pick(budget(3), starting=True, optim=optim, optim_due=True) is None
    assert pick(budget(6), starting=True, optim=optim, optim_due=False) == optim
    assert pick(budget(-1), starting=False, optim=optim, optim_due=True) is None


def test_gate_replay_names_a_bad_argument(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    main = _gate_replay().main
    cases = [([str(tmp_path)], "does not exist: RUN is the --run-dir"),
             ([str(tmp_path), "--confidence", "1.0"], "--confidence values must be in (0, 1)"),
             ([str(tmp_path), "--task-ms", "-1"], "--task-ms > 0"),
             ([str(tmp_path), "--kind", "Nap"], "invalid choice: 'Nap'")]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
