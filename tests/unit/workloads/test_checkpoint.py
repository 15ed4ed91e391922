"""checkpoint: atomic, fsynced, keep-last-N checkpoints."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_checkpoints_are_atomic_and_keep_last_n(tmp_path) -> None:
    import torch

    from spectrain_workloads.checkpoint import CheckpointManager

    mgr = CheckpointManager(tmp_path, rank=1, keep=2)
    (mgr.dir / ".tmp-step-9-999999").mkdir(parents=True)       # a killed save's leftover
    for step in (2, 4, 6):
        mgr.save(step, {"step": step, "w": torch.full((3,), float(step))})
    assert mgr.steps() == [4, 6] and not list(mgr.dir.glob(".tmp-*"))
    assert torch.equal(mgr.load(6)["w"], torch.full((3,), 6.0))


def test_every_rng_resumes_exactly_from_a_weights_only_checkpoint(tmp_path) -> None:
    import random

    import numpy as np
    import torch

    from spectrain_workloads.checkpoint import CheckpointManager, rng_state, set_rng_state

    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.standard_normal()                        # leaves a cached Gaussian in numpy's state
    mgr = CheckpointManager(tmp_path, rank=0, keep=1)
    mgr.save(1, {"rng": rng_state()})
    expected = (torch.rand(4), np.random.standard_normal(4), [random.random() for _ in range(4)])
    set_rng_state(mgr.load(1)["rng"])
    got = (torch.rand(4), np.random.standard_normal(4), [random.random() for _ in range(4)])
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]


class _RunsCode:
    """What a writer of the shared run volume could plant: unpickling it calls os.system."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, ("touch pwned",)


def test_a_checkpoint_that_would_run_code_is_refused_not_run(tmp_path, monkeypatch) -> None:
    import torch

    from spectrain_workloads.checkpoint import CheckpointManager, CheckpointRefused

    monkeypatch.chdir(tmp_path)
    mgr = CheckpointManager(tmp_path, rank=0, keep=1)
    mgr.save(5, {"step": 5, "w": torch.zeros(2)})
    torch.save({"step": 5, "payload": _RunsCode()}, mgr.path(5) / "state.pt")   # replaced behind its back
    with pytest.raises(CheckpointRefused, match=r"step-5/state.pt holds objects other than tensors.*Delete the step"):
        mgr.load(5)
    assert not (tmp_path / "pwned").exists()
