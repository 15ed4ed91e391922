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

Per step (`PretrainLoop.train_step`): `StageExecutor.run` (pipeline.py), optimizer step, the loss
travels from the last stage of replica 0 to rank 0 (progress). Metrics, checkpoints every
`checkpoint.everySteps` (plus the shared embedding / LM head files), resume and SIGTERM are the
mode loop's (loop.py); the process groups are topology.py's. Checkpoint step N means "N steps done"; a resumed run
continues with step N and reproduces the uninterrupted run bitwise on CPU.

An HF target with tied embeddings split across stages keeps its two copies (first stage's embedding,
last stage's head) equal by summing their gradients over a [first, last] group before each
optimizer step; at the end its stages write the trained model in Hugging Face's layout (hf.save).

Setup, checkpoints, metrics and the ring are the shared runtime's (spectrain_workloads.runtime);
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

from spectrain_api import rundir
from spectrain_api.config import JobConfig
from spectrain_api.eagle3 import feature_layers, resolve_draft_vocab_size
from spectrain_api.names import EAGLE3
from spectrain_api.rules import require_valid
from spectrain_workloads.checkpoint import rng_state, set_rng_state
from spectrain_workloads.data import LoaderSpec, TokenLoader, resolve_source
from spectrain_workloads.harvest.comm_hook import make_comm_hook
from spectrain_workloads.harvest.imbalance_watch import block_alarm_in_new_threads, unblock_alarm
from spectrain_workloads.harvest.instrument import Instrument, InstrumentOptions, instrumented_step
from spectrain_workloads.harvest.schedule import Schedule
from spectrain_workloads.loop import ModeLoop, StepReport
from spectrain_workloads.model import ModelConfig
from spectrain_workloads.runtime import RankInfo, Runtime, TargetOptions
from spectrain_workloads.target.pipeline import StageExecutor
from spectrain_workloads.target_model import TargetModel, resolve_target
from spectrain_workloads.topology import Topology

_LOSS_TAG = 1 << 20
COUNT_STEPS = 32     # batches whose tokens choose an EAGLE-3 drafter's draft vocabulary


@dataclass(kw_only=True, frozen=True)
class TrainingLayout:
    """How this job's ranks and model are arranged."""

    model: ModelConfig
    target: TargetModel
    schedule: Schedule
    data: int
    pipeline: int

    @property
    def topology(self) -> Topology:
        return Topology(data=self.data, pipeline=self.pipeline, chunks=self.schedule.chunks)


def make_layout(cfg: JobConfig, world: int) -> TrainingLayout:
    """The layout of a Pretrain run on `world` ranks; ConfigError naming the field on bad input
    (every rule of `rules.check_spec`, the actual WORLD_SIZE, the data source's existence)."""
    require_valid(cfg)
    t, par = cfg.target, cfg.target.parallelism
    Topology(data=par.data, pipeline=par.pipeline).check(world, world_size_hint=cfg.world_size)
    target = resolve_target(cfg)
    schedule = Schedule(name=par.schedule, n_stages=par.pipeline, microbatches=par.microbatches)
    resolve_source(t.data.source)
    return TrainingLayout(model=target.config, target=target, schedule=schedule, data=par.data,
                          pipeline=par.pipeline)


def train(cfg: JobConfig, opts: TargetOptions, rank: RankInfo) -> list[float | None]:
    """Run (or resume) the Pretrain job on this rank; returns this rank's per-step losses."""
    return PretrainLoop(cfg, opts, rank).train()


class PretrainLoop(ModeLoop):
    """spec.mode Pretrain on one rank: stage `rank % P` of replica `rank // P`."""

    metrics_step_offset = 0

    def prepare(self) -> None:
        cfg, t = self.cfg, self.cfg.target
        self.plan = plan = make_layout(cfg, self.rank.world)
        self.P, self.D = plan.pipeline, plan.data
        block_alarm_in_new_threads()     # the Instrument's imbalance alarm goes to this thread only
        self.stage, self.replica = self.rank.rank % self.P, self.rank.rank // self.P
        corpus = plan.target.load_corpus(t.data.source, max_bytes=self.opts.data_max_bytes)
        self.loader = TokenLoader(corpus, LoaderSpec(seq_len=t.data.seq_len, batch_size=t.data.batch_size,
                                                     data_parallel=self.D, replica=self.replica, seed=cfg.seed,
                                                     skew=self.opts.skew))

    def build(self) -> None:
        from spectrain_workloads.optim import build_optimizer

        plan, P, stage = self.plan, self.P, self.stage
        self.groups = plan.topology.build_groups(self.rank, tied=plan.target.is_hf and plan.model.tie_embeddings)
        V = plan.schedule.chunks                       # model chunks per rank (Interleaved1F1B: > 1)
        self.chunks = [plan.target.build_stage(c * P + stage, P * V) for c in range(V)]
        self.module: torch.nn.Module = self.chunks[0] if V == 1 else torch.nn.ModuleList(self.chunks)
        self.module.to(self.rt.device)
        self.opt = build_optimizer(self.module, self.cfg.target.optimizer, stage=stage, n_stages=P)
        self.last = stage == P - 1
        self._build_harvest()
        self.executor = self._build_executor()
        self.boundary: dict[str, Any] = {"step": 0, "rng": rng_state()}
        self.loss_buf = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        self.loss_send: Any = None     # the last stage's previous loss isend (rank 0 receives it after its step)
        self._counts_written = False

    def _build_harvest(self) -> None:
        """The ring, the Instrument (windows) and the data publisher: on the last stage, and for an
        EAGLE-3 drafter on every stage holding one of its feature layers (harvest.feature_tap)."""
        opts, t = self.opts, self.cfg.target
        ring_lock = threading.Lock()
        tap = None
        if self.cfg.drafter.enabled and self.cfg.drafter.arch == EAGLE3 and opts.publish_fraction > 0:
            from spectrain_workloads.harvest.feature_tap import FeatureTap

            tap = FeatureTap(self.chunks, feature_layers(self.cfg.drafter, self.plan.model.n_layers))
        held = len(tap.held) if tap is not None else 0
        self.producer = self.rt.ring_producer(hidden_dim=self.plan.model.dim, seq_len=t.data.seq_len,
                                              publishes=self.last or held > 0, width=int(self.last) + held)
        self.instr = Instrument(rank=self.rank.rank, stage=self.stage, producer=self.producer,
                                sink=self.rt.metrics.window_closed, producer_lock=ring_lock,
                                opts=InstrumentOptions(enabled=opts.instrument,
                                                       imbalance_min_ns=int(opts.imbalance_min_ms * 1e6)))
        self.publisher = None
        if self.producer is not None and (self.last or held) and opts.publish_fraction > 0:
            from spectrain_workloads.harvest.data_publisher import DataPublisher

            self.publisher = DataPublisher(self.producer, fraction=opts.publish_fraction, stage=self.stage,
                                           lock=ring_lock, tap=tap)
        elif tap is not None:
            tap.remove()

    def _build_executor(self) -> StageExecutor:
        """DDP around each chunk (when D > 1), then the stage's schedule executor."""
        g, device, V, P, stage = self.groups, self.rt.device, len(self.chunks), self.P, self.stage
        stage_mods: list[torch.nn.Module] = list(self.chunks)
        if g.dp is not None:
            for c, chunk in enumerate(self.chunks):
                ddp = torch.nn.parallel.DistributedDataParallel(
                    chunk, process_group=g.dp, forward_sync_buffers=False, bucket_cap_mb=self.opts.bucket_cap_mb,
                    device_ids=[device.index] if device.type == "cuda" else None)
                ddp.register_comm_hook(g.dp, make_comm_hook(self.instr, "dp-bucket-" if V == 1 else f"dp-bucket-c{c}-"))
                stage_mods[c] = ddp
        r = self.rank.rank
        if V == 1:
            prev_rank, next_rank = (r - 1 if stage > 0 else None), (r + 1 if not self.last else None)
        else:   # neighbours in the ring of this replica's stages: chunks go round it
            prev_rank, next_rank = self.replica * P + (stage - 1) % P, self.replica * P + (stage + 1) % P
        return StageExecutor(
            module=stage_mods[0] if V == 1 else stage_mods, schedule=self.plan.schedule, stage=stage,
            instrument=self.instr, prev_rank=prev_rank, next_rank=next_rank,
            fwd_group=g.fwd, bwd_group=g.bwd, fwd_wrap_group=g.fwd_wrap, bwd_wrap_group=g.bwd_wrap,
            dim=self.plan.model.dim, device=device,
            on_hidden=self.publisher.submit if self.publisher is not None else None)

    def fresh_start(self) -> None:
        self.loader.load_state_dict({"step": 0})

    def load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        self.loader.load_state_dict(state["loader"])
        self.boundary = {"step": int(state["step"]), "rng": rng_state()}

    def state(self) -> dict[str, Any]:
        b = self.boundary
        return {"step": b["step"], "model": self.module.state_dict(), "optimizer": self.opt.state_dict(),
                "rng": b["rng"], "loader": {"step": b["step"]}, "rank": self.rank.rank,
                "stage": self.stage, "replica": self.replica}

    def boundary_step(self) -> int:
        return int(self.boundary["step"])

    def write_shared(self) -> None:
        if self.replica != 0:
            return
        head, tail = self.chunks[0], self.chunks[-1]    # embedding: virtual stage 0; LM head: the last one
        counts, d, V = None, self.cfg.drafter, self.plan.model.vocab_size
        if self.last and not self._counts_written and d.enabled and d.arch == EAGLE3 \
                and resolve_draft_vocab_size(d.draft_vocab_size, V) < V:
            counts = self._token_counts()       # an EAGLE-3 draft vocabulary smaller than the target's
            self._counts_written = True
        self.rt.save_shared(embedding=head.tok_embeddings.weight if head.tok_embeddings is not None else None,
                            lm_head=tail.output.weight if tail.output is not None else None,
                            model_config=self.plan.target.shared_config() if self.last else None,
                            token_counts=counts)

    def _token_counts(self) -> torch.Tensor:
        """[V] int64: token frequencies over the first COUNT_STEPS batches of this replica's data,
        from which an EAGLE-3 drafter picks its draft vocabulary (reads the loader, no forward)."""
        V = self.plan.model.vocab_size
        counts = torch.zeros(V, dtype=torch.int64)
        for step in range(COUNT_STEPS):
            inputs, _ = self.loader.batch(step)
            counts += torch.bincount(inputs.flatten(), minlength=V)[:V]
        return counts

    def begin(self) -> None:
        self.write_shared()       # the drafter needs the embedding / LM head from the start
        unblock_alarm()           # every thread of the run exists now

    def train_step(self, step: int) -> StepReport:
        t, opts = self.cfg.target, self.opts
        t0 = time.monotonic()
        self.instr.enabled = opts.instrument and instrumented_step(step, opts.instrument_interleave)
        inputs, targets = self.loader.batch(step)
        try:
            t_pipe = time.monotonic_ns()
            out = self.executor.run(step, inputs, targets)
            pipeline_ns = time.monotonic_ns() - t_pipe
        except Exception:
            # A peer that saw SIGTERM first has left mid-step and gloo reports the closed
            # connection: save the last completed step like everyone else and go. Our own SIGTERM
            # is normally on its way (pods are stopped together), so give it a moment.
            if self.term.requested.wait(timeout=min(5.0, opts.term_grace_s / 4)):
                self.exit_terminated(self.boundary_step())
            raise
        if self.groups.tied is not None:   # one tied matrix in two places: both take the sum of their gradients
            tied = self.chunks[0].tok_embeddings if self.stage == 0 else self.chunks[-1].output
            dist.all_reduce(tied.weight.grad, group=self.groups.tied)
        with self.term.state_lock:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.boundary["step"], self.boundary["rng"] = step + 1, rng_state()
        loss = self._gather_loss(out.loss)
        extra = {"stage": self.stage, "replica": self.replica, "seq_len": inputs.size(1),
                 "forward_ms": sum(out.forward_ns) / 1e6, "backward_ms": sum(out.backward_ns) / 1e6,
                 "pipeline_ms": pipeline_ns / 1e6, "instrumented": self.instr.enabled}
        return StepReport(loss=loss, step_time_s=time.monotonic() - t0,
                          tokens=t.data.batch_size * self.D * inputs.size(1), extra=extra)

    def _gather_loss(self, loss: float | None) -> float | None:
        """The step's loss travels from the last stage of replica 0 to rank 0 (progress)."""
        if self.P > 1 and self.replica == 0 and self.last:
            # Non-blocking: a blocking send would wait for rank 0 to finish its step, and that
            # wait (the last stage's cool-down idle time) would vanish from its Bubble windows.
            if self.loss_send is not None:
                self.loss_send.wait()          # long done: rank 0 received it at the end of the last step
            self.loss_buf.fill_(loss)
            self.loss_send = dist.isend(self.loss_buf, 0, tag=_LOSS_TAG)
        elif self.P > 1 and self.rank.rank == 0:
            dist.recv(self.loss_buf, self.P - 1, tag=_LOSS_TAG)
            loss = float(self.loss_buf)
        return loss

    def finish(self) -> None:
        if self.loss_send is not None:
            self.loss_send.wait()
        if self.plan.target.is_hf:
            save_hf_layout(self.plan, self.chunks, self.rt, stage=self.stage, replica=self.replica)
        # Here and not in close(): draining the sends after a failure could wait on a peer that left.
        self.executor.close()
        if self.publisher is not None:
            self.publisher.close()
        self.instr.close()


def save_hf_layout(plan: TrainingLayout, chunks: list[torch.nn.Module], rt: Runtime, *, stage: int,
                   replica: int) -> None:
    """The trained target in Hugging Face's layout at $RUN_DIR/target/hf (hf.save): replica 0's
    stages each write a shard, then rank 0 the index, config and tokenizer."""
    from spectrain_workloads.hf import save as hf_save

    out = rundir.target_hf(rt.opts.run_dir)
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
