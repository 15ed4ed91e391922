"""Acceptance measurement: the cached chain equals a brute-force recompute; known drafters score as known."""

from __future__ import annotations

import copy

import pytest
import torch

from spectrain_workloads.drafter.models import EagleDrafter, build_drafter, eagle_loss
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.synthetic import make_target, target_hidden, text_sequences
from spectrain_workloads.drafter.verify import Verifier, chain_starts, measure, measure_batch, measure_sample
from spectrain_workloads.model import Transformer, model_config

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

CFG = model_config("debug", {"n_layers": 2, "max_seq_len": 64})
K = 4


@pytest.fixture(scope="module")
def target() -> Transformer:
    return make_target(CFG, seed=0)


@pytest.fixture(scope="module")
def data(target: Transformer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = text_sequences(3, 40, seed=5)
    hidden = target_hidden(target, tokens)
    return [(tokens[i], hidden[i]) for i in range(3)]


@pytest.fixture(scope="module")
def trained_eagle(target: Transformer, data: list[tuple[torch.Tensor, torch.Tensor]]) -> EagleDrafter:
    """Fitted to the evaluation sequences themselves: many accepted drafts to compare."""
    d = build_drafter(DrafterSettings(), CFG)
    assert isinstance(d, EagleDrafter) and target.tok_embeddings is not None and target.output is not None
    d.load_target_weights(target.tok_embeddings.weight, target.output.weight)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    tokens, hidden = torch.stack([t for t, _ in data]), torch.stack([h for _, h in data])
    for _ in range(60):
        loss, _ = eagle_loss(d, tokens, hidden, hidden_weight=1.0, ce_weight=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@torch.no_grad()
def brute_force(model: torch.nn.Module, tokens: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor,
                eagle: bool) -> tuple[int, int, list[int]]:
    """Accepted drafts summed over the same chain starts, re-running the whole prefix every step."""
    total, chains, depth = 0, 0, [0] * K
    for t in chain_starts(tokens.numel(), K, 4):
        if eagle:
            toks, hids = tokens[1:t + 2].tolist(), list(hidden[: t + 1])
        else:
            toks = tokens[: t + 2].tolist()
        n = 0
        for j in range(1, K + 1):
            if eagle:
                logits, h = model(torch.tensor([toks]), torch.stack(hids)[None])
            else:
                logits = model(torch.tensor([toks]))
            d = int(logits[0, -1].argmax())
            if d != int(greedy[t + j]):
                break
            n += 1
            depth[j - 1] += 1
            toks.append(d)
            if eagle:
                hids.append(h[0, -1])
        total, chains = total + n, chains + 1
    return total, chains, depth


def test_eagle_cached_chains_equal_brute_force(target: Transformer, trained_eagle: EagleDrafter,
                                               data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert target.output is not None
    seen = 0
    for tokens, hidden in data:
        greedy = target.output(hidden).argmax(-1)
        acc = measure_sample(trained_eagle, tokens, hidden, None, k=K)
        total, chains, depth = brute_force(trained_eagle, tokens, hidden, greedy, eagle=True)
        assert (acc.accepted_sum, acc.chains, acc.per_depth) == (total, chains, depth)
        seen += total
    assert seen >= 6, "the trained drafter should get some drafts accepted, or this test checks nothing"


def test_lm_identical_to_target_agrees_top1_and_first_draft(target: Transformer,
                                                             data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    lm = copy.deepcopy(target)
    assert target.output is not None
    acc = measure(lm, data, target.output.weight, k=K)
    assert acc.top1 == 1.0
    assert acc.per_depth[0] == acc.chains and acc.accepted >= 1.0
    for tokens, hidden in data:
        greedy = target.output(hidden).argmax(-1)
        one = measure_sample(lm, tokens, hidden, target.output.weight, k=K)
        assert (one.accepted_sum, one.chains, one.per_depth) == brute_force(lm, tokens, hidden, greedy, eagle=False)


def test_trained_beats_untrained_and_chunked_rounds_equal_one_pass(target: Transformer, trained_eagle: EagleDrafter,
                                                                   data: list) -> None:
    fresh = build_drafter(DrafterSettings(seed=1), CFG)
    assert isinstance(fresh, EagleDrafter) and target.tok_embeddings is not None and target.output is not None
    fresh.load_target_weights(target.tok_embeddings.weight, target.output.weight)
    trained, untrained = measure(trained_eagle, data, None, k=K), measure(fresh, data, None, k=K)
    assert trained.top1 > untrained.top1 + 0.2
    assert trained.acceptance_length == trained.accepted + 1 and trained.acceptance_length > untrained.acceptance_length
    v = Verifier(k=K)
    v.begin(data)
    results = [v.run_chunk(trained_eagle, None) for _ in data]
    assert results[:-1] == [None, None] and not v.in_progress and v.rounds == 1
    assert results[-1] is not None and results[-1].to_dict() == trained.to_dict()


def test_starts_do_not_overlap_and_fit() -> None:
    assert chain_starts(40, 4, 4) == [0, 8, 16, 24]
    assert chain_starts(10, 4, 8) == [0, 4]
    assert chain_starts(4, 4, 8) == []


def test_batched_measure_equals_rows_one_by_one(target: Transformer, trained_eagle: EagleDrafter,
                                                data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Rows with different accepted lengths in one batch: every count equals the per-row sum."""
    assert target.output is not None
    tokens = torch.stack([t for t, _ in data])
    hidden = torch.stack([h for _, h in data])
    one_by_one = measure(trained_eagle, data, None, k=K)
    batched = measure_batch(trained_eagle, tokens, hidden, None, k=K)
    assert batched.to_dict() == one_by_one.to_dict() and batched.per_depth == one_by_one.per_depth
    assert 0 < one_by_one.per_depth[-1] < one_by_one.chains, "chains should stop at different depths, or batching is not exercised"
    lm = copy.deepcopy(target)
    assert measure_batch(lm, tokens, hidden, target.output.weight, k=K).per_depth == \
        measure(lm, data, target.output.weight, k=K).per_depth


def test_verifier_chunks_batch_sequences_of_one_length(trained_eagle: EagleDrafter,
                                                       data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    short = [(t[:24], h[:24]) for t, h in data[:2]]
    mixed = [data[0], short[0], data[1], short[1], data[2]]
    v = Verifier(k=K, batch=2)
    v.begin(mixed)
    results = []
    while v.in_progress:
        results.append(v.run_chunk(trained_eagle, None))
    assert len(results) == 3 and results[:-1] == [None, None] and v.rounds == 1   # 40: 2 + 1, 24: 2
    assert results[-1] is not None and results[-1].to_dict() == measure(trained_eagle, mixed, None, k=K).to_dict()


def test_sampled_acceptance_rate_is_one_for_the_target_itself_and_ranks_drafters(
        target: Transformer, trained_eagle: EagleDrafter, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """sum_v min(p, q): 1 when the drafter's distribution is the target's, and the trained drafter
    above an untrained one."""
    from spectrain_workloads.drafter.verify import sampled_acceptance_rate

    class Oracle(EagleDrafter):
        """Predicts the next hidden state exactly (read from the data), so q = p."""

        def forward(self, tokens, hidden, *a):  # type: ignore[no-untyped-def]
            nxt = torch.cat([hidden[:, 1:], data[0][1][None, hidden.size(1):hidden.size(1) + 1]], 1)
            return self.lm_head(nxt), nxt

    oracle = Oracle(CFG)
    oracle.load_state_dict(trained_eagle.state_dict())
    assert sampled_acceptance_rate(oracle, data[:1]) == pytest.approx(1.0, abs=1e-5)
    untrained = build_drafter(DrafterSettings(), CFG)
    assert isinstance(untrained, EagleDrafter)
    untrained.load_target_weights(trained_eagle.embed.weight, trained_eagle.lm_head.weight)
    low, high = sampled_acceptance_rate(untrained, data), sampled_acceptance_rate(trained_eagle, data)
    assert 0.0 < low < high < 1.0
