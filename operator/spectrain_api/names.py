"""Every name that crosses the operator/workload seam, defined once: the API group and kind, the
enums the CRD lists, the presets, the exit codes, the pods' environment variables and annotations.

`scripts/gen.py` writes the CRD's enums from these tuples (its defaults from `config`'s
dataclasses); nothing outside this package spells one of these values as a literal.
"""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------- API names
GROUP = "spectrain.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SpecTrainJob"
PLURAL = "spectrainjobs"

# ---------------------------------------------------------------- enums (the CRD's enum lists)
# status.phase of a SpecTrainJob (the operator writes it; the CRD enumerates it)
PHASES = ("Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
PENDING, STARTING, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED = PHASES
# status.drafter.state (the drafter worker sets it; its Prometheus state gauge enumerates it)
DRAFTER_STATES = ("Disabled", "Waiting", "Active", "Degraded")
DISABLED, WAITING, ACTIVE, DEGRADED = DRAFTER_STATES
MODES = ("Pretrain", "RL", "AsyncPipeline")
PRETRAIN, RL, ASYNC_PIPELINE = MODES
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
GPIPE, ONE_F_ONE_B, INTERLEAVED = SCHEDULES
INTERLEAVED_CHUNKS = 2          # model chunks (virtual stages) per rank; API.md has no field for it
WINDOW_KINDS = ("Bubble", "Communication", "Imbalance", "RolloutTail")
# spec.drafter.arch: EAGLE-1 (one decoder layer on the final hidden state), a standalone LM, EAGLE-3
# (three target feature layers fused, a draft vocabulary; rules in spectrain_api.eagle3)
DRAFTER_ARCHS = ("Eagle", "LM", "Eagle3")
EAGLE, LM, EAGLE3 = DRAFTER_ARCHS
# spec.drafter.exchange.engine: the star through the exporting rank (drafter.fleet, authenticated) or
# the gloo ring all-reduce on the drafters' own store (drafter.allreduce, unauthenticated transport)
EXCHANGE_ENGINES = ("Star", "AllReduce")
STAR, ALLREDUCE = EXCHANGE_ENGINES
ACTIVATION_POLICIES = ("IdleOnly", "Always", "Off")
IDLE_ONLY, ALWAYS, OFF = ACTIVATION_POLICIES
OPTIMIZERS = ("AdamW", "BasisRotation")
ADAMW, BASIS_ROTATION = OPTIMIZERS
BASIS_GEOMETRIES = ("Bilateral", "Unilateral")
BILATERAL, UNILATERAL = BASIS_GEOMETRIES
BASIS_SOURCES = ("SecondMoment", "FirstMoment")
SECOND_MOMENT, FIRST_MOMENT = BASIS_SOURCES
RL_TASKS = ("arithmetic", "copy", "sort", "alphabet")
DRAFT_STRATEGIES = ("Bandit", "Fixed")
BANDIT, FIXED = DRAFT_STRATEGIES
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
# The byte tokenizer of the presets: 256 bytes + PAD, BOS, EOS, padded to a multiple of 8.
BYTE_VOCAB_SIZE = 264
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
ENV_POD_NAME = "SPECTRAIN_POD_NAME"                 # the pod's own name, namespace and UID (downward API):
ENV_POD_NAMESPACE = "SPECTRAIN_POD_NAMESPACE"       # the status path keys its reports in the job's status
ENV_POD_UID = "SPECTRAIN_POD_UID"                   # by the pod's UID
ENV_POD_IP = "SPECTRAIN_POD_IP"                     # status.podIP: what the pod's listeners bind (never 0.0.0.0)
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
# Per-pod identities (spectrain_api.fleet_identity): the pod's own private key, every pod's public key.
ENV_FLEET_IDENTITY_FILE = "SPECTRAIN_FLEET_IDENTITY_FILE"
ENV_FLEET_PEERS_FILE = "SPECTRAIN_FLEET_PEERS_FILE"
ENV_JOB_UID = "SPECTRAIN_JOB_UID"
ENV_RESTART_GENERATION = "SPECTRAIN_RESTART_GENERATION"
ENV_POD_IPS = "SPECTRAIN_POD_IPS"
# A drafter disabled in place (past drafter.maxFailures): the operator records it in the job's status
# (status.drafterDisabled), which the sidecar reads through the status path's ServiceAccount; pods
# the operator creates in that restart generation also carry this annotation, which the sidecar reads
# from the downward-API file named by ENV_DRAFTER_CONTROL. Either way it idles (stays up, never touches
# the GPU or the ring again); the target's pods are neither deleted nor restarted.
ENV_DRAFTER_CONTROL = "SPECTRAIN_DRAFTER_CONTROL"
ANNOTATION_DRAFTER_DISABLED = "spectrain.io/drafter-disabled"
# The status path (spectrain_workloads.podstatus writes, the operator's status policies read): each
# pod merge-patches status.reports.<its UID> of its own job = {pod, progress, drafter}, where
# `progress` (rank 0's training progress) and `drafter` (the pod's drafter summary) are JSON text of at
# most MAX_REPORT_CHARS. The pods' Role allows patching that one job's status, nothing of any pod.
STATUS_REPORTS = "reports"
REPORT_POD = "pod"
REPORT_PROGRESS = "progress"
REPORT_DRAFTER = "drafter"
MAX_REPORT_CHARS = 4096
DEVICES = ("auto", "cpu", "cuda")
# The export gate (drafter.worker_export): why a candidate export was not made LATEST. Counted per cause
# in the drafter's summary (exportsRejectedByCause), Prometheus (spectrain_drafter_exports_rejected_total
# {cause}) and status.drafter.exportsRejectedByCause. below_latest: under LATEST re-measured on the same
# held-back samples; below_floor: under spec.drafter.export.minAcceptance; non_finite: weights or
# acceptance not finite; unmeasured: no held-back samples (or no idle window) to measure it against
# LATEST or the floor; version_reused: a version at or below the export root's high-water mark.
EXPORT_REJECT_CAUSES = ("below_latest", "below_floor", "non_finite", "unmeasured", "version_reused")
# The robust combine (drafter.robust_combine): contributions the coordinator adjusted, by cause, in the
# coordinator's summary (combineAdjustedByCause), Prometheus (spectrain_drafter_combine_adjusted_total
# {cause}) and `spectrain report`. work_capped: claimed work above what its stream's wall time allows;
# outlier_clipped: an update far from the round's others, scaled back; weight_capped: a rank's weight
# held to its share of the round.
COMBINE_ADJUST_CAUSES = ("work_capped", "outlier_clipped", "weight_capped")
# spec.drafter.export.minAcceptance, in tokens per verification (the acceptance length, >= 1 for any
# drafter: the target's own token); 0 is no floor. The bound keeps a typo from rejecting every export.
MAX_MIN_ACCEPTANCE = 64.0
# The workload image's non-root user (workloads/Dockerfile ARG UID/GID): the operator's pods run as it
# by default (Pod Security "restricted"), and PodLocalMPS's one shared UID defaults to it.
IMAGE_UID = 1000
IMAGE_GID = 1000
