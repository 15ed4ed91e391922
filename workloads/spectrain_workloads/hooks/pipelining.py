"""`instrument_schedule(schedule, pub)`: Bubble windows for torch.distributed.pipelining schedules.

Supported: Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B (exact types: a subclass may run
its actions in another order). Per step, rank r runs its compute actions (F / B of a microbatch,
on one of its stages) in a fixed order, and before some of them it idles, waiting on a receive.

Idle slots: ScheduleInterleaved1F1B's `pipeline_order[r]` lists the rank's actions with None for
its idle steps; each run of Nones is one slot, claimed by the first action at or after it that
receives (an F on a stage other than the first, a B on a stage other than the last). torch 2.13
drops the Nones from the single-stage schedules' `pipeline_order` (and numbers the last rank's
forwards from 1 in Schedule1F1B's), so for Schedule1F1B and ScheduleGPipe the slots and the
compute order are the built-in trainer's for the same schedule (harvest/schedule.py), which runs
the same actions in the same order as torch's.

At run time each receive of the schedule is waited on by `_wait_batch_p2p` right before the action
that needs it (torch_internals.py). The wait before a slot's action is its Bubble window, opened
with the built-in trainer's prediction (Instrument.bubble_open: the schedule simulated with this
rank's measured F/B times, `harvest.schedule.simulate`, times a learned per-slot correction, or
the slot's recent lengths when those predicted better); any other receive wait is a Communication
window (pp-recv-act / pp-recv-grad) with an Imbalance watch, as in the built-in executor. The
first slot of a step also holds the previous step's tail (the stages are not synchronised
between steps): its simulation adds the rank's trailing idle time, except on the first step.

The final hidden states: `final_norm` (the last stage's final norm module) gets a forward hook
that publishes its output [b, T, H] with the microbatch's input ids, which the caller hands over
per step with `hooks.set_tokens(tokens [B, T])` (split like the schedule splits its inputs).
EAGLE-3 (`feature_layers=`, `num_layers=`): the layers the drafter reads are tapped
(hooks.features); a stage without the final norm publishes them after each forward, with the same
tokens.

The wrappers only read clocks and publish: tensors and the order of operations are untouched, so
training is bitwise the same with and without them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spectrain_api.errors import ConfigError
from spectrain_api.names import INTERLEAVED
from spectrain_workloads.harvest.schedule import Action, Op, ScaledTimeline, Schedule
from spectrain_workloads.hooks import torch_internals as ti
from spectrain_workloads.hooks.errors import HookError
from spectrain_workloads.hooks.publisher import NoopPublisher, Publisher

_NAMES = {"Schedule1F1B": "1F1B", "ScheduleGPipe": "GPipe", "ScheduleInterleaved1F1B": "Interleaved1F1B"}


@dataclass(frozen=True)
class SlotPlan:
    """The idle slots of one rank: its compute order and, per slot, the index of the action whose
    receive ends it. `orders` holds every rank's order (the simulation needs them all)."""

    orders: list[list[Action]]
    rank: int
    claims: list[int]

    @property
    def order(self) -> list[Action]:
        return self.orders[self.rank]


def _receives(a: Action, rank: int, p: int, n_virtual: int) -> bool:
    """Whether action `a` of rank `rank` waits on a receive (its virtual stage j = chunk * p + rank)."""
    j = a.chunk * p + rank
    return j > 0 if a.op is Op.F else j < n_virtual - 1


def slot_plan(schedule: Any, rank: int) -> SlotPlan:
    """The idle slots of `rank` in `schedule` (see the module docstring)."""
    kind = _NAMES.get(type(schedule).__name__)
    if kind is None or type(schedule).__module__ != "torch.distributed.pipelining.schedules":
        raise HookError(f"instrument_schedule does not know {type(schedule).__module__}.{type(schedule).__name__}; "
                        f"it supports torch.distributed.pipelining {', '.join(_NAMES)} (mark other schedules' "
                        "waits with pub.idle('Bubble'))")
    n_virtual, m = ti.schedule_shape(schedule)
    if kind != INTERLEAVED:
        try:
            s = Schedule(name=kind, n_stages=n_virtual, microbatches=m)
        except ConfigError as exc:
            raise HookError(f"instrument_schedule: {type(schedule).__name__} with {n_virtual} stages and {m} "
                            f"microbatches: {exc}") from None
        claims = s.bubble_positions(rank)
        if not all(_receives(s.orders[rank][k], rank, n_virtual, n_virtual) for k in claims):
            raise HookError(f"instrument_schedule: a simulated idle slot of rank {rank} in {type(schedule).__name__} "
                            f"(p={n_virtual}, microbatches={m}) is not before a receive; this layout is not supported")
        return SlotPlan(orders=s.orders, rank=rank, claims=claims)
    forward, backward = ti.compute_types()
    p = len(schedule.pipeline_order)
    orders: list[list[Action]] = []
    starts_by_rank: list[list[int]] = []
    for r in range(p):
        order: list[Action] = []
        starts: list[int] = []
        idle = False
        for entry in ti.rank_actions(schedule, r):
            if entry is None:
                idle = True
                continue
            ctype, stage_index, mb = entry
            if ctype not in (forward, backward):
                continue        # REDUCE_GRAD and other bookkeeping actions take no slot
            if idle:
                starts.append(len(order))
                idle = False
            order.append(Action(Op.F if ctype == forward else Op.B, mb, chunk=stage_index // p))
        orders.append(order)
        starts_by_rank.append(starts)
    claimed: list[int] = []
    order = orders[rank]
    for start in starts_by_rank[rank]:
        k = next((i for i in range(start, len(order)) if _receives(order[i], rank, p, n_virtual)), None)
        if k is None or (claimed and k <= claimed[-1]):
            raise HookError(f"instrument_schedule: idle slot before action {start} of rank {rank} has no receive of "
                            f"its own in {type(schedule).__name__} (p={p}, microbatches={m}); this layout is not "
                            "supported")
        claimed.append(k)
    return SlotPlan(orders=orders, rank=rank, claims=claimed)


_ACTIVE: list[PipelineHooks] = []          # the instrumented schedule whose step() is running
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _install_p2p_wrappers() -> None:
    """Replace the schedules module's `_batch_p2p` / `_wait_batch_p2p` once per process; outside an
    instrumented step() the replacements call straight through."""
    mod = ti.schedules_module()
    if _ORIGINAL:
        return
    batch, wait = getattr(mod, "_batch_p2p"), getattr(mod, "_wait_batch_p2p")  # noqa: B009
    _ORIGINAL.update(batch=batch, wait=wait)

    def batch_p2p(p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any) -> Any:
        works = batch(p2p_ops, *args, **kwargs)
        if _ACTIVE and _ACTIVE[-1].enabled:
            nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_ops if op.op is dist.irecv)
            if nbytes:
                _ACTIVE[-1].pending[id(works)] = (works, nbytes)
        return works

    def wait_batch_p2p(works: list[Any]) -> None:
        hooks = _ACTIVE[-1] if _ACTIVE else None
        recv = hooks.pending.pop(id(works), None) if hooks is not None else None
        if recv is None or hooks is None:
            wait(works)
            return
        hooks.recv_wait(wait, works, recv[1])

    setattr(mod, "_batch_p2p", batch_p2p)  # noqa: B010
    setattr(mod, "_wait_batch_p2p", wait_batch_p2p)  # noqa: B010


class PipelineHooks:
    """What `instrument_schedule` returns for a Publisher: `set_tokens(tokens)` each step on the
    last stage (when `final_norm` was given); `plan` says the rank's idle slots."""

    def __init__(self, schedule: Any, pub: Publisher, plan: SlotPlan, final_norm: torch.nn.Module | None,
                 features_here: bool = False) -> None:
        self.schedule, self.pub, self.plan = schedule, pub, plan
        self.instr = pub.instrument
        self.pending: dict[int, tuple[Any, int]] = {}    # id(works) -> (works, received bytes)
        self.enabled = False
        self._next = 0                  # index of the next compute action of this step
        self._slot = 0                  # next idle slot of this step
        self._preds: list[float] = []
        self._steps_run = 0
        self._tokens: tuple[torch.Tensor, ...] | None = None
        self._mb = -1                   # microbatch of the forward running now (-1: none)
        self._features_here = features_here and final_norm is None   # EAGLE-3 layers, no final norm: pub.features
        self._p = len(plan.orders)
        self._timeline = ScaledTimeline(plan.orders)
        self._n_virtual, self._m = ti.schedule_shape(schedule)
        self._step = schedule.step
        schedule.step = self._run_step
        for stage in ti.schedule_stages(schedule):
            self._wrap_stage(stage)
        if final_norm is not None:
            final_norm.register_forward_hook(self._on_final_norm)

    # ---------------------------------------------------------------- per step
    def set_tokens(self, tokens: torch.Tensor) -> None:
        """This step's input ids [B, T] (B: the batch the schedule splits into microbatches)."""
        self._tokens = tuple(torch.tensor_split(tokens, self._m, dim=0))

    def _run_step(self, *args: Any, **kwargs: Any) -> Any:
        self.enabled = self.pub.enabled
        if not self.enabled:
            return self._step(*args, **kwargs)
        self._next, self._slot = 0, 0
        self._preds = self._predictions()
        _ACTIVE.append(self)
        try:
            out = self._step(*args, **kwargs)
        finally:
            _ACTIVE.pop()
            self.pending.clear()
        if self._next != len(self.plan.order) or self._slot != len(self.plan.claims):
            raise HookError(f"instrument_schedule: rank {self.plan.rank} ran {self._next} compute actions and "
                            f"{self._slot} idle slots, expected {len(self.plan.order)} and {len(self.plan.claims)}: "
                            f"{type(self.schedule).__name__} did not run the order this torch version had")
        self._steps_run += 1
        return out

    def _predictions(self) -> list[float]:
        """Simulated length (ns) of each slot from this rank's F/B EMAs (0s until it has both)."""
        ema = self.instr.compute_ema_ns
        if ema is None:
            return [0.0] * len(self.plan.claims)
        gaps, trailing = self._timeline(ema[0], ema[1])
        r = self.plan.rank
        return [max(0.0, gaps[r][k] + (trailing[r] if i == 0 and self._steps_run > 0 else 0.0))
                for i, k in enumerate(self.plan.claims)]

    # ---------------------------------------------------------------- compute actions
    def _wrap_stage(self, stage: Any) -> None:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        chunk = int(stage.stage_index) // self._p

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fwd(fwd_chunk_id, *args, **kwargs)
            self._expect(Op.F, fwd_chunk_id, chunk)
            self._mb = fwd_chunk_id
            start = time.monotonic_ns()
            try:
                out = fwd(fwd_chunk_id, *args, **kwargs)
                if self._features_here:
                    self.pub.features(self._microbatch_tokens("feature_layers"))
                return out
            finally:
                self._mb = -1
                self.instr.record_compute("F", time.monotonic_ns() - start)
                self._next += 1

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return bwd(bwd_chunk_id, *args, **kwargs)
            self._expect(Op.B, bwd_chunk_id, chunk)
            start = time.monotonic_ns()
            try:
                return bwd(bwd_chunk_id, *args, **kwargs)
            finally:
                self.instr.record_compute("B", time.monotonic_ns() - start)
                self._next += 1

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def _expect(self, op: Op, mb: int, chunk: int) -> None:
        order = self.plan.order
        a = order[self._next] if self._next < len(order) else None
        if a is None or a.op is not op or a.mb != mb or a.chunk != chunk:
            raise HookError(f"instrument_schedule: rank {self.plan.rank} ran {op.value}{mb} (chunk {chunk}) as its "
                            f"action {self._next}, expected {a!r}; {type(self.schedule).__name__} does not run the "
                            "order this adapter knows for it")

    # ---------------------------------------------------------------- waits on receives
    def recv_wait(self, wait: Callable[[list[Any]], None], works: list[Any], nbytes: int) -> None:
        k, instr = self._next, self.instr
        if self._slot < len(self.plan.claims) and self.plan.claims[self._slot] == k:
            slot = self._slot
            self._slot += 1
            w = instr.bubble_open(self._preds[slot], slot, learn=self._steps_run > 0 or slot > 0)
            wait(works)
            instr.bubble_close(w)
            return
        a = self.plan.order[k] if k < len(self.plan.order) else None
        channel = "pp-recv-grad" if a is not None and a.op is Op.B else "pp-recv-act"
        w = instr.comm_open(channel, nbytes, pos=a.chunk * self._m + a.mb if a is not None else -1)
        instr.sync_begin()
        wait(works)
        instr.sync_end()
        instr.comm_close(w)

    # ---------------------------------------------------------------- final hidden states
    def _on_final_norm(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not self.enabled or self._mb < 0:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        self.pub.hidden_states(hidden.detach(), self._microbatch_tokens("final_norm"))

    def _microbatch_tokens(self, given: str) -> torch.Tensor:
        if self._tokens is None:
            raise HookError(f"instrument_schedule({given}=...): call hooks.set_tokens(input_ids) before each "
                            "schedule.step() on this stage, so what it publishes carries its tokens")
        return self._tokens[self._mb]


class _NoopHooks:
    plan = None

    def set_tokens(self, tokens: torch.Tensor) -> None:
        return None


_NOOP_HOOKS = _NoopHooks()


def instrument_schedule(schedule: Any, pub: Publisher | NoopPublisher, *,
                        final_norm: torch.nn.Module | None = None,
                        feature_layers: Mapping[int, torch.nn.Module] | None = None,
                        num_layers: int | None = None) -> PipelineHooks | _NoopHooks:
    """Publish `schedule`'s Bubble windows (and, with `final_norm`, the last stage's hidden states)
    through `pub`. A NoopPublisher leaves the schedule untouched (the type is still checked).
    EAGLE-3: `feature_layers` (this rank's decoder layers by global id) and `num_layers` (the
    model's depth) tap the layers the drafter reads (hooks.features); a stage without the final
    norm publishes them after each forward (set_tokens is then needed on every such stage)."""
    if type(schedule).__name__ not in _NAMES or type(schedule).__module__ != "torch.distributed.pipelining.schedules":
        slot_plan(schedule, 0)          # raises the unknown-schedule error
    if not isinstance(pub, Publisher):
        return _NOOP_HOOKS
    pub.require_kind("Bubble", "instrument_schedule")
    if not dist.is_initialized():
        raise HookError("instrument_schedule: call it after torch.distributed.init_process_group")
    stages = ti.schedule_stages(schedule)
    n_virtual, _ = ti.schedule_shape(schedule)
    plan = slot_plan(schedule, int(stages[0].stage_index) % (n_virtual // len(stages)))
    _install_p2p_wrappers()
    held: tuple[int, ...] = ()
    if feature_layers is not None:
        if num_layers is None:
            raise HookError("instrument_schedule(feature_layers=...): give num_layers, the model's depth")
        held = pub.feature_layers(feature_layers, num_layers=num_layers)
    return PipelineHooks(schedule, pub, plan, final_norm, features_here=bool(held))
