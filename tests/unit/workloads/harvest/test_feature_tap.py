"""EAGLE-3 features from a training forward (harvest.feature_tap) and their ring records
(harvest.data_publisher): the tapped inputs are the residual stream before each feature layer,
on the project's stages and on Hugging Face stages, split across pipeline stages or not."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spectrain_workloads.harvest.data_publisher import DataPublisher
from spectrain_workloads.harvest.feature_tap import FeatureTap
from spectrain_workloads.hf.source import inspect
from spectrain_workloads.hf.stage import HFStage
from spectrain_workloads.hf.tiny import build_model
from spectrain_workloads.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=8, n_heads=4, max_seq_len=64)
LAYERS = (2, 4, 5)


def reference_inputs(model: Transformer, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """The input of every layer, by running the layers by hand."""
    h = model.tok_embeddings(tokens)
    rope = model.rope[: tokens.size(1)]
    out = {}
    for i, block in model.layers.items():
        out[int(i)] = h
        h = block(h, rope, None, None)
    return out


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []

    def publish_data(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.records.append((dict(meta), {k: np.array(v, copy=True) for k, v in arrays.items()}))


def test_the_tap_keeps_the_residual_stream_before_each_feature_layer() -> None:
    full = Transformer(CFG)
    full.init_weights(0)
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    ref = reference_inputs(full, tokens)
    tap = FeatureTap([full], LAYERS)
    assert tap.held == LAYERS and not tap.ready()
    full(tokens).sum().backward()            # a training forward: nothing added to the graph
    assert tap.ready()
    got = tap.take(2)                        # the first 2 sequences
    assert got.shape == (2, 16, 3 * CFG.dim) and not got.requires_grad
    torch.testing.assert_close(got, torch.cat([ref[i][:2] for i in LAYERS], -1).detach(), rtol=0, atol=0)
    assert not tap.ready()                   # taken: the next forward fills it again
    tap.remove()
    full(tokens)
    assert not tap.ready()


def test_pipeline_stages_each_tap_the_layers_they_hold() -> None:
    stages = [Transformer.stage(CFG, s, 2) for s in range(2)]
    full = Transformer(CFG)
    full.init_weights(0)
    for s in stages:
        s.init_weights(0)
    taps = [FeatureTap([s], LAYERS) for s in stages]
    assert [t.held for t in taps] == [(2,), (4, 5)]
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    stages[1](stages[0](tokens))
    ref = reference_inputs(full, tokens)
    parts = [t.take(2) for t in taps]
    torch.testing.assert_close(torch.cat(parts, -1), torch.cat([ref[i] for i in LAYERS], -1).detach())


def test_a_stage_without_feature_layers_taps_nothing() -> None:
    stage = Transformer.stage(CFG, 3, 4)       # layers 6, 7
    assert FeatureTap([stage], LAYERS).held == ()


def test_on_a_hugging_face_stage_the_tap_equals_the_stage_s_own_feature_output(tmp_path: Path) -> None:
    build_model(tmp_path / "m", layers=7)
    src = inspect(f"file://{tmp_path / 'm'}")
    stage = HFStage.stage(src, 0, 1)
    stage.load_weights(src)
    tap = FeatureTap([stage], (2, 3, 4))
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, _, features = stage(tokens, return_hidden=True, features=(2, 3, 4))
    torch.testing.assert_close(tap.take(2), features, rtol=0, atol=0)


def test_the_publisher_writes_one_record_per_sampled_sequence_with_matching_indexes() -> None:
    """Stage 0 (features only) and the last stage (features + final hidden) of a 2-stage split:
    the same seq_index names the same sequence on both."""
    stages = [Transformer.stage(CFG, s, 2) for s in range(2)]
    for s in stages:
        s.init_weights(0)
    recs = [Recorder(), Recorder()]
    pubs = [DataPublisher(recs[s], fraction=0.5, stage=s, lock=threading.Lock(), tap=FeatureTap([stages[s]], LAYERS))
            for s in range(2)]
    g = torch.Generator().manual_seed(4)
    for mb in range(2):
        tokens = torch.randint(0, 64, (4, 8), generator=g)
        h0 = stages[0](tokens)
        pubs[0].submit(5, mb, None, tokens)
        _, hidden = stages[1](h0, return_hidden=True)
        pubs[1].submit(5, mb, hidden.detach(), tokens)
    first, last = recs[0].records, recs[1].records
    assert [m["seq_index"] for m, _ in first] == [m["seq_index"] for m, _ in last] == [0, 1, 4, 5]
    for (m0, a0), (m1, a1) in zip(first, last, strict=True):
        assert m0["feature_layers"] == [2] and m1["feature_layers"] == [4, 5] and m0["step"] == m1["step"] == 5
        assert set(a0) == {"tokens", "features"} and set(a1) == {"tokens", "features", "hidden"}
        assert a0["features"].shape == (8, CFG.dim) and a1["features"].shape == (8, 2 * CFG.dim)
        assert a1["hidden"].shape == (8, CFG.dim)
        np.testing.assert_array_equal(a0["tokens"], a1["tokens"])


def test_without_a_tap_a_non_last_stage_publishes_nothing() -> None:
    rec = Recorder()
    pub = DataPublisher(rec, fraction=1.0, stage=0, lock=threading.Lock())
    pub.submit(0, 0, None, torch.zeros(2, 8, dtype=torch.int64))
    assert rec.records == []


@pytest.mark.parametrize("fraction", [0.0])
def test_fraction_zero_publishes_nothing_and_leaves_the_tap_empty(fraction: float) -> None:
    stage = Transformer(CFG)
    stage.init_weights(0)
    rec = Recorder()
    tap = FeatureTap([stage], LAYERS)
    pub = DataPublisher(rec, fraction=fraction, stage=0, lock=threading.Lock(), tap=tap)
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    _, hidden = stage(tokens, return_hidden=True)
    pub.submit(0, 0, hidden.detach(), tokens)
    assert rec.records == [] and not tap.ready()
