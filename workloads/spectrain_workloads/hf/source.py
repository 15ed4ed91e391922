"""A Hugging Face model directory given by `spec.target.model.path`: where it is, and whether it is usable.

`inspect(path)` resolves file:///abs/dir or pvc://<claim>/<path> (claims are mounted under
$SPECTRAIN_DATA_ROOT, as for the data source) and checks, before anything is built, everything a
run needs from the directory: config.json with a supported architecture, the tokenizer files, the
weights (`model.safetensors`, or shards named by `model.safetensors.index.json`) with readable
headers holding every tensor the architecture needs. Each problem is a ConfigError naming the
field, the file and the fix. Needs no torch: the safetensors header is JSON after an 8-byte length.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectrain_api.config import ModelConfig
from spectrain_api.errors import ConfigError
from spectrain_api.names import HF_ARCHITECTURES
from spectrain_workloads.data import volume_path

FIELD = "spec.target.model.path"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20     # a header this large is a damaged file, not a model


@dataclass(frozen=True)
class ModelDir:
    root: Path
    config: dict[str, Any]                 # config.json as written
    arch: str                              # config["architectures"][0]
    weight_map: dict[str, str]             # tensor name -> file name under root
    shapes: dict[str, tuple[int, ...]]     # tensor name -> shape (from the headers)

    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def model_config(self) -> ModelConfig:
        return sizes(self.config)


def sizes(raw: dict[str, Any]) -> ModelConfig:
    """An HF config's sizes in the project's ModelConfig (the ring, the drafter, the data and the
    decoding engine read dim, vocab_size, max_seq_len from it)."""
    heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}
    return ModelConfig(vocab_size=int(raw["vocab_size"]), dim=int(raw["hidden_size"]),
                       n_layers=int(raw["num_hidden_layers"]), n_heads=heads,
                       n_kv_heads=int(raw.get("num_key_value_heads") or heads),
                       ffn_dim=int(raw.get("intermediate_size") or 0) or None,
                       max_seq_len=int(raw.get("max_position_embeddings") or 2048),
                       rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                       norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(raw.get("tie_word_embeddings", False)))


def resolve(uri: str, *, data_root: str | None = None) -> Path:
    return volume_path(FIELD, uri, data_root=data_root)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a .safetensors file ({name: {"dtype", "shape", "data_offsets"}})."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
    except PermissionError as exc:
        raise ConfigError(f"{FIELD}: {path} cannot be read by this process (uid {os.getuid()}, groups "
                          f"{sorted(os.getgroups())}): {exc}. Make the model files readable by the pods' user or "
                          "fsGroup, e.g. `chmod -R a+rX` the model directory on the volume (save_pretrained "
                          "writes model.safetensors with mode 0600)") from exc
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{FIELD}: {path} is not a readable safetensors file ({exc}); re-copy the model "
                          "files into the volume") from exc
    header.pop("__metadata__", None)
    return header


def _weights(root: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    if (root / INDEX).is_file():
        try:
            files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            raise ConfigError(f"{FIELD}: {root / INDEX} is not a safetensors index ({exc})") from exc
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise ConfigError(f"{FIELD}: {root} holds neither {SINGLE} nor {INDEX}; save the model with "
                          "save_pretrained(..., safe_serialization=True) (.bin weights are not read)")
    weight_map: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        if not (root / name).is_file():
            raise ConfigError(f"{FIELD}: {INDEX} names {name}, which is missing from {root}")
        for tensor, meta in read_safetensors_header(root / name).items():
            weight_map[tensor] = name
            shapes[tensor] = tuple(meta["shape"])
    return weight_map, shapes


def required_tensors(config: dict[str, Any]) -> list[str]:
    """The tensors every supported architecture needs (attention biases and q/k norms are optional
    per family, so only the common core is required; the model's strict load catches the rest)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        names += [p + s + ".weight" for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                              "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    if not config.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    return names


def inspect(uri: str, *, data_root: str | None = None) -> ModelDir:
    root = resolve(uri, data_root=data_root)
    if not root.is_dir():
        raise ConfigError(f"{FIELD} {uri!r}: {root} is not a directory; give the model's directory")
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{FIELD} {uri!r}: {root}/config.json is missing; a Hugging Face model directory "
                          "has config.json (save_pretrained writes it)") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{FIELD} {uri!r}: {root}/config.json is not readable JSON ({exc})") from exc
    archs = config.get("architectures") or []
    if not archs or archs[0] not in HF_ARCHITECTURES:
        raise ConfigError(f"{FIELD} {uri!r}: architecture {archs[0] if archs else None!r} (config.json "
                          f"'architectures') is not supported; supported: {', '.join(HF_ARCHITECTURES)}")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"):
        if not isinstance(config.get(key), int):
            raise ConfigError(f"{FIELD} {uri!r}: config.json lacks the integer {key!r}")
    missing = [n for n in TOKENIZER_FILES if not (root / n).is_file()]
    if missing:
        raise ConfigError(f"{FIELD} {uri!r}: tokenizer files {missing} are missing from {root}; save the "
                          "tokenizer next to the model (tokenizer.save_pretrained(dir))")
    weight_map, shapes = _weights(root)
    absent = [n for n in required_tensors(config) if n not in weight_map]
    if absent:
        raise ConfigError(f"{FIELD} {uri!r}: the weights lack {len(absent)} tensor(s) the architecture needs, "
                          f"e.g. {absent[:3]}; the files do not hold a complete {archs[0]}")
    return ModelDir(root=root, config=config, arch=archs[0], weight_map=weight_map, shapes=shapes)
