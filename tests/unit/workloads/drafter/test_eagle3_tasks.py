"""An EAGLE-3 drafter as the worker runs it (drafter.train.DrafterTrainer with arch Eagle3, the tasks
of drafter.eagle3_tasks) on a preset target: built from the target's shared pieces, trained by
micro-steps on real features, measured, exported in the project's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter import eagle3_tasks
from spectrain_workloads.drafter.combiner import Sample
from spectrain_workloads.drafter.export import export_drafter
from spectrain_workloads.drafter.models import TargetShared
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.synthetic import text_sequences
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.harvest.feature_tap import FeatureTap
from spectrain_workloads.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=264, dim=32, n_layers=8, n_heads=4, max_seq_len=64)


@pytest.fixture(scope="module")
def target() -> Transformer:
    torch.manual_seed(0)
    t = Transformer(CFG)
    t.init_weights(0)
    return t.eval()


def shared(t: Transformer, counts: torch.Tensor | None = None) -> TargetShared:
    assert t.tok_embeddings is not None and t.output is not None
    return TargetShared(embedding=t.tok_embeddings.weight.detach().clone(), lm_head=t.output.weight.detach().clone(),
                        model_config=CFG, digest="d", stamp=(), token_counts=counts)


def samples(t: Transformer, n: int, seed: int, layers: tuple[int, ...]) -> list[Sample]:
    """Real text through the target: tokens [T], hidden [T, 4H] = cat(features at `layers`, final)."""
    tap = FeatureTap([t], layers)
    x = text_sequences(n, 25, seed=seed)                           # [n, 25]
    with torch.no_grad():
        _, final = t(x, return_hidden=True)
        feats = tap.take(n)
    tap.remove()
    hidden = torch.cat([feats, final], -1)
    return [Sample(tokens=x[i], hidden=hidden[i], step=0) for i in range(n)]


def test_it_trains_and_its_acceptance_rises(target: Transformer) -> None:
    tr = DrafterTrainer(DrafterSettings(arch="Eagle3", lr=3e-3), shared(target), torch.device("cpu"))
    assert tr.eagle and tr.feature_layers == (2, 4, 5) and tr.model.draft_vocab_size == CFG.vocab_size
    train, held = samples(target, 64, 1, (2, 4, 5)), samples(target, 16, 2, (2, 4, 5))
    tokens, hidden = torch.stack([s.tokens for s in held]), torch.stack([s.hidden for s in held])  # type: ignore[misc]

    def acc() -> float:
        return eagle3_tasks.measure_batch(tr.model, tokens, hidden, tr.target_head, k=4).acceptance_length

    before, losses = acc(), []
    for _ in range(12):
        for i in range(0, len(train), 8):
            losses.append(tr.micro_step(train[i:i + 8]))
            tr.optimizer_step(8)
    after = acc()
    assert losses[-1] < 0.7 * losses[0], losses
    assert after > before + 0.3, (before, after)
    result = eagle3_tasks.measure_batch(tr.model, tokens, hidden, tr.target_head, k=4)
    assert result.chains > 0 and sum(result.per_depth) == result.accepted_sum
    assert result.per_depth == sorted(result.per_depth, reverse=True)   # a chain accepted at depth j was at j - 1


def test_a_narrow_sample_is_refused(target: Transformer) -> None:
    tr = DrafterTrainer(DrafterSettings(arch="Eagle3"), shared(target), torch.device("cpu"))
    narrow = Sample(tokens=torch.zeros(8, dtype=torch.int64), hidden=torch.zeros(8, CFG.dim), step=0)
    with pytest.raises(ValueError, match=r"hidden is \[T, 128\]"):
        tr.micro_step([narrow])


def test_the_draft_vocabulary_comes_from_the_token_counts(target: Transformer) -> None:
    with pytest.raises(ConfigError, match="needs the target's token counts"):
        DrafterTrainer(DrafterSettings(arch="Eagle3", draft_vocab_size=100), shared(target), torch.device("cpu"))
    counts = torch.arange(CFG.vocab_size, dtype=torch.int64)           # the highest ids are the most frequent
    tr = DrafterTrainer(DrafterSettings(arch="Eagle3", draft_vocab_size=100), shared(target, counts),
                        torch.device("cpu"))
    assert tr.model.draft_vocab_size == 100
    assert torch.equal(tr.model.target_ids(), torch.arange(CFG.vocab_size - 100, CFG.vocab_size))
    tr.micro_step(samples(target, 4, 3, (2, 4, 5)))                  # trains over the restricted vocabulary


def test_a_preset_target_s_export_is_the_project_format_only(target: Transformer, tmp_path: Path) -> None:
    tr = DrafterTrainer(DrafterSettings(arch="Eagle3", feature_layers=[1, 3, 6]), shared(target), torch.device("cpu"))
    path = export_drafter(tmp_path, 1, tr.model, {"target_model_config": CFG.to_dict()})
    meta = json.loads((path / "config.json").read_text())
    assert meta["arch"] == "Eagle3" and meta["eagle3"]["feature_layers"] == [1, 3, 6]
    assert meta["model_config"]["n_layers"] == CFG.n_layers and "hf_target_config" not in meta
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
