"""The exporting rank's gate (drafter.worker_export) on a real LM drafter, real held-back samples and a
real export directory: no mocks. Candidates are the drafter's own checkpoints (`Worker._checkpoint`),
measured at once as at shutdown (`_finishing`: no idle windows to wait for).

- A scripted sequence of candidates, each ~3 % worse than the one before on the held-back samples,
  never moves LATEST below the acceptance it had at the start, re-measured on those samples (the
  old rule, 0.9 x the last export's stored number, exported them one after the other).
- The job's absolute floor (spec.drafter.export.minAcceptance): a candidate below it is never LATEST.
- Every rejection is counted by cause, in the summary the status path and Prometheus read.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from spectrain_api.names import LM
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.combiner import Sample
from spectrain_workloads.drafter.models import TargetShared
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.verify import measure
from spectrain_workloads.drafter.worker import Worker
from spectrain_workloads.model import ModelConfig

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
    assert w.trainer is not None
    samples = [(s.tokens, s.hidden) for s in w.buffer.eval]
    return measure(model, samples, w.trainer.target_head, k=K, max_starts=2).acceptance_length


def _latest(w: Worker) -> float:
    """LATEST's acceptance, re-measured now on the held-back samples (loaded from the export volume)."""
    assert w.export_dir is not None
    model, _ = ex.load_drafter(w.export_dir)
    return _acceptance(model, w)


def _propose(w: Worker) -> None:
    w.combiner.optimizer_steps += 1
    w._checkpoint("periodic")      # the candidate, measured and decided at once
    assert w.candidate is None


def test_slightly_worse_candidates_never_lower_latest(tmp_path: Path) -> None:
    w = _worker(tmp_path)
    assert w.trainer is not None
    _train(w, PERM, 150, seed=0)
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
