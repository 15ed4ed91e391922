"""Pipeline schedules as explicit per-stage action lists, with their bubble slots known in advance.

A schedule gives each stage its compute order (F(i) = forward of microbatch i, B(i) = backward).
Simulating it with per-action durations (tf, tb) yields, per stage, the idle gap before every
action. The *slots* (positions of the non-zero gaps) are structural: they are computed once with
tf = 1, tb = 2 and inserted into the action list as BUBBLE actions, so a stage knows before the
step where it will wait. The *predicted length* of each slot comes from the same simulation with
the measured EMA of tf and tb (instrument.py), published to the ring before the wait begins.

Step boundary: the stages are not synchronised between steps, so stage s's trailing idle time of
step n (waiting for stage 0 to finish its last backward) merges with its leading gap of step n+1
(waiting for stage 0's first forward). The first BUBBLE of a step therefore predicts
leading + trailing, except on the first step a process runs (leading only).

With equal stage times both GPipe and 1F1B idle (p-1)(tf+tb) per stage per step: the bubble
fraction (p-1)/(m+p-1).

Pure Python; no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from spectrain_workloads.errors import ConfigError

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
_STRUCT_TF, _STRUCT_TB = 1.0, 2.0
_EPS = 1e-9


class Op(enum.Enum):
    F = "F"
    B = "B"
    BUBBLE = "BUBBLE"


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int = -1     # microbatch (F/B)
    slot: int = -1   # index of the bubble slot within the step (BUBBLE)

    def __repr__(self) -> str:
        return f"{self.op.value}{self.mb if self.op is not Op.BUBBLE else self.slot}"


def compute_order(name: str, p: int, m: int, stage: int) -> list[Action]:
    """F/B order of one stage (no bubbles)."""
    if name == "GPipe":
        return [Action(Op.F, i) for i in range(m)] + [Action(Op.B, i) for i in range(m)]
    if name == "1F1B":
        warm = min(p - stage - 1, m)
        out = [Action(Op.F, i) for i in range(warm)]
        for i in range(m - warm):
            out += [Action(Op.F, warm + i), Action(Op.B, i)]
        out += [Action(Op.B, i) for i in range(m - warm, m)]
        return out
    if name == "Interleaved1F1B":
        raise ConfigError("spec.target.parallelism.schedule Interleaved1F1B is not implemented by this trainer "
                          "yet; use GPipe or 1F1B")
    raise ConfigError(f"spec.target.parallelism.schedule {name!r} is unknown; use one of {list(SCHEDULES)}")


@dataclass
class Timeline:
    """Simulated start/end of every action, per stage, in the units of tf/tb."""

    starts: list[list[float]]
    ends: list[list[float]]
    gaps: list[list[float]]          # idle time before each action (first: from t = 0)
    step_end: float
    trailing: list[float] = field(default_factory=list)   # step_end - stage end


def simulate(orders: list[list[Action]], tf: float, tb: float) -> Timeline:
    """Event simulation: in-order per stage; F(s,i) after F(s-1,i); B(s,i) after B(s+1,i) and F(s,i)."""
    p = len(orders)
    starts: list[list[float]] = [[0.0] * len(o) for o in orders]
    ends: list[list[float]] = [[0.0] * len(o) for o in orders]
    done: dict[tuple[Op, int, int], float] = {}   # (op, stage, mb) -> end
    nxt = [0] * p
    free = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                a = orders[s][nxt[s]]
                if a.op is Op.F:
                    dep = done.get((Op.F, s - 1, a.mb)) if s > 0 else 0.0
                    dur = tf
                else:
                    dep = done.get((Op.B, s + 1, a.mb)) if s < p - 1 else done.get((Op.F, s, a.mb))
                    dur = tb
                if dep is None:
                    break
                start = max(free[s], dep)
                k = nxt[s]
                starts[s][k], ends[s][k] = start, start + dur
                free[s] = start + dur
                done[(a.op, s, a.mb)] = start + dur
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks: an action waits on one that never runs")
    gaps = [[st[k] - (en[k - 1] if k else 0.0) for k in range(len(st))] for st, en in zip(starts, ends, strict=True)]
    step_end = max(en[-1] for en in ends if en)
    trailing = [step_end - (en[-1] if en else 0.0) for en in ends]
    return Timeline(starts=starts, ends=ends, gaps=gaps, step_end=step_end, trailing=trailing)


@dataclass(frozen=True)
class Schedule:
    name: str
    n_stages: int
    microbatches: int

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ConfigError(f"spec.target.parallelism.pipeline must be >= 1, got {self.n_stages}")
        if self.microbatches < 1:
            raise ConfigError(f"spec.target.parallelism.microbatches must be >= 1, got {self.microbatches}")
        if self.n_stages > 1 and self.microbatches < self.n_stages:
            raise ConfigError(
                f"spec.target.parallelism.microbatches ({self.microbatches}) must be >= pipeline "
                f"({self.n_stages}) when pipeline > 1")
        compute_order(self.name, self.n_stages, self.microbatches, 0)   # validates the name

    @property
    def orders(self) -> list[list[Action]]:
        return [compute_order(self.name, self.n_stages, self.microbatches, s) for s in range(self.n_stages)]

    def _structure(self) -> Timeline:
        return simulate(self.orders, _STRUCT_TF, _STRUCT_TB)

    def bubble_positions(self, stage: int) -> list[int]:
        """Indices into the stage's compute order before which the stage idles."""
        tl = self._structure()
        return [k for k, g in enumerate(tl.gaps[stage]) if g > _EPS or (k == 0 and tl.trailing[stage] > _EPS)]

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
        tl = simulate(self.orders, tf, tb)
        preds = []
        for k in self.bubble_positions(stage):
            g = tl.gaps[stage][k]
            if k == 0 and not first_step:
                g += tl.trailing[stage]
            preds.append(max(g, 0.0))
        return preds

    def formula_bubble_fraction(self) -> float:
        p, m = self.n_stages, self.microbatches
        return (p - 1) / (m + p - 1)

    def last_backward(self, stage: int) -> int:
        """Microbatch whose backward comes last on `stage` (where the data-parallel sync is armed)."""
        return [a.mb for a in self.orders[stage] if a.op is Op.B][-1]
