"""Drafter architectures (contracts.md Eagle convention), losses, target weights, settings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from spectrain_api.config import DrafterSpec
from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter.models import (
    EagleDrafter,
    TargetShared,
    build_drafter,
    config_digest,
    eagle_loss,
    lm_loss,
    load_target_shared,
    wait_target_shared,
)
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.synthetic import (
    make_target,
    target_hidden,
    text_sequences,
    write_target_shared,
)
from spectrain_workloads.model import Transformer, causal_decode_mask, model_config

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

CFG = model_config("debug", {"n_layers": 2, "max_seq_len": 64})


@pytest.fixture(scope="module")
def target() -> Transformer:
    return make_target(CFG, seed=0)


def shared(t: Transformer) -> TargetShared:
    assert t.tok_embeddings is not None and t.output is not None
    return TargetShared(embedding=t.tok_embeddings.weight.detach(), lm_head=t.output.weight.detach(),
                        model_config=t.cfg, digest=config_digest(t.cfg.to_dict()), stamp=())


def eagle(t: Transformer, seed: int = 0) -> EagleDrafter:
    d = build_drafter(DrafterSettings(seed=seed), t.cfg)
    assert isinstance(d, EagleDrafter)
    s = shared(t)
    d.load_target_weights(s.embedding, s.lm_head)
    return d


def test_eagle_shapes_and_logits_are_the_target_head_of_the_predicted_hidden(target: Transformer) -> None:
    d = eagle(target)
    tokens = text_sequences(2, 16, seed=0)
    hidden = target_hidden(target, tokens)
    logits, h = d(tokens[:, 1:], hidden[:, :-1])
    assert logits.shape == (2, 15, CFG.vocab_size) and h.shape == (2, 15, CFG.dim)
    assert target.output is not None
    torch.testing.assert_close(logits, target.output(h))


def test_eagle_is_causal_and_kv_cache_decoding_matches_the_full_forward(target: Transformer) -> None:
    d = eagle(target)
    tokens = text_sequences(1, 12, seed=1)
    hidden = target_hidden(target, tokens)
    full_logits, full_h = d(tokens[:, 1:], hidden[:, :-1])
    changed = hidden.clone()
    changed[:, 8:] += 1.0
    part_logits, _ = d(tokens[:, 1:], changed[:, :-1])
    torch.testing.assert_close(part_logits[:, :8], full_logits[:, :8])     # no look-ahead
    d.setup_caches(1, 11)
    try:
        outs = []
        for p in range(11):
            pos = torch.tensor([p])
            lg, h = d(tokens[:, p + 1:p + 2], hidden[:, p:p + 1], pos, causal_decode_mask(pos, 11))
            outs.append(h)
        torch.testing.assert_close(torch.cat(outs, 1), full_h, atol=1e-5, rtol=1e-4)
    finally:
        d.clear_caches()


def test_eagle_training_updates_only_its_own_layers_and_fits_a_batch(target: Transformer) -> None:
    d = eagle(target)
    tokens = text_sequences(4, 32, seed=2)
    hidden = target_hidden(target, tokens)
    frozen = (d.embed.weight.clone(), d.lm_head.weight.clone())
    fc_before = d.fc.weight.clone()
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first: dict[str, float] = {}
    for _ in range(40):
        loss, stats = eagle_loss(d, tokens, hidden, hidden_weight=1.0, ce_weight=0.1)
        first = first or stats
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert stats["reg"] < 0.5 * first["reg"] and stats["ce"] < first["ce"]
    assert torch.equal(d.embed.weight, frozen[0]) and torch.equal(d.lm_head.weight, frozen[1])
    assert not torch.equal(d.fc.weight, fc_before)
    assert set(stats) == {"reg", "ce", "top1"}


def test_loss_weights_select_the_terms(target: Transformer) -> None:
    d = eagle(target)
    tokens = text_sequences(2, 16, seed=3)
    hidden = target_hidden(target, tokens)
    reg_only, s = eagle_loss(d, tokens, hidden, hidden_weight=1.0, ce_weight=0.0)
    ce_only, _ = eagle_loss(d, tokens, hidden, hidden_weight=0.0, ce_weight=1.0)
    both, _ = eagle_loss(d, tokens, hidden, hidden_weight=2.0, ce_weight=0.5)
    torch.testing.assert_close(both, 2 * reg_only + 0.5 * ce_only)
    torch.testing.assert_close(reg_only / 2, torch.tensor(s["reg"]))        # summed over the batch of 2


def test_lm_drafter_is_a_small_transformer_distilled_from_tokens_and_logits(target: Transformer) -> None:
    s = DrafterSettings(arch="LM")
    lm = build_drafter(s, target.cfg)
    assert type(lm) is Transformer and lm.cfg.dim == s.lm_dim and lm.cfg.vocab_size == CFG.vocab_size
    tokens = text_sequences(2, 16, seed=4)
    hidden = target_hidden(target, tokens)
    assert target.output is not None
    loss, stats = lm_loss(lm, tokens, hidden, target.output.weight, soft_weight=0.1, hard_weight=0.5)
    assert loss.requires_grad and {"hard_ce", "ce", "top1"} <= set(stats)
    tokens_only, stats2 = lm_loss(lm, tokens, None, None, soft_weight=0.1, hard_weight=0.5)
    assert "ce" not in stats2 and tokens_only.item() == pytest.approx(2 * 0.5 * stats2["hard_ce"], rel=1e-5)


def test_target_shared_roundtrip_and_wait(tmp_path: Path, target: Transformer) -> None:
    assert load_target_shared(tmp_path) is None
    t0 = time.monotonic()
    assert wait_target_shared(tmp_path, timeout_s=0.3, poll_s=0.05) is None
    assert time.monotonic() - t0 >= 0.3
    write_target_shared(tmp_path, target)
    got = load_target_shared(tmp_path)
    assert got is not None and got.model_config == target.cfg
    assert target.tok_embeddings is not None
    assert torch.equal(got.embedding, target.tok_embeddings.weight)
    assert got.digest == config_digest(json.loads((tmp_path / "target/shared/model_config.json").read_text()))
    with pytest.raises(ConfigError, match="shape"):
        eagle(target).load_target_weights(got.embedding[:10], got.lm_head)


def test_settings_from_spec_and_errors_name_the_field() -> None:
    spec = DrafterSpec(arch="LM", preset="small")
    s = DrafterSettings.from_spec(spec, seed=3, verify_k=2)
    assert (s.arch, s.lm_dim, s.verify_k, s.seed, s.kinds[0]) == ("LM", 128, 2, 3, "Bubble")
    cases = [
        (dict(arch="Medusa"), "spec.drafter.arch"),
        (dict(preset="huge"), "spec.drafter.preset"),
        (dict(policy="Sometimes"), "activation.policy"),
        (dict(kinds=[]), "activation.kinds"),
        (dict(kinds=["Bubble", "Bubble"]), "duplicates"),
        (dict(kinds=["Lunch"]), "unknown kinds"),
        (dict(lr=0.0), "optimizer.lr"),
        (dict(hidden_loss_weight=0.0, ce_loss_weight=0.0), "loss weights"),
        (dict(samples_per_step=0), "samples_per_step"),
        (dict(verify_batch=0), "verify_batch must be >= 1, got 0"),
    ]
    for kw, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            DrafterSettings(**kw)
    with pytest.raises(ConfigError, match="unknown drafter settings"):
        DrafterSettings.from_spec(spec, no_such_knob=1)



@pytest.mark.parametrize("weight", [1.0, 50.0])       # gradient norm ~0.1 (no clip) / ~5 (clipped)
def test_trainer_step_is_adamw_on_the_clipped_mean_gradient_of_its_micro_steps(target: Transformer,
                                                                                weight: float) -> None:
    """DrafterTrainer's fused optimizer step over gradients summed by micro-steps of different sizes
    is, to rounding, the textbook update: per-sample mean gradient, clipped to norm 1, unfused AdamW.
    Steps accumulate different numbers of samples, so a wrong divisor shows through Adam's scale
    invariance."""
    from spectrain_workloads.drafter.combiner import Sample
    from spectrain_workloads.drafter.train import DrafterTrainer

    s = DrafterSettings(lr=3e-3, hidden_loss_weight=weight, ce_loss_weight=0.1 * weight)
    trainer = DrafterTrainer(s, shared(target), torch.device("cpu"))
    ref = eagle(target)
    ref.load_state_dict(trainer.model.state_dict())
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0, foreach=False, fused=False)
    tokens = text_sequences(5, 32, seed=7)
    hidden = target_hidden(target, tokens)
    samples = [Sample(tokens=tokens[i], hidden=hidden[i], step=0) for i in range(5)]
    norms = []
    for n in (5, 2, 4, 1):
        trainer.micro_step(samples[:1])
        if n > 1:
            trainer.micro_step(samples[1:n])
        trainer.optimizer_step(n)
        loss, _ = eagle_loss(ref, tokens[:n], hidden[:n], hidden_weight=s.hidden_loss_weight,
                             ce_weight=s.ce_loss_weight, stats=False)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
    assert all(n > 1.0 for n in norms) if weight > 1 else all(n < 1.0 for n in norms)
    for (name, got), want in zip(trainer.model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    assert all(p.grad is None for p in trainer.model.parameters())
