"""The rollout engine and `spectrain generate` drive an EAGLE-3 drafter (drafter/eagle3.py through
specdec/eagle3_draft.py), still lossless.

A tiny random 7-layer transformers Llama (hf.tiny, no hub; 7 layers so the default feature layers
(2, 3, 4) exist) is the target; an Eagle3 drafter over half its vocabulary is trained here on the
target's own greedy continuations (200 TTT steps, 8 s on an idle core). Checked: the target forward's
features are transformers' hidden_states; the adapter's cached chain is `eagle3.draft`'s; greedy
speculative decoding is transformers' greedy `generate` token for token at batch 1 and 3 with
more than one token per verification; the enumerable chi-square test of test_specdec at
temperature 1 (a peaked random drafter whose draft vocabulary leaves tokens out); `spectrain
generate --json` on a saved model and an `export_eagle3` output; a drafter of another target refused
naming each mismatch. One thread: the matrices are tiny and the 2 cores are shared.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter.eagle3 import (
    Eagle3Drafter,
    build_draft_vocab,
    build_eagle3,
    default_feature_layers,
    draft,
    eagle3_layer_config,
    features_from_hidden_states,
    train_step,
)
from spectrain_workloads.drafter.eagle3_export import export_eagle3
from spectrain_workloads.generate import load_matching_drafter, load_target
from spectrain_workloads.hf.source import inspect
from spectrain_workloads.hf.stage import HFStage
from spectrain_workloads.hf.tiny import build_model
from spectrain_workloads.model import ModelConfig, Transformer, causal_decode_mask
from spectrain_workloads.specdec.adapters import as_drafter
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.specdec.eagle3_draft import Eagle3Draft
from spectrain_workloads.specdec.engine import RolloutEngine
from spectrain_workloads.specdec.sampling import Sampling, to_probs
from tests.unit.workloads.hf.test_hf_specdec import Scripted
from tests.unit.workloads.specdec.test_specdec import always_accept, chi2_pvalue

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

LAYERS, VD, NEW = 7, 256, 24      # target layers, draft vocabulary (of the tiny model's 512), new tokens


@dataclass
class Setup:
    model_dir: Path
    ref: LlamaForCausalLM          # transformers' own model: the reference greedy decoder
    stage: HFStage                 # the same weights as the engine runs them
    drafter: Eagle3Drafter         # trained on the target's greedy continuations


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    model_dir = build_model(tmp_path_factory.mktemp("e3") / "target", layers=LAYERS)
    ref = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    V = ref.config.vocab_size
    torch.manual_seed(0)
    with torch.no_grad():      # 512 greedy continuations [512, 32] of random 4-token prompts: what decoding sees
        ids = ref.generate(torch.randint(3, V, (512, 4)), max_new_tokens=28, min_new_tokens=28,
                           do_sample=False, pad_token_id=0)
        out = ref(ids, output_hidden_states=True)
    layers = default_feature_layers(LAYERS)
    feats, logits = features_from_hidden_states(out.hidden_states, layers), out.logits   # [512, 32, 3H], [.., V]
    counts = torch.bincount(logits.argmax(-1).flatten(), minlength=V)
    drafter = build_eagle3(ref, token_counts=counts, draft_vocab_size=VD, seed=0)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        b = torch.randint(0, ids.size(0), (16,), generator=gen)
        train_step(drafter, opt, feats[b], ids[b], logits[b])
    stage, _, _ = load_target(str(model_dir))
    return Setup(model_dir, ref, stage, drafter.eval())


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (length,), generator=g).tolist() for length in (3, 7, 5, 10, 4, 6)[:n]]


def test_the_target_forward_returns_transformers_hidden_states_at_the_feature_layers(setup: Setup) -> None:
    torch.manual_seed(7)
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        want = setup.ref(ids, output_hidden_states=True)
        logits, hidden, feats = setup.stage(ids, features=(2, 3, 4))
        plain = setup.stage(ids, return_hidden=True)
    torch.testing.assert_close(feats, features_from_hidden_states(want.hidden_states, (2, 3, 4)), rtol=0, atol=0)
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    assert len(plain) == 2 and torch.equal(plain[1], hidden)          # nothing extra when not asked
    with pytest.raises(ConfigError, match=r"feature layers \[2, 3, 7\]: this stage runs layers 0\.\.6"):
        setup.stage(ids, features=(2, 3, 7))
    first = HFStage.stage(inspect(f"file://{setup.model_dir}"), 0, 7)      # layer 0 only, no LM head
    with pytest.raises(ConfigError, match=r"runs layers 0\.\.0 and lacks the LM head"):
        first(ids, features=(0,))


def test_the_adapters_cached_chain_is_eagle3_draft(setup: Setup) -> None:
    """Catch-up over a prefix (features at slots 0..T-1) then k single steps through the static
    cache propose what `eagle3.draft` (a growing cache) proposes; every proposal is in the draft
    vocabulary and the logits are -inf elsewhere."""
    torch.manual_seed(3)
    ids = torch.randint(3, 512, (2, 12))
    with torch.no_grad():
        feats = features_from_hidden_states(setup.ref(ids, output_hidden_states=True).hidden_states,
                                            setup.drafter.feature_layers)
        want = draft(setup.drafter, feats[:, :11], ids, k=4)                     # [2, 4]
        ad = as_drafter(setup.drafter)
        assert isinstance(ad, Eagle3Draft) and ad.feature_layers == (2, 3, 4)
        ad.setup_caches(2, 32)
        pos = torch.arange(11).expand(2, 11)
        logits, h = ad.forward(ids[:, 1:12], feats[:, :11], pos, causal_decode_mask(pos, 32))
        got, h = [logits[:, -1].argmax(-1)], h[:, -1:]
        for j in range(1, 4):
            p = torch.full((2, 1), 10 + j)
            logits, h = ad.forward(got[-1][:, None], h, p, causal_decode_mask(p, 32))
            got.append(logits[:, -1].argmax(-1))
    assert torch.equal(torch.stack(got, 1), want)
    assert bool(setup.drafter.t2d[want].all())
    assert bool(torch.isinf(logits[..., ~setup.drafter.t2d]).all()) and bool(torch.isfinite(logits[..., setup.drafter.t2d]).all())


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_decoding_is_transformers_greedy(setup: Setup, batch: int) -> None:
    rc = RolloutConfig(max_new_tokens=NEW, temperature=0, eos_id=2, max_draft_tokens=3, batch_threshold=8,
                       strategy="Fixed", seed=0)
    accepted = []
    for seed in (1, 2):
        ps = prompts(batch, seed + batch)
        with torch.no_grad():
            res = RolloutEngine(setup.stage, rc, setup.drafter).generate(ps)
            for p, seq in zip(ps, res.sequences, strict=True):
                want = setup.ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0].tolist()
                assert seq == want, (p, seq, want)
        assert res.stats.spec_steps > 0
        accepted.append(res.stats.acceptance_length)
    # measured 1.25-1.67 tokens per verification at k = 3 (an untrained drafter: 1.0)
    assert min(accepted) > 1.15, accepted


# ---- losslessness: the enumerable chi-square test of test_specdec / test_hf_specdec (vocabulary 8,
# 3-token continuations, N samples) with an Eagle3 drafter
V8, N, CHI_NEW, PROMPT = 8, 24000, 3, [3]
EXCLUDED = [1, 3]        # target ids outside the chi-square drafter's draft vocabulary
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V8, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def peaked_pair() -> tuple[HFStage, Eagle3Drafter]:
    """A target and an Eagle3 drafter far from uniform (distinct p and q); the drafter's vocabulary
    is 6 of the 8 ids, so q is 0 on two tokens the target does emit (EXCLUDED). The target's
    weights are smaller than test_hf_specdec's 1-layer one's: over 7 layers N(0, 0.5) makes it
    emit one token with probability 0.999 (a test without power)."""
    torch.manual_seed(1)
    target = HFStage(CONFIG, layers=range(LAYERS), first=True, last=True)
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
        target.lm_head.weight.mul_(3.0)      # type: ignore[union-attr]   # entropy 2.2 nats over the 512 outcomes
    counts = torch.ones(V8)
    counts[EXCLUDED] = 0.0
    d2t, t2d = build_draft_vocab(counts, V8 - len(EXCLUDED))
    torch.manual_seed(2)
    dr = Eagle3Drafter(eagle3_layer_config(target.hf_cfg), target.model.embed_tokens.weight,   # type: ignore[union-attr]
                       default_feature_layers(LAYERS), target_num_layers=LAYERS, d2t=d2t, t2d=t2d)
    with torch.no_grad():
        for p in dr.parameters():
            p.normal_(0.0, 0.5) if p.dim() > 1 else p.fill_(1.0)
        dr.lm_head.weight.mul_(4.0)
    return target.eval(), dr.eval()


@pytest.fixture(scope="module")
def chi() -> tuple[HFStage, Eagle3Drafter, torch.Tensor]:
    """(target, drafter, the exact probability [V^3] of every 3-token continuation at temperature 1)."""
    target, dr = peaked_pair()
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V8), repeat=CHI_NEW)])   # [V^3, 4]
    with torch.no_grad():
        p = to_probs(target(seqs[:, :-1])[:, len(PROMPT) - 1:], Sampling(temperature=1.0))          # [V^3, 3, V]
    probs = p.gather(-1, seqs[:, len(PROMPT):, None])[..., 0].prod(-1)
    off_vocab = torch.isin(seqs[:, len(PROMPT):], torch.tensor(EXCLUDED)).any(1)                      # [V^3]
    assert float(probs[off_vocab].sum()) > 0.3        # the tokens q never proposes carry much of p (0.74)
    return target, dr, probs


def sample_counts(target: HFStage, dr: Eagle3Drafter, rule: object = None,
                  pattern: list[int] | None = None) -> torch.Tensor:
    """N continuations through the engine -> counts [V^3]; pattern: scripted draft lengths per step."""
    cfg = RolloutConfig(max_new_tokens=CHI_NEW, temperature=1.0, eos_id=None, max_draft_tokens=2,
                        batch_threshold=N, strategy="Bandit" if pattern else "Fixed", seed=123)
    eng = RolloutEngine(target, cfg, dr, **({"rule": rule} if rule else {}))
    if pattern:
        eng.controller = Scripted(pattern)
    res = eng.generate([PROMPT] * N)
    assert res.stats.spec_steps > 0 and res.stats.accepted > 0
    idx = torch.tensor([sum(t * V8 ** (CHI_NEW - 1 - i) for i, t in enumerate(r)) for r in res.responses])
    return torch.bincount(idx, minlength=V8 ** CHI_NEW)


def test_speculative_sampling_with_an_eagle3_drafter_matches_the_targets_distribution(
        chi: tuple[HFStage, Eagle3Drafter, torch.Tensor]) -> None:
    target, dr, probs = chi
    assert chi2_pvalue(sample_counts(target, dr), probs) > 1e-3                  # measured p = 0.93
    assert chi2_pvalue(sample_counts(target, dr, always_accept), probs) < 1e-6   # the test has power


@pytest.mark.parametrize("pattern", [[0, 2], [1, 0, 1]])
def test_switching_between_plain_and_eagle3_steps_stays_lossless(
        chi: tuple[HFStage, Eagle3Drafter, torch.Tensor], pattern: list[int]) -> None:
    """Plain steps in between: the drafter catches up on their tokens from the features the plain
    verifications stored (test_hf_specdec's scripted controller)."""
    target, dr, probs = chi
    assert chi2_pvalue(sample_counts(target, dr, pattern=pattern), probs) > 1e-3   # measured 0.83, 0.52


# ---- `spectrain generate`
def cli_generate(model: Path, drafter: Path, capsys: pytest.CaptureFixture[str], prompt: str) -> tuple[int, str, str]:
    from spectrain_operator.cli import main

    rc = main(["generate", "--model", str(model), "--drafter", str(drafter), "--prompt", prompt,
               "--max-new-tokens", "16", "--draft-tokens", "3", "--json", "--device", "cpu"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_spectrain_generate_with_an_eagle3_export_is_greedy(setup: Setup, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((setup.model_dir / "config.json").read_text())
    written = export_eagle3(tmp_path / "export", setup.drafter, target_config=cfg, target_path=setup.model_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup.model_dir))
    prompt = "def fibonacci(n):"
    ids = tok(prompt).input_ids
    want = setup.ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    for drafter_dir in (tmp_path / "export", written["speculators"]):       # the root or the directory
        rc, out, err = cli_generate(setup.model_dir, drafter_dir, capsys, prompt)
        assert rc == 0, err
        assert json.loads(out)["completions"][0]["token_ids"] == want
    rc, _, err = cli_generate(setup.model_dir, written["sglang"], capsys, prompt)
    assert rc == 2 and "sglang layout of an EAGLE-3 export; give its sibling" in err
    # what it loaded: the trained weights and maps, the target's embedding borrowed (its storage)
    source = inspect(f"file://{setup.model_dir}")
    loaded, meta = load_matching_drafter(str(tmp_path / "export"), source, setup.stage)
    assert meta["speculators_model_type"] == "eagle3" and loaded.feature_layers == (2, 3, 4)
    want_state = setup.drafter.state_dict()
    assert all(torch.equal(v, want_state[k]) for k, v in loaded.state_dict().items()) and \
        loaded.state_dict().keys() == want_state.keys()
    assert loaded.embed_weight.data_ptr() == setup.stage.model.embed_tokens.weight.data_ptr()   # type: ignore[union-attr]
    # a full draft vocabulary (speculators then writes no d2t/t2d), loaded without a target: the file's embedding
    full = build_eagle3(setup.ref, draft_vocab_size=512, seed=1)
    export_eagle3(tmp_path / "full", full, target_config=cfg, target_path=setup.model_dir)
    again, _ = load_matching_drafter(str(tmp_path / "full"), source)
    assert torch.equal(again.d2t, full.d2t) and bool(again.t2d.all()) and torch.equal(again.fc.weight, full.fc.weight)
    assert torch.equal(again.embed_weight, setup.ref.model.embed_tokens.weight)


def test_a_drafter_of_another_target_is_refused_naming_each_mismatch(setup: Setup, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                         num_key_value_heads=1, num_hidden_layers=10, vocab_size=384,
                                         max_position_embeddings=64))
    other.config.architectures = ["LlamaForCausalLM"]
    dr = build_eagle3(other, draft_vocab_size=384, seed=0)                 # feature layers (2, 5, 7)
    export_eagle3(tmp_path / "other", dr, target_config=other.config.to_dict(), target_path=tmp_path / "x",
                  dtype="float32")
    rc, out, err = cli_generate(setup.model_dir, tmp_path / "other", capsys, "x = 1")
    assert rc == 2 and out == ""
    for words in ("--drafter ", "an EAGLE-3 drafter for another target", "hidden size 32 vs the target's 64",
                  "vocab size 384 vs the target's 512", "feature layers [2, 5, 7] vs the target's 7 layers"):
        assert words in err, err
    # the engine refuses an EAGLE-3 drafter over a target that cannot return the feature layers
    preset = Transformer(ModelConfig(dim=64, n_layers=LAYERS, n_heads=4, vocab_size=512, max_seq_len=64))
    with pytest.raises(ConfigError, match=r"residual stream before layers \[2, 3, 4\]; a Transformer target"):
        RolloutEngine(preset, RolloutConfig(max_new_tokens=4, temperature=0, eos_id=None), setup.drafter)
    # an arch that contradicts the module is refused, naming both
    with pytest.raises(ConfigError, match=r"drafter.arch 'Eagle' does not fit a Eagle3Drafter drafter"):
        as_drafter(setup.drafter, "Eagle")
