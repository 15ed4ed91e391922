"""The runtime every target mode shares: Pretrain (target.trainer), RL (rl.mode) and AsyncPipeline
(target.async_pipeline) start the same way and keep their state the same way;
loop.py runs them all through one loop.

`Runtime.start(cfg)` runs the contract's checks, reads the environment (`TargetOptions`,
`RankInfo`: docs/contracts.md), picks the device and the CPU threads, prepares the run directory
(tokenizer), joins the process group (gloo on CPU, nccl on CUDA), and owns from then on the
checkpoint manager (atomic, fsynced, keep-last-N), the metrics writer, the ring producer for the
drafter and the SIGTERM path (save at a step boundary, exit 143). SIGTERM must be blocked before
torch starts a thread: the entrypoint calls `shutdown.block_sigterm()` first.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spectrain_api.config import JobConfig
from spectrain_api.errors import ConfigError
from spectrain_api.names import (
    DEVICES,
    ENV_DEVICE,
    ENV_DRAFTER_ENABLED,
    ENV_EXPORT_DIR,
    ENV_METRICS_PORT,
    ENV_RING_DIR,
    ENV_RUN_DIR,
    EXIT_TERMINATED,
)
from spectrain_api.rules import require_valid
from spectrain_workloads.checkpoint import CheckpointManager, save_shared
from spectrain_workloads.listen import rendezvous_store
from spectrain_workloads.metrics import MetricsWriter
from spectrain_workloads.shutdown import Terminator
from spectrain_workloads.tokenizer import ByteTokenizer


def env_value(env: dict[str, str], name: str, kind: type, default: Any) -> Any:
    """`env[name]` as `kind` (bool: 1/0/true/false), `default` when unset or empty."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true")
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


@dataclass(kw_only=True)
class TargetOptions:
    """Knobs of a target process that are not SpecTrainJob fields (env var in brackets)."""

    run_dir: Path                       # [SPECTRAIN_RUN_DIR]
    ring_dir: Path | None = None        # [SPECTRAIN_RING_DIR]; None: no ring
    device: str = "auto"                # [SPECTRAIN_DEVICE] auto | cpu | cuda
    drafter_enabled: bool = True        # [SPECTRAIN_DRAFTER_ENABLED] 0: publish nothing to the ring
    instrument: bool = True             # [SPECTRAIN_INSTRUMENT] 0: no windows at all (bitwise-equal losses)
    # [SPECTRAIN_INSTRUMENT_INTERLEAVE] k > 0: instrument only some steps, in blocks of k steps in the
    # order on off off on (ABBA, then again), so that one run measures the instrumentation's cost side
    # by side (bench-target); metrics mark each step `instrumented`. 0: every step (instrument on).
    instrument_interleave: int = 0
    publish_fraction: float = 0.25      # [SPECTRAIN_PUBLISH_FRACTION] of each microbatch's sequences
    bucket_cap_mb: float = 25.0         # [SPECTRAIN_BUCKET_CAP_MB] DDP bucket size
    skew: float = 0.0                   # [SPECTRAIN_DATA_SKEW] seq-length skew injection (data.py)
    imbalance_min_ms: float = 5.0       # [SPECTRAIN_IMBALANCE_MIN_MS] slack before a wait counts as imbalance
    metrics_port: int = 0               # [SPECTRAIN_METRICS_PORT] (+ local rank); 0: off
    term_grace_s: float = 30.0          # [SPECTRAIN_TERM_GRACE_S] SIGTERM -> saved and exited within this
    data_max_bytes: int = 8 << 20       # [SPECTRAIN_DATA_MAX_BYTES] corpus cap
    torch_threads: int = 0              # [SPECTRAIN_TORCH_THREADS] 0: cores / local ranks on CPU
    drafter_threads: int = 1            # [SPECTRAIN_DRAFTER_THREADS] the sidecar's share of the CPU cores
    rl_warmup_steps: int = 200          # [SPECTRAIN_RL_WARMUP_STEPS] mode RL: supervised warm-up steps on a fresh start
    rl_plain_every: int = 0             # [SPECTRAIN_RL_PLAIN_EVERY] mode RL: every n-th step also rolls out plainly; 0: never
    export_dir: Path | None = None      # [SPECTRAIN_EXPORT_DIR] mode RL: drafter exports; None: run_dir / spec's export path

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"{ENV_DEVICE}={self.device!r}: use one of {', '.join(DEVICES)}")
        if not 0.0 <= self.publish_fraction <= 1.0:
            raise ConfigError(f"SPECTRAIN_PUBLISH_FRACTION must be in [0, 1], got {self.publish_fraction}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"SPECTRAIN_BUCKET_CAP_MB must be > 0, got {self.bucket_cap_mb}")
        if self.instrument_interleave < 0:
            raise ConfigError(f"SPECTRAIN_INSTRUMENT_INTERLEAVE must be >= 0 (0: off), got {self.instrument_interleave}")
        if self.term_grace_s <= 2:
            raise ConfigError(f"SPECTRAIN_TERM_GRACE_S must be > 2, got {self.term_grace_s}")
        if self.rl_warmup_steps < 0 or self.rl_plain_every < 0:
            raise ConfigError("SPECTRAIN_RL_WARMUP_STEPS and SPECTRAIN_RL_PLAIN_EVERY must be >= 0, got "
                              f"{self.rl_warmup_steps} and {self.rl_plain_every}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TargetOptions:
        e = dict(os.environ if env is None else env)
        run_dir = e.get(ENV_RUN_DIR)
        if not run_dir:
            raise ConfigError(f"{ENV_RUN_DIR} is not set; point it at the checkpoint volume")
        ring, export = e.get(ENV_RING_DIR), e.get(ENV_EXPORT_DIR)
        return cls(
            run_dir=Path(run_dir), ring_dir=Path(ring) if ring else None,
            device=e.get(ENV_DEVICE, "auto") or "auto",
            drafter_enabled=env_value(e, ENV_DRAFTER_ENABLED, bool, True),
            instrument=env_value(e, "SPECTRAIN_INSTRUMENT", bool, True),
            instrument_interleave=env_value(e, "SPECTRAIN_INSTRUMENT_INTERLEAVE", int, 0),
            publish_fraction=env_value(e, "SPECTRAIN_PUBLISH_FRACTION", float, 0.25),
            bucket_cap_mb=env_value(e, "SPECTRAIN_BUCKET_CAP_MB", float, 25.0),
            skew=env_value(e, "SPECTRAIN_DATA_SKEW", float, 0.0),
            imbalance_min_ms=env_value(e, "SPECTRAIN_IMBALANCE_MIN_MS", float, 5.0),
            metrics_port=env_value(e, ENV_METRICS_PORT, int, 0),
            term_grace_s=env_value(e, "SPECTRAIN_TERM_GRACE_S", float, 30.0),
            data_max_bytes=env_value(e, "SPECTRAIN_DATA_MAX_BYTES", int, 8 << 20),
            torch_threads=env_value(e, "SPECTRAIN_TORCH_THREADS", int, 0),
            drafter_threads=env_value(e, "SPECTRAIN_DRAFTER_THREADS", int, 1),
            rl_warmup_steps=env_value(e, "SPECTRAIN_RL_WARMUP_STEPS", int, 200),
            rl_plain_every=env_value(e, "SPECTRAIN_RL_PLAIN_EVERY", int, 0),
            export_dir=Path(export) if export else None,
        )


@dataclass(kw_only=True, frozen=True)
class RankInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RankInfo:
        e = dict(os.environ if env is None else env)
        rank, world = env_value(e, "RANK", int, 0), env_value(e, "WORLD_SIZE", int, 1)
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
        return cls(rank=rank, world=world, local_rank=env_value(e, "LOCAL_RANK", int, 0),
                   local_world=env_value(e, "LOCAL_WORLD_SIZE", int, 1))


def select_device(opts: TargetOptions, rank: RankInfo) -> torch.device:
    if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(f"{ENV_DEVICE}=cuda but no CUDA device is visible")
        torch.cuda.set_device(rank.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


RING_BUDGET_BYTES = 192 << 20     # data slots of one rank's ring at most (a memory-backed volume)


def ring_layout(*, hidden_dim: int, seq_len: int, publishes: bool, width: int = 1) -> Any:
    """The ring of a rank: ranks that publish hidden states get data slots of one sequence each
    (`width` arrays [T, H] fp32: the final hidden and/or EAGLE-3 features, + tokens [T] int64 +
    meta), 4..32 of them within RING_BUDGET_BYTES."""
    from spectrain_workloads.ring import RingLayout

    mib = 1 << 20
    need = seq_len * hidden_dim * 4 * width + seq_len * 8 + 64 * 1024
    slot = max(mib, -(-need // mib) * mib) if publishes else 64 * 1024
    return RingLayout(data_slots=max(4, min(32, RING_BUDGET_BYTES // slot)), data_slot_bytes=slot)


@dataclass(kw_only=True)
class Runtime:
    cfg: JobConfig
    opts: TargetOptions
    rank: RankInfo
    device: torch.device
    ckpt: CheckpointManager
    metrics: MetricsWriter

    @classmethod
    def start(cls, cfg: JobConfig, opts: TargetOptions | None = None, rank: RankInfo | None = None, *,
              leave_drafter_threads: bool = False) -> Runtime:
        """`leave_drafter_threads`: on CPU keep `drafter_threads` cores for the sidecar (RL decodes
        many tiny steps, which oversubscribed intra-op threads make many times slower)."""
        require_valid(cfg)
        opts = opts or TargetOptions.from_env()
        rank = rank or RankInfo.from_env()
        device = select_device(opts, rank)
        if device.type == "cpu":
            spare = opts.drafter_threads if leave_drafter_threads and opts.drafter_enabled else 0
            torch.set_num_threads(opts.torch_threads
                                  or max(1, ((os.cpu_count() or 1) - spare) // max(1, rank.local_world)))
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        if rank.rank == 0 and cfg.target.model.path is None:   # an HF target's goes with its export
            ByteTokenizer().save(opts.run_dir)
        if rank.world > 1 and not dist.is_initialized():
            timeout = datetime.timedelta(minutes=10)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank.rank, world_size=rank.world,
                                    store=rendezvous_store(rank.rank, rank.world, timeout), timeout=timeout)
        t = cfg.target
        return cls(cfg=cfg, opts=opts, rank=rank, device=device,
                   ckpt=CheckpointManager(opts.run_dir, rank.rank, t.checkpoint.keep),
                   metrics=MetricsWriter(opts.run_dir, rank.rank, local_rank=rank.local_rank,
                                         port=opts.metrics_port, progress=rank.rank == 0, total_steps=t.steps))

    def resume_step(self) -> int | None:
        """The newest step every rank has a checkpoint of; None when some rank has none (start
        fresh). A step-0 checkpoint counts: mode RL saves its warmed-up policy as step 0."""
        latest = self.ckpt.latest()
        mine = -1 if latest is None else latest
        if self.rank.world > 1:
            buf = torch.tensor([mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MIN)
            mine = int(buf.item())
        return None if mine < 0 else mine

    def ring_producer(self, *, hidden_dim: int, seq_len: int, publishes: bool, width: int = 1) -> Any:
        """The ring of this local rank (None when the drafter is off). Ranks that publish hidden
        states get data slots of one sequence: hidden [T, H] fp32 + tokens [T] + meta."""
        if not self.opts.drafter_enabled or self.opts.ring_dir is None:
            return None
        from spectrain_workloads.ring import RingProducer, ring_path

        return RingProducer.create(ring_path(self.opts.ring_dir, self.rank.local_rank),
                                   layout=ring_layout(hidden_dim=hidden_dim, seq_len=seq_len, publishes=publishes,
                                                                  width=width),
                                   rank=self.rank.rank)

    def save_shared(self, *, embedding: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
                    model_config: dict[str, Any] | None = None, token_counts: torch.Tensor | None = None) -> None:
        """The drafter's copies of the target's embedding / LM head (docs/contracts.md)."""
        save_shared(self.opts.run_dir, embedding=embedding, lm_head=lm_head, model_config=model_config,
                    token_counts=token_counts)

    def terminator(self, emergency_save: Callable[[], None]) -> Terminator:
        return Terminator(self.opts.term_grace_s, emergency_save)

    def exit_terminated(self, term: Terminator, save: Callable[[int], None], step: int) -> None:
        """SIGTERM seen at a step boundary: save `step` (when > 0) and exit 143."""
        with term.state_lock:
            if step > 0:
                save(step)
            term.done.set()
        print(f"[spectrain-target] SIGTERM: saved step {step}; exiting", file=sys.stderr, flush=True)
        self.metrics.close()
        os._exit(EXIT_TERMINATED)

    def close(self, *, barrier: bool = True) -> None:
        self.metrics.close()
        if self.rank.world > 1 and dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
