"""Speculative sampling stays lossless on a Hugging Face target: transformers' Llama layers under the
project's engine, with the EAGLE drafter built of the same layer class. The same enumerable
chi-square test as test_specdec (vocabulary 8, 3-token continuations), plus the cached decode of
an HF stage against transformers' own forward."""

from __future__ import annotations

import itertools

import pytest
import torch

from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter
from spectrain_workloads.hf.stage import HFStage
from spectrain_workloads.model import causal_decode_mask
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.specdec.controller import DraftController
from spectrain_workloads.specdec.engine import RolloutEngine
from spectrain_workloads.specdec.sampling import Sampling, to_probs
from tests.unit.workloads.specdec.test_specdec import always_accept, chi2_pvalue

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

V, NEW, N = 8, 3, 24000
PROMPT = [3]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def peaked_target(seed: int) -> HFStage:
    torch.manual_seed(seed)
    m = HFStage(CONFIG, layers=range(1), first=True, last=True)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5) if p.dim() > 1 else p.fill_(1.0)
        m.lm_head.weight.mul_(6.0)      # type: ignore[union-attr]   # far from uniform: distinct p and q
    return m.eval()


def peaked_drafter(target: HFStage, seed: int) -> HFEagleDrafter:
    torch.manual_seed(seed)
    d = HFEagleDrafter(CONFIG)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0.0, 0.5) if p.dim() > 1 else p.fill_(1.0)
    d.load_target_weights(target.model.embed_tokens.weight, target.lm_head.weight)   # type: ignore[union-attr]
    return d.eval()


TARGET = peaked_target(1)
DRAFTER = peaked_drafter(TARGET, 2)


def exact(s: Sampling) -> torch.Tensor:
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=NEW)])   # [V^3, 4]
    with torch.no_grad():
        p = to_probs(TARGET(seqs[:, :-1])[:, len(PROMPT) - 1:], s)                               # [V^3, 3, V]
    return p.gather(-1, seqs[:, len(PROMPT):, None])[..., 0].prod(-1)


class Scripted(DraftController):
    """The Bandit controller's engine paths with a fixed sequence of draft lengths per step (0: plain)."""

    def __init__(self, pattern: list[int]) -> None:
        super().__init__(max_draft=max(pattern), batch_threshold=N, strategy="Bandit")
        self.pattern, self.i = pattern, 0

    def choose(self, bucket: int, n_active: int, can_draft: bool, horizon: object = None) -> int:
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)] if can_draft else 0


def sample_counts(s: Sampling, k: int, rule=None, pattern: list[int] | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    cfg = RolloutConfig(max_new_tokens=NEW, temperature=s.temperature, top_p=s.top_p, eos_id=None,
                        max_draft_tokens=k, batch_threshold=N, strategy="Bandit" if pattern else "Fixed", seed=123)
    eng = RolloutEngine(TARGET, cfg, DRAFTER, **({"rule": rule} if rule else {}))
    if pattern:
        eng.controller = Scripted(pattern)
    res = eng.generate([PROMPT] * N)
    assert res.stats.spec_steps > 0
    idx = torch.tensor([sum(t * V ** (NEW - 1 - i) for i, t in enumerate(r)) for r in res.responses])
    return torch.bincount(idx, minlength=V**NEW)


def test_speculative_sampling_on_an_hf_target_matches_its_distribution() -> None:
    s = Sampling(temperature=1.0)
    probs = exact(s)
    assert chi2_pvalue(sample_counts(s, 2), probs) > 1e-3
    assert chi2_pvalue(sample_counts(s, 2, rule=always_accept), probs) < 1e-6   # the test has power


@pytest.mark.parametrize("pattern", [[0, 2], [1, 0, 1]])
def test_switching_between_plain_and_speculative_steps_stays_lossless(pattern: list[int]) -> None:
    """The adaptive engine's paths: calibration, plain steps, the drafter's catch-up after them."""
    s = Sampling(temperature=1.0)
    assert chi2_pvalue(sample_counts(s, 2, pattern=pattern), exact(s)) > 1e-3


def test_cached_decode_of_an_hf_stage_is_transformers_forward() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**CONFIG, "num_hidden_layers": 2}
    ref = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    stage = HFStage(cfg, layers=range(2), first=True, last=True)
    stage.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randint(0, V, (3, 12))
    stage.setup_caches(3, 16)
    with torch.no_grad():
        want = ref(x).logits
        pos = torch.arange(7)
        a = stage(x[:, :7], pos, causal_decode_mask(pos, 16))
        pos = torch.arange(7, 12)
        b = stage(x[:, 7:], pos, causal_decode_mask(pos, 16))
    assert torch.allclose(torch.cat([a, b], 1), want, atol=1e-6)


def test_ragged_batch_speculative_greedy_equals_plain_on_an_hf_target() -> None:
    """Rows of different lengths share each forward with per-row positions ([B, T] into StaticKV):
    greedy speculative decoding gives each row exactly its plain greedy continuation."""
    cfg = {**CONFIG, "vocab_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 64}
    torch.manual_seed(0)
    target = HFStage(cfg, layers=range(2), first=True, last=True).eval()
    drafter = HFEagleDrafter(cfg)
    drafter.load_target_weights(target.model.embed_tokens.weight, target.lm_head.weight)   # type: ignore[union-attr]
    prompts = [[1, 5, 9], [2], [3, 4, 5, 6, 7, 8, 9], [10, 11]]
    rc = RolloutConfig(max_new_tokens=12, temperature=0, eos_id=None, max_draft_tokens=3, batch_threshold=8,
                       strategy="Fixed", seed=0)
    with torch.no_grad():
        spec = RolloutEngine(target, rc, drafter.eval()).generate(prompts)
        plain = RolloutEngine(target, rc).generate(prompts, speculative=False)
    assert spec.stats.spec_steps > 0
    assert spec.sequences == plain.sequences
