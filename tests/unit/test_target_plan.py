"""Target trainer pieces that need no peers: schedules, data loader, config checks, checkpoints."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from spectrain_workloads.config import JobConfig, Parallelism, TargetSpec
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus, resolve_source
from spectrain_workloads.errors import ConfigError
from spectrain_workloads.schedule import Op, Schedule, simulate

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
            assert sum(preds) == pytest.approx(idle)
    for k in range(p):
        acts = s.stage_actions(k)
        assert [a.mb for a in acts if a.op is Op.F] == list(range(m))
        assert sorted(a.mb for a in acts if a.op is Op.B) == list(range(m))
        slots = [a.slot for a in acts if a.op is Op.BUBBLE]
        assert slots == list(range(len(slots)))
        assert (len(slots) > 0) == (p > 1)


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
            assert sum(preds) == pytest.approx(sum(tl.gaps[k]) + tl.trailing[k])
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

    from spectrain_workloads.instrument import Instrument, InstrumentOptions
    from spectrain_workloads.pipeline import StageExecutor

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


def test_loader_is_deterministic_sharded_resumable_and_skewable(tmp_path) -> None:
    corpus = load_corpus("builtin:python-stdlib", max_bytes=1 << 18)
    assert corpus.dtype == np.uint16 and corpus.size == 1 << 18
    specs = [LoaderSpec(seq_len=16, batch_size=4, data_parallel=2, replica=r, seed=3) for r in (0, 1)]
    a, b = TokenLoader(corpus, specs[0]), TokenLoader(corpus, specs[1])
    x0, y0 = a.batch(5)
    x1, _ = b.batch(5)
    assert x0.shape == (4, 16) and (x0[:, 1:] == y0[:, :-1]).all()
    assert not any((x0[i] == x1[j]).all() for i in range(4) for j in range(4))   # disjoint shards
    first = [next(a)[0] for _ in range(3)]
    resumed = TokenLoader(corpus, specs[0])
    resumed.load_state_dict({"step": 2})
    assert (next(resumed)[0] == first[2]).all() and a.state_dict() == {"step": 3}
    skewed = [TokenLoader(corpus, dataclasses.replace(s, skew=4.0)) for s in specs]
    assert [sk.batch(0)[0].shape[1] for sk in skewed] == [16, 8]    # step 0: replica 0 is the slow one
    assert [sk.batch(1)[0].shape[1] for sk in skewed] == [8, 16]


def test_data_sources(tmp_path, monkeypatch) -> None:
    (tmp_path / "claim" / "txt").mkdir(parents=True)
    (tmp_path / "claim" / "txt" / "a.txt").write_text("hello world\n" * 200)
    monkeypatch.setenv("SPECTRAIN_DATA_ROOT", str(tmp_path))
    assert load_corpus("pvc://claim/txt").size == 2400 + 1
    assert load_corpus(f"file://{tmp_path}/claim/txt/a.txt").size == 2401
    for bad, msg in [(f"file://{tmp_path}/nope", "does not exist"), ("builtin:wikipedia", "unknown builtin"),
                     ("s3://bucket/x", "use builtin"), ("file://relative/dir", "absolute")]:
        with pytest.raises(ConfigError, match=msg) as info:
            resolve_source(bad)
        assert "spec.target.data.source" in str(info.value)


def _cfg(**par: int | str) -> JobConfig:
    return JobConfig(target=TargetSpec(parallelism=Parallelism(**{"schedule": "1F1B", **par})))


def test_bad_input_is_a_config_error_naming_the_field(tmp_path) -> None:
    from spectrain_workloads.trainer import make_plan

    plan = make_plan(_cfg(data=1, pipeline=2, microbatches=4), 2)
    assert plan.pipeline == 2 and plan.model.n_layers == 4
    assert make_plan(_cfg(data=1, pipeline=2, microbatches=4, schedule="Interleaved1F1B"), 2).schedule.chunks == 2
    cases = [
        (_cfg(data=2, pipeline=2, microbatches=4), 2, r"spec\.target\.parallelism: data \(2\) x pipeline \(2\)"),
        (_cfg(data=1, pipeline=3, microbatches=4), 3, r"pipeline \(3\) must divide the model's n_layers \(4"),
        (_cfg(data=1, pipeline=4, microbatches=4, schedule="Interleaved1F1B"), 4,
         r"Interleaved1F1B .* pipeline x 2 = 8 must divide the model's n_layers \(4, spec\.target\.model\.preset "
         r"'debug'\); set spec\.target\.model\.overrides\.n_layers to a multiple of 8"),
        (_cfg(data=1, pipeline=2, microbatches=3, schedule="Interleaved1F1B"), 2,
         r"spec\.target\.parallelism\.microbatches \(3\) must be a multiple of pipeline \(2\)"),
    ]
    unknown = _cfg(data=1, pipeline=1)
    unknown.target.model.preset = "huge"
    cases.append((unknown, 1, r"model.preset 'huge' is unknown"))
    unreadable = _cfg(data=1, pipeline=1)
    unreadable.target.data.source = f"file://{tmp_path}/missing"
    cases.append((unreadable, 1, r"spec\.target\.data\.source .* does not exist"))
    odd = _cfg(data=1, pipeline=2, microbatches=3)
    odd.target.data.batch_size = 8
    cases.append((odd, 2, r"batchSize \(8\) must be a multiple of .*microbatches \(3\)"))
    for cfg, world, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            make_plan(cfg, world)


def test_checkpoints_are_atomic_and_keep_last_n(tmp_path) -> None:
    import torch

    from spectrain_workloads.checkpoint import CheckpointManager

    mgr = CheckpointManager(tmp_path, rank=1, keep=2)
    (mgr.dir / ".tmp-step-9-999999").mkdir(parents=True)       # a killed save's leftover
    for step in (2, 4, 6):
        mgr.save(step, {"step": step, "w": torch.full((3,), float(step))})
    assert mgr.steps() == [4, 6] and not list(mgr.dir.glob(".tmp-*"))
    assert torch.equal(mgr.load(6)["w"], torch.full((3,), 6.0))


def test_instrument_interleave_pattern_and_option() -> None:
    from spectrain_workloads.trainer import TrainerOptions, instrumented_step

    assert all(instrumented_step(s, 0) for s in range(10))
    # blocks of 2 in the order on off off on, then again
    assert [instrumented_step(s, 2) for s in range(16)] == [True] * 2 + [False] * 4 + [True] * 4 + [False] * 4 + [True] * 2
    env = {"SPECTRAIN_RUN_DIR": "/tmp/x", "SPECTRAIN_INSTRUMENT_INTERLEAVE": "4"}
    assert TrainerOptions.from_env(env).instrument_interleave == 4
    with pytest.raises(ConfigError, match="SPECTRAIN_INSTRUMENT_INTERLEAVE must be >= 0"):
        TrainerOptions.from_env({**env, "SPECTRAIN_INSTRUMENT_INTERLEAVE": "-1"})
    with pytest.raises(ConfigError, match="SPECTRAIN_INSTRUMENT_INTERLEAVE='x' is not a valid int"):
        TrainerOptions.from_env({**env, "SPECTRAIN_INSTRUMENT_INTERLEAVE": "x"})
