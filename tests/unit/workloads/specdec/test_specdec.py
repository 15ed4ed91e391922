"""Speculative sampling is lossless: the engine's samples follow the target's exact distribution.

A vocabulary-8 model makes the exact distribution of a 3-token continuation enumerable (512 cells).
Chi-square goodness of fit on many samples (fixed seeds): the rejection rule passes; an always-accept
rule (emits the drafter's distribution) fails. The drafter is deliberately far from the target.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from spectrain_workloads.model import ModelConfig, Transformer
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.specdec.engine import RolloutEngine
from spectrain_workloads.specdec.sampling import Sampling, to_probs, verify

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

V, NEW, N = 8, 3, 24000
PROMPT = [3]


def peaked_model(seed: int) -> Transformer:
    m = Transformer(ModelConfig(vocab_size=V, dim=16, n_layers=1, n_heads=2, max_seq_len=32))
    m.init_weights(seed)
    with torch.no_grad():
        m.output.weight.mul_(60.0)   # type: ignore[union-attr]   # far from uniform: distinct p and q
    return m.eval()


TARGET, DRAFTER = peaked_model(1), peaked_model(2)


def exact(s: Sampling) -> torch.Tensor:
    """[V**NEW] probability of every continuation under the target (plain decoding's distribution)."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=NEW)])   # [V^3, 4]
    with torch.no_grad():
        p = to_probs(TARGET(seqs[:, :-1])[:, len(PROMPT) - 1:], s)                               # [V^3, 3, V]
    return p.gather(-1, seqs[:, len(PROMPT):, None])[..., 0].prod(-1)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells with expected count < 5 pooled; p-value from the regularised gamma."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def always_accept(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(u, dtype=torch.bool)


def sample_counts(s: Sampling, k: int, rule=None, speculative: bool = True) -> torch.Tensor:  # type: ignore[no-untyped-def]
    cfg = RolloutConfig(max_new_tokens=NEW, temperature=s.temperature, top_p=s.top_p, eos_id=None,
                        max_draft_tokens=k, batch_threshold=N, strategy="Fixed", seed=123)
    eng = RolloutEngine(TARGET, cfg, DRAFTER, **({"rule": rule} if rule else {}))
    res = eng.generate([PROMPT] * N, speculative=speculative)
    assert not speculative or res.stats.spec_steps > 0
    idx = torch.tensor([sum(t * V ** (NEW - 1 - i) for i, t in enumerate(r)) for r in res.responses])
    return torch.bincount(idx, minlength=V**NEW)


@pytest.mark.parametrize("s,k", [(Sampling(temperature=1.0), 2), (Sampling(temperature=3.0, top_p=0.9), 3)])
def test_speculative_sampling_matches_target_distribution(s: Sampling, k: int) -> None:
    probs = exact(s)
    counts = sample_counts(s, k)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert counts[probs == 0].sum() == 0            # nothing outside the nucleus
    # the same test has power: accepting every draft (lossy) is rejected decisively
    lossy = sample_counts(s, k, rule=always_accept)
    assert chi2_pvalue(lossy, probs) < 1e-6


def test_plain_sampling_passes_the_same_test() -> None:
    s = Sampling(temperature=1.0)
    assert chi2_pvalue(sample_counts(s, 2, speculative=False), exact(s)) > 1e-3


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = to_probs(logits, Sampling(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = to_probs(logits, Sampling(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_verify_accepts_prefix_and_resamples_from_residual() -> None:
    # draft token 1 everywhere; p puts 0 on token 1 at the 2nd position: exactly one accepted when q_d <= p_d
    p = torch.tensor([[[0.2, 0.8, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])   # [1, 3, 3]
    q = torch.tensor([[[0.0, 0.8, 0.2], [0.0, 1.0, 0.0]]])                    # [1, 2, 3]
    n, nxt = verify(p, q, torch.tensor([[1, 1]]), torch.Generator().manual_seed(0))
    assert n.tolist() == [1] and nxt.tolist() == [0]                           # residual max(0, p-q) = token 0
    p2 = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    n, nxt = verify(p2, q, torch.tensor([[1, 1]]), torch.Generator().manual_seed(0))
    assert n.tolist() == [2] and nxt.tolist() == [2]                           # all accepted: bonus from p_3
