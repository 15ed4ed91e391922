"""Write an HF target's EAGLE-1 drafter in the layouts vLLM and SGLang load, and check an export.

One directory per engine, `<out>/<engine>/{config.json, model.safetensors}`: the engines disagree
on the fc bias (vLLM's fc has none, so a `fc.bias` tensor is an unknown weight there; SGLang's has
one, so it must be in the file or stays at its random init) and on the `architectures` name, so one
directory cannot serve both. The weights are one decoder layer (tens of MB at 7B), so the copy is
cheap. Neither layout carries the embedding or an LM head: both engines take the target's
(vLLM when pipeline parallel is 1, SGLang always, through set_embed_and_head).

The layouts, from the loader files (docs/serving.md has the table with the fields):

  vllm-eagle-llama    vllm-project/vllm vllm/model_executor/models/llama_eagle.py
                      (EagleLlamaForCausalLM; vllm/transformers_utils/configs/eagle.py renames
                      config.json's LlamaForCausalLM to it for method "eagle")
  vllm-eagle-llama-qkv-bias   the same class for Qwen2 targets: vllm/model_executor/models/llama.py
                      gives q/k/v a bias and o_proj none when config has qkv_bias=true, attention_bias=false
  sglang-eagle-llama  sgl-project/sglang python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle)
  sglang-eagle-qwen2  sgl-project/sglang python/sglang/srt/models/qwen2_eagle.py (Qwen2ForCausalLMEagle)
  sglang-eagle-qwen3  sgl-project/sglang python/sglang/srt/models/qwen3_eagle.py (Qwen3ForCausalLMEagle:
                      a Qwen3ForCausalLM with `eagle_fc`; no vLLM class keeps Qwen3's q/k norms)

Each config.json also names its target: spectrain_target_architecture, spectrain_target_config_sha256
(models.config_digest of the target's config.json), spectrain_target_vocab_size, spectrain_layout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spectrain_api.errors import ConfigError
from spectrain_api.fsio import atomic_dir
from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter, rope_theta
from spectrain_workloads.drafter.models import config_digest
from spectrain_workloads.hf.arch import head_dim

SERVING_FORMAT = "spectrain-serving/1"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Layout:
    name: str
    engine: str                  # "vllm" | "sglang"
    architecture: str            # config.json architectures[0]
    model_type: str              # config.json model_type (the transformers config class the engine builds)
    loader: str                  # the file that loads it
    fc: str = "fc"               # the fusion layer's tensor prefix
    fc_bias: bool = False        # the loader's fc has a bias (written as zeros: the drafter has none)
    qkv_bias: bool = False       # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False        # per-head q/k RMSNorm (Qwen3)
    fixed: dict[str, Any] = field(default_factory=dict)   # config fields the layout pins


VLLM_LLAMA = Layout("vllm-eagle-llama", "vllm", "LlamaForCausalLM", "llama",
                    "vllm-project/vllm vllm/model_executor/models/llama_eagle.py")
VLLM_QKV_BIAS = Layout("vllm-eagle-llama-qkv-bias", "vllm", "LlamaForCausalLM", "llama",
                       "vllm-project/vllm vllm/model_executor/models/llama_eagle.py + llama.py (qkv_bias)",
                       qkv_bias=True, fixed={"attention_bias": False, "qkv_bias": True})
SGLANG_LLAMA = Layout("sglang-eagle-llama", "sglang", "LlamaForCausalLMEagle", "llama",
                      "sgl-project/sglang python/sglang/srt/models/llama_eagle.py", fc_bias=True)
SGLANG_QWEN2 = Layout("sglang-eagle-qwen2", "sglang", "Qwen2ForCausalLMEagle", "qwen2",
                      "sgl-project/sglang python/sglang/srt/models/qwen2_eagle.py", fc_bias=True, qkv_bias=True)
SGLANG_QWEN3 = Layout("sglang-eagle-qwen3", "sglang", "Qwen3ForCausalLMEagle", "qwen3",
                      "sgl-project/sglang python/sglang/srt/models/qwen3_eagle.py", fc="eagle_fc", fc_bias=True,
                      qk_norm=True, fixed={"skip_first_input_layernorm": True, "skip_output_norm": True})
LAYOUTS = {x.name: x for x in (VLLM_LLAMA, VLLM_QKV_BIAS, SGLANG_LLAMA, SGLANG_QWEN2, SGLANG_QWEN3)}

# Target architecture -> the layouts its drafter is exported in. Mistral's HF layer has Llama's
# tensors (its sliding window is a mask, which the drafter, trained with full causal attention,
# does not use), so it takes the Llama layouts.
LAYOUTS_BY_TARGET: dict[str, tuple[Layout, ...]] = {
    "LlamaForCausalLM": (VLLM_LLAMA, SGLANG_LLAMA),
    "MistralForCausalLM": (VLLM_LLAMA, SGLANG_LLAMA),
    "Qwen2ForCausalLM": (VLLM_QKV_BIAS, SGLANG_QWEN2),
    "Qwen3ForCausalLM": (SGLANG_QWEN3,),
}

# Fields every layout's config.json has (type checked by check_serving_layout).
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "architectures": list, "model_type": str, "num_hidden_layers": int, "hidden_size": int,
    "intermediate_size": int, "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "hidden_act": str, "rms_norm_eps": float, "max_position_embeddings": int, "vocab_size": int,
    "rope_theta": (int, float), "tie_word_embeddings": bool, "torch_dtype": str,
    "spectrain_format": str, "spectrain_layout": str, "spectrain_target_architecture": str,
    "spectrain_target_config_sha256": str, "spectrain_target_vocab_size": int,
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}   # safetensors header names


def layouts_for(target_arch: str) -> tuple[Layout, ...]:
    if target_arch not in LAYOUTS_BY_TARGET:
        raise ConfigError(f"no serving layout for target architecture {target_arch!r}; "
                          f"supported: {', '.join(LAYOUTS_BY_TARGET)}")
    return LAYOUTS_BY_TARGET[target_arch]


# ---------------------------------------------------------------- the table

def expected_tensors(layout: Layout, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape the loader expects, from the export's config.json fields."""
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    n, n_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    a = "layers.0.self_attn"
    out: dict[str, tuple[int, ...]] = {f"{layout.fc}.weight": (H, 2 * H)}
    if layout.fc_bias:
        out[f"{layout.fc}.bias"] = (H,)
    out.update({f"{a}.q_proj.weight": (n * d, H), f"{a}.k_proj.weight": (n_kv * d, H),
                f"{a}.v_proj.weight": (n_kv * d, H), f"{a}.o_proj.weight": (H, n * d)})
    attention_bias = bool(cfg.get("attention_bias")) and not layout.qkv_bias
    if layout.qkv_bias or attention_bias:
        out.update({f"{a}.q_proj.bias": (n * d,), f"{a}.k_proj.bias": (n_kv * d,), f"{a}.v_proj.bias": (n_kv * d,)})
    if attention_bias:
        out[f"{a}.o_proj.bias"] = (H,)
    if layout.qk_norm:
        out.update({f"{a}.q_norm.weight": (d,), f"{a}.k_norm.weight": (d,)})
    m = "layers.0.mlp"
    out.update({"layers.0.post_attention_layernorm.weight": (H,), f"{m}.gate_proj.weight": (inter, H),
                f"{m}.up_proj.weight": (inter, H), f"{m}.down_proj.weight": (H, inter)})
    if cfg.get("mlp_bias"):
        out.update({f"{m}.gate_proj.bias": (inter,), f"{m}.up_proj.bias": (inter,), f"{m}.down_proj.bias": (H,)})
    return out


def serving_config(drafter: HFEagleDrafter, layout: Layout, dtype: str) -> dict[str, Any]:
    """config.json of the export: the target's sizes, one layer, and what the loader reads."""
    c, t = drafter.hf_cfg, drafter.target_config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = rope_theta(c)
    scaling = None if rope.get("rope_type", "default") == "default" else {k: v for k, v in rope.items()
                                                                         if k != "rope_theta"}
    config: dict[str, Any] = {
        "architectures": [layout.architecture], "model_type": layout.model_type, "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "head_dim": head_dim(c), "hidden_act": c.hidden_act, "rms_norm_eps": float(c.rms_norm_eps),
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        # Both spellings: engines pinned to transformers 4 read rope_theta/rope_scaling, 5 rope_parameters.
        "rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {**rope, "rope_theta": theta},
        # The drafter has no LM head of its own; false keeps SGLang from aliasing lm_head to
        # embed_tokens before it installs the target's (set_embed_and_head).
        "tie_word_embeddings": False,
        "attention_bias": bool(getattr(c, "attention_bias", False)) and not layout.qkv_bias,
        "mlp_bias": bool(getattr(c, "mlp_bias", False)), "torch_dtype": dtype, "dtype": dtype,
        **{k: t[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in t},
        **layout.fixed,
        "spectrain_format": SERVING_FORMAT, "spectrain_layout": layout.name,
        "spectrain_target_architecture": drafter.hf_arch,
        "spectrain_target_config_sha256": config_digest(t), "spectrain_target_vocab_size": c.vocab_size,
    }
    return config


def serving_tensors(drafter: HFEagleDrafter, layout: Layout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's trained weights under the layout's names (no embedding, no LM head)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in drafter.state_dict().items():
        if name.startswith(("embed.", "lm_head.")):
            continue   # the engines use the target's
        key = f"{layout.fc}.{name.removeprefix('fc.')}" if name.startswith("fc.") else name
        out[key] = w.detach().to("cpu", dtype).contiguous()
    if layout.fc_bias:
        out[f"{layout.fc}.bias"] = torch.zeros(drafter.cfg.dim, dtype=dtype)   # exact: the drafter has none
    return out


def _dtype_name(drafter: HFEagleDrafter, dtype: str | torch.dtype | None) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    name = dtype or drafter.target_config.get("torch_dtype") or drafter.target_config.get("dtype")
    name = name or str(drafter.fc.weight.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"serving export dtype {name!r} is not one of {list(_DTYPES)}")
    return str(name)


def export_serving(out_dir: str | os.PathLike[str], drafter: HFEagleDrafter, *,
                   engines: tuple[str, ...] | None = None, dtype: str | torch.dtype | None = None) -> dict[str, Path]:
    """Write `<out_dir>/<engine>/` for each layout of the drafter's target; {engine: directory}.

    dtype: of the tensors (default the target's torch_dtype, else the drafter's). Each directory
    is complete or absent (built aside and renamed)."""
    from safetensors.torch import save_file

    name = _dtype_name(drafter, dtype)
    written: dict[str, Path] = {}
    for layout in layouts_for(drafter.hf_arch):
        if engines is not None and layout.engine not in engines:
            continue
        config = serving_config(drafter, layout, name)
        tensors = serving_tensors(drafter, layout, _DTYPES[name])

        def fill(tmp: Path, config: dict[str, Any] = config, tensors: dict[str, torch.Tensor] = tensors) -> None:
            save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))

        written[layout.engine] = atomic_dir(Path(out_dir) / layout.engine, fill)
    return written


# ---------------------------------------------------------------- conformance

def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) from the file header, without loading tensors."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in meta.items() if k != "__metadata__"}


def _layout_of(cfg: dict[str, Any]) -> Layout | None:
    named = LAYOUTS.get(str(cfg.get("spectrain_layout")))
    if named is not None:
        return named
    archs = cfg.get("architectures") or []
    cands = [x for x in LAYOUTS.values() if archs and x.architecture == archs[0]]
    if len(cands) > 1:   # the two vLLM layouts share the class: qkv_bias tells them apart
        cands = [x for x in cands if x.qkv_bias == bool(cfg.get("qkv_bias"))]
    return cands[0] if cands else None


def check_serving_layout(path: str | os.PathLike[str]) -> list[str]:
    """Problems of an export directory against its layout (empty: it conforms)."""
    d = Path(path)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"{d}/config.json: unreadable ({exc})"]
    layout = _layout_of(cfg)
    if layout is None:
        return [f"{d}/config.json: architectures {cfg.get('architectures')!r} / spectrain_layout "
                f"{cfg.get('spectrain_layout')!r} match no serving layout ({', '.join(LAYOUTS)})"]
    where = f"{d} ({layout.name}, loader {layout.loader})"
    problems: list[str] = []
    for key, kind in REQUIRED_FIELDS.items():
        if key not in cfg:
            problems.append(f"{where}: config.json lacks {key!r}")
        elif not isinstance(cfg[key], kind) or (kind is int and isinstance(cfg[key], bool)):
            problems.append(f"{where}: config.json {key}={cfg[key]!r} is not {getattr(kind, '__name__', kind)}")
    pinned = {"architectures": [layout.architecture], "model_type": layout.model_type, "num_hidden_layers": 1,
              "tie_word_embeddings": False, "hidden_act": "silu", **layout.fixed}
    for key, want in pinned.items():
        if key in cfg and cfg[key] != want:
            problems.append(f"{where}: config.json {key}={cfg[key]!r}, the layout needs {want!r}")
    if layout.engine == "vllm" and cfg.get("bias"):
        problems.append(f"{where}: config.json bias=true gives vLLM's Llama layer q/k/v/o biases; remove it")
    if cfg.get("torch_dtype") not in _ST_DTYPES:
        problems.append(f"{where}: config.json torch_dtype {cfg.get('torch_dtype')!r} is not one of {list(_ST_DTYPES)}")
    if problems:
        return problems   # the shapes below derive from these fields
    try:
        have = _header(d / WEIGHTS)
    except (OSError, ValueError) as exc:
        return [f"{where}: {WEIGHTS} unreadable ({exc})"]
    want = expected_tensors(layout, cfg)
    st_dtype = _ST_DTYPES[cfg["torch_dtype"]]
    for name, shape in want.items():
        if name not in have:
            problems.append(f"{where}: tensor {name} missing (shape {list(shape)} expected)")
        elif have[name][0] != shape:
            problems.append(f"{where}: tensor {name} has shape {list(have[name][0])}, the config gives {list(shape)}")
        elif have[name][1] != st_dtype:
            problems.append(f"{where}: tensor {name} is {have[name][1]}, config.json torch_dtype says {st_dtype}")
    for name in sorted(set(have) - set(want)):
        why = ("the engine takes the target's" if name.startswith(("embed_tokens.", "lm_head.", "model."))
               else "EAGLE-1 layer 0 has no input norm" if "input_layernorm" in name else "the loader has no such weight")
        problems.append(f"{where}: unexpected tensor {name} ({why})")
    return problems


def layout_table() -> list[dict[str, str]]:
    """One row per (target architecture, layout): what docs/serving.md tabulates."""
    return [{"target": t, "layout": x.name, "engine": x.engine, "architecture": x.architecture,
             "model_type": x.model_type, "loader": x.loader}
            for t, xs in LAYOUTS_BY_TARGET.items() for x in xs]
