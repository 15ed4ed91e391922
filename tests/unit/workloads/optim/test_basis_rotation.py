"""BasisRotation / PipeDreamLR / build_optimizer: exactness against AdamW, orthonormal bases,
bitwise resume, stage-aware budget, clear errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from spectrain_api.config import BasisRotationSpec, OptimizerSpec
from spectrain_api.errors import ConfigError
from spectrain_workloads.model import ModelConfig, Transformer
from spectrain_workloads.optim import (
    BasisRotation,
    PipeDreamLR,
    build_optimizer,
    param_groups,
    stage_refresh_every,
    staleness_lr_factor,
)

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def _model(seed: int = 0) -> Transformer:
    m = Transformer(ModelConfig(dim=16, n_layers=2, n_heads=2, max_seq_len=16, vocab_size=32))
    m.init_weights(seed)
    return m


def _train(model: Transformer, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 32, (4, 9), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_identity_bases_give_adamw_bitwise() -> None:
    a, b = _model(), _model()
    groups = param_groups(a)
    for g in groups:
        g.pop("rotate")
    adamw = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # warmup_steps beyond the run: bases stay identity, but the rotated code path (matmuls) runs.
    rot = BasisRotation(param_groups(b), lr=3e-3, weight_decay=0.1, warmup_steps=10**9)
    la, lb = _train(a, adamw, 6), _train(b, rot, 6)
    assert la == lb
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert any("basis_left" in s for s in rot.state.values())


def test_rotation_changes_the_update_and_bases_stay_orthonormal() -> None:
    a, b = _model(), _model()
    adamw_like = BasisRotation(param_groups(a), lr=3e-3, warmup_steps=10**9)
    rot = BasisRotation(param_groups(b), lr=3e-3, refresh_every=2)
    _train(a, adamw_like, 12)
    losses = _train(b, rot, 12)
    assert losses[-1] < losses[0]
    w = b.layers["0"].attention.wq.weight
    assert not torch.allclose(w, a.layers["0"].attention.wq.weight)
    checked = 0
    for st in rot.state.values():
        assert st["refreshes"] in (0, 6)
        for side in ("left", "right"):
            if f"basis_{side}" in st:
                q = st[f"basis_{side}"]
                torch.testing.assert_close(q.T @ q, torch.eye(q.shape[0]), atol=2e-5, rtol=0)
                checked += 1
    assert checked == 2 * 7 * 2  # wq wk wv wo w1 w2 w3 per layer, two sides, two layers


def test_unilateral_rotates_only_the_smaller_side() -> None:
    p = torch.nn.Parameter(torch.randn(8, 3))
    opt = BasisRotation([p], geometry="Unilateral", refresh_every=1)
    p.grad = torch.randn(8, 3)
    opt.step()
    assert "basis_right" in opt.state[p] and "basis_left" not in opt.state[p]


@pytest.mark.parametrize("geometry,source", [("Bilateral", "SecondMoment"), ("Unilateral", "FirstMoment")])
def test_state_dict_round_trip_resumes_bitwise(geometry: str, source: str) -> None:
    spec = OptimizerSpec(name="BasisRotation", lr=3e-3,
                         basis_rotation=BasisRotationSpec(refresh_every=3, geometry=geometry, source=source))
    a = _model()
    opt_a = build_optimizer(a, spec, stage=0, n_stages=2)
    _train(a, opt_a, 5, seed=1)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    cont = _train(a, opt_a, 5, seed=2)

    b = _model(seed=99)
    b.load_state_dict(saved_model)
    opt_b = build_optimizer(b, spec, stage=0, n_stages=2)
    opt_b.load_state_dict(saved_opt)
    assert _train(b, opt_b, 5, seed=2) == cont
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("every", [2, 3, 10])
def test_stage_aware_budget_is_fixed_and_favours_stale_stages(every: int) -> None:
    P = 8
    intervals = [stage_refresh_every(every, k, P) for k in range(P)]
    assert intervals == sorted(intervals) and intervals[0] < every < intervals[-1]
    assert all(i >= 1 for i in intervals)
    assert sum(1 / i for i in intervals) == pytest.approx(P / every, rel=1e-9)   # same total refreshes per step
    assert intervals[0] / intervals[-1] == pytest.approx(1 / P) or intervals[0] == 1.0  # share ~ staleness + 1
    assert stage_refresh_every(every, 0, 1) == every


def test_stage_aware_caps_at_one_refresh_per_step_and_redistributes() -> None:
    assert [stage_refresh_every(1, k, 4) for k in range(4)] == [1.0] * 4
    intervals = [stage_refresh_every(1.5, k, 8) for k in range(8)]        # stages 0, 1 would want > 1 per step
    assert intervals[:2] == [1.0, 1.0] and intervals[2] > 1
    assert sum(1 / i for i in intervals) == pytest.approx(8 / 1.5)


@pytest.mark.parametrize("every", [1, 3, 2.25, 45.0])
def test_fractional_refresh_interval_keeps_its_average_rate(every: float) -> None:
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = BasisRotation([p], refresh_every=every)
    gen = torch.Generator().manual_seed(0)
    for _ in range(90):
        p.grad = torch.randn(6, 4, generator=gen)
        opt.step()
    assert opt.state[p]["refreshes"] == math.floor(89 / every) + 1        # at 0, every, 2 every, ...


def _refresh(st: dict, side: str, reproject: bool) -> None:
    BasisRotation._refresh_side(st, side, reproject)


def test_second_moment_follows_a_reordered_basis() -> None:
    """When a refresh only reorders the basis, re-projection is exactly SOAP's permutation of V~."""
    lam = torch.tensor([1.0, 5.0, 3.0, 2.0])
    perm = torch.eye(4)[:, [2, 0, 3, 1]]                                  # current basis: permuted axes
    v = torch.rand(4, 3, generator=torch.Generator().manual_seed(0))     # V~ [4, 3], rows = columns of perm
    out = {}
    for reproject in (True, False):
        st = {"refreshes": 1, "stat_left": torch.diag(lam), "basis_left": perm.clone(), "exp_avg_sq": v.clone()}
        _refresh(st, "left", reproject)
        q = st["basis_left"]
        torch.testing.assert_close(q.abs().argmax(0), torch.tensor([1, 2, 3, 0]))   # sorted by eigenvalue
        out[reproject] = st["exp_avg_sq"]
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=1e-6)
    assert not torch.equal(out[True], v)


def test_second_moment_is_carried_into_a_rotated_basis() -> None:
    """The first refresh after an identity warm-up rotates the whole basis: V~ keeps its mass and is
    re-estimated, not left in the old coordinates (that was the pre-fix behaviour)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(5, 5, generator=gen)
    stat = a @ a.T                                                        # L [5, 5], generic eigenbasis
    v = torch.rand(5, 2, generator=gen)
    st = {"refreshes": 0, "stat_left": stat, "basis_left": torch.eye(5), "exp_avg_sq": v.clone()}
    _refresh(st, "left", True)
    q = st["basis_left"]
    torch.testing.assert_close(st["exp_avg_sq"], q.square().T @ v)        # variance along each new direction
    torch.testing.assert_close(st["exp_avg_sq"].sum(0), v.sum(0))          # mass per column preserved
    st = {"refreshes": 0, "stat_left": stat, "basis_left": torch.eye(5), "exp_avg_sq": v.clone()}
    _refresh(st, "left", False)
    assert torch.equal(st["exp_avg_sq"], v)                               # the old rule: untouched


def test_build_optimizer_picks_the_named_optimizer_and_groups() -> None:
    m = _model()
    assert type(build_optimizer(m, OptimizerSpec(name="AdamW"))) is torch.optim.AdamW
    spec = OptimizerSpec(name="BasisRotation", basis_rotation=BasisRotationSpec(refresh_every=10, stage_aware=True))
    opt = build_optimizer(m, spec, stage=0, n_stages=4)
    assert isinstance(opt, BasisRotation)
    rotated = [g for g in opt.param_groups if g["rotate"]]
    assert len(rotated) == 1 and len(rotated[0]["params"]) == 14
    assert rotated[0]["refresh_every"] == stage_refresh_every(10, 0, 4) < 10
    norms = [g for g in opt.param_groups if any(p.dim() == 1 for p in g["params"])]
    assert norms[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("spec,field", [
    (OptimizerSpec(name="Adam"), "spec.target.optimizer.name"),
    (OptimizerSpec(lr=0.0), "spec.target.optimizer.lr"),
    (OptimizerSpec(name="BasisRotation", basis_rotation=BasisRotationSpec(refresh_every=0)), "refreshEvery"),
    (OptimizerSpec(name="BasisRotation", basis_rotation=BasisRotationSpec(geometry="Left")), "geometry"),
    (OptimizerSpec(name="BasisRotation", basis_rotation=BasisRotationSpec(source="Hessian")), "source"),
    (OptimizerSpec(name="BasisRotation", basis_rotation=BasisRotationSpec(stage_aware="yes")), "stageAware"),  # type: ignore[arg-type]
])
def test_bad_options_are_clear_errors(spec: OptimizerSpec, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        build_optimizer(_model(), spec)


def test_bad_stage_and_direct_constructor_errors() -> None:
    with pytest.raises(ConfigError, match="pipeline"):
        build_optimizer(_model(), OptimizerSpec(), stage=2, n_stages=2)
    with pytest.raises(ConfigError, match="geometry"):
        BasisRotation(_model().parameters(), geometry="bilateral")
    with pytest.raises(ConfigError, match="delay"):
        PipeDreamLR(_model().parameters(), delay=-1)


def test_pipedream_lr_scales_by_staleness_and_anneals() -> None:
    assert staleness_lr_factor(0, 3, None) == pytest.approx(0.25)
    assert staleness_lr_factor(500, 3, None) == pytest.approx(0.25)
    assert staleness_lr_factor(50, 3, 100) == pytest.approx(0.5)
    assert staleness_lr_factor(100, 3, 100) == 1.0
    assert staleness_lr_factor(0, 0, 100) == 1.0
    # delay 0: exactly AdamW; the outer lr is restored after each step
    a, b = _model(), _model()
    la = _train(a, torch.optim.AdamW(a.parameters(), lr=1e-3), 3)
    opt = PipeDreamLR(b.parameters(), delay=0, lr=1e-3)
    assert _train(b, opt, 3) == la and opt.param_groups[0]["lr"] == 1e-3
    assert opt.state_dict()["param_groups"][0]["lr_step"] == 3
