"""The target's Pretrain loop: data parallel x pipeline parallel, publishing its idle windows.

Rank layout: global rank r is stage `r % pipeline` of replica `r // pipeline` (pipeline
neighbours are adjacent ranks, so a node's local ranks hold consecutive stages). Every stage
builds `target.build_stage(k, P)` (target_model.py: a preset's `Transformer.stage` with the seeded
init, or a Hugging Face model's `HFStage` with its checkpoint's weights), so the pipelined model is
the single-process model cut into slices. Under Interleaved1F1B stage k builds v chunks, the virtual
stages `build_stage(c * P + k, P * v)` for c < v (each its own DDP; one optimizer and
one checkpoint per rank over all of them, as an `nn.ModuleList`). Gradient accumulation over
microbatches, one optimizer step per step; DDP (gloo on CPU, nccl on CUDA) averages gradients
across replicas per stage.

Per step: `StageExecutor.run` (pipeline.py), optimizer step, the loss travels from the last stage
of replica 0 to rank 0 (progress), metrics, and every `checkpoint.everySteps` a checkpoint plus
the shared embedding / LM head files. Checkpoint step N means "N steps done"; a resumed run
continues with step N and reproduces the uninterrupted run bitwise on CPU.

An HF target with tied embeddings split across stages keeps its two copies (first stage's embedding,
last stage's head) equal by summing their gradients over a [first, last] group before each
optimizer step; at the end its stages write the trained model in Hugging Face's layout (hf.save).

Setup, checkpoints, metrics, the ring and SIGTERM are the shared runtime's (spectrain_workloads.runtime);
the windows and their predictions, the DDP comm hook and the data publisher are harvest/'s, the
components the hooks API drives in a user's trainer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spectrain_workloads.checkpoint import rng_state, set_rng_state
from spectrain_workloads.config import JobConfig
from spectrain_workloads.contract import require_valid
from spectrain_workloads.data import LoaderSpec, TokenLoader, resolve_source
from spectrain_workloads.errors import ConfigError
from spectrain_workloads.harvest.comm_hook import make_comm_hook
from spectrain_workloads.harvest.imbalance_watch import block_alarm_in_new_threads, unblock_alarm
from spectrain_workloads.harvest.instrument import Instrument, InstrumentOptions, instrumented_step
from spectrain_workloads.harvest.schedule import Schedule
from spectrain_workloads.model import ModelConfig
from spectrain_workloads.runtime import RankInfo, Runtime, TargetOptions
from spectrain_workloads.target.pipeline import StageExecutor
from spectrain_workloads.target_model import TargetModel, resolve_target

_LOSS_TAG = 1 << 20


@dataclass(kw_only=True, frozen=True)
class TrainingLayout:
    """How this job's ranks and model are arranged."""

    model: ModelConfig
    target: TargetModel
    schedule: Schedule
    data: int
    pipeline: int


def make_layout(cfg: JobConfig, world: int) -> TrainingLayout:
    """The layout of a Pretrain run on `world` ranks; ConfigError naming the field on bad input
    (every rule of `contract.check_spec`, the actual WORLD_SIZE, the data source's existence)."""
    require_valid(cfg)
    t, par = cfg.target, cfg.target.parallelism
    if par.data * par.pipeline != world:
        raise ConfigError(
            f"spec.target.parallelism: data ({par.data}) x pipeline ({par.pipeline}) = {par.data * par.pipeline} "
            f"but WORLD_SIZE is {world}; run nodes x procsPerNode = {cfg.world_size} ranks")
    target = resolve_target(cfg)
    schedule = Schedule(name=par.schedule, n_stages=par.pipeline, microbatches=par.microbatches)
    resolve_source(t.data.source)
    return TrainingLayout(model=target.config, target=target, schedule=schedule, data=par.data,
                          pipeline=par.pipeline)


def train(cfg: JobConfig, opts: TargetOptions, rank: RankInfo) -> list[float | None]:
    """Run (or resume) the Pretrain job on this rank; returns this rank's per-step losses."""
    plan = make_layout(cfg, rank.world)
    t = cfg.target
    P, D = plan.pipeline, plan.data
    block_alarm_in_new_threads()     # the Instrument's imbalance alarm goes to this thread only
    stage, replica = rank.rank % P, rank.rank // P
    corpus = plan.target.load_corpus(t.data.source, max_bytes=opts.data_max_bytes)
    loader = TokenLoader(corpus, LoaderSpec(seq_len=t.data.seq_len, batch_size=t.data.batch_size,
                                            data_parallel=D, replica=replica, seed=cfg.seed, skew=opts.skew))
    rt = Runtime.start(cfg, opts, rank)
    device = rt.device
    dp_group = fwd_group = bwd_group = None
    for s in range(P):   # every rank creates every group, in the same order
        g = dist.new_group([d * P + s for d in range(D)]) if D > 1 else None
        if s == stage:
            dp_group = g
    if P > 1:
        fwd_group, bwd_group = dist.new_group(list(range(rank.world))), dist.new_group(list(range(rank.world)))
    tied_group = None   # an HF target with tied embeddings split across stages: its first and last stage
    if plan.target.is_hf and plan.model.tie_embeddings and P > 1:
        for d in range(D):
            g = dist.new_group([d * P, d * P + P - 1])
            if d == replica and stage in (0, P - 1):
                tied_group = g
    fwd_wrap = bwd_wrap = None
    if P > 1 and plan.schedule.chunks > 1:   # interleaved: the ring's wrap-around link gets its own groups
        fwd_wrap, bwd_wrap = dist.new_group(list(range(rank.world))), dist.new_group(list(range(rank.world)))

    V = plan.schedule.chunks                       # model chunks per rank (Interleaved1F1B: > 1)
    chunks = [plan.target.build_stage(c * P + stage, P * V) for c in range(V)]
    module: torch.nn.Module = chunks[0] if V == 1 else torch.nn.ModuleList(chunks)
    module.to(device)
    from spectrain_workloads.optim import build_optimizer

    opt = build_optimizer(module, t.optimizer, stage=stage, n_stages=P)
    ckpt = rt.ckpt
    start = rt.resume_step()
    if start > 0:
        state = ckpt.load(start)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        loader.load_state_dict(state["loader"])
    else:
        loader.load_state_dict({"step": 0})

    last = stage == P - 1
    metrics = rt.metrics
    ring_lock = threading.Lock()
    producer = rt.ring_producer(hidden_dim=plan.model.dim, seq_len=t.data.seq_len, publishes=last)
    instr = Instrument(rank=rank.rank, stage=stage, producer=producer, sink=metrics.window_closed,
                       producer_lock=ring_lock,
                       opts=InstrumentOptions(enabled=opts.instrument,
                                              imbalance_min_ns=int(opts.imbalance_min_ms * 1e6)))
    publisher = None
    if producer is not None and last and opts.publish_fraction > 0:
        from spectrain_workloads.harvest.data_publisher import DataPublisher

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
        rt.save_shared(embedding=head.tok_embeddings.weight if head.tok_embeddings is not None else None,
                       lm_head=tail.output.weight if tail.output is not None else None,
                       model_config=plan.target.shared_config() if last else None)

    def save(step: int) -> None:
        ckpt.save(step, state_at_boundary())
        if replica == 0:
            write_shared()

    if replica == 0:
        # The drafter needs the embedding / LM head from the start, not from the first checkpoint.
        write_shared()
    term = rt.terminator(lambda: save(boundary["step"]))
    unblock_alarm()                  # every thread of the run exists now
    losses: list[float | None] = []
    loss_buf = torch.zeros((), dtype=torch.float32, device=device)
    loss_send: Any = None     # the last stage's previous loss isend (rank 0 receives it after its step)
    tokens_per_step = t.data.batch_size * D   # sequences; times T below
    for step in range(start, t.steps):
        if term.requested.is_set():
            rt.exit_terminated(term, save, boundary["step"])
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
                rt.exit_terminated(term, save, boundary["step"])
            raise
        if tied_group is not None:   # one tied matrix in two places: both take the sum of their gradients
            tied = chunks[0].tok_embeddings if stage == 0 else chunks[-1].output
            dist.all_reduce(tied.weight.grad, group=tied_group)
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
        rt.exit_terminated(term, save, boundary["step"])
    if plan.target.is_hf:
        save_hf_layout(plan, chunks, rt, stage=stage, replica=replica)
    executor.close()
    if publisher is not None:
        publisher.close()
    instr.close()
    if producer is not None:
        producer.close()
    rt.close()
    return losses


def save_hf_layout(plan: TrainingLayout, chunks: list[torch.nn.Module], rt: Runtime, *, stage: int,
                   replica: int) -> None:
    """The trained target in Hugging Face's layout at $RUN_DIR/target/hf (hf.save): replica 0's
    stages each write a shard, then rank 0 the index, config and tokenizer."""
    from spectrain_workloads.hf import save as hf_save

    out = rt.opts.run_dir / "target" / "hf"
    P, V = plan.pipeline, plan.schedule.chunks
    if replica == 0:
        for c, chunk in enumerate(chunks):
            hf_save.write_shard(out, c * P + stage, P * V, chunk.hf_state_dict())
    if dist.is_initialized():
        dist.barrier()
    if rt.rank.rank == 0:
        assert plan.target.source is not None
        dtype = next(chunks[0].parameters()).dtype
        hf_save.finish(out, plan.target.source, P * V, plan.target.tokenizer(), dtype)
