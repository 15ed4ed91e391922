"""What the drafter runs in a window: its sample buffer and the adaptive batch combiner.

- SampleBuffer: the target's published sequences, copied out of the ring and cut into chunks of
  `seq_cap` positions (the drafter's unit of work is one chunk), bounded in bytes (the CPU side
  of the memory cap). Every `eval_every`-th sequence is held out for verification and never
  trained on. Fresh samples train first (newest first: closest to the current target),
  then older ones are replayed, each at most `max_reuse` times.
- BatchCombiner: picks the micro-batch size that processes the most samples in the predicted
  remaining time (micro-step costs measured per size; an unmeasured size is priced by scaling
  the largest measured smaller one, which overestimates and so is safe), capped by the memory
  cap; counts samples accumulated across micro-steps and windows, and says when an optimizer
  step is due. Its batches hold only drafter samples; nothing is shared with the target.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass

import torch

from spectrain_workloads.drafter.gating import CostModel


@dataclass
class Sample:
    tokens: torch.Tensor                 # [T] int64
    hidden: torch.Tensor | None          # [T, H] float32 (None: tokens-only data, LM arch)
    step: int                            # target step that produced it
    uses: int = 0
    arrival: int = 0                     # order in which the buffer received it
    gone: bool = False                   # retired (max_reuse) or evicted from the buffer

    @property
    def nbytes(self) -> int:
        n = self.tokens.numel() * self.tokens.element_size()
        return n + (self.hidden.numel() * self.hidden.element_size() if self.hidden is not None else 0)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


class _Pool:
    """The training samples of one length: fresh ones in arrival order, used ones in a heap by
    (use count, arrival), so that taking the newest fresh or the least used (oldest first) sample
    costs O(log n), not a scan and a sort of the buffer."""

    def __init__(self) -> None:
        self.fresh: deque[Sample] = deque()
        self.replay: list[tuple[int, int, Sample]] = []      # heap of (uses, arrival, sample)

    def head(self) -> tuple[int, int] | None:
        """(0, -arrival of the newest fresh) or (uses, arrival) of the least used: the order in
        which the pools are served (smallest first); None when nothing is left."""
        while self.fresh and self.fresh[-1].gone:
            self.fresh.pop()
        if self.fresh:
            return 0, -self.fresh[-1].arrival
        while self.replay and self.replay[0][2].gone:
            heapq.heappop(self.replay)
        return self.replay[0][:2] if self.replay else None

    def take(self, n: int) -> list[Sample]:
        out: list[Sample] = []
        while len(out) < n and self.fresh:
            s = self.fresh.pop()
            if not s.gone:
                out.append(s)
        while len(out) < n and self.replay:
            s = heapq.heappop(self.replay)[2]
            if not s.gone:
                out.append(s)
        return out

    def put_back(self, s: Sample) -> None:
        heapq.heappush(self.replay, (s.uses, s.arrival, s))

    def compact(self) -> None:
        self.fresh = deque(s for s in self.fresh if not s.gone)
        self.replay = [e for e in self.replay if not e[2].gone]
        heapq.heapify(self.replay)


class SampleBuffer:
    def __init__(self, *, max_bytes: int, max_reuse: int, eval_every: int, eval_samples: int) -> None:
        self.max_bytes, self.max_reuse, self.eval_every = max_bytes, max_reuse, eval_every
        self.train: deque[Sample] = deque()      # training samples in arrival order (evicted oldest first)
        self.eval: deque[Sample] = deque(maxlen=eval_samples)
        self.bytes = 0
        self.received = 0
        self.evicted_unused = 0      # samples dropped before they ever trained (the drafter lagged)
        self._eval_fresh = 0         # held-out samples not yet verified on
        self._pools: dict[int, _Pool] = {}          # by length
        self._live = 0               # samples in train that are not gone (retired or evicted)
        self._fresh = 0              # of which never used
        self._arrivals = 0
        self._gone = 0               # gone samples still referenced by train or a pool

    def add(self, sample: Sample) -> None:
        self.add_sequence([sample])

    def add_sequence(self, chunks: list[Sample]) -> None:
        """The chunks of one published sequence: held out or trained on together (no chunk of a
        held-out sequence is ever trained on)."""
        if not chunks:
            return
        self.received += 1
        if self.received % self.eval_every == 0:
            self.eval.extend(chunks)
            self._eval_fresh += len(chunks)
            return
        for sample in chunks:
            self._arrivals += 1
            sample.arrival = self._arrivals
            self.train.append(sample)
            self._pools.setdefault(sample.length, _Pool()).fresh.append(sample)
            self.bytes += sample.nbytes
            self._live += 1
            self._fresh += 1
        while self.bytes > self.max_bytes and self._live > 1:
            old = self.train.popleft()
            if old.gone:
                self._gone -= 1
                continue
            self.evicted_unused += old.uses == 0
            self._retire(old)

    def _retire(self, s: Sample) -> None:
        s.gone = True
        self.bytes -= s.nbytes
        self._live -= 1
        self._fresh -= s.uses == 0
        self._gone += 1

    def fresh_count(self) -> int:
        return self._fresh

    def trainable(self) -> int:
        return self._live

    def newest_length(self) -> int | None:
        return next((s.length for s in reversed(self.train) if not s.gone), None)

    def take(self, n: int) -> list[Sample]:
        """Up to n samples of one length: fresh newest first, then the least used; counts the use.
        The length is that of the first sample in that order over the whole buffer."""
        if not self._live or n < 1:
            return []
        heads = [(h, length) for length, pool in self._pools.items() if (h := pool.head()) is not None]
        if not heads:
            return []
        pool = self._pools[min(heads)[1]]
        chosen = pool.take(n)
        for s in chosen:
            self._fresh -= s.uses == 0
            s.uses += 1
            if s.uses >= self.max_reuse:
                self._retire(s)
            else:
                pool.put_back(s)
        if self._gone > self._live + 64:    # drop the references to gone samples (amortised O(1))
            self.train = deque(s for s in self.train if not s.gone)
            for p in self._pools.values():
                p.compact()
            self._gone = 0
        return chosen

    def eval_batch(self) -> list[Sample]:
        """The held-out samples (newest), and mark them verified."""
        self._eval_fresh = 0
        return list(self.eval)

    def eval_fresh(self) -> int:
        return self._eval_fresh


def collate(samples: list[Sample], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> tokens [B, T] int64, hidden [B, T, H] (None if any sample lacks it)."""
    tokens = torch.stack([s.tokens for s in samples]).to(device)
    if any(s.hidden is None for s in samples):
        return tokens, None
    return tokens, torch.stack([s.hidden for s in samples]).to(device)  # type: ignore[misc]


@dataclass
class WindowWork:
    """What one window's budget buys: `micro_steps` micro-batches of `micro_batch` samples."""

    micro_batch: int
    micro_steps: int          # how many of them fit the budget
    cost_ns: int | None       # predicted cost of one (None: not measured yet)


def micro_key(b: int) -> tuple[str, int]:
    return ("train", b)


OPTIM_KEY = ("optim", 0)
VERIFY_KEY = ("verify", 0)


class BatchCombiner:
    def __init__(self, *, max_micro_batch: int, samples_per_step: int, cost: CostModel) -> None:
        self.max_micro_batch = max_micro_batch
        self.samples_per_step = samples_per_step
        self.cost = cost
        self.memory_cap_samples = max_micro_batch     # lowered by the worker from the device memory cap
        self.accumulated = 0                          # samples in the gradients since the last step
        self.samples_trained = 0
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.sizes = sorted({b for b in itertools.takewhile(lambda b: b <= max_micro_batch,
                                                            (1 << i for i in range(32)))} | {max_micro_batch})

    def micro_cost(self, b: int) -> int | None:
        """Predicted ns of a micro-step of b samples: measured (never above a larger measured size,
        CostModel.estimate_sized), else scaled from a smaller measured size."""
        measured = self.cost.estimate_sized(*micro_key(b))
        if measured is not None:
            return measured
        below = [s for s in self.sizes if s < b and self.cost.estimate(micro_key(s)) is not None]
        if not below:
            return None
        b0 = max(below)
        return int(self.cost.estimate(micro_key(b0)) * b / b0)  # type: ignore[operator]

    def plan(self, budget_ns: int, available: int) -> WindowWork | None:
        """The micro-batch size that trains the most samples within budget_ns (ties: the larger size).

        A size never measured is tried first when its pessimistic (linearly scaled) cost fits:
        linear scaling alone would never show that a larger batch is cheaper per sample.
        """
        limit = min(self.max_micro_batch, self.memory_cap_samples, available)
        best: WindowWork | None = None
        for b in self.sizes:
            if b > limit:
                break
            c = self.micro_cost(b)
            if c is None:
                if b == 1:
                    return WindowWork(1, 1, None)   # the unit itself, not yet measured
                continue
            n = budget_ns // max(c, 1)
            if n < 1:
                continue
            if self.cost.estimate(micro_key(b)) is None:
                return WindowWork(b, int(min(n, 1 << 30)), c)          # explore
            if best is None or n * b >= best.micro_steps * best.micro_batch:
                best = WindowWork(b, int(min(n, 1 << 30)), c)
        return best

    def note_micro_step(self, b: int) -> None:
        self.accumulated += b
        self.samples_trained += b
        self.micro_steps += 1

    def step_due(self) -> bool:
        return self.accumulated >= self.samples_per_step

    def note_optimizer_step(self) -> None:
        self.accumulated = 0
        self.optimizer_steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"samples_trained": self.samples_trained, "micro_steps": self.micro_steps,
                "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples_trained = int(state.get("samples_trained", 0))
        self.micro_steps = int(state.get("micro_steps", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.accumulated = 0   # gradients are not checkpointed: accumulation restarts
