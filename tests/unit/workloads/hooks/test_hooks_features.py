"""The hooks API's EAGLE-3 calls (hooks.features): `pub.feature_layers` taps the layers the drafter
reads in a user's model, `pub.features` (a stage without the final norm) and `pub.hidden_states`
(the last stage) publish their inputs; the drafter finds the model's depth in the shared config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from spectrain_workloads import hooks
from spectrain_workloads.drafter.models import load_target_shared
from spectrain_workloads.hooks import HookError
from spectrain_workloads.ring import RingConsumer, ring_path

H, T, L = 8, 16, 8


def _env(tmp: Path, drafter: dict[str, Any], *, rank: int = 0, world: int = 1, pipeline: int = 1) -> dict[str, str]:
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"metadata": {"name": "t"}, "spec": {"mode": "Pretrain", "target": {
        "image": "x", "nodes": world, "procsPerNode": 1, "parallelism": {"pipeline": pipeline},
        "data": {"seqLen": T, "batchSize": 4}, "steps": 10}, "drafter": drafter}}))
    return {"SPECTRAIN_RUN_DIR": str(tmp / "run"), "SPECTRAIN_CONFIG": str(cfg), "RANK": str(rank),
            "WORLD_SIZE": str(world), "SPECTRAIN_PUBLISH_FRACTION": "0.5", "SPECTRAIN_RING_DIR": str(tmp / "ring"),
            "LOCAL_RANK": "0"}


class Stage(nn.Module):
    """A user's pipeline stage: its own layer class, layers by global id."""

    def __init__(self, ids: range) -> None:
        super().__init__()
        self.ids = list(ids)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in self.ids)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        inputs = {}
        for i, layer in zip(self.ids, self.layers, strict=True):
            inputs[i] = h
            h = h + torch.tanh(layer(h))
        return h, inputs


def test_a_stage_without_the_final_norm_publishes_the_inputs_of_its_feature_layers(tmp_path: Path) -> None:
    """Rank 0 of 2 stages holds layers 0..3; the default feature layers of 8 layers are (2, 4, 5)."""
    pub = hooks.attach(hidden_dim=H, seq_len=T, env=_env(tmp_path, {"arch": "Eagle3"}, world=2, pipeline=2))
    stage = Stage(range(0, 4))
    held = pub.feature_layers({i: m for i, m in zip(stage.ids, stage.layers, strict=True)}, num_layers=L)
    assert held == (2,)
    consumer = RingConsumer.open(ring_path(tmp_path / "ring", 0), timeout_s=5, start="oldest")
    try:
        g = torch.Generator().manual_seed(0)
        sent = []
        for _ in range(2):
            x = torch.randn(4, T, H, generator=g)
            tokens = torch.randint(0, 264, (4, T), generator=g)
            _, inputs = stage(x)
            pub.features(tokens)
            sent.append((inputs[2][:2].detach(), tokens[:2]))     # fraction 0.5 of 4: the first 2
        recs = [consumer.next_data() for _ in range(4)]
        assert all(r is not None for r in recs)
        assert [r.meta["seq_index"] for r in recs] == [0, 1, 4, 5]
        for r, (feat, tok) in zip(recs, [(f[j], t[j]) for f, t in sent for j in range(2)], strict=True):
            assert r.meta["feature_layers"] == [2] and set(r.arrays) == {"tokens", "features"}
            assert torch.equal(torch.from_numpy(r.arrays["features"].copy()), feat)
            assert torch.equal(torch.from_numpy(r.arrays["tokens"].copy()), tok)
        assert consumer.next_data() is None
    finally:
        consumer.close()
        pub.close()


def test_the_last_stage_publishes_its_features_with_the_hidden_states(tmp_path: Path) -> None:
    pub = hooks.attach(hidden_dim=H, seq_len=T, env=_env(tmp_path, {"arch": "Eagle3"}, rank=1, world=2, pipeline=2))
    stage = Stage(range(4, 8))
    assert pub.feature_layers(dict(zip(stage.ids, stage.layers, strict=True)), num_layers=L) == (4, 5)
    pub.share_weights(lm_head=torch.randn(264, H))
    consumer = RingConsumer.open(ring_path(tmp_path / "ring", 0), timeout_s=5, start="oldest")
    try:
        h, inputs = stage(torch.randn(2, T, H))
        tokens = torch.randint(0, 264, (2, T))
        pub.hidden_states(h.detach(), tokens)
        rec = consumer.next_data()
        assert rec is not None and rec.meta["feature_layers"] == [4, 5]
        want = torch.cat([inputs[4][0], inputs[5][0]], -1).detach()
        assert torch.equal(torch.from_numpy(rec.arrays["features"].copy()), want)
        assert torch.equal(torch.from_numpy(rec.arrays["hidden"].copy()), h[0].detach())
    finally:
        consumer.close()
        pub.close()
    pub.share_weights(embedding=torch.randn(264, H))
    shared = load_target_shared(tmp_path / "run")
    assert shared is not None and shared.model_config.n_layers == L     # the drafter's default layers need L


def test_with_eagle1_the_calls_do_nothing(tmp_path: Path) -> None:
    pub = hooks.attach(hidden_dim=H, seq_len=T, env=_env(tmp_path, {"arch": "Eagle"}))
    stage = Stage(range(0, 8))
    assert pub.feature_layers(dict(zip(stage.ids, stage.layers, strict=True)), num_layers=L) == ()
    pub.features(torch.zeros(2, T, dtype=torch.int64))
    pub.close()
    assert hooks.NOOP.feature_layers({}, num_layers=L) == ()


def test_bad_calls_are_clear_errors(tmp_path: Path) -> None:
    pub = hooks.attach(hidden_dim=H, seq_len=T, env=_env(tmp_path, {"arch": "Eagle3"}))
    stage = Stage(range(0, 8))
    layers = dict(zip(stage.ids, stage.layers, strict=True))
    with pytest.raises(HookError, match="pub.features: call pub.feature_layers"):
        pub.features(torch.zeros(2, T, dtype=torch.int64))
    with pytest.raises(HookError, match=r"layer ids \[8\] are not global layer ids in \[0, 8\)"):
        pub.feature_layers({**layers, 8: nn.Linear(H, H)}, num_layers=L)
    with pytest.raises(HookError, match="at least 3 layers"):
        pub.feature_layers({0: stage.layers[0]}, num_layers=2)
    with pytest.raises(HookError, match="maps global layer ids"):
        pub.feature_layers([stage.layers[0]], num_layers=L)   # type: ignore[arg-type]
    pub.feature_layers(layers, num_layers=L)
    with pytest.raises(HookError, match="integer token ids"):
        pub.features(torch.zeros(2, T))
    pub.close()
