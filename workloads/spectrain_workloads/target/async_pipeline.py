"""Asynchronous pipeline training (PipeDream-1F1B with weight stashing), for spec.mode AsyncPipeline.

Stage k of P runs its forward of minibatch t on the weights it had after t - d_k updates and
applies the resulting gradient to its current weights: d_k = P - 1 - k steps of staleness (stage 0
is the stalest, the last stage is synchronous). Weight stashing keeps, per minibatch in flight, the
weight version its forward used, so its backward runs on the same version. Each minibatch is one
optimizer update (no gradient accumulation), so no bubbles exist and the ring gets no windows.

Two executions of the same maths:
- `simulate(...)`: one process, the full model, each stage's stashed versions swapped in through
  `torch.func.functional_call`; for fast experiments (bench/basis_rotation.py).
- `run(cfg)` (`AsyncPipelineLoop`, on the mode loop of loop.py: resume, checkpoints, SIGTERM,
  metrics): one process per stage (gloo on CPU, nccl on CUDA), 1F1B schedule: d_k warm-up
  forwards, then forward(t + d_k), backward(t). Activations go down, gradients (and the last
  stage's loss, for rank 0's progress) come back up.
With `max_staleness=0` both are synchronous training; `simulate` with P=1 is plain training.

Shapes: B batch, T seq_len, H model dim, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from spectrain_api.config import JobConfig, preset_model_config
from spectrain_api.errors import ConfigError
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus
from spectrain_workloads.loop import ModeLoop, StepReport
from spectrain_workloads.model import ModelConfig, Transformer
from spectrain_workloads.optim import build_optimizer
from spectrain_workloads.runtime import RankInfo, TargetOptions
from spectrain_workloads.topology import Topology

Weights = dict[str, torch.Tensor]

# ---- schedule -------------------------------------------------------------------------------


def lr_scale(step: int, total_steps: int) -> float:
    """Linear warm-up over min(100, 5% of the run), then constant."""
    warm = max(1, min(100, total_steps // 20))
    return min(1.0, (step + 1) / warm)


def set_lr(opt: torch.optim.Optimizer, scale: float) -> None:
    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
        g["lr"] = g["initial_lr"] * scale


# ---- stages ---------------------------------------------------------------------------------


def delays(n_stages: int, max_staleness: int | None = None) -> list[int]:
    """Staleness d_k = P - 1 - k of each stage (capped at max_staleness; 0: synchronous)."""
    cap = n_stages if max_staleness is None else max_staleness
    return [min(n_stages - 1 - k, cap) for k in range(n_stages)]


def stage_of(name: str, cfg: ModelConfig, n_stages: int) -> int:
    """Pipeline stage owning full-model parameter `name` (same split as Transformer.stage)."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith(("norm.", "output.")):
        return n_stages - 1
    return int(name.split(".")[1]) // (cfg.n_layers // n_stages)


def stage_named_params(model: Transformer, stage: int, n_stages: int) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if stage_of(n, model.cfg, n_stages) == stage]


def _snapshot(named: list[tuple[str, nn.Parameter]]) -> Weights:
    return {n: p.detach().clone() for n, p in named}


def _leaves(weights: Weights) -> Weights:
    """Fresh autograd leaves over the given storage (their .grad is the stage's gradient)."""
    return {n: w.detach().requires_grad_() for n, w in weights.items()}


# ---- single-process simulator ---------------------------------------------------------------


@dataclass(kw_only=True)
class SimResult:
    losses: list[float]                                 # training loss of minibatch t
    evals: list[tuple[int, float]] = field(default_factory=list)   # (updates applied, eval loss)
    seconds_per_step: float = 0.0


def simulate(
    model: Transformer,
    optimizers: list[torch.optim.Optimizer],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    *,
    max_staleness: int | None = None,
    lr_at: Callable[[int], float] = lambda t: 1.0,
    eval_fn: Callable[[Transformer], float] | None = None,
    eval_every: int = 0,
    stop_below: float | None = None,
) -> SimResult:
    """PipeDream with weight stashing on one process: optimizers[k] owns stage k's parameters.

    At step t stage k's parameters are w^k_{max(t - d_k, 0)}; the gradient of the loss at that
    composite point updates the current w^k_t. `eval_fn(model)` runs every `eval_every` updates
    on the current weights; the run stops early once it returns a value <= `stop_below`.
    """
    P = len(optimizers)
    d = delays(P, max_staleness)
    named = [stage_named_params(model, k, P) for k in range(P)]
    # stash[k][t]: stage k's weights for minibatch t, recorded d_k updates before it runs.
    stash: list[dict[int, Weights]] = [{t: _snapshot(named[k]) for t in range(d[k])} for k in range(P)]
    result = SimResult(losses=[])
    t0 = time.perf_counter()
    for t in range(steps):
        weights: Weights = {}
        for k in range(P):
            src = stash[k].pop(t) if d[k] else {n: p.detach() for n, p in named[k]}
            weights.update(_leaves(src))
        x, y = batch(t)                                                 # [B, T], [B, T]
        logits = functional_call(model, weights, (x,))                  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        result.losses.append(loss.item())
        for k, opt in enumerate(optimizers):
            for n, p in named[k]:
                p.grad = weights[n].grad
            if d[k]:
                stash[k][t + d[k]] = _snapshot(named[k])                # w_t serves minibatch t + d_k
            set_lr(opt, lr_at(t))
            opt.step()
            opt.zero_grad(set_to_none=True)
        if eval_fn is not None and eval_every and (t + 1) % eval_every == 0:
            with torch.no_grad():
                result.evals.append((t + 1, eval_fn(model)))
            if stop_below is not None and result.evals[-1][1] <= stop_below:
                break
    result.seconds_per_step = (time.perf_counter() - t0) / max(1, len(result.losses))
    return result


# ---- multi-process execution ----------------------------------------------------------------


@dataclass(kw_only=True)
class _InFlight:
    weights: Weights            # stashed leaves the forward ran on
    inp: torch.Tensor           # tokens [B, T] (stage 0) or received hidden [B, T, H] (leaf)
    out: torch.Tensor           # hidden [B, T, H], or the loss (last stage)


class StageRunner:
    """One stage's 1F1B loop with weight stashing. Ranks are stages (data parallelism 1)."""

    def __init__(self, *, module: Transformer, opt: torch.optim.Optimizer, stage: int, n_stages: int,
                 delay: int, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], total_steps: int,
                 device: torch.device, hidden_shape: tuple[int, int, int]) -> None:
        self.m, self.opt, self.k, self.P, self.d = module, opt, stage, n_stages, delay
        self.batch, self.total_steps, self.device, self.hidden_shape = batch, total_steps, device, hidden_shape
        self.named = list(module.named_parameters())
        # stash[t]: the weights minibatch t will run on (w_{t-d}), recorded right after update t-d.
        self.stash: dict[int, Weights] = {t: _snapshot(self.named) for t in range(delay + 1)} if delay else {}
        self.in_flight: dict[int, _InFlight] = {}
        self._pending: list[tuple[int, Any, torch.Tensor]] = []   # (minibatch, work, buffer) of isends
        self.on_hidden: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def first(self) -> bool:
        return self.k == 0

    @property
    def last(self) -> bool:
        return self.k == self.P - 1

    def _send(self, t: int, tensor: torch.Tensor, dst: int) -> None:
        buf = tensor.detach().contiguous()
        self._pending.append((t, dist.isend(buf, dst), buf))

    def _reap(self, upto: int) -> None:
        """Wait for sends of minibatches <= upto: their receivers have provably posted the recv."""
        keep = []
        for t, work, buf in self._pending:
            if t <= upto:
                work.wait()
            else:
                keep.append((t, work, buf))
        self._pending = keep

    def forward(self, t: int) -> None:
        # d = 0: forward and backward of t are adjacent, the live storage can serve as the stash.
        weights = _leaves(self.stash.pop(t) if self.d else {n: p.detach() for n, p in self.named})
        x, y = (v.to(self.device) for v in self.batch(t))
        if self.first:
            inp = x                                                         # [B, T]
        else:
            inp = torch.empty(self.hidden_shape, device=self.device)
            dist.recv(inp, self.k - 1)
            inp.requires_grad_()                                            # [B, T, H]
        if self.last:
            logits, hidden = functional_call(self.m, weights, (inp,), {"return_hidden": True})
            out = F.cross_entropy(logits.flatten(0, 1), y.flatten())         # loss []
            if self.on_hidden is not None:
                self.on_hidden(t, hidden[0].detach(), x[0])
        else:
            out = functional_call(self.m, weights, (inp,))                   # [B, T, H]
            self._send(t, out, self.k + 1)
        self.in_flight[t] = _InFlight(weights=weights, inp=inp, out=out)

    def backward(self, t: int) -> float:
        """Backward of minibatch t on its stashed weights, then update t+1 of the live weights."""
        f = self.in_flight.pop(t)
        loss = torch.zeros(1, device=self.device)
        if self.last:
            f.out.backward()
            loss[0] = f.out.detach()
        else:
            grad = torch.empty(self.hidden_shape, device=self.device)
            dist.recv(grad, self.k + 1)
            dist.recv(loss, self.k + 1)
            f.out.backward(grad)
        if not self.first:
            self._send(t, f.inp.grad, self.k - 1)
            self._send(t, loss, self.k - 1)
        self._reap(t - 2)
        for n, p in self.named:
            p.grad = f.weights[n].grad
        set_lr(self.opt, lr_scale(t, self.total_steps))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.d:
            self.stash[t + 1 + self.d] = _snapshot(self.named)              # w_{t+1} serves t+1+d
        return float(loss[0])

    def step(self, t: int, start: int, end: int) -> float:
        """Minibatch t of start..end-1 (1F1B): at t = start the d warm-up forwards, then
        forward(t + d), backward(t); after the last one, the outstanding sends. -> its loss."""
        if t == start:
            for w in range(start, min(start + self.d, end)):
                self.forward(w)
        if t + self.d < end:
            self.forward(t + self.d)
        loss = self.backward(t)
        if t + 1 == end:
            self._reap(end)
        return loss

    def versions(self) -> dict[int, Weights]:
        """Weights of every minibatch not yet applied, forwarded or not (saved in checkpoints)."""
        out = {t: {n: w.detach().clone() for n, w in f.weights.items()} for t, f in self.in_flight.items()}
        return {**out, **self.stash} if self.d else {}


# ---- entry point ----------------------------------------------------------------------------


def run(cfg: JobConfig, *, max_staleness: int | None = None) -> dict[str, Any]:
    """Train this rank's stage (env: docs/contracts.md). Resumes from the newest checkpoint step
    every rank holds; SIGTERM saves at the next step boundary. Returns a small summary."""
    loop = AsyncPipelineLoop(cfg, max_staleness=max_staleness)
    losses = loop.train()
    return {"rank": loop.rank.rank, "stage": loop.rank.rank, "start_step": loop.start_step,
            "steps": cfg.target.steps, "loss": losses[-1] if losses else float("nan")}


class AsyncPipelineLoop(ModeLoop):
    """spec.mode AsyncPipeline on one rank: stage k = rank of P = WORLD_SIZE."""

    # A step in flight spans several weight versions: the Terminator's thread cannot save one, so
    # saves happen only at step boundaries.
    saves_mid_step = False

    def __init__(self, cfg: JobConfig, opts: TargetOptions | None = None, rank: RankInfo | None = None, *,
                 max_staleness: int | None = None) -> None:
        super().__init__(cfg, opts, rank)
        self.max_staleness = max_staleness
        self.completed = 0

    def build(self) -> None:
        cfg, device, P, k = self.cfg, self.rt.device, self.rank.world, self.rank.rank
        Topology(data=1, pipeline=cfg.target.parallelism.pipeline).check(P, world_size_hint=cfg.world_size)
        self.mcfg = preset_model_config(cfg.target.model)
        data = cfg.target.data
        self.module = Transformer.stage(self.mcfg, k, P).to(device)
        self.module.init_weights(cfg.seed)
        self.opt = build_optimizer(self.module, cfg.target.optimizer, stage=k, n_stages=P)
        corpus = load_corpus(data.source, max_bytes=self.opts.data_max_bytes)
        loader = TokenLoader(corpus, LoaderSpec(seq_len=data.seq_len, batch_size=data.batch_size, seed=cfg.seed))
        self.runner = StageRunner(
            module=self.module, opt=self.opt, stage=k, n_stages=P, delay=delays(P, self.max_staleness)[k],
            batch=loader.batch, total_steps=cfg.target.steps, device=device,
            hidden_shape=(data.batch_size, data.seq_len, self.mcfg.dim))

    def load_state(self, state: dict[str, Any]) -> None:
        runner = self.runner
        if state["n_stages"] != runner.P:
            raise ConfigError(f"{self.rt.ckpt.path(state['step'])}: the checkpoint has {state['n_stages']} pipeline "
                              f"stages, the job {runner.P}; use a new run directory or the old "
                              "spec.target.parallelism.pipeline")
        runner.m.load_state_dict(state["model"])
        runner.opt.load_state_dict(state["optimizer"])
        runner.stash = {t: {n: w.to(self.rt.device) for n, w in ws.items()} for t, ws in state["versions"].items()}
        self.completed = int(state["step"])

    def begin(self) -> None:
        self.producer = self.rt.ring_producer(hidden_dim=self.mcfg.dim, seq_len=self.cfg.target.data.seq_len,
                                              publishes=self.runner.last)
        if self.producer is not None and self.runner.last:
            self.runner.on_hidden = _publisher(self.producer, self.runner.k)
        self._t_last = time.perf_counter()

    def state(self) -> dict[str, Any]:
        return {"step": self.completed, "stage": self.runner.k, "n_stages": self.runner.P,
                "model": self.module.state_dict(), "optimizer": self.opt.state_dict(),
                "versions": self.runner.versions()}

    def boundary_step(self) -> int:
        return self.completed

    def write_shared(self) -> None:
        m, r = self.module, self.runner
        self.rt.save_shared(embedding=m.tok_embeddings.weight if r.first and m.tok_embeddings is not None else None,
                            lm_head=m.output.weight if r.last and m.output is not None else None,
                            model_config=self.mcfg.to_dict() if r.last else None)

    def train_step(self, step: int) -> StepReport:
        loss = self.runner.step(step, self.start_step, self.cfg.target.steps)
        self.completed = step + 1
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        data = self.cfg.target.data
        return StepReport(loss=loss, step_time_s=dt, tokens=data.batch_size * data.seq_len,
                          extra={"stage": self.runner.k, "staleness": self.runner.d})


def _publisher(producer: Any, stage: int) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    """The last stage's data channel: one sequence per step (hidden [T, H], tokens [T])."""

    def publish(step: int, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        meta = {"step": step, "dtype": str(hidden.dtype).removeprefix("torch."), "stage": stage, "seq_index": 0}
        producer.publish_data(meta, {"hidden": hidden.float().cpu().numpy(), "tokens": tokens.cpu().numpy()})

    return publish
