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
