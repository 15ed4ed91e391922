"""EAGLE-3 serving exports (drafter/eagle3_export.py) against the loaders' tables (eagle3_tables.py):
both layouts conform, a mutated export is refused naming the fault, and SGLang's / vLLM's
load_weights (transcribed) map every exported tensor to a parameter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from spectrain_workloads.drafter.eagle3 import Eagle3Drafter, build_eagle3, features_from_hidden_states
from spectrain_workloads.drafter.eagle3_export import export_eagle3
from spectrain_workloads.drafter.eagle3_tables import (
    SGLANG_FROM_TARGET,
    SGLANG_PARAMS,
    VLLM_PARAMS,
    LayoutError,
    Sizes,
    check_layout,
    layout_problems,
    sglang_param_for,
    sglang_table,
    speculators_table,
    vllm_param_for,
)

H, V, VD, LAYERS = 64, 256, 96, 8
SIZES = Sizes(H=H, I=128, n=4, n_kv=2, d=16, Vd=VD, V=V, Ht=H)


def tiny_target(tmp: Path) -> tuple[LlamaForCausalLM, Path]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=LAYERS, vocab_size=V, max_position_embeddings=128)
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(tmp / "target")
    return target, tmp / "target"


def exported(tmp: Path, draft_vocab: int = VD, **kw: Any) -> tuple[Eagle3Drafter, LlamaForCausalLM, dict[str, Path]]:
    target, path = tiny_target(tmp)
    counts = torch.randperm(V).float()
    dr = build_eagle3(target, token_counts=counts, draft_vocab_size=draft_vocab, seed=0)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(0.01 * torch.randn_like(p))     # not the init values: a mix-up would show
    cfg = json.loads((path / "config.json").read_text())
    return dr, target, export_eagle3(tmp / "out", dr, target_config=cfg, target_path=path, **kw)


def names(d: Path) -> set[str]:
    return set(load_file(str(d / "model.safetensors")))


def test_both_layouts_conform_and_carry_the_same_weights(tmp_path: Path) -> None:
    dr, target, out = exported(tmp_path)
    assert check_layout(out["sglang"]) == "sglang" and check_layout(out["speculators"]) == "speculators"
    sg, sp = load_file(str(out["sglang"] / "model.safetensors")), load_file(str(out["speculators"] / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sg.items()} == {k: s for k, (s, _) in sglang_table(SIZES).items()}
    assert {k: tuple(v.shape) for k, v in sp.items()} == {k: s for k, (s, _) in speculators_table(SIZES).items()}
    state = dr.state_dict()
    for name, w in state.items():
        assert torch.equal(sg[name], w), name
        assert torch.equal(sp[name.replace("midlayer.", "layers.0.")], w), name
    assert torch.equal(sp["embed_tokens.weight"], target.model.embed_tokens.weight)
    # the sglang directory is our own state dict: it reloads strictly and drafts the same
    again = build_eagle3(target, token_counts=torch.ones(V), draft_vocab_size=VD, seed=5)
    again.load_state_dict(sg, strict=True)
    ids = torch.randint(0, V, (1, 10))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = features_from_hidden_states(hs, dr.feature_layers)
        torch.testing.assert_close(again.unroll(feats, ids, 2)[1], dr.unroll(feats, ids, 2)[1], rtol=0, atol=0)


def test_configs_carry_what_the_loaders_read(tmp_path: Path) -> None:
    dr, _, out = exported(tmp_path)
    sg = json.loads((out["sglang"] / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["num_hidden_layers"] == 1
    assert sg["draft_vocab_size"] == VD and sg["vocab_size"] == V and sg["tie_word_embeddings"] is False
    assert dr.feature_layers == (2, 4, 5)
    assert sg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]                   # vLLM: before layer i
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]   # SGLang adds 1
    assert sg["norm_before_residual"] is False and "bias" not in sg
    LlamaConfig(**{k: v for k, v in sg.items() if k != "model_type"})           # what SGLang/vLLM build
    sp = json.loads((out["speculators"] / "config.json").read_text())
    assert sp["speculators_model_type"] == "eagle3"
    assert sp["speculators_config"]["verifier"] == {"name_or_path": str(tmp_path / "target"),
                                                    "architectures": ["LlamaForCausalLM"]}
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert sp["transformer_layer_config"]["vocab_size"] == V and sp["draft_vocab_size"] == VD
    assert sp["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert {k: sp[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == \
        dict.fromkeys(("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False)


def test_sglang_layout_names_equal_sglangs_loader_table(tmp_path: Path) -> None:
    _, _, out = exported(tmp_path)
    sg = names(out["sglang"])
    assert sg == set(sglang_table(SIZES))
    landed = {sglang_param_for(n) for n in sg}
    assert None not in landed, sorted(n for n in sg if sglang_param_for(n) is None)
    # every SGLang parameter is written except the embedding it installs from the target
    assert landed - {""} == SGLANG_PARAMS - SGLANG_FROM_TARGET
    # the hazard the table guards: the speculators names would be skipped without a word
    assert sglang_param_for("layers.0.self_attn.q_proj.weight") is None
    assert sglang_param_for("layers.0.hidden_norm.weight") is None
    # vLLM loads both directories (strictly: an unknown name is a KeyError there)
    for layout in ("sglang", "speculators"):
        got = {vllm_param_for(n) for n in names(out[layout])}
        assert None not in got, layout
        assert got - {""} >= VLLM_PARAMS - {"model.embed_tokens.weight"}, layout


def test_full_draft_vocabulary_drops_the_maps_where_speculators_has_none(tmp_path: Path) -> None:
    _, _, out = exported(tmp_path, draft_vocab=V, dtype="bfloat16")
    assert {"d2t", "t2d"} <= names(out["sglang"])
    assert not {"d2t", "t2d"} & names(out["speculators"])
    for d in out.values():
        check_layout(d)
    with open(out["sglang"] / "model.safetensors", "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    assert header["fc.weight"]["dtype"] == "BF16" and header["d2t"]["dtype"] == "I64"


def _rewrite(d: Path, edit: Any) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def test_a_mutated_export_is_refused_naming_each_fault(tmp_path: Path) -> None:
    _, _, out = exported(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(out["sglang"], bad)

    def rename_and_break(t: dict[str, torch.Tensor]) -> None:
        t["layers.0.hidden_norm.weight"] = t.pop("midlayer.hidden_norm.weight")   # a name SGLang skips
        t["lm_head.weight"] = t["lm_head.weight"][:-1]                            # [Vd-1, H]
        t["d2t"] = t["d2t"].to(torch.int32)
    _rewrite(bad, rename_and_break)
    with pytest.raises(LayoutError) as err:
        check_layout(bad)
    msg = str(err.value)
    assert "tensor midlayer.hidden_norm.weight missing" in msg
    assert "unexpected tensor layers.0.hidden_norm.weight" in msg and "skips it silently" in msg
    assert f"lm_head.weight has shape [{VD - 1}, {H}], the sglang loader needs [{VD}, {H}]" in msg
    assert "tensor d2t is I32, the sglang loader needs I64" in msg
    assert len(err.value.problems) == 4

    cfg = json.loads((out["sglang"] / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]   # vLLM's ids given to SGLang
    cfg["tie_word_embeddings"] = True
    (bad / "config.json").write_text(json.dumps(cfg))
    problems = layout_problems(bad)
    assert any("eagle_config.eagle_aux_hidden_state_layer_ids=[2, 4, 5] must be [1, 3, 4]" in p for p in problems)
    assert any("tie_word_embeddings=True" in p for p in problems)

    spec = tmp_path / "bad-spec"
    shutil.copytree(out["speculators"], spec)
    cfg = json.loads((spec / "config.json").read_text())
    del cfg["norm_before_residual"]
    cfg["speculators_config"]["verifier"]["name_or_path"] = None
    (spec / "config.json").write_text(json.dumps(cfg))
    problems = layout_problems(spec)
    assert any("norm_before_residual='<absent>'" in p for p in problems)
    assert any("verifier.name_or_path is required" in p for p in problems)
    shutil.copy(out["speculators"] / "config.json", spec / "config.json")
    _rewrite(spec, lambda t: t.pop("embed_tokens.weight"))
    assert layout_problems(spec) == [f"tensor embed_tokens.weight missing (shape [{V}, {H}] F32 expected)"]
