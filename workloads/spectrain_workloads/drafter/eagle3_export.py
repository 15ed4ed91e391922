"""Write one Eagle3Drafter as the two directories the serving engines load, and check them.

  <out>/sglang/       config.json (LlamaForCausalLMEagle3) + model.safetensors, `midlayer.*` names:
                      SGLang `--speculative-algorithm EAGLE3 --speculative-draft-model-path <dir>`;
                      vLLM `--speculative-config '{"method": "eagle3", "model": "<dir>", ...}'`
                      (registry alias, `midlayer.` renamed on load).
  <out>/speculators/  the speculators 0.9.0 on-disk format (`layers.0.*` names, speculators_config
                      naming the target as verifier): `vllm serve <dir>` enables EAGLE-3 on its own;
                      speculators' `SpeculatorModel.from_pretrained(<dir>)` loads it.

The tables and the loader files they were read from are in eagle3_tables.py; each directory is
checked against its table (`check_layout`) before it is renamed into place.

Feature-layer ids: ours, vLLM's and speculators' mean "the residual stream before layer i"
(transformers' hidden_states[i]); SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` are
shifted (it captures before layer id+1: `set_eagle3_layers_to_capture` adds 1). The sglang
config therefore carries both: top-level `eagle_aux_hidden_state_layer_ids` = i (vLLM's
`_get_eagle3_aux_layers_from_config` reads it first) and `eagle_config...` = i - 1 (SGLang reads
only that).

Only the speculators directory carries the target's embedding (`embed_tokens.weight`, as its
save_pretrained writes it; its loader does not refill a missing one, see eagle3_tables.py); SGLang
installs the target's and vLLM shares it, so the sglang directory has none (SpecForge's
`_REQUIRED_SERVING_KEYS` has none either).

Loading back (`load_eagle3`, what `spectrain generate --drafter DIR` uses): DIR is the speculators
directory or the export root holding it (`find_eagle3`); the speculators one because it is complete
on its own (it names its target and feature layers in the format vLLM reads). The drafter borrows
the running target's embedding (the file's copy is used only when no target is given) and is refused,
naming both sides, when it was trained for another target: hidden size, vocabulary, a feature layer
the target does not have, or another architecture (`target_mismatches`). Pointing at the sglang
directory is refused with the way to the speculators one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from spectrain_api.errors import ConfigError
from spectrain_api.fsio import atomic_dir
from spectrain_workloads.drafter.eagle3 import TTT_STEPS, Eagle3Drafter, eagle3_layer_config
from spectrain_workloads.drafter.eagle3_tables import (
    FLOAT_DTYPES,
    SGLANG,
    SGLANG_ARCH,
    SPECULATORS,
    SPECULATORS_ARCH,
    WEIGHTS,
    LayoutError,
    layout_problems,
)
from spectrain_workloads.drafter.models import config_digest

FORMAT = "spectrain-eagle3/1"
SPECULATORS_VERSION = "0.9.0"   # the release whose loader the tests run (make test-serving)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _layer_fields(drafter: Eagle3Drafter, target_config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The Llama fields both engines (and transformers' LlamaConfig) read for the one layer."""
    c = drafter.cfg
    rope = dict(c.rope_parameters or {})
    theta = float(rope.get("rope_theta", 10000.0))
    scaling = None if rope.get("rope_type", "default") == "default" else {k: v for k, v in rope.items()
                                                                         if k != "rope_theta"}
    return {
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "rms_norm_eps": float(c.rms_norm_eps), "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        # Both spellings: engines on transformers 4 read rope_theta/rope_scaling, 5 rope_parameters.
        "rope_theta": theta, "rope_scaling": scaling, "rope_parameters": {**rope, "rope_theta": theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype,
        **{k: target_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in target_config},
    }


def _provenance(drafter: Eagle3Drafter, target_config: dict[str, Any], layout: str) -> dict[str, Any]:
    archs = target_config.get("architectures") or ["?"]
    return {"spectrain_format": FORMAT, "spectrain_layout": layout, "spectrain_target_architecture": archs[0],
            "spectrain_target_config_sha256": config_digest(target_config),
            "spectrain_feature_layers": list(drafter.feature_layers)}


def sglang_config(drafter: Eagle3Drafter, target_config: dict[str, Any], dtype: str) -> dict[str, Any]:
    ids = list(drafter.feature_layers)
    return {
        "architectures": [SGLANG_ARCH], **_layer_fields(drafter, target_config, dtype),
        "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.cfg.hidden_size,
        "norm_before_residual": False,   # SGLang has no flag (its residual is the un-normed input); vLLM reads it
        "eagle_aux_hidden_state_layer_ids": ids,                                  # vLLM: before layer i
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],   # SGLang adds 1
                         "use_aux_hidden_state": True},
        **_provenance(drafter, target_config, SGLANG),
    }


def speculators_config(drafter: Eagle3Drafter, target_config: dict[str, Any], dtype: str, target_path: str,
                       speculative_tokens: int) -> dict[str, Any]:
    """The keys speculators 0.9.0 `save_pretrained` writes for an Eagle3SpeculatorConfig."""
    return {
        "architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_fields(drafter, target_config, dtype),
        "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(drafter.feature_layers),
        # explicit: vLLM's update_eagle3 defaults norm_before_residual to true, speculators to false
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "embed_requires_grad": False, "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_path,
                         "architectures": list(target_config.get("architectures") or [])},
        },
        **_provenance(drafter, target_config, SPECULATORS),
    }


def layout_tensors(drafter: Eagle3Drafter, layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's state under a layout's names: floats in `dtype`, d2t int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    identity_vocab = drafter.draft_vocab_size == drafter.cfg.vocab_size
    if layout == SPECULATORS:
        out["embed_tokens.weight"] = drafter.embed_weight.detach().to("cpu", dtype).contiguous()
    for name, w in drafter.state_dict().items():
        if name in ("d2t", "t2d"):
            if layout == SPECULATORS and identity_vocab:
                continue   # speculators registers them only for Vd != V (an extra key is "unexpected")
            out[name] = w.detach().cpu().contiguous()
            continue
        key = f"layers.0.{name.removeprefix('midlayer.')}" if layout == SPECULATORS and name.startswith("midlayer.") \
            else name
        out[key] = w.detach().to("cpu", dtype).contiguous()
    return out


def _dtype_name(drafter: Eagle3Drafter, dtype: str | torch.dtype | None, target_config: dict[str, Any]) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    name = dtype or target_config.get("torch_dtype") or target_config.get("dtype") \
        or str(drafter.fc.weight.dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"EAGLE-3 export dtype {name!r} is not one of {sorted(FLOAT_DTYPES)}")
    return str(name)


def export_eagle3(out_dir: str | os.PathLike[str], drafter: Eagle3Drafter, *, target_config: dict[str, Any],
                  target_path: str | os.PathLike[str], dtype: str | torch.dtype | None = None,
                  speculative_tokens: int = TTT_STEPS, layouts: tuple[str, ...] = (SGLANG, SPECULATORS),
                  ) -> dict[str, Path]:
    """Write `<out_dir>/<layout>/` for each layout; {layout: directory}.

    target_config: the target's config.json (dict); target_path: where its weights lie (the
    speculators verifier, which vLLM and speculators load). dtype: of the float tensors (default
    the target's). Each directory is checked, then renamed into place (complete or absent)."""
    from safetensors.torch import save_file

    name = _dtype_name(drafter, dtype, target_config)
    written: dict[str, Path] = {}
    for layout in layouts:
        if layout == SGLANG:
            config = sglang_config(drafter, target_config, name)
        elif layout == SPECULATORS:
            config = speculators_config(drafter, target_config, name, str(target_path), speculative_tokens)
        else:
            raise ConfigError(f"unknown EAGLE-3 layout {layout!r}; known: {SGLANG}, {SPECULATORS}")
        tensors = layout_tensors(drafter, layout, _DTYPES[name])

        def fill(tmp: Path, config: dict[str, Any] = config, tensors: dict[str, torch.Tensor] = tensors) -> None:
            save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
            problems = layout_problems(tmp)
            if problems:   # a bug here, not the user's: refuse to publish it
                raise LayoutError(tmp, problems)

        written[layout] = atomic_dir(Path(out_dir) / layout, fill)
    return written


# ---------------------------------------------------------------- loading back

def _config(d: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def find_eagle3(path: str | os.PathLike[str]) -> Path | None:
    """The speculators directory of an EAGLE-3 export given it, the version directory holding it
    or a job's export root (its LATEST version); None when `path` is none of these (another kind of
    drafter export). The sglang directory is refused."""
    p = Path(path)
    latest = p / "LATEST"
    version = p / latest.read_text().strip() if latest.is_file() else p
    for d in (p, version / SPECULATORS):
        if _config(d).get("speculators_model_type") == "eagle3":
            return d
    if _config(p).get("architectures") == [SGLANG_ARCH]:
        raise ConfigError(f"{p} is the sglang layout of an EAGLE-3 export; give its sibling "
                          f"{p.parent / SPECULATORS} or the export root {p.parent}")
    return None


def target_mismatches(config: dict[str, Any], target_config: dict[str, Any]) -> list[str]:
    """What makes a speculators EAGLE-3 config (ours) unfit for a target (its config.json), each
    naming both sides; empty when it fits."""
    layer = config.get("transformer_layer_config") or {}
    out = []
    for name, ours, theirs in (("hidden size", config.get("target_hidden_size", layer.get("hidden_size")),
                                target_config.get("hidden_size")),
                               ("vocab size", layer.get("vocab_size"), target_config.get("vocab_size"))):
        if ours != theirs:
            out.append(f"{name} {ours} vs the target's {theirs}")
    ids, n_layers = list(config.get("eagle_aux_hidden_state_layer_ids") or []), target_config.get("num_hidden_layers")
    if not isinstance(n_layers, int) or len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < n_layers for i in ids):
        out.append(f"feature layers {ids} vs the target's {n_layers} layers")
    archs = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
    if archs and target_config.get("architectures") and archs != target_config["architectures"]:
        out.append(f"architectures {archs} vs the target's {target_config['architectures']}")
    return out


def load_eagle3(path: str | os.PathLike[str], *, target_config: dict[str, Any],
                embedding: torch.Tensor | None = None) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """(Eagle3Drafter in eval mode, the speculators config.json) from an export (`find_eagle3`),
    for the target whose config.json is `target_config`; embedding [V, H]: the target's, borrowed
    (None: the export's copy). ConfigError for a layout problem or another target's drafter."""
    from safetensors.torch import load_file

    d = find_eagle3(path)
    if d is None:
        raise ConfigError(f"{path}: no EAGLE-3 export (a {SPECULATORS}/ directory or an export root holding one)")
    problems = layout_problems(d)
    if problems:
        raise ConfigError(f"{d}: not a loadable EAGLE-3 export: {'; '.join(problems)}")
    config = _config(d)
    wrong = target_mismatches(config, target_config)
    if wrong:
        raise ConfigError(f"{d}: an EAGLE-3 drafter for another target ({'; '.join(wrong)}); "
                          f"the target is {target_config.get('architectures')}")
    tensors = load_file(str(d / WEIGHTS))
    own = tensors.pop("embed_tokens.weight")
    state = {f"midlayer.{k.removeprefix('layers.0.')}" if k.startswith("layers.0.") else k: v for k, v in tensors.items()}
    layer_cfg = eagle3_layer_config(SimpleNamespace(**config["transformer_layer_config"]))
    drafter = Eagle3Drafter(layer_cfg, own if embedding is None else embedding, config["eagle_aux_hidden_state_layer_ids"],
                            target_num_layers=int(target_config["num_hidden_layers"]),
                            d2t=state.get("d2t"), t2d=state.get("t2d"))
    state.setdefault("d2t", drafter.d2t)          # a full vocabulary: speculators writes no maps
    state.setdefault("t2d", drafter.t2d)
    drafter.load_state_dict(state, strict=True)
    return drafter.eval(), config
