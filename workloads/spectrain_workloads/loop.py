"""The one loop every target mode runs: a mode says what differs, `ModeLoop.train` owns the rest.

A mode (target.trainer.PretrainLoop, rl.mode.RLLoop, target.async_pipeline.AsyncPipelineLoop)
gives `prepare()` (checks and inputs before the process group exists), `build()` (model,
optimizer, ring: `self.rt` is up), `train_step(step)` (one step; returns a `StepReport`),
`state()` / `load_state(state)` (the checkpoint of the last completed step) and the hooks
`fresh_start()`, `write_shared()`, `begin()`, `finish()`, `close()`. `train()` owns, once for
all modes:

- resume: the newest checkpoint step every rank holds (`Runtime.resume_step`, one MIN
  all-reduce; None: some rank has none, start fresh), loaded with `load_state`;
- checkpoint cadence: after step N (N steps done) when N % checkpoint.everySteps == 0 and at
  the last step; a save is `state()` under the step lock, then the mode's shared files;
- SIGTERM: checked at every step boundary, i.e. before the first step and after each completed
  step and its save; seen there, the boundary is saved and the rank exits 143
  (`Runtime.exit_terminated`). A rank blocked on a peer is saved by the Terminator's thread
  through `boundary_step()` (modes whose step spans several weight versions cannot: they set
  `saves_mid_step = False`);
- metrics: one line per step through the Runtime's writer, closed with the run;
- close: the mode's `close()`, the ring producer, then the Runtime (barrier, process group); after
  an error only the local resources (mode, ring, metrics): a failed collective can leave the
  process group hung, and the process exits right after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from spectrain_api.config import JobConfig
from spectrain_workloads.runtime import RankInfo, Runtime, TargetOptions
from spectrain_workloads.shutdown import Terminator


@dataclass(kw_only=True)
class StepReport:
    """What one step measured, for its metrics line."""

    loss: float | None
    step_time_s: float
    tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


class ModeLoop:
    """One target mode on one rank; see the module docstring for what a mode provides."""

    # Metrics lines number steps from this: Pretrain's name the step that ran (0-based), RL's and
    # AsyncPipeline's the steps done (docs/contracts.md).
    metrics_step_offset: ClassVar[int] = 1
    # On CPU, keep SPECTRAIN_DRAFTER_THREADS cores for the sidecar (Runtime.start).
    leave_drafter_threads: ClassVar[bool] = False
    # Whether the Terminator's thread may save `boundary_step()` while a step is in flight.
    saves_mid_step: ClassVar[bool] = True

    def __init__(self, cfg: JobConfig, opts: TargetOptions | None = None, rank: RankInfo | None = None) -> None:
        self.cfg = cfg
        self.opts = opts or TargetOptions.from_env()
        self.rank = rank or RankInfo.from_env()
        self.producer: Any = None          # ring.RingProducer; closed by train()
        self.start_step = 0
        self._rt: Runtime | None = None
        self._term: Terminator | None = None

    # ---- what a mode provides
    def prepare(self) -> None:
        """Checks and inputs before the process group exists (ConfigError before any training)."""

    def build(self) -> None:
        raise NotImplementedError

    def train_step(self, step: int) -> StepReport:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The checkpoint of the last completed step (`boundary_step()`)."""
        raise NotImplementedError

    def load_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def boundary_step(self) -> int:
        """Steps completed (what `state()` holds)."""
        raise NotImplementedError

    def fresh_start(self) -> None:
        """No checkpoint on some rank: start from the initial state."""

    def write_shared(self) -> None:
        """The drafter's shared embedding / LM head files, after each save."""

    def begin(self) -> None:
        """Right before the first step (the Terminator and every thread of the run exist)."""

    def finish(self) -> None:
        """After the last step, on success only."""

    def close(self) -> None:
        """Release the mode's resources (both after success and after an error)."""

    # ---- what train() owns
    @property
    def rt(self) -> Runtime:
        assert self._rt is not None, "train() starts the Runtime"
        return self._rt

    @property
    def term(self) -> Terminator:
        assert self._term is not None, "train() starts the Terminator"
        return self._term

    def save(self, step: int) -> None:
        self.rt.ckpt.save(step, self.state())
        self.write_shared()

    def exit_terminated(self, step: int) -> None:
        """SIGTERM seen at the boundary after `step` steps: save it and exit 143."""
        self.rt.exit_terminated(self.term, self.save, step)

    def train(self) -> list[float | None]:
        """Run (or resume) the mode on this rank; returns the loss of each step it ran."""
        self.prepare()
        self._rt = rt = Runtime.start(self.cfg, self.opts, self.rank,
                                      leave_drafter_threads=self.leave_drafter_threads)
        steps, every = self.cfg.target.steps, self.cfg.target.checkpoint.every_steps
        losses: list[float | None] = []
        try:
            self.build()
            start = rt.resume_step()
            if start is None:
                self.fresh_start()
                start = 0
            else:
                self.load_state(rt.ckpt.load(start))
            self.start_step = start
            emergency: Callable[[], None] = (lambda: self.save(self.boundary_step())) if self.saves_mid_step \
                else (lambda: None)
            self._term = rt.terminator(emergency)
            self.begin()
            self._stop_if_terminated(start)
            for step in range(start, steps):
                report = self.train_step(step)
                losses.append(report.loss)
                rt.metrics.step(step=step + self.metrics_step_offset, loss=report.loss,
                                step_time_s=report.step_time_s, tokens=report.tokens, extra=report.extra,
                                final=step + 1 == steps, completed=step + 1)
                if (step + 1) % every == 0 or step + 1 == steps:
                    with self.term.state_lock:
                        self.save(step + 1)
                self._stop_if_terminated(step + 1)
            self.finish()
        except BaseException:
            self._close_local()
            raise
        self.close()
        self._close_producer()
        rt.close()
        return losses

    def _stop_if_terminated(self, step: int) -> None:
        if self.term.requested.is_set():
            self.exit_terminated(step)

    def _close_producer(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def _close_local(self) -> None:
        try:
            self.close()
            self._close_producer()
        finally:
            self.rt.metrics.close()
