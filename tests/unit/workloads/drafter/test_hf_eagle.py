"""HFEagleDrafter (EAGLE-1 over an HF target) and its serving export (vLLM / SGLang layouts).

Tiny random targets built with transformers (no hub): hidden 64, 2 layers, vocab 300.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spectrain_workloads.drafter.export import export_drafter, load_drafter  # noqa: E402
from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter  # noqa: E402
from spectrain_workloads.drafter.models import EagleDrafter, config_digest, eagle_loss  # noqa: E402
from spectrain_workloads.drafter.serving_export import (  # noqa: E402
    LAYOUTS,
    check_serving_layout,
    export_serving,
    layout_table,
)
from spectrain_workloads.drafter.verify import measure_batch  # noqa: E402
from spectrain_workloads.model import causal_decode_mask  # noqa: E402
from spectrain_workloads.specdec.adapters import EagleDraft, as_drafter  # noqa: E402

pytestmark = pytest.mark.unit

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
V, H = 300, 64
ROOT = Path(__file__).resolve().parents[4]


def target_config(arch: str) -> dict:
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cls(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, architectures=[arch],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0 if "Llama" in arch else 1e6})
    return cfg.to_dict()


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    """(arch, config dict, transformers model in eval, tokens [2, 12], final-norm hidden [2, 12, H])."""
    arch = request.param
    raw = target_config(arch)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(transformers.AutoConfig.for_model(**raw)).eval()
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(input_ids=tokens).last_hidden_state    # after the final norm
    return arch, raw, model, tokens, hidden


def drafter_for(raw: dict, model, seed: int = 0) -> HFEagleDrafter:
    torch.manual_seed(seed)
    d = HFEagleDrafter(raw)
    d.load_target_weights(model.get_input_embeddings().weight, model.lm_head.weight)
    return d


def test_interface_and_shapes(target):
    arch, raw, model, tokens, hidden = target
    d = drafter_for(raw, model)
    assert isinstance(d, EagleDrafter) and d.arch == "Eagle" and d.hf_arch == arch
    assert (d.cfg.vocab_size, d.cfg.dim, d.cfg.max_seq_len) == (V, H, 128)
    assert isinstance(d.layers[0].input_layernorm, torch.nn.Identity)
    assert d.fc.bias is None and not d.embed.weight.requires_grad and not d.lm_head.weight.requires_grad
    assert torch.equal(d.lm_head.weight, model.lm_head.weight)
    logits, h = d(tokens[:, 1:], hidden[:, :-1])
    assert logits.shape == (2, 11, V) and h.shape == (2, 11, H)
    assert isinstance(as_drafter(d), EagleDraft)
    names = set(d.state_dict())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("input_layernorm" in n for n in names)
    assert ("layers.0.self_attn.q_proj.bias" in names) == (arch == "Qwen2ForCausalLM")
    assert ("layers.0.self_attn.q_norm.weight" in names) == (arch == "Qwen3ForCausalLM")


def test_eagle_loss_decreases(target):
    _, raw, model, tokens, hidden = target
    d = drafter_for(raw, model)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss, stats = eagle_loss(d, tokens, hidden, hidden_weight=1.0, ce_weight=0.1)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert set(stats) == {"reg", "ce", "top1"}
    assert losses[-1] < 0.8 * losses[0], losses


def test_cached_decoding_equals_full_forward(target):
    _, raw, model, tokens, hidden = target
    d = drafter_for(raw, model).eval()
    x, h = tokens[:, 1:], hidden[:, :-1]
    T, max_len = x.size(1), 16
    with torch.no_grad():
        full, full_h = d(x, h)
        # shared positions: a 5-token prefill, then one position at a time
        d.setup_caches(2, max_len)
        pos = torch.arange(5)
        parts = [d(x[:, :5], h[:, :5], pos, causal_decode_mask(pos, max_len))[0]]
        for t in range(5, T):
            p = torch.tensor([t])
            parts.append(d(x[:, t:t + 1], h[:, t:t + 1], p, causal_decode_mask(p, max_len))[0])
        assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
        # per-row positions [B, T] (the rollout engine's path): prefill 4, then one step
        d.setup_caches(2, max_len)
        pos_rows = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
        d(x[:, :4], h[:, :4], pos_rows, causal_decode_mask(pos_rows, max_len))
        p = torch.tensor([[4], [4]])
        step, step_h = d(x[:, 4:5], h[:, 4:5], p, causal_decode_mask(p, max_len))
        assert torch.allclose(step, full[:, 4:5], atol=1e-5) and torch.allclose(step_h, full_h[:, 4:5], atol=1e-5)
        d.clear_caches()
        again, _ = d(x, h)
    assert torch.equal(again, full)


def test_verifier_runs_on_hf_drafter(target):
    _, raw, model, tokens, hidden = target
    acc = measure_batch(drafter_for(raw, model).eval(), tokens, hidden, None, k=3, max_starts=2)
    assert acc.chains == 4 and acc.top1_total == 2 * 11


def test_spectrain_export_roundtrip(target, tmp_path):
    _, raw, model, tokens, hidden = target
    d = drafter_for(raw, model).eval()
    export_drafter(tmp_path, 1, d, {"target_digest": config_digest(raw)})
    back, meta = load_drafter(tmp_path)
    assert isinstance(back, HFEagleDrafter) and meta["arch"] == "Eagle"
    with torch.no_grad():
        assert torch.equal(back(tokens[:, 1:], hidden[:, :-1])[0], d(tokens[:, 1:], hidden[:, :-1])[0])


# ---------------------------------------------------------------- serving layouts

def test_export_conforms(target, tmp_path):
    arch, raw, model, _, _ = target
    dirs = export_serving(tmp_path, drafter_for(raw, model))
    assert set(dirs) == ({"sglang"} if arch == "Qwen3ForCausalLM" else {"vllm", "sglang"})
    for engine, path in dirs.items():
        assert path == tmp_path / engine
        assert check_serving_layout(path) == [], engine
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V and cfg["hidden_size"] == H
        assert cfg["spectrain_target_architecture"] == arch
        assert cfg["spectrain_target_config_sha256"] == config_digest(raw)
        assert cfg["spectrain_target_vocab_size"] == V


def _family_layer(cfg: dict, target_arch: str):
    """Build the exported layer with transformers' own classes from the export's config.json."""
    layout = LAYOUTS[cfg["spectrain_layout"]]
    # vLLM's Llama layer with qkv_bias is a Qwen2 layer; SGLang's Qwen2/Qwen3 are transformers'.
    family = {"llama": "Qwen2" if layout.qkv_bias else "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[layout.model_type]
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    hf = transformers.AutoConfig.for_model(family.lower(), **fields)
    hf._attn_implementation = "sdpa"
    mod = __import__(f"transformers.models.{family.lower()}.modeling_{family.lower()}", fromlist=["x"])
    layer = getattr(mod, f"{family}DecoderLayer")(hf, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    return layout, layer, getattr(mod, f"{family}RotaryEmbedding")(config=hf), hf


def test_export_loads_with_transformers_and_matches(target, tmp_path):
    from safetensors.torch import load_file

    arch, raw, model, tokens, hidden = target
    d = drafter_for(raw, model).eval()
    x, h = tokens[:, 1:], hidden[:, :-1]
    with torch.no_grad():
        _, want = d(x, h)
    for path in export_serving(tmp_path, d, dtype="float32").values():
        cfg = json.loads((path / "config.json").read_text())
        layout, layer, rotary, hf = _family_layer(cfg, arch)
        assert hf.rope_parameters["rope_theta"] == raw["rope_parameters"]["rope_theta"]
        w = load_file(str(path / "model.safetensors"))
        fc = torch.nn.Linear(2 * H, H, bias=layout.fc_bias)
        fc.load_state_dict({k.removeprefix(f"{layout.fc}."): v for k, v in w.items() if k.startswith(f"{layout.fc}.")},
                           strict=True)
        layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in w.items() if k.startswith("layers.0.")},
                              strict=True)
        if layout.fc_bias:
            assert torch.count_nonzero(fc.bias) == 0
        with torch.no_grad():
            inp = fc(torch.cat([model.get_input_embeddings()(x), h], -1))
            pos = torch.arange(x.size(1))[None]
            got = layer(inp, attention_mask=None, position_ids=pos, position_embeddings=rotary(inp, pos))
        assert torch.allclose(got, want, atol=1e-5), layout.name


def _export_one(tmp_path, target) -> Path:
    _, raw, model, _, _ = target
    return export_serving(tmp_path, drafter_for(raw, model), engines=("sglang",))["sglang"]


def test_missing_tensor_is_reported(target, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _export_one(tmp_path, target)
    w = load_file(str(path / "model.safetensors"))
    fc = next(k for k in w if k.endswith("fc.bias"))
    del w["layers.0.mlp.up_proj.weight"], w[fc]
    save_file(w, str(path / "model.safetensors"))
    problems = check_serving_layout(path)
    assert any("tensor layers.0.mlp.up_proj.weight missing" in p for p in problems), problems
    assert any(f"tensor {fc} missing" in p for p in problems), problems


def test_wrong_shape_and_extra_tensor_are_reported(target, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _export_one(tmp_path, target)
    w = load_file(str(path / "model.safetensors"))
    w["layers.0.self_attn.k_proj.weight"] = w["layers.0.self_attn.q_proj.weight"].clone()   # [64, 64], not [32, 64]
    w["layers.0.input_layernorm.weight"] = torch.ones(H, dtype=w["layers.0.self_attn.q_proj.weight"].dtype)
    w["lm_head.weight"] = torch.zeros(V, H, dtype=w["layers.0.self_attn.q_proj.weight"].dtype)
    save_file(w, str(path / "model.safetensors"))
    problems = check_serving_layout(path)
    assert any("k_proj.weight has shape [64, 64], the config gives [32, 64]" in p for p in problems), problems
    assert any("unexpected tensor layers.0.input_layernorm.weight (EAGLE-1 layer 0 has no input norm)" in p
               for p in problems), problems
    assert any("unexpected tensor lm_head.weight (the engine takes the target's)" in p for p in problems), problems


def test_config_problems_are_reported(target, tmp_path):
    path = _export_one(tmp_path, target)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_key_value_heads"]
    cfg["num_hidden_layers"] = 2
    cfg["torch_dtype"] = "int8"
    (path / "config.json").write_text(json.dumps(cfg))
    problems = check_serving_layout(path)
    assert any("config.json lacks 'num_key_value_heads'" in p for p in problems), problems
    assert any("num_hidden_layers=2, the layout needs 1" in p for p in problems), problems
    assert any("torch_dtype 'int8'" in p for p in problems), problems


def test_dtype_mismatch_and_unknown_layout(tmp_path):
    raw = target_config("LlamaForCausalLM")
    torch.manual_seed(0)
    path = export_serving(tmp_path, HFEagleDrafter(raw), engines=("vllm",), dtype="bfloat16")["vllm"]
    assert check_serving_layout(path) == []
    cfg = json.loads((path / "config.json").read_text())
    assert "fc.bias" not in json.dumps(cfg) and cfg["torch_dtype"] == "bfloat16"
    (path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    assert any("is BF16, config.json torch_dtype says F32" in p for p in check_serving_layout(path))
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"],
                                                  "spectrain_layout": "nope"}))
    assert "match no serving layout" in check_serving_layout(path)[0]
    assert "unreadable" in check_serving_layout(tmp_path / "absent")[0]


def test_docs_table_lists_every_layout():
    text = (ROOT / "docs" / "serving.md").read_text()
    for row in layout_table():
        assert row["layout"] in text and row["architecture"] in text, row
        assert row["loader"].split()[1] in text, row
