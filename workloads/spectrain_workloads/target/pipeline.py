"""Executes one stage's action list (harvest/schedule.py) over isend/irecv, with DDP across replicas.

Per step, stage s of p with m microbatches of shape [b, T] (b = batch / m):
- F(i): stage 0 embeds tokens [b, T]; others wait for the activation [b, T, H] from s-1. The
  output [b, T, H] goes to s+1 (isend); the last stage computes logits [b, T, V], the loss
  CE / m (so the accumulated gradient is the batch mean) and hands the final-norm hidden
  [b, T, H] to `on_hidden` (drafter data channel); the other stages call it with hidden None,
  for the EAGLE-3 feature layers they hold (harvest.feature_tap).
- B(i): the last stage back-propagates its loss; others wait for d out [b, T, H] from s+1. The
  input gradient [b, T, H] goes to s-1.
- BUBBLE(k): a scheduled idle slot: opened (with its prediction) before the wait that ends it.

Interleaved1F1B: the rank holds v chunks (`module` is a list, one per chunk) and every F/B names
its chunk c, virtual stage j = c * p + stage of V = p * v. Virtual stage 0 embeds, V-1 computes
the loss and feeds `on_hidden` (so does every other forward, with hidden None, for the EAGLE-3
feature taps of harvest.feature_tap); j sends to j+1, which is the next rank in the ring (the last rank
sends to rank 0's next chunk), and receives from j-1 (the previous rank in the ring). Transfers
are tagged with the *receiving* chunk and the microbatch, tag = chunk * m + mb, so every receive
of a step has its own (peer, group, tag) and gloo pairs them whatever the order (with one chunk,
tag = mb as before).

Activations and gradients travel on two process groups (forward, backward) so that on NCCL the two
directions get separate communicators and a pre-posted receive in one direction never blocks a
send in the other. All receives of a step are posted at its start (gloo matches by tag = mb),
in the order the peer sends them (NCCL matches by order). Interleaved, the wrap-around link
(last rank -> rank 0 forward, back for gradients) has two more groups: with p = 2 the ranks are
each other's next and previous, and one group would carry both directions between them.

DDP (data parallel across replicas of the same stage; one DDP per chunk): forwards run under DDP with
require_backward_grad_sync off (like `no_sync()`); right before the step's last backward the
reducer is armed with `prepare_for_backward([])`, which is exactly what DDP's own forward does
when sync is on. That is needed because in 1F1B the last forward is not followed by the last
backward, so `no_sync()` around forwards cannot express it. Each chunk's reducer is armed
before that chunk's last backward on the rank, so it all-reduces exactly the chunk's gradients
(every chunk's parameters take part in each of its backwards). The comm hook (harvest/comm_hook.py,
registered by the trainer) is the default all-reduce's maths (divide by world, sum) plus
Communication windows per bucket; it is installed whether or not instrumentation is on, so losses
are bitwise equal either way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spectrain_workloads.harvest.instrument import Instrument
from spectrain_workloads.harvest.schedule import Op, Schedule


class SendTracker:
    """Keeps isend works (and their tensors) alive until complete. With instrumentation, a thread
    waits on them in order and closes their Communication windows at completion (gloo's send
    works expose no future and report completion only through wait()). The hand-offs are C-level
    SimpleQueues, so the thread runs little Python per send; its wake-ups are the larger cost on a
    busy CPU (harvest/imbalance_watch.py says more)."""

    def __init__(self, instrument: Instrument) -> None:
        self.instrument = instrument
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._q: queue.SimpleQueue[Any] | None = None
        self._done: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._inflight = 0            # handed to the thread and not yet reported done (training thread only)
        if instrument.enabled:
            self._q = queue.SimpleQueue()
            threading.Thread(target=self._loop, name="spectrain-send-waiter", daemon=True).start()

    def send(self, tensor: torch.Tensor, dst: int, group: Any, tag: int, channel: str) -> None:
        if self._q is None or not self.instrument.enabled:
            self._pending.append((dist.isend(tensor, dst, group=group, tag=tag), tensor))
            return
        w = self.instrument.comm_open(channel, tensor.numel() * tensor.element_size(), pos=tag)
        work = dist.isend(tensor, dst, group=group, tag=tag)
        self._inflight += 1
        self._q.put((work, tensor, w))

    def _loop(self) -> None:
        assert self._q is not None
        get, close, done = self._q.get, self.instrument.comm_close, self._done.put
        while True:
            item = get()
            if item is None:
                return
            item[0].wait()
            close(item[2])
            done(None)

    def drain(self) -> None:
        """Block until every send issued so far has completed (and its window is closed)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        while self._inflight:
            self._done.get()
            self._inflight -= 1

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
    module: nn.Module | Sequence[nn.Module]  # the stage (a Transformer slice) or one per chunk, maybe DDP
    schedule: Schedule
    stage: int
    instrument: Instrument
    prev_rank: int | None = None             # global ranks of the neighbouring stages (interleaved: in the
    next_rank: int | None = None             # ring, the last stage's next is stage 0)
    fwd_group: Any = None
    bwd_group: Any = None
    fwd_wrap_group: Any = None               # interleaved: last rank -> rank 0 (activations)
    bwd_wrap_group: Any = None               # interleaved: rank 0 -> last rank (gradients)
    dim: int = 0
    act_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # (step, mb, hidden [b, T, H] on the last stage else None, tokens [b, T]) after each forward
    on_hidden: Callable[[int, int, torch.Tensor | None, torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        self.modules = list(self.module) if isinstance(self.module, Sequence) else [self.module]
        if len(self.modules) != self.schedule.chunks:
            raise ValueError(f"{self.schedule.name} runs {self.schedule.chunks} chunk(s) per rank, "
                             f"got {len(self.modules)} module(s)")
        self.ddps = [m if isinstance(m, nn.parallel.DistributedDataParallel) else None for m in self.modules]
        for ddp in self.ddps:
            if ddp is not None:
                ddp.require_backward_grad_sync = False
        self.n_virtual = self.schedule.n_stages * self.schedule.chunks
        self.first = self.stage == 0
        self.last = self.stage == self.schedule.n_stages - 1   # holds the last virtual stage (loss)
        # Groups per direction of each link: the wrap-around link of interleaving (last rank ->
        # rank 0 forward, rank 0 -> last rank backward) has its own, so that on NCCL (one stream
        # per pair and group) no pair of ranks ever has both a receive and a send on one group.
        self.act_in = self.fwd_wrap_group if self.first else self.fwd_group
        self.act_out = self.fwd_wrap_group if self.last else self.fwd_group
        self.grad_in = self.bwd_wrap_group if self.last else self.bwd_group
        self.grad_out = self.bwd_wrap_group if self.first else self.bwd_group
        self.act_tags = self._recv_tags(Op.F)
        self.grad_tags = self._recv_tags(Op.B)
        self.actions = self.schedule.stage_actions(self.stage)
        self.sends = SendTracker(self.instrument)
        self._steps_run = 0

    def _recv_tags(self, op: Op) -> list[int]:
        """Tags of this rank's activation (F) or gradient (B) receives, in the order the peer sends
        them (its action order), as NCCL matches by order; gloo matches by tag."""
        p, m = self.schedule.n_stages, self.schedule.microbatches
        peer = (self.stage - 1) % p if op is Op.F else (self.stage + 1) % p
        out = []
        for a in self.schedule.orders[peer]:
            if a.op is op:
                to = a.chunk * p + peer + (1 if op is Op.F else -1)     # the receiving virtual stage
                if 0 <= to < self.n_virtual and to % p == self.stage:
                    out.append((to // p) * m + a.mb)
        return out

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
        m, p, v = self.schedule.microbatches, self.schedule.n_stages, self.schedule.chunks
        B, T = inputs.shape
        b = B // m
        instr = self.instrument
        instr.step = step
        act_shape = (b, T, self.dim)
        act_bytes = b * T * self.dim * torch.empty((), dtype=self.act_dtype).element_size()
        vstage = [c * p + self.stage for c in range(v)]     # virtual stage of each chunk
        # Receives by tag = chunk * m + mb (chunk: this rank's, the receiving one).
        recv_act: dict[int, tuple[torch.Tensor, Any]] = {}
        recv_grad: dict[int, tuple[torch.Tensor, Any]] = {}
        for tag in self.act_tags:
            buf = torch.empty(act_shape, dtype=self.act_dtype, device=self.device)
            recv_act[tag] = (buf, dist.irecv(buf, self.prev_rank, group=self.act_in, tag=tag))
        for tag in self.grad_tags:
            buf = torch.empty(act_shape, dtype=self.act_dtype, device=self.device)
            recv_grad[tag] = (buf, dist.irecv(buf, self.next_rank, group=self.grad_in, tag=tag))
        preds = self._bubble_predictions()
        ins: dict[int, torch.Tensor] = {}      # by tag
        outs: dict[int, torch.Tensor] = {}
        out = StepOutput(loss=0.0 if self.last else None)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        last_b = self.schedule.last_backwards(self.stage)   # chunk -> microbatch of its last backward
        bubble = None
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        for a in self.actions:
            if a.op is Op.BUBBLE:
                bubble = instr.bubble_open(preds[a.slot], a.slot, learn=self._steps_run > 0 or a.slot > 0)
                continue
            i, c = a.mb, a.chunk
            j = vstage[c]
            first, last = j == 0, j == self.n_virtual - 1
            k = c * m + i                                   # this chunk's tag for microbatch i
            module = self.modules[c]
            if a.op is Op.F:
                if first:
                    x = inputs[i * b:(i + 1) * b]
                else:
                    x, work = recv_act[k]
                    self._wait_recv(work, act_bytes, "pp-recv-act", bubble, k)
                    x.requires_grad_(True)
                bubble = None
                t0 = time.monotonic_ns()
                if last:
                    logits, hidden = module(x, return_hidden=True)               # [b, T, V], [b, T, H]
                    y = targets[i * b:(i + 1) * b]
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)) / m
                    outs[k] = loss
                    loss_sum += loss.detach()
                    if self.on_hidden is not None:
                        self.on_hidden(step, i, hidden.detach(), inputs[i * b:(i + 1) * b])
                else:
                    outs[k] = module(x)                                           # [b, T, H]
                    if self.on_hidden is not None:     # a stage holding EAGLE-3 feature layers
                        self.on_hidden(step, i, None, inputs[i * b:(i + 1) * b])
                dt = time.monotonic_ns() - t0
                out.forward_ns.append(dt)
                instr.record_compute("F", dt)
                ins[k] = x
                if not last:
                    tag = ((j + 1) // p) * m + i                  # the receiving chunk's tag
                    self.sends.send(outs[k].detach(), self.next_rank, self.act_out, tag, "pp-send-act")
            else:
                grad = None
                if not last:
                    grad, work = recv_grad[k]
                    self._wait_recv(work, act_bytes, "pp-recv-grad", bubble, k)
                bubble = None
                ddp = self.ddps[c]
                sync = ddp is not None and i == last_b[c]
                if sync:
                    assert ddp is not None
                    self._arm_ddp_sync(outs[k], ddp)
                t0 = time.monotonic_ns()
                torch.autograd.backward(outs[k], grad_tensors=grad)
                if sync:
                    instr.sync_end()   # DDP finalize waited for the buckets inside backward()
                dt = time.monotonic_ns() - t0
                out.backward_ns.append(dt)
                instr.record_compute("B", dt)
                x = ins.pop(k)
                del outs[k]
                if not first:
                    assert x.grad is not None
                    tag = ((j - 1) // p) * m + i
                    self.sends.send(x.grad, self.prev_rank, self.grad_out, tag, "pp-send-grad")
        self.sends.drain()
        instr.end_step()
        self._steps_run += 1
        if self.last:
            out.loss = float(loss_sum)
        return out

    def _arm_ddp_sync(self, root: torch.Tensor, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Make the coming backward all-reduce the accumulated gradients, and mark its sync point."""
        ddp.reducer.prepare_for_backward([])
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
