"""The target trainer as real processes (gloo on loopback, debug preset, tiny batches).

Runs are module-scoped and shared between assertions to keep the tier short on 2 cores:
- `pp`: pipeline 2 x 1F1B, 4 microbatches of 2 x 128 tokens (reference loss, bubbles, data
  channel, shared files): long enough F/B that per-step overheads do not blur the bubbles;
- `ipp`: the same with Interleaved1F1B (2 chunks of 1 layer per rank): reference loss, bubbles,
  data channel from the last chunk, bitwise resume from a copy of its step-8 checkpoints;
- `idp`: data 2 x pipeline 2 x Interleaved1F1B, a few short steps (per-chunk DDP vs a reference);
- `dp`: data 2, small DDP buckets (loss falls, comm windows per bucket, no imbalance);
- `dp_off`: the same with instrumentation off (bitwise-equal losses, no windows);
- `dp_skew`: the same with the seq-length skew injector (imbalance windows);
- a SIGTERM'd run of `dp`'s config, resumed (bitwise continuation of `dp`).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.launch import launch_local, ring_file, stop, wait_all
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

STEPS = 12
PP_SEQ = 128
RUN_TIMEOUT_S = 150


def _config(path: Path, *, data: int, pipeline: int, microbatches: int, steps: int = STEPS,
            schedule: str = "1F1B", every: int = 4, seq_len: int = 32) -> Path:
    manifest = {
        "apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "t"},
        "spec": {"mode": "Pretrain", "seed": 7, "target": {
            "image": "x", "nodes": data * pipeline, "procsPerNode": 1,
            "parallelism": {"data": data, "pipeline": pipeline, "microbatches": microbatches, "schedule": schedule},
            "model": {"preset": "debug"},
            "data": {"source": "builtin:python-stdlib", "seqLen": seq_len, "batchSize": 8},
            "optimizer": {"name": "AdamW", "lr": 0.003},
            "steps": steps, "checkpoint": {"everySteps": every, "keep": 2, "claimName": "run"}}}}
    path.write_text(json.dumps(manifest))
    return path


BASE_ENV = {"SPECTRAIN_DATA_MAX_BYTES": str(1 << 20), "SPECTRAIN_BUCKET_CAP_MB": "0.05"}


def _run(root: Path, cfg: Path, world: int, env: dict[str, str] | None = None) -> Path:
    procs = launch_local(cfg, world, root, root / "ring", env={**BASE_ENV, **(env or {})})
    codes = wait_all(procs, RUN_TIMEOUT_S)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((root / "logs").glob("*.log")))
    assert codes == [0] * world, logs
    return root


def _lines(root: Path, name: str) -> list[dict[str, Any]]:
    path = root / "metrics" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(root: Path, rank: int) -> list[float]:
    return [line["loss"] for line in _lines(root, f"target-rank-{rank}.jsonl")]


def _windows(root: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    return [w for w in _lines(root, f"windows-rank-{rank}.jsonl") if w["kind"] == kind]


def _bubble_fraction(root: Path, stage: int) -> tuple[float, list[float]]:
    """The stage's bubble fraction: its idle time in Bubble windows / the time it spends in the
    pipeline schedule (the executor's span per step; the optimizer step, loss hand-over and metrics
    between steps are not part of the schedule the formula describes), per step from step 2 (the
    EMAs exist), and their median. A step is ~50 ms with bubbles of a few ms: one preemption of the
    other stage on this shared 2-core machine (tens of ms) lands in this stage's bubble slots and
    would move a sum over all steps by 0.1; the median is the fraction of a typical step, which a
    wrong schedule (0 or 0.5) moves in every step."""
    bubbles = _windows(root, stage, "Bubble")
    per_step = []
    for s in _lines(root, f"target-rank-{stage}.jsonl")[2:]:
        idle_ms = sum(w["actual_ns"] for w in bubbles if w["step"] == s["step"]) / 1e6
        per_step.append(idle_ms / s["pipeline_ms"])
    return statistics.median(per_step), per_step


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp")
    return _run(root, _config(root / "cfg.json", data=1, pipeline=2, microbatches=4, seq_len=PP_SEQ), 2)


@pytest.fixture(scope="module")
def dp_cfg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _config(tmp_path_factory.mktemp("cfg") / "dp.json", data=2, pipeline=1, microbatches=2, seq_len=64)


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory, dp_cfg: Path) -> Path:
    return _run(tmp_path_factory.mktemp("dp"), dp_cfg, 2)


@pytest.fixture(scope="module")
def ipp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ipp")
    return _run(root, _config(root / "cfg.json", data=1, pipeline=2, microbatches=4, seq_len=PP_SEQ,
                              schedule="Interleaved1F1B"), 2)


def _reference_losses(cfg_path: Path, seq_len: int, steps: int, data: int = 1) -> list[float]:
    """Single-process losses of replica 0 for the same seed, microbatching and data shards (the
    gradient is the mean over the replicas' batches, as DDP's)."""
    import torch
    import torch.nn.functional as F

    from spectrain_api import config
    from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus
    from spectrain_workloads.model import Transformer, model_config
    from spectrain_workloads.optim import build_optimizer

    torch.set_num_threads(1)
    cfg = config.load(cfg_path)
    m = cfg.target.parallelism.microbatches
    model = Transformer(model_config("debug", vocab_size=264))
    model.init_weights(cfg.seed)
    opt = build_optimizer(model, cfg.target.optimizer, stage=0, n_stages=1)
    corpus = load_corpus("builtin:python-stdlib", max_bytes=1 << 20)
    loaders = [TokenLoader(corpus, LoaderSpec(seq_len=seq_len, batch_size=8, data_parallel=data, replica=r,
                                              seed=cfg.seed)) for r in range(data)]
    b = 8 // m
    ref = []
    for step in range(steps):
        for r, loader in enumerate(loaders):
            x, y = loader.batch(step)
            total = 0.0
            for i in range(m):
                loss = F.cross_entropy(model(x[b * i:b * i + b]).reshape(-1, 264), y[b * i:b * i + b].reshape(-1)) / m
                (loss / data).backward()
                total += loss.item()
            if r == 0:
                ref.append(total)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref


def test_pipeline_loss_equals_single_process_reference(pp: Path) -> None:
    import torch
    import torch.nn.functional as F

    from spectrain_api import config
    from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus
    from spectrain_workloads.model import Transformer, model_config
    from spectrain_workloads.optim import build_optimizer

    torch.set_num_threads(1)
    cfg = config.load(pp / "cfg.json")
    model = Transformer(model_config("debug", vocab_size=264))
    model.init_weights(cfg.seed)
    opt = build_optimizer(model, cfg.target.optimizer, stage=0, n_stages=1)
    loader = TokenLoader(load_corpus("builtin:python-stdlib", max_bytes=1 << 20),
                         LoaderSpec(seq_len=PP_SEQ, batch_size=8, seed=cfg.seed))
    ref = []
    for step in range(STEPS):
        x, y = loader.batch(step)
        total = 0.0
        for i in range(4):   # same microbatching as the pipeline; mean over the batch
            loss = F.cross_entropy(model(x[2 * i:2 * i + 2]).reshape(-1, 264), y[2 * i:2 * i + 2].reshape(-1)) / 4
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(total)
    got = _losses(pp, 1)                       # the last stage computes the loss
    assert _losses(pp, 0) == got               # ... and sends it to rank 0 for progress
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert json.loads((pp / "progress.json").read_text())["step"] == STEPS    # completed steps


def test_bubble_windows_follow_the_schedule(pp: Path) -> None:
    from spectrain_workloads.harvest.schedule import Op, Schedule

    sched = Schedule(name="1F1B", n_stages=2, microbatches=4)
    fractions = []
    for stage in (0, 1):
        n_slots = sum(1 for a in sched.stage_actions(stage) if a.op is Op.BUBBLE)
        bubbles = _windows(pp, stage, "Bubble")
        for step in range(STEPS):
            mine = sorted((w for w in bubbles if w["step"] == step), key=lambda w: w["start_ns"])
            assert [w["slot"] for w in mine] == list(range(n_slots)), (stage, step)
            if step >= 2:   # EMAs of F/B exist: every bubble has a prediction
                assert all(w["predicted_ns"] > 0 for w in mine)
        fractions.append(_bubble_fraction(pp, stage))
    # Formula 0.2 for (p, m) = (2, 4). A wrong schedule is far off: no overlap at all (each stage
    # idles while the other computes) gives 0.5, a schedule without warm-up/cool-down 0. Idle,
    # the mean is within 0.03 (bench-target: 0.18); the band leaves room for a shared 2-core
    # machine, where a stage preempted mid-compute moves idle time out of the scheduled slots.
    medians = [m for m, _ in fractions]
    assert abs(sum(medians) / 2 - sched.formula_bubble_fraction()) <= 0.08, fractions
    assert all(abs(f - sched.formula_bubble_fraction()) <= 0.12 for f in medians), fractions


def test_last_stage_feeds_the_ring_and_shared_files(pp: Path) -> None:
    from safetensors.torch import load_file

    from spectrain_workloads.ring import RingConsumer

    with RingConsumer.open(ring_file(pp / "ring", 1, world=2), timeout_s=5, start="oldest") as c:
        rec = c.next_data()
        assert rec is not None
        assert set(rec.meta) >= {"step", "dtype", "stage", "seq_index"} and rec.meta["stage"] == 1
        assert rec.arrays["hidden"].shape == (PP_SEQ, 64) and rec.arrays["tokens"].shape == (PP_SEQ,)
        kinds = {e.kind.api_name for e in c.poll_windows()}
        assert "Bubble" in kinds and "Communication" in kinds
    shared = pp / "target" / "shared"
    assert load_file(str(shared / "embedding.safetensors"))["weight"].shape == (264, 64)
    assert load_file(str(shared / "lm_head.safetensors"))["weight"].shape == (264, 64)
    assert json.loads((shared / "model_config.json").read_text())["n_layers"] == 4
    assert sorted(p.name for p in (pp / "target" / "rank-0").iterdir()) == ["step-12", "step-8"]


def test_data_parallel_loss_falls_and_comm_windows_cover_each_bucket(dp: Path) -> None:
    import torch

    losses = _losses(dp, 0)
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    params = torch.load(dp / "target" / "rank-0" / f"step-{STEPS}" / "state.pt", weights_only=False)["model"]
    grad_bytes = sum(t.numel() * 4 for t in params.values())
    for rank in (0, 1):
        comm = [w for w in _windows(dp, rank, "Communication") if w["channel"].startswith("dp-bucket-")]
        per_step = [[w for w in comm if w["step"] == s] for s in range(STEPS)]
        buckets = sorted(w["channel"] for w in per_step[-1])
        assert len(buckets) >= 3 and len(set(buckets)) == len(buckets)
        for ws in per_step[1:]:   # DDP may regroup buckets after its first step
            assert sorted(w["channel"] for w in ws) == buckets
            assert sum(w["bytes"] for w in ws) == grad_bytes    # every gradient byte, once
            assert all(w["predicted_ns"] > 0 and w["actual_ns"] > 0 for w in ws)


def test_imbalance_windows_appear_with_skew_and_not_without(dp: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("skew")
    steps = 8
    # Long sequences so the injected skew (256 vs 8 tokens) dwarfs this shared machine's stalls.
    cfg = _config(root / "skew.json", data=2, pipeline=1, microbatches=2, steps=steps, seq_len=256, every=100)
    skew = _run(root, cfg, 2, {"SPECTRAIN_DATA_SKEW": "32"})
    for rank in (0, 1):
        # At step s replica s % 2 is the slow one; the other waits for it at the gradient all-reduce.
        fast_steps = {s for s in range(1, steps) if s % 2 != rank}
        skewed = _windows(skew, rank, "Imbalance")
        assert len({w["step"] for w in skewed} & fast_steps) >= len(fast_steps) // 2 + 1, (rank, skewed)
        assert all(w["predicted_ns"] == 0 and w["actual_ns"] > 0 for w in skewed)
        # Balanced, only scheduling noise makes a rank wait: far less per step.
        per_fast_step = sum(w["actual_ns"] for w in skewed if w["step"] in fast_steps) / len(fast_steps)
        per_balanced_step = sum(w["actual_ns"] for w in _windows(dp, rank, "Imbalance")) / STEPS
        assert per_balanced_step < per_fast_step / 3, (rank, per_balanced_step, per_fast_step)


def test_instrumentation_off_is_bitwise_identical(dp: Path, dp_cfg: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    off = _run(tmp_path_factory.mktemp("off"), dp_cfg, 2, {"SPECTRAIN_INSTRUMENT": "0"})
    for rank in (0, 1):
        assert _losses(off, rank) == _losses(dp, rank)
        assert _lines(off, f"windows-rank-{rank}.jsonl") == []


def test_interleaved_instrumentation_is_bitwise_and_marks_its_steps(dp: Path, dp_cfg: Path,
                                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """bench-target's overhead run: instrumented and plain steps alternate (blocks of 2: on on off
    off off off on on ...) without changing the losses, and only instrumented steps have windows."""
    mixed = _run(tmp_path_factory.mktemp("interleaved"), dp_cfg, 2, {"SPECTRAIN_INSTRUMENT_INTERLEAVE": "2"})
    expect = [True, True, False, False, False, False, True, True, True, True, False, False]
    for rank in (0, 1):
        assert _losses(mixed, rank) == _losses(dp, rank)
        assert [line["instrumented"] for line in _lines(mixed, f"target-rank-{rank}.jsonl")] == expect[:STEPS]
        steps = {w["step"] for w in _lines(mixed, f"windows-rank-{rank}.jsonl")}
        assert steps == {i for i, on in enumerate(expect[:STEPS]) if on}, (rank, steps)


def test_sigterm_saves_and_resume_is_bitwise(dp: Path, dp_cfg: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("resume")
    long_cfg = _config(root / "long.json", data=2, pipeline=1, microbatches=2, steps=1000, every=1000, seq_len=64)
    procs = launch_local(long_cfg, 2, root, root / "ring", env={**BASE_ENV, "SPECTRAIN_TERM_GRACE_S": "20"})
    try:
        wait_for(lambda: len(_lines(root, "target-rank-1.jsonl")) >= 2, timeout=120, what="two steps")
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        codes = wait_all(procs, 20)
    finally:
        stop(procs)
    assert codes == [143, 143]
    saved = [int(p.name.split("-")[1]) for p in (root / "target" / "rank-0").iterdir()]
    assert len(saved) == 1 and 2 <= saved[0] < STEPS, saved
    _run(root, dp_cfg, 2)   # same run dir, steps = STEPS: resumes from the SIGTERM checkpoint
    for rank in (0, 1):
        losses = _losses(root, rank)
        assert losses[-(STEPS - saved[0]):] == _losses(dp, rank)[saved[0]:]
        assert losses[:saved[0]] == _losses(dp, rank)[:saved[0]]


def test_interleaved_loss_equals_single_process_reference(ipp: Path) -> None:
    ref = _reference_losses(ipp / "cfg.json", PP_SEQ, STEPS)
    got = _losses(ipp, 1)                      # rank 1 holds the last virtual stage (chunk 1: layer 3 + head)
    assert _losses(ipp, 0) == got
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert sorted(p.name for p in (ipp / "target" / "rank-0").iterdir()) == ["step-12", "step-8"]


def test_interleaved_bubble_windows_follow_the_schedule(ipp: Path) -> None:
    from spectrain_workloads.harvest.schedule import Op, Schedule

    sched = Schedule(name="Interleaved1F1B", n_stages=2, microbatches=4)
    fractions = []
    for stage in (0, 1):
        n_slots = sum(1 for a in sched.stage_actions(stage) if a.op is Op.BUBBLE)
        assert n_slots == (3 if stage == 0 else 1)
        bubbles = _windows(ipp, stage, "Bubble")
        for step in range(STEPS):
            mine = sorted((w for w in bubbles if w["step"] == step), key=lambda w: w["start_ns"])
            assert [w["slot"] for w in mine] == list(range(n_slots)), (stage, step)
            if step >= 2:
                assert all(w["predicted_ns"] > 0 for w in mine)
        fractions.append(_bubble_fraction(ipp, stage))
    # Formula (p-1)/(v*m+p-1) = 1/9 for (p, m, v) = (2, 4, 2), against 0.2 for 1F1B with the same
    # (p, m): the same band as the 1F1B test.
    assert sched.formula_bubble_fraction() == pytest.approx(1 / 9)
    medians = [m for m, _ in fractions]
    assert abs(sum(medians) / 2 - sched.formula_bubble_fraction()) <= 0.08, fractions
    assert all(abs(f - sched.formula_bubble_fraction()) <= 0.12 for f in medians), fractions


def test_interleaved_feeds_the_ring_from_the_last_chunk_and_resumes_bitwise(
        ipp: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    import shutil

    from safetensors.torch import load_file

    from spectrain_workloads.ring import RingConsumer

    with RingConsumer.open(ring_file(ipp / "ring", 1, world=2), timeout_s=5, start="oldest") as c:
        rec = c.next_data()
        assert rec is not None and rec.meta["stage"] == 1
        assert rec.arrays["hidden"].shape == (PP_SEQ, 64) and rec.arrays["tokens"].shape == (PP_SEQ,)
    shared = ipp / "target" / "shared"
    assert load_file(str(shared / "embedding.safetensors"))["weight"].shape == (264, 64)
    assert load_file(str(shared / "lm_head.safetensors"))["weight"].shape == (264, 64)
    # every rank's checkpoint holds both of its chunks: rank r has layers r and 2 + r
    for rank in (0, 1):
        keys = torch_load(ipp / "target" / f"rank-{rank}" / "step-8" / "state.pt")["model"].keys()
        assert {k.split(".")[2] for k in keys if ".layers." in k} == {str(rank), str(2 + rank)}
    root = tmp_path_factory.mktemp("iresume")
    for rank in (0, 1):
        shutil.copytree(ipp / "target" / f"rank-{rank}" / "step-8", root / "target" / f"rank-{rank}" / "step-8")
    _run(root, ipp / "cfg.json", 2)        # resumes from step 8
    for rank in (0, 1):
        assert _losses(root, rank) == _losses(ipp, rank)[8:]


def torch_load(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, weights_only=False)


def test_interleaved_with_data_parallel_equals_the_reference(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("idp")
    steps = 3
    cfg = _config(root / "cfg.json", data=2, pipeline=2, microbatches=2, steps=steps, every=100,
                  schedule="Interleaved1F1B")
    # 4 processes on a small machine: one thread each, no ring (windows still go to the metrics)
    _run(root, cfg, 4, {"SPECTRAIN_TORCH_THREADS": "1", "SPECTRAIN_DRAFTER_ENABLED": "0"})
    got = _losses(root, 1)                     # last stage of replica 0
    assert got == pytest.approx(_reference_losses(cfg, 32, steps, data=2), rel=1e-4, abs=1e-5)
    for rank in range(4):                      # each chunk all-reduces its own buckets every step
        comm = {w["channel"].rsplit("-", 1)[0] for w in _windows(root, rank, "Communication")
                if w["channel"].startswith("dp-bucket-") and w["step"] == steps - 1}
        assert comm == {"dp-bucket-c0", "dp-bucket-c1"}, (rank, comm)
