"""The target's Pretrain loop: data parallel x pipeline parallel, publishing its idle windows.

Rank layout: global rank r is stage `r % pipeline` of replica `r // pipeline` (pipeline
neighbours are adjacent ranks, so a node's local ranks hold consecutive stages). Every stage
builds `Transformer.stage(cfg, k, P)` and `init_weights(seed)`, so the pipelined model is the
single-process model cut into slices. Under Interleaved1F1B stage k builds v chunks, the virtual
stages `Transformer.stage(cfg, c * P + k, P * v)` for c < v (each its own DDP; one optimizer and
one checkpoint per rank over all of them, as an `nn.ModuleList`). Gradient accumulation over
microbatches, one optimizer step per step; DDP (gloo on CPU, nccl on CUDA) averages gradients
across replicas per stage.

Per step: `StageExecutor.run` (pipeline.py), optimizer step, the loss travels from the last stage
of replica 0 to rank 0 (progress), metrics, and every `checkpoint.everySteps` a checkpoint plus
the shared embedding / LM head files. Checkpoint step N means "N steps done"; a resumed run
continues with step N and reproduces the uninterrupted run bitwise on CPU.

Knobs that are not part of the SpecTrainJob API come from the environment (TrainerOptions).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spectrain_workloads.checkpoint import CheckpointManager, rng_state, save_shared, set_rng_state
from spectrain_workloads.config import JobConfig
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus, resolve_source
from spectrain_workloads.errors import ConfigError
from spectrain_workloads.imbalance_watch import block_alarm_in_new_threads, unblock_alarm
from spectrain_workloads.instrument import Instrument, InstrumentOptions
from spectrain_workloads.metrics import MetricsWriter
from spectrain_workloads.model import ModelConfig, Transformer, model_config
from spectrain_workloads.pipeline import StageExecutor, make_comm_hook
from spectrain_workloads.schedule import INTERLEAVED, Schedule
from spectrain_workloads.shutdown import EXIT_TERMINATED, Terminator
from spectrain_workloads.tokenizer import ByteTokenizer

_LOSS_TAG = 1 << 20


def _env(env: dict[str, str], name: str, kind: type, default: Any) -> Any:
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
class TrainerOptions:
    """Runtime knobs (env var in brackets)."""

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

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"SPECTRAIN_DEVICE={self.device!r}: use auto, cpu or cuda")
        if not 0.0 <= self.publish_fraction <= 1.0:
            raise ConfigError(f"SPECTRAIN_PUBLISH_FRACTION must be in [0, 1], got {self.publish_fraction}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"SPECTRAIN_BUCKET_CAP_MB must be > 0, got {self.bucket_cap_mb}")
        if self.instrument_interleave < 0:
            raise ConfigError(f"SPECTRAIN_INSTRUMENT_INTERLEAVE must be >= 0 (0: off), got {self.instrument_interleave}")
        if self.term_grace_s <= 2:
            raise ConfigError(f"SPECTRAIN_TERM_GRACE_S must be > 2, got {self.term_grace_s}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TrainerOptions:
        e = dict(os.environ if env is None else env)
        run_dir = e.get("SPECTRAIN_RUN_DIR")
        if not run_dir:
            raise ConfigError("SPECTRAIN_RUN_DIR is not set; point it at the checkpoint volume")
        ring = e.get("SPECTRAIN_RING_DIR")
        return cls(
            run_dir=Path(run_dir), ring_dir=Path(ring) if ring else None,
            device=e.get("SPECTRAIN_DEVICE", "auto") or "auto",
            drafter_enabled=_env(e, "SPECTRAIN_DRAFTER_ENABLED", bool, True),
            instrument=_env(e, "SPECTRAIN_INSTRUMENT", bool, True),
            instrument_interleave=_env(e, "SPECTRAIN_INSTRUMENT_INTERLEAVE", int, 0),
            publish_fraction=_env(e, "SPECTRAIN_PUBLISH_FRACTION", float, 0.25),
            bucket_cap_mb=_env(e, "SPECTRAIN_BUCKET_CAP_MB", float, 25.0),
            skew=_env(e, "SPECTRAIN_DATA_SKEW", float, 0.0),
            imbalance_min_ms=_env(e, "SPECTRAIN_IMBALANCE_MIN_MS", float, 5.0),
            metrics_port=_env(e, "SPECTRAIN_METRICS_PORT", int, 0),
            term_grace_s=_env(e, "SPECTRAIN_TERM_GRACE_S", float, 30.0),
            data_max_bytes=_env(e, "SPECTRAIN_DATA_MAX_BYTES", int, 8 << 20),
            torch_threads=_env(e, "SPECTRAIN_TORCH_THREADS", int, 0),
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
        rank, world = _env(e, "RANK", int, 0), _env(e, "WORLD_SIZE", int, 1)
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
        return cls(rank=rank, world=world, local_rank=_env(e, "LOCAL_RANK", int, 0),
                   local_world=_env(e, "LOCAL_WORLD_SIZE", int, 1))


@dataclass(kw_only=True, frozen=True)
class Plan:
    model: ModelConfig
    schedule: Schedule
    data: int
    pipeline: int


def make_plan(cfg: JobConfig, world: int) -> Plan:
    """Every check that needs no data or peers; ConfigError naming the field on bad input."""
    t = cfg.target
    par = t.parallelism
    if par.data < 1 or par.pipeline < 1:
        raise ConfigError(f"spec.target.parallelism.data/pipeline must be >= 1, got {par.data}/{par.pipeline}")
    if par.data * par.pipeline != world:
        raise ConfigError(
            f"spec.target.parallelism: data ({par.data}) x pipeline ({par.pipeline}) = {par.data * par.pipeline} "
            f"but WORLD_SIZE is {world} (nodes x procsPerNode = {cfg.world_size}); make them equal")
    mcfg = model_config(t.model.preset, t.model.overrides, vocab_size=ByteTokenizer.vocab_size)
    if mcfg.n_layers % par.pipeline:
        raise ConfigError(
            f"spec.target.parallelism.pipeline ({par.pipeline}) must divide the model's n_layers ({mcfg.n_layers}, "
            f"preset {t.model.preset!r}); pick a divisor or set target.model.overrides.n_layers")
    schedule = Schedule(name=par.schedule, n_stages=par.pipeline, microbatches=par.microbatches)
    if schedule.name == INTERLEAVED and mcfg.n_layers % (par.pipeline * schedule.chunks):
        v = schedule.chunks
        raise ConfigError(
            f"spec.target.parallelism.schedule {INTERLEAVED} splits each of the pipeline ({par.pipeline}) ranks "
            f"into {v} model chunks, so pipeline x {v} = {par.pipeline * v} must divide the model's n_layers "
            f"({mcfg.n_layers}, spec.target.model.preset {t.model.preset!r}); set "
            f"spec.target.model.overrides.n_layers to a multiple of {par.pipeline * v}, lower "
            "spec.target.parallelism.pipeline, or use schedule 1F1B")
    if t.data.batch_size % par.microbatches:
        raise ConfigError(f"spec.target.data.batchSize ({t.data.batch_size}) must be a multiple of "
                          f"spec.target.parallelism.microbatches ({par.microbatches})")
    if t.data.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"spec.target.data.seqLen ({t.data.seq_len}) exceeds the model's max_seq_len "
                          f"({mcfg.max_seq_len}); lower it or override model.max_seq_len")
    if t.steps < 1 or t.checkpoint.every_steps < 1 or t.checkpoint.keep < 1:
        raise ConfigError("spec.target.steps, checkpoint.everySteps and checkpoint.keep must all be >= 1")
    from spectrain_workloads.optim import OPTIMIZERS

    if t.optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"spec.target.optimizer.name {t.optimizer.name!r} is unknown; use one of {list(OPTIMIZERS)}")
    resolve_source(t.data.source)
    return Plan(model=mcfg, schedule=schedule, data=par.data, pipeline=par.pipeline)


def _device(opts: TrainerOptions, rank: RankInfo) -> torch.device:
    if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("SPECTRAIN_DEVICE=cuda but no CUDA device is visible")
        torch.cuda.set_device(rank.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ring_producer(opts: TrainerOptions, rank: RankInfo, plan: Plan, seq_len: int, last: bool) -> Any:
    if not opts.drafter_enabled or opts.ring_dir is None:
        return None
    from spectrain_workloads.ring import RingLayout, RingProducer, ring_path

    mib = 1 << 20
    need = seq_len * plan.model.dim * 4 + seq_len * 8 + 64 * 1024     # hidden fp32 + tokens + meta/descriptors
    slot = max(mib, -(-need // mib) * mib) if last else 64 * 1024
    slots = max(4, min(32, (192 * mib) // slot))
    return RingProducer.create(ring_path(opts.ring_dir, rank.local_rank),
                               layout=RingLayout(data_slots=slots, data_slot_bytes=slot), rank=rank.rank)


def train(cfg: JobConfig, opts: TrainerOptions, rank: RankInfo) -> list[float | None]:
    """Run (or resume) the Pretrain job on this rank; returns this rank's per-step losses."""
    plan = make_plan(cfg, rank.world)
    t = cfg.target
    P, D = plan.pipeline, plan.data
    block_alarm_in_new_threads()     # the Instrument's imbalance alarm goes to this thread only
    stage, replica = rank.rank % P, rank.rank // P
    corpus = load_corpus(t.data.source, max_bytes=opts.data_max_bytes)
    loader = TokenLoader(corpus, LoaderSpec(seq_len=t.data.seq_len, batch_size=t.data.batch_size,
                                            data_parallel=D, replica=replica, seed=cfg.seed, skew=opts.skew))
    device = _device(opts, rank)
    if device.type == "cpu":
        torch.set_num_threads(opts.torch_threads or max(1, (os.cpu_count() or 1) // max(1, rank.local_world)))
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    if rank.rank == 0:
        ByteTokenizer().save(opts.run_dir)

    if rank.world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank.rank,
                                world_size=rank.world, timeout=datetime.timedelta(minutes=10))
    dp_group = fwd_group = bwd_group = None
    for s in range(P):   # every rank creates every group, in the same order
        g = dist.new_group([d * P + s for d in range(D)]) if D > 1 else None
        if s == stage:
            dp_group = g
    if P > 1:
        fwd_group, bwd_group = dist.new_group(list(range(rank.world))), dist.new_group(list(range(rank.world)))
    fwd_wrap = bwd_wrap = None
    if P > 1 and plan.schedule.chunks > 1:   # interleaved: the ring's wrap-around link gets its own groups
        fwd_wrap, bwd_wrap = dist.new_group(list(range(rank.world))), dist.new_group(list(range(rank.world)))

    V = plan.schedule.chunks                       # model chunks per rank (Interleaved1F1B: > 1)
    chunks = [Transformer.stage(plan.model, c * P + stage, P * V) for c in range(V)]
    for chunk in chunks:
        chunk.init_weights(cfg.seed)
    module: torch.nn.Module = chunks[0] if V == 1 else torch.nn.ModuleList(chunks)
    module.to(device)
    from spectrain_workloads.optim import build_optimizer

    opt = build_optimizer(module, t.optimizer, stage=stage, n_stages=P)
    ckpt = CheckpointManager(opts.run_dir, rank.rank, t.checkpoint.keep)
    start = _agreed_resume_step(ckpt, rank, device)
    if start > 0:
        state = ckpt.load(start)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        loader.load_state_dict(state["loader"])
    else:
        loader.load_state_dict({"step": 0})

    last = stage == P - 1
    metrics = MetricsWriter(opts.run_dir, rank.rank, local_rank=rank.local_rank, port=opts.metrics_port,
                            progress=rank.rank == 0, total_steps=t.steps)
    ring_lock = threading.Lock()
    producer = _ring_producer(opts, rank, plan, t.data.seq_len, last)
    instr = Instrument(rank=rank.rank, stage=stage, producer=producer, sink=metrics.window_closed,
                       producer_lock=ring_lock,
                       opts=InstrumentOptions(enabled=opts.instrument,
                                              imbalance_min_ns=int(opts.imbalance_min_ms * 1e6)))
    publisher = None
    if producer is not None and last and opts.publish_fraction > 0:
        from spectrain_workloads.publisher import DataPublisher

        publisher = DataPublisher(producer, fraction=opts.publish_fraction, stage=stage, lock=ring_lock)
    stage_mods: list[torch.nn.Module] = list(chunks)
    if dp_group is not None:
        for c, chunk in enumerate(chunks):
            ddp = torch.nn.parallel.DistributedDataParallel(
                chunk, process_group=dp_group, forward_sync_buffers=False, bucket_cap_mb=opts.bucket_cap_mb,
                device_ids=[device.index] if device.type == "cuda" else None)
            ddp.register_comm_hook(dp_group, make_comm_hook(instr, "dp-bucket-" if V == 1 else f"dp-bucket-c{c}-"))
            stage_mods[c] = ddp
    if V == 1:
        prev_rank = rank.rank - 1 if stage > 0 else None
        next_rank = rank.rank + 1 if not last else None
    else:   # neighbours in the ring of this replica's stages: chunks go round it
        prev_rank, next_rank = replica * P + (stage - 1) % P, replica * P + (stage + 1) % P
    executor = StageExecutor(
        module=stage_mods[0] if V == 1 else stage_mods, schedule=plan.schedule, stage=stage, instrument=instr,
        prev_rank=prev_rank, next_rank=next_rank,
        fwd_group=fwd_group, bwd_group=bwd_group, fwd_wrap_group=fwd_wrap, bwd_wrap_group=bwd_wrap,
        dim=plan.model.dim, device=device,
        on_hidden=publisher.submit if publisher is not None else None)

    boundary = {"step": start, "rng": rng_state()}

    def state_at_boundary() -> dict[str, Any]:
        return {"step": boundary["step"], "model": module.state_dict(), "optimizer": opt.state_dict(),
                "rng": boundary["rng"], "loader": {"step": boundary["step"]}, "rank": rank.rank,
                "stage": stage, "replica": replica}

    def write_shared() -> None:
        head, tail = chunks[0], chunks[-1]    # embedding: virtual stage 0; LM head: the last one
        save_shared(opts.run_dir,
                    embedding=head.tok_embeddings.weight if head.tok_embeddings is not None else None,
                    lm_head=tail.output.weight if tail.output is not None else None,
                    model_config=plan.model.to_dict() if last else None)

    def save(step: int) -> None:
        ckpt.save(step, state_at_boundary())
        if replica == 0:
            write_shared()

    if replica == 0:
        # The drafter needs the embedding / LM head from the start, not from the first checkpoint.
        write_shared()
    term = Terminator(opts.term_grace_s, lambda: save(boundary["step"]))
    unblock_alarm()                  # every thread of the run exists now
    losses: list[float | None] = []
    loss_buf = torch.zeros((), dtype=torch.float32, device=device)
    loss_send: Any = None     # the last stage's previous loss isend (rank 0 receives it after its step)
    tokens_per_step = t.data.batch_size * D   # sequences; times T below
    for step in range(start, t.steps):
        if term.requested.is_set():
            _exit_terminated(term, save, boundary["step"], metrics, publisher)
        t0 = time.monotonic()
        instr.enabled = opts.instrument and instrumented_step(step, opts.instrument_interleave)
        inputs, targets = loader.batch(step)
        try:
            t_pipe = time.monotonic_ns()
            out = executor.run(step, inputs, targets)
            pipeline_ns = time.monotonic_ns() - t_pipe
        except Exception:
            # A peer that saw SIGTERM first has left mid-step and gloo reports the closed
            # connection: save the last completed step like everyone else and go. Our own SIGTERM
            # is normally on its way (pods are stopped together), so give it a moment.
            if term.requested.wait(timeout=min(5.0, opts.term_grace_s / 4)):
                _exit_terminated(term, save, boundary["step"], metrics, publisher)
            raise
        with term.state_lock:
            opt.step()
            opt.zero_grad(set_to_none=True)
            boundary["step"], boundary["rng"] = step + 1, rng_state()
        loss = out.loss
        if P > 1 and replica == 0 and last:
            # Non-blocking: a blocking send would wait for rank 0 to finish its step, and that
            # wait (the last stage's cool-down idle time) would vanish from its Bubble windows.
            if loss_send is not None:
                loss_send.wait()          # long done: rank 0 received it at the end of the last step
            loss_buf.fill_(loss)
            loss_send = dist.isend(loss_buf, 0, tag=_LOSS_TAG)
        elif P > 1 and rank.rank == 0:
            dist.recv(loss_buf, P - 1, tag=_LOSS_TAG)
            loss = float(loss_buf)
        losses.append(loss)
        dt = time.monotonic() - t0
        metrics.step(step=step, loss=loss, step_time_s=dt, tokens=tokens_per_step * inputs.size(1),
                     extra={"stage": stage, "replica": replica, "seq_len": inputs.size(1),
                            "forward_ms": sum(out.forward_ns) / 1e6, "backward_ms": sum(out.backward_ns) / 1e6,
                            "pipeline_ms": pipeline_ns / 1e6, "instrumented": instr.enabled},
                     final=step + 1 == t.steps)
        if (step + 1) % t.checkpoint.every_steps == 0 or step + 1 == t.steps:
            with term.state_lock:
                save(step + 1)
    if loss_send is not None:
        loss_send.wait()
    if term.requested.is_set():
        _exit_terminated(term, save, boundary["step"], metrics, publisher)
    executor.close()
    if publisher is not None:
        publisher.close()
    instr.close()
    metrics.close()
    if producer is not None:
        producer.close()
    if rank.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return losses


def instrumented_step(step: int, interleave: int) -> bool:
    """Whether `step` is instrumented when steps are interleaved in blocks of `interleave` (0: all):
    blocks on, off, off, on, then again, so a load drifting linearly over 4 blocks cancels out."""
    return interleave <= 0 or (step // interleave) % 4 in (0, 3)


def _agreed_resume_step(ckpt: CheckpointManager, rank: RankInfo, device: torch.device) -> int:
    """The newest step every rank has a checkpoint of (0: start fresh)."""
    latest = ckpt.latest() or 0
    if rank.world == 1:
        return latest
    buf = torch.tensor([latest], dtype=torch.int64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MIN)
    return int(buf.item())


def _exit_terminated(term: Terminator, save: Any, step: int, metrics: MetricsWriter, publisher: Any) -> None:
    with term.state_lock:
        if step > 0:
            save(step)
        term.done.set()
    print(f"[spectrain-target] SIGTERM: saved step {step}; exiting", file=sys.stderr, flush=True)
    metrics.close()
    os._exit(EXIT_TERMINATED)
