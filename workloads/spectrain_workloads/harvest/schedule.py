"""Pipeline schedules as explicit per-stage action lists, with their bubble slots known in advance.

A schedule gives each stage (rank of the pipeline) its compute order (F(i) = forward of
microbatch i, B(i) = backward). Under Interleaved1F1B a rank holds v model chunks and an action
also names its chunk: chunk c of rank r is virtual stage j = c * p + r (the layers are cut into
p * v slices, so the activations go round the ranks v times). Simulating the orders with
per-action durations (tf, tb: one stage's, or under interleaving one chunk's, F and B) yields, per
stage, the idle gap before every action. The *slots* (positions of the non-zero gaps) are structural: they are computed once with
tf = 1, tb = 2 and inserted into the action list as BUBBLE actions, so a stage knows before the
step where it will wait. (Interleaved1F1B: the union of the positions over tb/tf from 0.5 to 4,
as some of its gaps move with the ratio; a slot that is not idle at the measured ratio predicts 0.) The *predicted length* of each slot comes from the same simulation with
the measured EMA of tf and tb (instrument.py), published to the ring before the wait begins.

Step boundary: the stages are not synchronised between steps, so stage s's trailing idle time of
step n (waiting for stage 0 to finish its last backward) merges with its leading gap of step n+1
(waiting for stage 0's first forward). The first BUBBLE of a step therefore predicts
leading + trailing, except on the first step a process runs (leading only).

With equal stage times both GPipe and 1F1B idle (p-1)(tf+tb) per stage per step: the bubble
fraction (p-1)/(m+p-1). Interleaved1F1B (Megatron-LM's schedule; m a multiple of p) idles the
same (p-1)(tf+tb) in chunk units, i.e. 1/v of a stage's, against v*m(tf+tb) of compute: the bubble
fraction (p-1)/(v*m+p-1), whatever tf/tb (the unit tests check both against `simulate`).

Pure Python; no torch.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field

from spectrain_api.errors import ConfigError
from spectrain_api.names import GPIPE, INTERLEAVED, INTERLEAVED_CHUNKS, ONE_F_ONE_B, SCHEDULES

_STRUCT_TF, _STRUCT_TB = 1.0, 2.0
# Interleaved1F1B idles at different positions for different tb/tf (GPipe and 1F1B do not): its slots
# are where the simulation idles for any of these ratios (a slot can then predict 0 at the measured one).
_STRUCT_TB_RATIOS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
_EPS = 1e-9
_RATIO_STEP = math.log(1.02)    # ScaledTimeline's quantisation of tb / tf


class Op(enum.Enum):
    F = "F"
    B = "B"
    BUBBLE = "BUBBLE"


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int = -1     # microbatch (F/B)
    slot: int = -1   # index of the bubble slot within the step (BUBBLE)
    chunk: int = 0   # model chunk of the rank (F/B; Interleaved1F1B), virtual stage chunk * p + rank

    def __repr__(self) -> str:
        base = f"{self.op.value}{self.mb if self.op is not Op.BUBBLE else self.slot}"
        return f"{base}c{self.chunk}" if self.chunk else base


def compute_order(name: str, p: int, m: int, stage: int, chunks: int = 1) -> list[Action]:
    """F/B order of one stage (no bubbles); `chunks`: model chunks per rank (Interleaved1F1B only)."""
    if name == GPIPE:
        return [Action(Op.F, i) for i in range(m)] + [Action(Op.B, i) for i in range(m)]
    if name == ONE_F_ONE_B:
        warm = min(p - stage - 1, m)
        out = [Action(Op.F, i) for i in range(warm)]
        for i in range(m - warm):
            out += [Action(Op.F, warm + i), Action(Op.B, i)]
        out += [Action(Op.B, i) for i in range(m - warm, m)]
        return out
    if name == INTERLEAVED:
        return _interleaved_order(p, m, stage, chunks)
    raise ConfigError(f"spec.target.parallelism.schedule {name!r} is unknown; use one of {list(SCHEDULES)}")


def _interleaved_order(p: int, m: int, stage: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B for rank `stage` (m a multiple of p).

    The rank's k-th forward (k < v*m) is microbatch (k // (p*v)) * p + k % p of chunk (k // p) % v:
    groups of p microbatches go through chunk 0, then the same group through chunk 1, ... Its k-th
    backward is the same microbatch in reverse chunk order (chunk v-1 - (k // p) % v). Warm-up:
    2 (p - rank - 1) + (v - 1) p forwards (all of them when m == p), then one F one B, then the
    remaining backwards.
    """
    total = v * m

    def f(k: int, backward: bool) -> Action:
        c = (k // p) % v
        return Action(Op.B if backward else Op.F, (k // (p * v)) * p + k % p, chunk=v - 1 - c if backward else c)

    warm = total if m == p else min(2 * (p - stage - 1) + (v - 1) * p, total)
    out = [f(k, False) for k in range(warm)]
    for k in range(total - warm):
        out += [f(warm + k, False), f(k, True)]
    out += [f(k, True) for k in range(total - warm, total)]
    return out


@dataclass
class Timeline:
    """Simulated start/end of every action, per stage, in the units of tf/tb."""

    starts: list[list[float]]
    ends: list[list[float]]
    gaps: list[list[float]]          # idle time before each action (first: from t = 0)
    step_end: float
    trailing: list[float] = field(default_factory=list)   # step_end - stage end


def simulate(orders: list[list[Action]], tf: float, tb: float) -> Timeline:
    """Event simulation over virtual stages j = chunk * p + stage (j = stage without chunks):
    in-order per stage; F(j,i) after F(j-1,i); B(j,i) after B(j+1,i) and F(j,i)."""
    p = len(orders)
    n_virtual = p * (1 + max((a.chunk for o in orders for a in o), default=0))
    starts: list[list[float]] = [[0.0] * len(o) for o in orders]
    ends: list[list[float]] = [[0.0] * len(o) for o in orders]
    done: dict[tuple[Op, int, int], float] = {}   # (op, virtual stage, mb) -> end
    nxt = [0] * p
    free = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                a = orders[s][nxt[s]]
                j = a.chunk * p + s
                if a.op is Op.F:
                    dep = done.get((Op.F, j - 1, a.mb)) if j > 0 else 0.0
                    dur = tf
                else:
                    dep = done.get((Op.B, j + 1, a.mb)) if j < n_virtual - 1 else done.get((Op.F, j, a.mb))
                    dur = tb
                if dep is None:
                    break
                start = max(free[s], dep)
                k = nxt[s]
                starts[s][k], ends[s][k] = start, start + dur
                free[s] = start + dur
                done[(a.op, j, a.mb)] = start + dur
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks: an action waits on one that never runs")
    gaps = [[st[k] - (en[k - 1] if k else 0.0) for k in range(len(st))] for st, en in zip(starts, ends, strict=True)]
    step_end = max(en[-1] for en in ends if en)
    trailing = [step_end - (en[-1] if en else 0.0) for en in ends]
    return Timeline(starts=starts, ends=ends, gaps=gaps, step_end=step_end, trailing=trailing)


class ScaledTimeline:
    """simulate(orders, tf, tb)'s gaps and trailing idle for the per-step predictions, which move
    with the F/B EMAs every step. Every time in a timeline is a sum of tf's and tb's, so at one
    ratio tb / tf it is the unit timeline times tf: one simulation per ratio, quantised to steps of
    2 % (a gap moves by at most as much), serves every step."""

    def __init__(self, orders: list[list[Action]]) -> None:
        self.orders = orders
        self._unit: dict[int, tuple[list[list[float]], list[float]]] = {}

    def __call__(self, tf: float, tb: float) -> tuple[list[list[float]], list[float]]:
        if tf <= 0 or tb <= 0:               # no ratio to scale by: simulate these times as they are
            tl = simulate(self.orders, tf, tb)
            return tl.gaps, tl.trailing
        q = round(math.log(tb / tf) / _RATIO_STEP)
        unit = self._unit.get(q)
        if unit is None:
            tl = simulate(self.orders, 1.0, math.exp(q * _RATIO_STEP))
            unit = self._unit[q] = (tl.gaps, tl.trailing)
        gaps, trailing = unit
        return [[g * tf for g in row] for row in gaps], [x * tf for x in trailing]


@dataclass(frozen=True)
class Schedule:
    name: str
    n_stages: int
    microbatches: int
    chunks: int = 0   # model chunks per rank; 0: the schedule's own (INTERLEAVED_CHUNKS, else 1)

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ConfigError(f"spec.target.parallelism.pipeline must be >= 1, got {self.n_stages}")
        if self.microbatches < 1:
            raise ConfigError(f"spec.target.parallelism.microbatches must be >= 1, got {self.microbatches}")
        if self.n_stages > 1 and self.microbatches < self.n_stages:
            raise ConfigError(
                f"spec.target.parallelism.microbatches ({self.microbatches}) must be >= pipeline "
                f"({self.n_stages}) when pipeline > 1")
        if self.name == INTERLEAVED:
            object.__setattr__(self, "chunks", self.chunks or INTERLEAVED_CHUNKS)
            if self.chunks < 2:
                raise ConfigError(f"{INTERLEAVED} needs at least 2 model chunks per rank, got {self.chunks}")
            if self.n_stages < 2:
                raise ConfigError(
                    f"spec.target.parallelism.schedule {INTERLEAVED} interleaves model chunks across pipeline "
                    f"ranks, so spec.target.parallelism.pipeline must be >= 2 (got {self.n_stages}); use 1F1B "
                    "for pipeline 1")
            if self.microbatches % self.n_stages:
                raise ConfigError(
                    f"spec.target.parallelism.microbatches ({self.microbatches}) must be a multiple of pipeline "
                    f"({self.n_stages}) with schedule {INTERLEAVED} (microbatches go round the ranks in groups "
                    f"of pipeline); use e.g. {self.n_stages * -(-self.microbatches // self.n_stages)}")
        else:
            object.__setattr__(self, "chunks", self.chunks or 1)
            if self.chunks != 1:
                raise ConfigError(f"schedule {self.name} runs one model chunk per rank, got chunks={self.chunks}")
        compute_order(self.name, self.n_stages, self.microbatches, 0, self.chunks)   # validates the name

    @property
    def orders(self) -> list[list[Action]]:
        return [compute_order(self.name, self.n_stages, self.microbatches, s, self.chunks)
                for s in range(self.n_stages)]

    @functools.cached_property
    def scaled_timeline(self) -> ScaledTimeline:
        return ScaledTimeline(self.orders)

    @functools.cached_property
    def _structure(self) -> Timeline:
        return simulate(self.orders, _STRUCT_TF, _STRUCT_TB)

    def bubble_positions(self, stage: int) -> list[int]:
        """Indices into the stage's compute order before which the stage idles."""
        if self.chunks > 1:
            return list(self._interleaved_positions[stage])
        tl = self._structure
        return [k for k, g in enumerate(tl.gaps[stage]) if g > _EPS or (k == 0 and tl.trailing[stage] > _EPS)]

    @functools.cached_property
    def _interleaved_positions(self) -> list[list[int]]:
        pos: list[set[int]] = [set() for _ in range(self.n_stages)]
        for ratio in _STRUCT_TB_RATIOS:
            tl = simulate(self.orders, _STRUCT_TF, _STRUCT_TF * ratio)
            for s in range(self.n_stages):
                pos[s] |= {k for k, g in enumerate(tl.gaps[s]) if g > _EPS or (k == 0 and tl.trailing[s] > _EPS)}
        return [sorted(x) for x in pos]

    def stage_actions(self, stage: int) -> list[Action]:
        """The stage's action list: compute order with BUBBLE slots before the actions that wait."""
        order = self.orders[stage]
        pos = set(self.bubble_positions(stage))
        out: list[Action] = []
        slot = 0
        for k, a in enumerate(order):
            if k in pos:
                out.append(Action(Op.BUBBLE, slot=slot))
                slot += 1
            out.append(a)
        return out

    def bubble_predictions(self, stage: int, tf: float, tb: float, *, first_step: bool) -> list[float]:
        """Predicted length of each BUBBLE slot of `stage` (same units as tf, tb), in slot order."""
        gaps, trailing = self.scaled_timeline(tf, tb)
        preds = []
        for k in self.bubble_positions(stage):
            g = gaps[stage][k]
            if k == 0 and not first_step:
                g += trailing[stage]
            preds.append(max(g, 0.0))
        return preds

    def formula_bubble_fraction(self) -> float:
        """Idle share of each stage's step: (p-1)/(v*m+p-1), v = chunks per rank (1: GPipe, 1F1B)."""
        p, m, v = self.n_stages, self.microbatches, self.chunks
        return (p - 1) / (v * m + p - 1)

    def last_backward(self, stage: int) -> int:
        """Microbatch whose backward comes last on `stage` (where the data-parallel sync is armed)."""
        return [a.mb for a in self.orders[stage] if a.op is Op.B][-1]

    def last_backwards(self, stage: int) -> dict[int, int]:
        """Per chunk of `stage`, the microbatch of its last backward (each chunk's DDP sync point)."""
        return {a.chunk: a.mb for a in self.orders[stage] if a.op is Op.B}
