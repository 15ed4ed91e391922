"""The single-process PipeDream simulator: staleness 0 is synchronous training; staleness d means
stage k's gradient is taken at its weights from d_k updates ago."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spectrain_api.config import OptimizerSpec
from spectrain_api.errors import ConfigError
from spectrain_workloads.data import LoaderSpec, TokenLoader
from spectrain_workloads.model import ModelConfig, Transformer
from spectrain_workloads.optim import build_optimizer
from spectrain_workloads.target.async_pipeline import delays, simulate, stage_named_params, stage_of

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

CFG = ModelConfig(dim=16, n_layers=4, n_heads=2, max_seq_len=16, vocab_size=40)
CORPUS = np.random.default_rng(3).integers(0, 40, 2000).astype(np.uint16)   # token ids [2000]
LOADER = TokenLoader(CORPUS, LoaderSpec(seq_len=8, batch_size=3))
SPEC = OptimizerSpec(name="AdamW", lr=3e-3)


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    return LOADER.batch(t)


def _model() -> Transformer:
    m = Transformer(CFG)
    m.init_weights(7)
    return m


def _stage_opts(model: Transformer, P: int, spec: OptimizerSpec = SPEC) -> list[torch.optim.Optimizer]:
    return [build_optimizer(stage_named_params(model, k, P), spec, stage=k, n_stages=P) for k in range(P)]


def _sync_reference(steps: int) -> tuple[list[float], Transformer]:
    model = _model()
    opt = build_optimizer(model, SPEC)
    losses = []
    for t in range(steps):
        x, y = _batch(t)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("P,cap", [(1, None), (4, 0), (2, 0)])
def test_staleness_zero_equals_synchronous_training(P: int, cap: int | None) -> None:
    ref_losses, ref = _sync_reference(5)
    model = _model()
    res = simulate(model, _stage_opts(model, P), _batch, 5, max_staleness=cap)
    assert res.losses == ref_losses
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_stale_stages_take_gradients_at_old_weights() -> None:
    """P=2: stage 0 (delay 1) sees w0_{t-1}; stage 1 (delay 0) sees w1_t. Hand-rolled reference."""
    P, steps = 2, 4
    model = _model()
    res = simulate(model, _stage_opts(model, P), _batch, steps)

    ref = _model()
    opts = _stage_opts(ref, P)
    named0 = stage_named_params(ref, 0, P)
    prev0 = {n: p.detach().clone() for n, p in named0}               # w0_{t-1} (w0_0 at t = 0)
    losses = []
    for t in range(steps):
        live0 = {n: p.detach().clone() for n, p in named0}
        probe = copy.deepcopy(ref)                                    # composite model for the gradient
        with torch.no_grad():
            for n, p in probe.named_parameters():
                if n in prev0:
                    p.copy_(prev0[n])
        x, y = _batch(t)
        loss = F.cross_entropy(probe(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        for (_, p), (_, q) in zip(ref.named_parameters(), probe.named_parameters(), strict=True):
            p.grad = q.grad
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        prev0 = live0
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=0, atol=1e-6)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # and staleness changes the trajectory
    assert res.losses != _sync_reference(steps)[0]


def test_stage_split_matches_transformer_stage_and_delays() -> None:
    full = _model()
    for k in range(4):
        stage = Transformer.stage(CFG, k, 4)
        assert [n for n, _ in stage_named_params(full, k, 4)] == [n for n, _ in stage.named_parameters()]
    assert delays(4) == [3, 2, 1, 0] and delays(4, 1) == [1, 1, 1, 0]
    assert stage_of("output.weight", CFG, 2) == 1
    with pytest.raises(ConfigError, match="pipeline"):
        Transformer.stage(CFG, 0, 3)
