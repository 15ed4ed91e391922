"""The SpecTrainJob contract shared by the operator and the workloads, importable without torch.

Every name, enum, preset, exit code and environment variable that crosses the operator/workload
seam is defined here once, and so is every semantic rule: `check_spec(cfg)` returns what would
make the workloads refuse a job at start. The operator's `spectrain validate` and reconcile call it
(`spectrain_operator.spec`), every workload entrypoint calls it before any training, and
`scripts/gen.py` writes the CRD's enums from these tuples (its defaults from `config`'s dataclasses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spectrain_workloads.errors import ConfigError

if TYPE_CHECKING:
    from spectrain_workloads.config import JobConfig

# ---------------------------------------------------------------- API names
GROUP = "spectrain.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SpecTrainJob"
PLURAL = "spectrainjobs"

# ---------------------------------------------------------------- enums (the CRD's enum lists)
# status.phase of a SpecTrainJob (the operator writes it; the CRD enumerates it)
PHASES = ("Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
# status.drafter.state (the drafter worker sets it; its Prometheus state gauge enumerates it)
DRAFTER_STATES = ("Disabled", "Waiting", "Active", "Degraded")
MODES = ("Pretrain", "RL", "AsyncPipeline")
PRETRAIN, RL, ASYNC_PIPELINE = MODES
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
INTERLEAVED = "Interleaved1F1B"
INTERLEAVED_CHUNKS = 2          # model chunks (virtual stages) per rank; API.md has no field for it
WINDOW_KINDS = ("Bubble", "Communication", "Imbalance", "RolloutTail")
DRAFTER_ARCHS = ("Eagle", "LM")
# spec.drafter.exchange.engine: the star through the exporting rank (drafter.fleet, authenticated) or
# the gloo ring all-reduce on the drafters' own store (drafter.allreduce, unauthenticated transport)
EXCHANGE_ENGINES = ("Star", "AllReduce")
STAR, ALLREDUCE = EXCHANGE_ENGINES
ACTIVATION_POLICIES = ("IdleOnly", "Always", "Off")
OPTIMIZERS = ("AdamW", "BasisRotation")
BASIS_GEOMETRIES = ("Bilateral", "Unilateral")
BASIS_SOURCES = ("SecondMoment", "FirstMoment")
RL_TASKS = ("arithmetic", "copy", "sort", "alphabet")
DRAFT_STRATEGIES = ("Bandit", "Fixed")
MAX_DRAFT_TOKENS = 32
DATA_BUILTINS = ("python-stdlib",)
# Hugging Face targets (spec.target.model.path): config.json's `architectures[0]`.
HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")

# ---------------------------------------------------------------- presets
# Target models (API.md names). `debug` trains in seconds on CPU.
TARGET_PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=64, n_layers=4, n_heads=4, max_seq_len=512),
    "small": dict(dim=256, n_layers=8, n_heads=8, max_seq_len=1024),
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=2048),
    "1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, max_seq_len=4096),
    "7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, max_seq_len=4096, ffn_dim=11008),
}
DEFAULT_PRESET = "debug"        # the target when spec.target.model names neither a preset nor a path
# Drafter training presets. `lm_*` size the standalone LM drafter (the Eagle drafter's one decoder
# layer always has the target's width); the rest are training hyperparameters (drafter.settings).
DRAFTER_PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(lm_dim=32, lm_layers=1, lm_heads=2, samples_per_step=8, max_micro_batch=8,
                  buffer_mb=64, seq_cap=32, eval_samples=16),
    "small": dict(lm_dim=128, lm_layers=2, lm_heads=4, samples_per_step=16, max_micro_batch=16,
                  buffer_mb=256, seq_cap=128, eval_samples=16),
    "base": dict(lm_dim=512, lm_layers=4, lm_heads=8, samples_per_step=32, max_micro_batch=32,
                 buffer_mb=1024, seq_cap=256, eval_samples=16),
}

# ---------------------------------------------------------------- exit codes (faults.py reads them back)
EXIT_OK = 0
EXIT_ERROR = 1                  # uncaught error
EXIT_CONFIG = 2                 # ConfigError: the spec cannot run; the job fails, no restart
EXIT_GPU_FAULT = 86             # a CUDA / MPS error was caught
EXIT_TERMINATED = 128 + 15      # SIGTERM: checkpoint saved, then exit
EXIT_PEER_FRAME = 87            # a drafter ended by what a peer sent: counted apart from its own faults
GPU_FAULT_EXIT_CODES = frozenset({EXIT_GPU_FAULT, 134, 139})   # + SIGABRT, SIGSEGV from the driver
TERMINATION_LOG = "/dev/termination-log"   # the kubelet's default terminationMessagePath
# SingleContainer mode: the supervisor's verdict (JSON under this key) in the termination message.
SUPERVISOR_VERDICT_KEY = "spectrainSupervisor"
# Target and drafter ending with GPU faults this close together (s) lost their MPS server together.
MPS_LOSS_WINDOW_S = 30.0

# ---------------------------------------------------------------- environment of the pods (docs/contracts.md)
ENV_CONFIG = "SPECTRAIN_CONFIG"
ENV_RUN_DIR = "SPECTRAIN_RUN_DIR"
ENV_RING_DIR = "SPECTRAIN_RING_DIR"
ENV_EXPORT_DIR = "SPECTRAIN_EXPORT_DIR"
ENV_JOB_NAME = "SPECTRAIN_JOB_NAME"
ENV_DRAFTER_ENABLED = "SPECTRAIN_DRAFTER_ENABLED"
ENV_DEVICE = "SPECTRAIN_DEVICE"
ENV_METRICS_PORT = "SPECTRAIN_METRICS_PORT"
ENV_TERMINATION_LOG = "SPECTRAIN_TERMINATION_LOG"   # where entrypoints write their fatal error
ENV_DATA_ROOT = "SPECTRAIN_DATA_ROOT"               # where the data claims are mounted
ENV_POD_NAME = "SPECTRAIN_POD_NAME"                 # the pod's own name and namespace (downward API): the
ENV_POD_NAMESPACE = "SPECTRAIN_POD_NAMESPACE"       # status path patches the pod's annotations
ENV_GPU_SHARING = "SPECTRAIN_GPU_SHARING"           # spec.gpuSharing.mode, for the drafter's NVML report
# Every pod's drafter address (`host:port` per node), the address a drafter binds to when not its
# pod's own (`spectrain run`: loopback), and the TCPStore of the AllReduce engine.
ENV_DRAFTER_PEERS = "SPECTRAIN_DRAFTER_PEERS"
ENV_DRAFTER_BIND = "SPECTRAIN_DRAFTER_BIND"
ENV_DRAFTER_STORE = "SPECTRAIN_DRAFTER_STORE"
# The drafter fleet's channel (docs/design.md, "Trust"): the per-job key (a Secret mounted only into
# the drafter container; `spectrain run` writes one per run), the job identity every handshake and
# frame MAC binds, and the pod's own addresses the drafter binds to (dual-stack: comma-separated).
ENV_FLEET_KEY_FILE = "SPECTRAIN_FLEET_KEY_FILE"
ENV_JOB_UID = "SPECTRAIN_JOB_UID"
ENV_RESTART_GENERATION = "SPECTRAIN_RESTART_GENERATION"
ENV_POD_IPS = "SPECTRAIN_POD_IPS"
# A drafter disabled in place (past drafter.maxFailures): the operator sets this pod annotation, the
# sidecar reads it from the downward-API file named by ENV_DRAFTER_CONTROL and idles (stays up, never
# touches the GPU or the ring again); the target's pods are neither deleted nor restarted.
ENV_DRAFTER_CONTROL = "SPECTRAIN_DRAFTER_CONTROL"
ANNOTATION_DRAFTER_DISABLED = "spectrain.io/drafter-disabled"
DEVICES = ("auto", "cpu", "cuda")
# The workload image's non-root user (workloads/Dockerfile ARG UID/GID): the operator's pods run as it
# by default (Pod Security "restricted"), and PodLocalMPS's one shared UID defaults to it.
IMAGE_UID = 1000
IMAGE_GID = 1000


# ---------------------------------------------------------------- the target model's config

@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the decoder (spectrain_workloads.model builds it); checked without torch."""

    vocab_size: int = 264          # byte tokenizer: 256 bytes + specials, padded to a multiple of 8
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
    from spectrain_workloads.tokenizer import ByteTokenizer

    return model_config(model.preset or DEFAULT_PRESET, model.overrides, vocab_size=ByteTokenizer.vocab_size)


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


# ---------------------------------------------------------------- the semantic rules

def _one_of(path: str, value: Any, allowed: tuple[str, ...] | dict[str, Any]) -> list[str]:
    return [] if value in allowed else [f"{path}: {value!r} is not one of: {', '.join(allowed)}"]


def check_spec(cfg: JobConfig) -> list[str]:
    """Every reason the workloads would refuse this job at start, one line each: the field path,
    what is wrong and what to change. [] when it can run. Needs neither torch nor a cluster."""
    t, d = cfg.target, cfg.drafter
    par = t.parallelism
    out = _one_of("spec.mode", cfg.mode, MODES)
    out += _one_of("spec.target.parallelism.schedule", par.schedule, SCHEDULES)
    out += _one_of("spec.target.optimizer.name", t.optimizer.name, OPTIMIZERS)
    out += _one_of("spec.target.optimizer.basisRotation.geometry", t.optimizer.basis_rotation.geometry,
                   BASIS_GEOMETRIES)
    out += _one_of("spec.target.optimizer.basisRotation.source", t.optimizer.basis_rotation.source, BASIS_SOURCES)
    out += _one_of("spec.drafter.arch", d.arch, DRAFTER_ARCHS)
    out += _one_of("spec.drafter.preset", d.preset, DRAFTER_PRESETS)
    out += _one_of("spec.drafter.activation.policy", d.activation.policy, ACTIVATION_POLICIES)
    out += _kinds_errors(list(d.activation.kinds))
    if not d.exchange.bandwidth_m_bps > 0:
        out.append(f"spec.drafter.exchange.bandwidthMBps: must be > 0 (MB/s a drafter may send to its peers), got "
                   f"{d.exchange.bandwidth_m_bps}; to keep the drafters apart set spec.drafter.exchange.enabled: false")
    out += _one_of("spec.drafter.exchange.engine", d.exchange.engine, EXCHANGE_ENGINES)
    if not d.exchange.combine_every_seconds >= 1:
        out.append(f"spec.drafter.exchange.combineEverySeconds: must be >= 1, got {d.exchange.combine_every_seconds}")
    out += _data_source_errors(t.data.source)
    if par.data < 1 or par.pipeline < 1 or par.microbatches < 1:
        return out + [f"spec.target.parallelism: data ({par.data}), pipeline ({par.pipeline}) and microbatches "
                      f"({par.microbatches}) must all be >= 1"]
    if par.data * par.pipeline != cfg.world_size:
        out.append(f"spec.target.parallelism: data ({par.data}) x pipeline ({par.pipeline}) = "
                   f"{par.data * par.pipeline} must equal nodes x procsPerNode = {cfg.world_size}")
    out += _mode_errors(cfg)
    if t.model.path is not None:   # its layer count is known where the directory is mounted (hf.source)
        if cfg.mode == ASYNC_PIPELINE:
            out.append("spec.target.model.path: mode AsyncPipeline trains the project's presets only; a Hugging "
                       "Face model trains in mode Pretrain or RL (use spec.target.model.preset for this mode)")
        return out + model_path_errors(t.model) + pipeline_errors(cfg, None)
    try:
        mcfg = preset_model_config(t.model)
    except ConfigError as exc:
        return out + [str(exc)]
    except TypeError as exc:        # a wrong value type inside overrides
        return out + [f"spec.target.model.overrides: {exc}"]
    out += pipeline_errors(cfg, mcfg.n_layers)
    if t.data.seq_len > mcfg.max_seq_len:
        out.append(f"spec.target.data.seqLen: {t.data.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len} "
                   f"(preset {t.model.preset or DEFAULT_PRESET}); lower seqLen or set "
                   "spec.target.model.overrides.max_seq_len")
    return out


HUB_ID_HINT = ("a Hugging Face hub id is not fetched at run time: download it into a volume first "
               "(docs/bring-your-model.md) and give its directory")


def is_hub_id(path: str) -> bool:
    """"org/name": what a Hugging Face hub id looks like (no scheme, one slash, not absolute)."""
    return "://" not in path and path.count("/") == 1 and not path.startswith("/")


def model_path_errors(model: Any) -> list[str]:
    """The rules of `spec.target.model.path` that need no file system (the operator checks them too);
    the directory itself is checked where it is mounted (hf.source.inspect)."""
    path, field = model.path, "spec.target.model.path"
    out: list[str] = []
    if model.preset is not None:
        out.append(f"spec.target.model: preset ({model.preset!r}) and path are exclusive; remove preset to "
                   "train the model at path, or path to train the preset")
    if model.overrides:
        out.append(f"spec.target.model.overrides: not applied to a model given by path (its config.json "
                   f"decides its shape); remove overrides ({sorted(model.overrides)})")
    if not isinstance(path, str) or not path:
        return out + [f"{field}: must be file:///abs/dir or pvc://<claim>/<path>"]
    if path.startswith("file://"):
        if not path.startswith("file:///"):
            out.append(f"{field} {path!r}: file:// needs an absolute path (file:///abs/dir)")
    elif path.startswith("pvc://"):
        if not path[len("pvc://"):].strip("/"):
            out.append(f"{field} {path!r}: use pvc://<claim>/<path>")
    elif is_hub_id(path):
        out.append(f"{field} {path!r}: {HUB_ID_HINT}")
    else:
        out.append(f"{field} {path!r}: use file:///abs/dir or pvc://<claim>/<path>")
    return out


def _kinds_errors(kinds: list[str]) -> list[str]:
    path = "spec.drafter.activation.kinds"
    if not kinds:
        return [f"{path}: empty; list at least one of {', '.join(WINDOW_KINDS)}"]
    bad = [k for k in kinds if k not in WINDOW_KINDS]
    if bad:
        return [f"{path}: unknown kinds {bad}; use {', '.join(WINDOW_KINDS)}"]
    if len(set(kinds)) != len(kinds):
        return [f"{path}: duplicates; list each kind once"]
    return []


def _data_source_errors(source: str) -> list[str]:
    path = "spec.target.data.source"
    if source.startswith("builtin:"):
        name = source[len("builtin:"):]
        return [] if name in DATA_BUILTINS else [
            f"{path}: {source!r} is not a builtin dataset; use one of "
            f"{', '.join('builtin:' + b for b in DATA_BUILTINS)}, file:///abs/dir or pvc://<claim>/<path>"]
    if source.startswith("file://"):
        return [] if source.startswith("file:///") else [
            f"{path}: {source!r}: file:// needs an absolute path (file:///abs/dir)"]
    if source.startswith("pvc://"):
        return [] if source[len("pvc://"):].strip("/") else [f"{path}: {source!r}: use pvc://<claim>/<path>"]
    return [f"{path}: {source!r}: use builtin:python-stdlib, file:///abs/dir or pvc://<claim>/<path>"]


def _mode_errors(cfg: JobConfig) -> list[str]:
    t, par = cfg.target, cfg.target.parallelism
    out: list[str] = []
    if (cfg.mode == RL) != (t.rl is not None):
        out.append("spec.target.rl: required when spec.mode is RL and forbidden otherwise")
    if cfg.mode == RL and par.pipeline != 1:
        out.append(f"spec.target.parallelism.pipeline: mode RL runs data-parallel only (rollouts need the whole "
                   f"model on each rank); set pipeline to 1 (got {par.pipeline})")
    if cfg.mode == RL and t.rl is not None:
        rl = t.rl
        out += _one_of("spec.target.rl.task", rl.task, RL_TASKS)
        out += _one_of("spec.target.rl.speculative.strategy", rl.speculative.strategy, DRAFT_STRATEGIES)
        if rl.group_size < 2:
            out.append(f"spec.target.rl.groupSize: must be >= 2 (GRPO advantages are group-relative), "
                       f"got {rl.group_size}")
        if not 1 <= rl.speculative.max_draft_tokens <= MAX_DRAFT_TOKENS:
            out.append(f"spec.target.rl.speculative.maxDraftTokens: must be in 1..{MAX_DRAFT_TOKENS}, "
                       f"got {rl.speculative.max_draft_tokens}")
        if rl.max_new_tokens < 1:
            out.append(f"spec.target.rl.maxNewTokens: must be >= 1, got {rl.max_new_tokens}")
        if rl.temperature < 0:
            out.append(f"spec.target.rl.temperature: must be >= 0 (0 is greedy), got {rl.temperature}")
    if cfg.mode == ASYNC_PIPELINE:
        if par.pipeline < 2:
            out.append(f"spec.target.parallelism.pipeline: mode AsyncPipeline needs >= 2 stages, got {par.pipeline}")
        if par.data != 1:
            out.append(f"spec.target.parallelism.data: mode AsyncPipeline runs one replica; set data to 1 "
                       f"(got {par.data})")
    if cfg.mode == PRETRAIN and t.data.batch_size % par.microbatches:
        out.append(f"spec.target.data.batchSize: {t.data.batch_size} must be a multiple of "
                   f"spec.target.parallelism.microbatches ({par.microbatches}); each microbatch takes "
                   "batchSize / microbatches sequences")
    return out


def pipeline_errors(cfg: JobConfig, n_layers: int | None) -> list[str]:
    """The pipeline rules; those about the layer count only when it is known (`n_layers`)."""
    par = cfg.target.parallelism
    model = cfg.target.model
    what = f"preset {model.preset or DEFAULT_PRESET}" if model.path is None else f"model at {model.path}"
    out: list[str] = []
    if par.pipeline > 1 and par.microbatches < par.pipeline and cfg.mode == PRETRAIN:
        out.append(f"spec.target.parallelism.microbatches: must be >= pipeline ({par.pipeline}) when "
                   f"pipeline > 1, got {par.microbatches}")
    if n_layers is not None and n_layers % par.pipeline:
        out.append(f"spec.target.parallelism.pipeline: {par.pipeline} stages do not divide the model's "
                   f"{n_layers} layers ({what}); choose a divisor of {n_layers}"
                   + (" or set spec.target.model.overrides.n_layers" if model.path is None else ""))
    if par.schedule == INTERLEAVED and cfg.mode == PRETRAIN:
        v = INTERLEAVED_CHUNKS
        if par.pipeline < 2:
            out.append("spec.target.parallelism.pipeline: Interleaved1F1B interleaves model chunks across "
                       "pipeline ranks and needs pipeline >= 2; use schedule 1F1B for pipeline 1")
        elif par.microbatches % par.pipeline:
            out.append(f"spec.target.parallelism.microbatches: Interleaved1F1B needs a multiple of pipeline "
                       f"({par.pipeline}), got {par.microbatches}")
        if n_layers is not None and n_layers % (v * par.pipeline):
            fix = (f"set spec.target.model.overrides.n_layers to a multiple of {v * par.pipeline}, lower pipeline, "
                   "or use schedule 1F1B") if model.path is None else "lower pipeline or use schedule 1F1B"
            out.append(f"spec.target.parallelism.schedule: Interleaved1F1B gives each of the {par.pipeline} "
                       f"pipeline ranks {v} model chunks, so {v} x pipeline = {v * par.pipeline} must divide the "
                       f"model's {n_layers} layers; {fix}")
    return out


def require_valid(cfg: JobConfig) -> None:
    """ConfigError with every problem of `cfg` (the entrypoints' first call)."""
    errors = check_spec(cfg)
    if errors:
        raise ConfigError("; ".join(errors))
