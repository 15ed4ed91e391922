"""bench-eagle3's pieces that need no training: the bytes-per-sample layout and the EAGLE-3 alpha
(drafter.eagle3_tasks.sampled_acceptance_rate) against a position-by-position reference."""

from __future__ import annotations

import pytest
import torch

from bench.eagle3 import feature_bytes

pytestmark = pytest.mark.unit


def test_the_demo_layout_moves_4_4x_the_bytes_per_sample_with_eagle3() -> None:
    b = feature_bytes()
    T, H = 256, 64
    rec = lambda w: T * 8 + T * w * 4   # noqa: E731 - tokens int64 + fp32 [T, w]
    assert b["feature_bytes_per_sample_eagle1"] == 2 * rec(H)
    # stage 0 ring (layer 2) + stage 1 ring (layers 4, 5 + final) + the part stage 0 sends + the forwarded sample
    assert b["feature_bytes_per_sample_eagle3"] == rec(H) + rec(3 * H) + rec(H) + rec(4 * H)
    assert b["feature_layers_per_stage"] == [1, 2]


@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_eagle3_alpha_is_the_mean_of_sum_min_p_q_with_q_zero_outside_the_draft_vocab(draft_vocab: int | None) -> None:
    from spectrain_workloads.drafter import eagle3_tasks
    from spectrain_workloads.drafter.models import TargetShared
    from spectrain_workloads.drafter.settings import DrafterSettings
    from spectrain_workloads.model import ModelConfig

    g = torch.Generator().manual_seed(0)
    V, H, T = 32, 16, 6
    cfg = ModelConfig(vocab_size=V, dim=H, n_layers=8, n_heads=2)
    shared = TargetShared(embedding=torch.randn(V, H, generator=g), lm_head=torch.randn(V, H, generator=g),
                          model_config=cfg, digest="x", stamp=(), token_counts=torch.arange(V, 0, -1))
    model = eagle3_tasks.build(DrafterSettings(arch="Eagle3", draft_vocab_size=draft_vocab), shared).eval()
    tokens = torch.randint(0, V, (2, T), generator=g)
    hidden = torch.randn(2, T, 4 * H, generator=g)
    got = eagle3_tasks.sampled_acceptance_rate(model, tokens, hidden, shared.lm_head)

    ids = model.target_ids().tolist()
    with torch.no_grad():
        q_draft = torch.softmax(model.unroll(hidden[:, :T - 1, :3 * H], tokens[:, 1:], 1)[0], -1)
    rates = []
    for b in range(2):
        for i in range(T - 1):
            p = torch.softmax(hidden[b, i + 1, 3 * H:] @ shared.lm_head.T, -1)      # the target's x_{i+2}
            q = torch.zeros(V)
            q[ids] = q_draft[b, i]
            rates.append(float(torch.minimum(p, q).sum()))
    assert got == pytest.approx(sum(rates) / len(rates), rel=1e-5)
    assert 0.0 < got <= 1.0
