"""The exporting rank's gate (drafter.worker_export) on a real LM drafter, real held-back samples and a
real export directory: no mocks. Candidates are the drafter's own checkpoints (`Worker._checkpoint`),
measured at once as at shutdown (`_finishing`: no idle windows to wait for).

- A scripted sequence of candidates, each ~3 % worse than the one before on the held-back samples,
  never moves LATEST below the acceptance it had at the start, re-measured on those samples (a gate
  comparing with 0.9 x the number stored at the last export lets every one through: LATEST 5.0 -> 4.1).
- The job's absolute floor (spec.drafter.export.minAcceptance): a candidate below it is never LATEST.
- Every rejection is counted by cause, in the summary the status path and Prometheus read.
- After a restart LATEST is read back from the export volume and is still the bar.
- A candidate no idle window measured in time: the first version is exported, a later one rejected.
- A paired round measures each model as it would measure it alone; the held LATEST shares the
  target's frozen tensors with the training model and copies only the trainable ones.
"""

from __future__ import annotations

import functools
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from spectrain_api.names import LM
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.combiner import Sample
from spectrain_workloads.drafter.export_latest import LatestDrafter
from spectrain_workloads.drafter.models import EagleDrafter, TargetShared
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.verify import measure, measure_batch
from spectrain_workloads.drafter.worker import Worker
from spectrain_workloads.drafter.worker_export import GATE_WAIT_S
from spectrain_workloads.model import ModelConfig, model_config

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

V, T, K, HELD_BACK = 64, 32, 4, 64
CFG = ModelConfig(vocab_size=V, dim=16, n_layers=1, n_heads=2, max_seq_len=T)
# The data: walks along one fixed permutation of the vocabulary (a sequence's next token is PERM[token]).
PERM = torch.randperm(V, generator=torch.Generator().manual_seed(3))


def _bent(n: int) -> torch.Tensor:
    """PERM with its first n transitions redirected (token j -> PERM[PERM[j]]): a drafter that learns it
    is wrong where a held-back chain crosses one of those, ~3 % of the chains per transition."""
    p = PERM.clone()
    p[:n] = PERM[PERM[:n]]
    return p


def _walk(perm: torch.Tensor, start: int) -> Sample:
    out = [start]
    for _ in range(T - 1):
        out.append(int(perm[out[-1]]))
    return Sample(tokens=torch.tensor(out), hidden=None, step=0)   # tokens only: the reference is the data


def _worker(tmp_path: Path, **settings: object) -> Worker:
    s = DrafterSettings(arch=LM, preset="debug", lr=3e-2, verify_k=K, verify_batch=16,  # type: ignore[arg-type]
                        eval_samples=HELD_BACK, **settings)
    g = torch.Generator().manual_seed(0)
    shared = TargetShared(embedding=torch.randn(V, 16, generator=g), lm_head=torch.randn(V, 16, generator=g),
                          model_config=CFG, digest="test", stamp=(0,))
    w = Worker(settings=s, rank=0, ring_path=tmp_path / "ring", run_dir=tmp_path / "run",
               export_dir=tmp_path / "export", device=torch.device("cpu"), stop=threading.Event())
    w._build_trainer(shared)
    w._finishing = True           # measure each candidate at once, as at shutdown
    w.buffer.eval.extend(_walk(PERM, i) for i in range(HELD_BACK))
    return w


def _train(w: Worker, perm: torch.Tensor, steps: int, seed: int) -> None:
    tr = w.trainer
    assert tr is not None
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = [_walk(perm, int(i)) for i in torch.randint(0, V, (16,), generator=g)]
        tr.micro_step(batch)
        tr.optimizer_step(len(batch))


def _acceptance(model: torch.nn.Module, w: Worker) -> float:
    """On every held-back walk at once (measure_batch: the sum of the rows measured one by one)."""
    assert w.trainer is not None
    tokens = torch.stack([s.tokens for s in w.buffer.eval])
    return measure_batch(model, tokens, None, w.trainer.target_head, k=K, max_starts=2).acceptance_length


def _latest(w: Worker) -> float:
    """LATEST's acceptance, re-measured now on the held-back samples (loaded from the export volume)."""
    assert w.export_dir is not None
    model, _ = ex.load_drafter(w.export_dir)
    return _acceptance(model, w)


def _propose(w: Worker) -> None:
    w.combiner.optimizer_steps += 1
    w._checkpoint("periodic")      # the candidate, measured and decided at once
    assert w.candidate is None


@functools.cache
def _trained() -> dict[str, torch.Tensor]:
    """The drafter's weights after learning PERM (acceptance 5.0 = k + 1 on the held-back walks)."""
    with tempfile.TemporaryDirectory() as d:
        w = _worker(Path(d))
        _train(w, PERM, 150, seed=0)
        assert w.trainer is not None
        return {k: v.detach().clone() for k, v in w.trainer.model.state_dict().items()}


def test_slightly_worse_candidates_never_lower_latest(tmp_path: Path) -> None:
    w = _worker(tmp_path)
    assert w.trainer is not None
    w.trainer.model.load_state_dict(_trained())
    _propose(w)
    start = _latest(w)
    assert start > 4.5 and w.exported_version == 1, start
    before = start
    for n in range(1, 7):         # each candidate learns one more wrong transition than the one before
        _train(w, _bent(n), 40, seed=n)
        acc = _acceptance(w.trainer.model, w)
        assert 0.95 * before <= acc <= 0.985 * before, (n, before, acc)     # ~3 % worse than the previous
        before = acc
        _propose(w)
        assert _latest(w) >= start, (n, start, _latest(w))
    assert before < 0.9 * start                # together far below the start
    assert w.exported_version == 1 and w.exports_rejected == 6


def test_the_floor_unmeasured_candidates_and_latest_after_a_restart(tmp_path: Path) -> None:
    w = _worker(tmp_path, min_acceptance=4.9)
    assert w.trainer is not None and w.export_dir is not None
    w.trainer.model.load_state_dict(_trained())
    _train(w, _bent(3), 40, seed=3)                  # ~4.55: below the floor, and the first version
    _propose(w)
    assert w.exported_version == 0 and not (w.export_dir / "LATEST").exists()
    w.trainer.model.load_state_dict(_trained())      # 5.0: above it
    _propose(w)
    assert w.exported_version == 2 and _latest(w) == 5.0
    w.buffer.eval.clear()                            # nothing held back: a floor to meet, nothing measured
    _propose(w)
    assert w.exported_version == 2
    by_cause = w.summary()["exportsRejectedByCause"]
    assert by_cause == {"below_latest": 0, "below_floor": 1, "non_finite": 0, "unmeasured": 1, "version_reused": 0}

    # a restart (same volumes, no floor): LATEST is read back from the export and still the bar
    w2 = _worker(tmp_path)
    assert w2.trainer is not None and w2.latest.version == 2 and w2.latest.module is not None
    assert _acceptance(w2.latest.module, w2) == 5.0
    _train(w2, _bent(1), 40, seed=1)                  # ~4.84
    _propose(w2)
    assert w2.exported_version == 2 and w2.rejected_by_cause["below_latest"] == 1
    assert (w2.export_dir / "LATEST").read_text().strip() == "v2"   # type: ignore[operator]


def test_a_paired_round_measures_each_model_as_alone_on_the_same_chunks(tmp_path: Path) -> None:
    w = _worker(tmp_path)
    tr = w.trainer
    assert tr is not None
    tr.model.load_state_dict(_trained())
    w.latest.take(tr.model, 1)
    _train(w, _bent(3), 40, seed=3)
    held = [(s.tokens, s.hidden) for s in w.buffer.eval]
    tr.begin_verify(list(w.buffer.eval), w.latest.module)
    chunks, result = 0, None
    while result is None:
        assert tr.verifier.paired
        result, chunks = tr.verify_chunk(), chunks + 1
    assert chunks == 2 * HELD_BACK // w.s.verify_batch and not tr.verifier.paired   # each chunk: candidate, LATEST
    assert result.reference is not None and w.latest.module is not None
    alone = measure(w.latest.module, held, tr.target_head, k=K, max_starts=2)
    assert result.reference.to_dict() == alone.to_dict() and alone.acceptance_length == 5.0
    assert result.to_dict() == measure(tr.model, held, tr.target_head, k=K, max_starts=2).to_dict()
    assert result.acceptance_length < 4.8


def test_latest_shares_the_target_s_frozen_tensors_and_copies_only_the_trainable_ones() -> None:
    cfg = model_config("debug", {"max_seq_len": 32})
    g = torch.Generator().manual_seed(0)

    def shared() -> TargetShared:
        return TargetShared(embedding=torch.randn(cfg.vocab_size, cfg.dim, generator=g),
                            lm_head=torch.randn(cfg.vocab_size, cfg.dim, generator=g), model_config=cfg,
                            digest="t", stamp=(0,))

    tr = DrafterTrainer(DrafterSettings(), shared(), torch.device("cpu"))     # EAGLE: frozen embedding, head
    model = tr.model
    assert isinstance(model, EagleDrafter)
    first = next(p for p in model.parameters() if p.requires_grad)
    first.grad = torch.ones_like(first)              # gradients mid-accumulation
    latest = LatestDrafter()
    latest.take(model, 1)
    held = latest.module
    assert isinstance(held, EagleDrafter)
    assert held.embed.weight is model.embed.weight and held.lm_head.weight is model.lm_head.weight
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    ours, theirs = dict(model.named_parameters()), dict(held.named_parameters())
    assert trainable and all(theirs[n] is not ours[n] and torch.equal(theirs[n], ours[n]) for n in trainable)
    assert all(p.grad is None and not p.requires_grad for p in held.parameters())
    assert first.grad is not None and bool((first.grad == 1).all())     # untouched
    tr.refresh_target(shared())                      # the target rewrote its head: LATEST scores against it too
    latest.share_frozen(model)
    assert torch.equal(held.lm_head.weight, model.lm_head.weight)


def test_a_candidate_no_window_measured_is_exported_first_and_rejected_once_there_is_latest(tmp_path: Path) -> None:
    """Under load no idle window may fit a verification chunk: a candidate left unmeasured past
    GATE_WAIT_S is decided by gate_verdict like one with nothing held back, so the first version is
    exported (the finite check alone) and a later one, with LATEST to beat, is rejected as unmeasured."""
    w = _worker(tmp_path)
    assert w.trainer is not None
    w._finishing = False          # candidates wait for an idle window, as while the target trains
    for _ in range(2):
        w.combiner.optimizer_steps += 1
        w._checkpoint("periodic")
        assert w.candidate is not None and w._settle_candidate()       # waiting: no verdict yet
        w.candidate["since"] -= GATE_WAIT_S + 1
        assert not w._settle_candidate() and w.candidate is None
    assert w.exported_version == 1 and (w.export_dir / "LATEST").read_text().strip() == "v1"  # type: ignore[operator]
    assert {c: n for c, n in w.rejected_by_cause.items() if n} == {"unmeasured": 1}, w.rejected_by_cause
    assert "no idle window fit a verification chunk" in w.export_rejected_reason
