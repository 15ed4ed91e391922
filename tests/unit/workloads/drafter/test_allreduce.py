"""drafter.allreduce.apply: a combined version replaces the parameters it was computed from, and
the progress the caller made since (while the round ran) is kept on top of it."""

from __future__ import annotations

import pytest
import torch

from spectrain_workloads.drafter.allreduce import Result, apply

pytestmark = pytest.mark.unit


def test_apply_keeps_local_progress_made_during_the_round() -> None:
    base = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    live = {"w": torch.tensor([1.5, 2.0]), "b": torch.tensor([0.5]), "frozen": torch.tensor([9.0])}
    combined = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])}
    apply(live, Result(combined, base, 2, 1.0, 3.0, 4, 1.0, "1.0"))
    assert torch.equal(live["w"], torch.tensor([3.5, 4.0]))       # + the 0.5 learnt since `base`
    assert torch.equal(live["b"], torch.tensor([1.0]))
    assert torch.equal(live["frozen"], torch.tensor([9.0]))         # not combined: untouched


def test_apply_without_base_sets_the_version() -> None:
    """A version received on joining (no contribution of the caller's in it): base is empty."""
    live = {"w": torch.tensor([7.0])}
    apply(live, Result({"w": torch.tensor([2.0])}, {}, 5, 0.0, 10.0, 3, 0.0, "4.2"))
    assert torch.equal(live["w"], torch.tensor([2.0]))
