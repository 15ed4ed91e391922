"""What the EAGLE-3 loaders read: tensor tables per layout, the loaders' name mapping, `check_layout`.

Two layouts (eagle3_export.py writes both from one Eagle3Drafter):

  sglang       sgl-project/sglang python/sglang/srt/models/llama_eagle3.py
               (LlamaForCausalLMEagle3.load_weights over LlamaModel: fc, midlayer = its
               LlamaDecoderLayer with qkv_proj over 2H and hidden_norm, norm, lm_head [Vd, H];
               `d2t` -> hot_token_id = d2t + arange; `t2d` skipped). vLLM serves the same directory:
               vllm-project/vllm vllm/model_executor/models/llama_eagle3.py (registry alias
               LlamaForCausalLMEagle3 -> Eagle3LlamaForCausalLM; `midlayer.` -> `layers.0.`,
               `d2t` -> draft_id_to_target_id, `t2d` skipped, an unknown name is a KeyError).
  speculators  vllm-project/speculators 0.9.0 src/speculators/models/eagle3/core.py
               (Eagle3DraftModel: fc, layers.0 = model_definitions.py LlamaDecoderEagle3FirstLayer,
               norm, plus speculators/model.py DraftVocabMixin: lm_head [Vd, H], d2t/t2d buffers only
               when Vd != V, and embed_tokens [V, H]: it is in `_keys_to_ignore_on_load_missing`
               and meant to be refilled from the verifier, but under transformers 5.19 a missing
               one is left uninitialised (std ~1e-20, not the NaN the refill checks for; seen in
               make test-serving), so the file carries the target's, as speculators'
               save_pretrained does). vLLM reads it through
               vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`.

SGLang *silently skips* names it does not map (`if param_name in params_dict`), so a file with
`layers.0.*` names serves a randomly initialised layer there: the tables below are exact, and
`check_layout` refuses any missing, unexpected, mis-shaped or mis-typed tensor, naming each.

Shapes in terms of H (drafter width), Ht (target width, = H here), I (intermediate), n / n_kv
heads, d head dim, Vd draft vocab, V target vocab.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SGLANG = "sglang"
SPECULATORS = "speculators"
WEIGHTS = "model.safetensors"
SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3DraftModel"
FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}   # config dtype -> safetensors header


class LayoutError(ValueError):
    """An export directory that a loader would refuse or load wrongly; `problems` names each."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Sizes:
    H: int
    I: int          # noqa: E741 (the loaders' intermediate_size)
    n: int
    n_kv: int
    d: int
    Vd: int
    V: int
    Ht: int


def _layer(prefix: str, s: Sizes, f: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The decoder layer both loaders build (q/k/v over 2H, no biases)."""
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    return {
        f"{a}.q_proj.weight": ((s.n * s.d, 2 * s.H), f), f"{a}.k_proj.weight": ((s.n_kv * s.d, 2 * s.H), f),
        f"{a}.v_proj.weight": ((s.n_kv * s.d, 2 * s.H), f), f"{a}.o_proj.weight": ((s.H, s.n * s.d), f),
        f"{m}.gate_proj.weight": ((s.I, s.H), f), f"{m}.up_proj.weight": ((s.I, s.H), f),
        f"{m}.down_proj.weight": ((s.H, s.I), f),
        f"{prefix}.input_layernorm.weight": ((s.H,), f), f"{prefix}.hidden_norm.weight": ((s.H,), f),
        f"{prefix}.post_attention_layernorm.weight": ((s.H,), f),
    }


def sglang_table(s: Sizes, f: str = "F32") -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype). SGLang llama_eagle3.py: fc in = target_hidden_size * 3,
    no bias unless config.bias; lm_head [draft_vocab_size, H] (tie_word_embeddings false)."""
    return {"fc.weight": ((s.H, 3 * s.Ht), f), **_layer("midlayer", s, f), "norm.weight": ((s.H,), f),
            "lm_head.weight": ((s.Vd, s.H), f), "d2t": ((s.Vd,), "I64"), "t2d": ((s.V,), "BOOL")}


def speculators_table(s: Sizes, f: str = "F32") -> dict[str, tuple[tuple[int, ...], str]]:
    """speculators 0.9.0 Eagle3DraftModel: fc Linear(num_aux * hidden_size, hidden_size, bias=False);
    d2t/t2d registered only when draft_vocab_size != transformer_layer_config.vocab_size."""
    out = {"embed_tokens.weight": ((s.V, s.H), f), "fc.weight": ((s.H, 3 * s.H), f), **_layer("layers.0", s, f),
           "norm.weight": ((s.H,), f), "lm_head.weight": ((s.Vd, s.H), f)}
    if s.Vd != s.V:
        out.update({"d2t": ((s.Vd,), "I64"), "t2d": ((s.V,), "BOOL")})
    return out



# ---------------------------------------------------------------- the loaders' name mapping
# Transcribed from the two load_weights methods, so a test can replay what each engine does with
# every name of an export (the engines themselves need CUDA and are not installed here).

_STACKED = ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
            (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj"))

# SGLang LlamaForCausalLMEagle3 parameters (num_hidden_layers 1, tie_word_embeddings false).
SGLANG_PARAMS = frozenset({
    "model.embed_tokens.weight", "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight", "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight", "model.midlayer.post_attention_layernorm.weight",
    "model.norm.weight", "lm_head.weight"})
SGLANG_FROM_TARGET = frozenset({"model.embed_tokens.weight"})   # EAGLEWorker set_embed

# vLLM Eagle3LlamaForCausalLM parameters (one layer, no parallel drafting).
VLLM_PARAMS = frozenset({
    "model.embed_tokens.weight", "model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"})
VLLM_FROM_TARGET = frozenset({"model.embed_tokens.weight"})     # shared with the target when absent


def sglang_param_for(name: str) -> str | None:
    """The SGLang parameter a file tensor lands in; "" for one it consumes otherwise (d2t ->
    hot_token_id, t2d dropped on purpose); None when SGLang silently skips it."""
    if "d2t" in name or "t2d" in name:
        return ""
    for fused, part in _STACKED:
        if part in name:                       # first match wins, then `break` even when unmatched
            name = name.replace(part, fused)
            cand = name if name in SGLANG_PARAMS else f"model.{name}"
            return cand if cand in SGLANG_PARAMS else None
    cand = name if name in SGLANG_PARAMS else f"model.{name}"
    return cand if cand in SGLANG_PARAMS else None


def vllm_param_for(name: str) -> str | None:
    """The vLLM parameter a file tensor lands in ("" for t2d, dropped); None where vLLM raises."""
    if "t2d" in name:
        return ""
    if "d2t" in name:
        return "draft_id_to_target_id"
    name = name.replace("midlayer.", "layers.0.")
    if "lm_head" not in name:
        name = f"model.{name}"
    for fused, part in _STACKED:
        if part in name:
            name = name.replace(part, fused)
            break
    return name if name in VLLM_PARAMS else None


# ---------------------------------------------------------------- conformance

def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) from the file header, without loading tensors."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n))
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in meta.items() if k != "__metadata__"}


def _need(cfg: dict[str, Any], key: str, kind: type, problems: list[str], where: str) -> Any:
    value = cfg.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        problems.append(f"{where}{key}={value!r} (a {kind.__name__} is required)")
        return None
    return value


def _pin(cfg: dict[str, Any], key: str, want: Any, problems: list[str], where: str, why: str) -> None:
    if key not in cfg or cfg[key] != want:
        problems.append(f"{where}{key}={cfg.get(key, '<absent>')!r}, needs {want!r} ({why})")


def _sizes(c: dict[str, Any], Vd: Any, Ht: Any, problems: list[str], where: str) -> Sizes | None:
    vals = [_need(c, k, int, problems, where) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim", "vocab_size")]
    if None in vals or not isinstance(Vd, int) or not isinstance(Ht, int):
        return None
    H, I, n, n_kv, d, V = vals  # noqa: E741
    return Sizes(H, I, n, n_kv, d, Vd, V, Ht)


def _check_sglang(cfg: dict[str, Any], problems: list[str]) -> Sizes | None:
    w = "config.json "
    _pin(cfg, "model_type", "llama", problems, w, "SGLang builds a LlamaConfig")
    _pin(cfg, "num_hidden_layers", 1, problems, w, "one midlayer")
    _pin(cfg, "tie_word_embeddings", False, problems, w, "true makes lm_head the embedding")
    _pin(cfg, "hidden_act", "silu", problems, w, "LlamaMLP supports silu only")
    _pin(cfg, "norm_before_residual", False, problems, w, "SGLang's layer keeps the un-normed residual")
    for key in ("bias", "attention_bias", "mlp_bias"):
        if cfg.get(key):
            problems.append(f"{w}{key}=true adds biases the drafter does not have")
    Vd = _need(cfg, "draft_vocab_size", int, problems, w)
    ids = _need(cfg, "eagle_aux_hidden_state_layer_ids", list, problems, w)
    eagle = cfg.get("eagle_config")
    sg_ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if ids is not None and (not isinstance(sg_ids, list) or [i + 1 for i in sg_ids] != ids):
        problems.append(f"{w}eagle_config.eagle_aux_hidden_state_layer_ids={sg_ids!r} must be "
                        f"{[i - 1 for i in ids]} (SGLang captures before layer id+1; vLLM reads the top-level {ids})")
    return _sizes(cfg, Vd, cfg.get("target_hidden_size", cfg.get("hidden_size")), problems, w)


def _check_speculators(cfg: dict[str, Any], problems: list[str]) -> Sizes | None:
    w = "config.json "
    _pin(cfg, "speculators_model_type", "eagle3", problems, w, "the registry key")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        _pin(cfg, flag, False, problems, w, "set explicitly: vLLM defaults norm_before_residual to true, "
             "speculators to false")
    spec = cfg.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    if not isinstance(verifier, dict) or not verifier.get("name_or_path"):
        problems.append(f"{w}speculators_config.verifier.name_or_path is required (vLLM loads the target from it)")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if not (isinstance(methods, list) and methods and isinstance(methods[0].get("speculative_tokens"), int)):
        problems.append(f"{w}speculators_config.proposal_methods[0].speculative_tokens is required")
    ids = _need(cfg, "eagle_aux_hidden_state_layer_ids", list, problems, w)
    if ids is not None and len(ids) != 3:
        problems.append(f"{w}eagle_aux_hidden_state_layer_ids={ids} must name 3 layers (fc reads 3H)")
    Vd = _need(cfg, "draft_vocab_size", int, problems, w)
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append(f"{w}transformer_layer_config must be an object")
        return None
    lw = "config.json transformer_layer_config."
    _pin(layer, "model_type", "llama", problems, lw, "model_definitions 'llama'")
    _pin(layer, "num_hidden_layers", 1, problems, lw, "one layer")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            problems.append(f"{lw}{key}=true adds biases the drafter does not have")
    return _sizes(layer, Vd, layer.get("hidden_size"), problems, lw)


def layout_problems(path: str | os.PathLike[str]) -> list[str]:
    """Every problem of an export directory against its layout's loader (empty: it conforms)."""
    d = Path(path)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"config.json unreadable ({exc})"]
    problems: list[str] = []
    if "speculators_model_type" in cfg:
        layout, sizes = SPECULATORS, _check_speculators(cfg, problems)
    elif cfg.get("architectures") == [SGLANG_ARCH]:
        layout, sizes = SGLANG, _check_sglang(cfg, problems)
    else:
        return [f"config.json is neither layout: architectures={cfg.get('architectures')!r} and no "
                "speculators_model_type"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype not in FLOAT_DTYPES:
        problems.append(f"config.json torch_dtype={dtype!r} is not one of {sorted(FLOAT_DTYPES)}")
    if sizes is None or problems:
        return problems   # the table derives from these fields
    try:
        have = _header(d / WEIGHTS)
    except (OSError, ValueError) as exc:
        return [f"{WEIGHTS} unreadable ({exc})"]
    table = (sglang_table if layout == SGLANG else speculators_table)(sizes, FLOAT_DTYPES[dtype])
    for name, (shape, st) in table.items():
        if name not in have:
            problems.append(f"tensor {name} missing (shape {list(shape)} {st} expected)")
        elif have[name][0] != shape:
            problems.append(f"tensor {name} has shape {list(have[name][0])}, the {layout} loader needs {list(shape)}")
        elif have[name][1] != st:
            problems.append(f"tensor {name} is {have[name][1]}, the {layout} loader needs {st}")
    for name in sorted(set(have) - set(table)):
        problems.append(f"unexpected tensor {name} (the {layout} loader has no such weight"
                        + (": SGLang skips it silently)" if layout == SGLANG else ")"))
    return problems


def check_layout(path: str | os.PathLike[str]) -> str:
    """The layout name of a conforming export directory; LayoutError naming every problem otherwise."""
    problems = layout_problems(path)
    if problems:
        raise LayoutError(Path(path), problems)
    cfg = json.loads((Path(path) / "config.json").read_text())
    return SPECULATORS if "speculators_model_type" in cfg else SGLANG
