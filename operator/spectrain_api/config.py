"""The typed job config: the SpecTrainJob spec (defaults applied) that the operator renders into
the `<job>-config` ConfigMap and the local backend writes to a file. Path: $SPECTRAIN_CONFIG.

File shape: {"apiVersion", "kind", "metadata": {"name", "namespace"}, "spec": {...}}. Field names
are API.md's camelCase; dataclass attributes are snake_case. Unknown keys are kept out of the
dataclasses (the operator validated them); missing keys take API.md's defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from spectrain_api.eagle3 import TTT_STEPS_DEFAULT
from spectrain_api.errors import ConfigError
from spectrain_api.names import (
    BYTE_VOCAB_SIZE,
    DEFAULT_PRESET,
    EAGLE,
    EAGLE3,
    ENV_CONFIG,
    PRETRAIN,
    TARGET_PRESETS,
    WINDOW_KINDS,
)
from spectrain_api.rundir import DRAFTER_DIR


@dataclass(kw_only=True)
class Parallelism:
    data: int = 1
    pipeline: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"


@dataclass(kw_only=True)
class ModelSpec:
    preset: str | None = None      # a project preset (names.TARGET_PRESETS); neither: DEFAULT_PRESET
    path: str | None = None        # a Hugging Face model directory: file:///abs/dir | pvc://<claim>/<path>
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class DataSpec:
    source: str = "builtin:python-stdlib"
    seq_len: int = 256
    batch_size: int = 8


@dataclass(kw_only=True)
class BasisRotationSpec:
    refresh_every: int = 10
    stage_aware: bool = True
    geometry: str = "Bilateral"
    source: str = "SecondMoment"


@dataclass(kw_only=True)
class OptimizerSpec:
    name: str = "AdamW"
    lr: float = 3e-4
    basis_rotation: BasisRotationSpec = field(default_factory=BasisRotationSpec)


@dataclass(kw_only=True)
class CheckpointSpec:
    claim_name: str = ""
    every_steps: int = 100
    keep: int = 3


@dataclass(kw_only=True)
class SpeculativeSpec:
    enabled: bool = True
    max_draft_tokens: int = 8
    batch_threshold: int = 32
    strategy: str = "Bandit"


@dataclass(kw_only=True)
class RLSpec:
    task: str = "arithmetic"
    group_size: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)


@dataclass(kw_only=True)
class TargetSpec:
    image: str = ""
    nodes: int = 1
    procs_per_node: int = 1
    parallelism: Parallelism = field(default_factory=Parallelism)
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    steps: int = 1000
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    rl: RLSpec | None = None


@dataclass(kw_only=True)
class ActivationSpec:
    policy: str = "IdleOnly"
    min_window_ms: float = 0
    safety_margin_ms: float = 2
    kinds: list[str] = field(default_factory=lambda: list(WINDOW_KINDS))


@dataclass(kw_only=True)
class GpuShareSpec:
    active_thread_percentage: int = 30
    pinned_memory_limit: str = "8Gi"


@dataclass(kw_only=True)
class DrafterOptimizerSpec:
    lr: float = 1e-3


@dataclass(kw_only=True)
class ExportSpec:
    claim_name: str = ""
    path: str = DRAFTER_DIR            # under the run volume's drafter/: no mount of its own (rundir)
    min_acceptance: float = 0.0        # minAcceptance: no candidate below it becomes LATEST (0: no floor)


@dataclass(kw_only=True)
class ExchangeSpec:
    enabled: bool = True
    bandwidth_m_bps: float = 64.0        # bandwidthMBps: MB/s a drafter sends to its peers, at most
    combine_every_seconds: float = 10.0
    engine: str = "Star"                 # how the replicas' weights are combined (names.EXCHANGE_ENGINES)


# A field whose dataclass default the CRD must not write (scripts/crd_def.workload_defaults): its
# default depends on other fields, resolved by `from_manifest` (which the apiserver's would pre-empt).
NO_SCHEMA_DEFAULT = {"schema_default": False}


@dataclass(kw_only=True)
class DrafterSpec:
    enabled: bool = True
    # Absent from the manifest: Eagle3 for a Hugging Face target in mode Pretrain, else Eagle
    # (`default_arch`); this default serves JobConfig() built directly.
    arch: str = field(default=EAGLE, metadata=NO_SCHEMA_DEFAULT)
    preset: str = "debug"
    activation: ActivationSpec = field(default_factory=ActivationSpec)
    gpu_share: GpuShareSpec = field(default_factory=GpuShareSpec)
    optimizer: DrafterOptimizerSpec = field(default_factory=DrafterOptimizerSpec)
    export: ExportSpec = field(default_factory=ExportSpec)
    exchange: ExchangeSpec = field(default_factory=ExchangeSpec)
    max_failures: int = 3
    # arch Eagle3 only (spectrain_api.eagle3): None = the default there
    feature_layers: list[int] | None = None      # featureLayers: three target layers whose inputs it fuses
    draft_vocab_size: int | None = None          # draftVocabSize: default min(32768, the target's vocab)
    ttt_steps: int = TTT_STEPS_DEFAULT           # tttSteps: training-time-test unroll steps


@dataclass(kw_only=True)
class JobConfig:
    name: str = "local"
    namespace: str = "default"
    mode: str = "Pretrain"
    target: TargetSpec = field(default_factory=TargetSpec)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.target.nodes * self.target.procs_per_node


T = TypeVar("T")
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def _snake(name: str) -> str:
    return _CAMEL.sub("_", name).lower()


def _build(cls: type[T], data: Any, path: str) -> T:
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        attr = _snake(key)
        if attr not in names or value is None:
            continue
        hint = hints[attr]
        sub = _dataclass_in(hint)
        kwargs[attr] = _build(sub, value, f"{path}.{key}") if sub is not None else value
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    for arg in getattr(hint, "__args__", ()):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def default_arch(mode: str, target: TargetSpec) -> str:
    """spec.drafter.arch when the manifest gives none: Eagle3 for a Hugging Face target
    (spec.target.model.path) in mode Pretrain, the one mode whose stages publish the feature layers
    it reads; Eagle otherwise (the presets keep EAGLE-1, as TLT trains it; mode RL's rollouts and
    AsyncPipeline publish the final hidden state only)."""
    return EAGLE3 if target.model.path is not None and mode == PRETRAIN else EAGLE


def from_manifest(manifest: dict[str, Any]) -> JobConfig:
    """JobConfig from a SpecTrainJob object (or the rendered config file, same shape)."""
    spec = manifest.get("spec") or {}
    meta = manifest.get("metadata") or {}
    mode = spec.get("mode", PRETRAIN)
    target = _build(TargetSpec, spec.get("target") or {}, "spec.target")
    drafter = _build(DrafterSpec, spec.get("drafter") or {}, "spec.drafter")
    if (spec.get("drafter") or {}).get("arch") is None:
        drafter.arch = default_arch(mode, target)
    cfg = JobConfig(
        name=meta.get("name", "local"),
        namespace=meta.get("namespace", "default"),
        mode=mode,
        target=target,
        drafter=drafter,
        seed=int(spec.get("seed", 0)),
    )
    return cfg


def load(path: str | os.PathLike[str] | None = None) -> JobConfig:
    """Load $SPECTRAIN_CONFIG (JSON or YAML)."""
    path = path or os.environ.get(ENV_CONFIG)
    if not path:
        raise ConfigError("SPECTRAIN_CONFIG is not set; point it at the rendered workload config file")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"SPECTRAIN_CONFIG={p} does not exist or is not a file")
    text = p.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        data = yaml.safe_load(text)
    return from_manifest(data)


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the decoder (spectrain_workloads.model builds it); checked without torch."""

    vocab_size: int = BYTE_VOCAB_SIZE
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    ffn_dim: int | None = None     # SwiGLU hidden; None = 8/3 * dim rounded to multiple_of
    multiple_of: int = 32
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"spec.target.model.overrides.{name} must be an integer >= 1, got {value!r}")
        for name in ("n_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"spec.target.model.overrides.{name} must be an integer >= 1 or null, "
                                  f"got {value!r}")
        if self.dim % self.n_heads:
            raise ConfigError(f"spec.target.model.overrides: dim ({self.dim}) must be divisible by n_heads "
                              f"({self.n_heads}); change one of them")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ConfigError(f"spec.target.model.overrides: n_heads ({self.n_heads}) must be divisible by "
                              f"n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"spec.target.model.overrides: the head dim dim/n_heads = {self.dim // self.n_heads} "
                              "must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        h = int(8 * self.dim / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def preset_model_config(model: Any) -> ModelConfig:
    """The ModelConfig of a preset target (`spec.target.model` without a path) on the byte tokenizer."""
    return model_config(model.preset or DEFAULT_PRESET, model.overrides, vocab_size=BYTE_VOCAB_SIZE)


def model_config(preset: str, overrides: dict[str, Any] | None = None, **fixed: Any) -> ModelConfig:
    """Preset + user overrides (+ values the runtime fixes, e.g. the tokenizer's vocab_size)."""
    if preset not in TARGET_PRESETS:
        raise ConfigError(f"spec.target.model.preset {preset!r} is unknown; use one of {list(TARGET_PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if not isinstance(overrides or {}, dict):
        raise ConfigError("spec.target.model.overrides must be a mapping of model settings")
    for key in overrides or {}:
        if key not in known:
            raise ConfigError(f"spec.target.model.overrides.{key} is not a model setting; valid keys: "
                              f"{sorted(known)}")
    return ModelConfig(**{**TARGET_PRESETS[preset], **(overrides or {}), **fixed})
