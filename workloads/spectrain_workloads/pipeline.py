"""Executes one stage's action list (schedule.py) over isend/irecv, with DDP across replicas.

Per step, stage s of p with m microbatches of shape [b, T] (b = batch / m):
- F(i): stage 0 embeds tokens [b, T]; others wait for the activation [b, T, H] from s-1. The
  output [b, T, H] goes to s+1 (isend); the last stage computes logits [b, T, V], the loss
  CE / m (so the accumulated gradient is the batch mean) and hands the final-norm hidden
  [b, T, H] to `on_hidden` (drafter data channel).
- B(i): the last stage back-propagates its loss; others wait for d out [b, T, H] from s+1. The
  input gradient [b, T, H] goes to s-1.
- BUBBLE(k): a scheduled idle slot: opened (with its prediction) before the wait that ends it.

Activations and gradients travel on two process groups (forward, backward) so that on NCCL the two
directions get separate communicators and a pre-posted receive in one direction never blocks a
send in the other. All receives of a step are posted at its start (gloo matches by tag = mb).

DDP (data parallel across replicas of the same stage): forwards run under DDP with
require_backward_grad_sync off (like `no_sync()`); right before the step's last backward the
reducer is armed with `prepare_for_backward([])`, which is exactly what DDP's own forward does
when sync is on. That is needed because in 1F1B the last forward is not followed by the last
backward, so `no_sync()` around forwards cannot express it. The comm hook is the default
all-reduce's maths (divide by world, sum) plus Communication windows per bucket; it is installed
whether or not instrumentation is on, so losses are bitwise equal either way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spectrain_workloads.instrument import Instrument
from spectrain_workloads.schedule import Op, Schedule


def make_comm_hook(instrument: Instrument) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """DDP comm hook: bucket all-reduce (mean) with a Communication window per bucket."""

    # No annotations on purpose: DDP checks them against the real classes, and this module's
    # `from __future__ import annotations` turns them into strings.
    def hook(group, bucket):  # type: ignore[no-untyped-def]
        buf = bucket.buffer()                       # flat [n] view of this bucket's gradients
        world = dist.get_world_size(group)
        buf.div_(world)                             # same maths as torch's allreduce_hook
        # anchor "dp": a bucket's all-reduce ends when the slowest replica launches it, so its end is
        # predicted relative to this step's first bucket launch (instrument.py), not from bandwidth
        w = instrument.comm_open(f"dp-bucket-{bucket.index()}", buf.numel() * buf.element_size(), anchor="dp")
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            instrument.comm_close(w)                # runs on completion (gloo's worker thread)
            return f.value()[0]

        return fut.then(done)

    return hook


class SendTracker:
    """Keeps isend works (and their tensors) alive until complete. With instrumentation, a thread
    waits on them in order and closes their Communication windows at completion (gloo's send
    works expose no future and report completion only through wait())."""

    def __init__(self, instrument: Instrument) -> None:
        self.instrument = instrument
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._q: queue.Queue[Any] | None = None
        self._inflight = 0
        self._cv = threading.Condition()
        if instrument.enabled:
            self._q = queue.Queue()
            threading.Thread(target=self._loop, name="spectrain-send-waiter", daemon=True).start()

    def send(self, tensor: torch.Tensor, dst: int, group: Any, tag: int, channel: str) -> None:
        if self._q is None:
            self._pending.append((dist.isend(tensor, dst, group=group, tag=tag), tensor))
            return
        w = self.instrument.comm_open(channel, tensor.numel() * tensor.element_size(), pos=tag)
        work = dist.isend(tensor, dst, group=group, tag=tag)
        with self._cv:
            self._inflight += 1
        self._q.put((work, tensor, w))

    def _loop(self) -> None:
        assert self._q is not None
        while True:
            item = self._q.get()
            if item is None:
                return
            work, _tensor, w = item
            work.wait()
            self.instrument.comm_close(w)
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()

    def drain(self) -> None:
        """Block until every send issued so far has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        with self._cv:
            while self._inflight:
                self._cv.wait()

    def close(self) -> None:
        self.drain()
        if self._q is not None:
            self._q.put(None)


@dataclass
class StepOutput:
    loss: float | None                       # mean loss of the batch (last stage only)
    forward_ns: list[int] = field(default_factory=list)
    backward_ns: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class StageExecutor:
    module: nn.Module                        # the stage (a Transformer slice), possibly DDP-wrapped
    schedule: Schedule
    stage: int
    instrument: Instrument
    prev_rank: int | None = None             # global ranks of the neighbouring stages
    next_rank: int | None = None
    fwd_group: Any = None
    bwd_group: Any = None
    dim: int = 0
    act_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    on_hidden: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None  # (step, mb, hidden, tokens)

    def __post_init__(self) -> None:
        self.ddp = self.module if isinstance(self.module, nn.parallel.DistributedDataParallel) else None
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = False
        self.first = self.stage == 0
        self.last = self.stage == self.schedule.n_stages - 1
        self.actions = self.schedule.stage_actions(self.stage)
        self.sends = SendTracker(self.instrument)
        self._steps_run = 0

    def _bubble_predictions(self) -> list[float]:
        ema = self.instrument.compute_ema_ns
        n = sum(1 for a in self.actions if a.op is Op.BUBBLE)
        if ema is None:
            return [0.0] * n                  # unknown until this stage has measured F and B
        return self.schedule.bubble_predictions(self.stage, ema[0], ema[1], first_step=self._steps_run == 0)

    def _wait_recv(self, work: Any, nbytes: int, channel: str, bubble: Any, mb: int) -> None:
        instr = self.instrument
        if bubble is not None:
            work.wait()
            instr.bubble_close(bubble)
            return
        if not instr.enabled:
            work.wait()
            return
        w = instr.comm_open(channel, nbytes, pos=mb)
        instr.sync_begin()
        work.wait()
        instr.sync_end()
        instr.comm_close(w)

    def run(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        """One training step's forwards and backwards (gradients accumulate; no optimizer step).

        inputs, targets: [B, T] int64 token ids of this replica's batch.
        """
        m = self.schedule.microbatches
        B, T = inputs.shape
        b = B // m
        instr = self.instrument
        instr.step = step
        act_shape = (b, T, self.dim)
        act_bytes = b * T * self.dim * torch.empty((), dtype=self.act_dtype).element_size()
        recv_act: list[tuple[torch.Tensor, Any]] = []
        recv_grad: list[tuple[torch.Tensor, Any]] = []
        if not self.first:
            for i in range(m):
                buf = torch.empty(act_shape, dtype=self.act_dtype, device=self.device)
                recv_act.append((buf, dist.irecv(buf, self.prev_rank, group=self.fwd_group, tag=i)))
        if not self.last:
            for i in range(m):
                buf = torch.empty(act_shape, dtype=self.act_dtype, device=self.device)
                recv_grad.append((buf, dist.irecv(buf, self.next_rank, group=self.bwd_group, tag=i)))
        preds = self._bubble_predictions()
        ins: dict[int, torch.Tensor] = {}
        outs: dict[int, torch.Tensor] = {}
        out = StepOutput(loss=0.0 if self.last else None)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        last_b = self.schedule.last_backward(self.stage)
        bubble = None
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        for a in self.actions:
            if a.op is Op.BUBBLE:
                bubble = instr.bubble_open(preds[a.slot], a.slot, learn=self._steps_run > 0 or a.slot > 0)
                continue
            i = a.mb
            if a.op is Op.F:
                if self.first:
                    x = inputs[i * b:(i + 1) * b]
                else:
                    x, work = recv_act[i]
                    self._wait_recv(work, act_bytes, "pp-recv-act", bubble, i)
                    x.requires_grad_(True)
                bubble = None
                t0 = time.monotonic_ns()
                if self.last:
                    logits, hidden = self.module(x, return_hidden=True)          # [b, T, V], [b, T, H]
                    y = targets[i * b:(i + 1) * b]
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)) / m
                    outs[i] = loss
                    loss_sum += loss.detach()
                    if self.on_hidden is not None:
                        self.on_hidden(step, i, hidden.detach(), inputs[i * b:(i + 1) * b])
                else:
                    outs[i] = self.module(x)                                      # [b, T, H]
                dt = time.monotonic_ns() - t0
                out.forward_ns.append(dt)
                instr.record_compute("F", dt)
                ins[i] = x
                if not self.last:
                    self.sends.send(outs[i].detach(), self.next_rank, self.fwd_group, i, "pp-send-act")
            else:
                grad = None
                if not self.last:
                    grad, work = recv_grad[i]
                    self._wait_recv(work, act_bytes, "pp-recv-grad", bubble, i)
                bubble = None
                sync = self.ddp is not None and i == last_b
                if sync:
                    self._arm_ddp_sync(outs[i])
                t0 = time.monotonic_ns()
                torch.autograd.backward(outs[i], grad_tensors=grad)
                if sync:
                    instr.sync_end()   # DDP finalize waited for the buckets inside backward()
                dt = time.monotonic_ns() - t0
                out.backward_ns.append(dt)
                instr.record_compute("B", dt)
                x = ins.pop(i)
                del outs[i]
                if not self.first:
                    assert x.grad is not None
                    self.sends.send(x.grad, self.prev_rank, self.bwd_group, i, "pp-send-grad")
        self.sends.drain()
        self._steps_run += 1
        if self.last:
            out.loss = float(loss_sum)
        return out

    def _arm_ddp_sync(self, root: torch.Tensor) -> None:
        """Make the coming backward all-reduce the accumulated gradients, and mark its sync point."""
        assert self.ddp is not None
        self.ddp.reducer.prepare_for_backward([])
        if not self.instrument.enabled:
            return
        instr = self.instrument
        engine = torch.autograd.Variable._execution_engine

        def at_root(grad: torch.Tensor) -> None:
            # Queued first, so it runs after this rank's local backward and before DDP's
            # finalize (queued later, when the last bucket is launched) blocks on the buckets.
            engine.queue_callback(instr.sync_begin)

        root.register_hook(at_root)

    def close(self) -> None:
        self.sends.close()
