"""What a drafter worker runs inside idle windows, and measuring what each task costs.

The gate (drafter.gating) lets a task start only if its predicted cost fits the window's
remaining time, so the costs must be measured first: once data shows the sequence length, a few
micro-steps and verification chunks on synthetic samples of that length (`_calibrate`), inside an
open window where one comes. A unit measured while the machine was busy may exceed every window,
and then nothing would ever run to learn otherwise: idle with data for REMEASURE_AFTER_S, the
costs are measured again, backing off. Inside a window the tasks run back to back, each only if
the gate says it fits (`gating.pick_task`: optimizer step, verification chunk, micro-step), and the
ring is polled before every task so the window's end record stops the work.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from spectrain_api.names import ACTIVE, ALWAYS, IDLE_ONLY, WAITING
from spectrain_workloads.drafter.combiner import OPTIM_KEY, VERIFY_KEY, micro_key
from spectrain_workloads.drafter.gating import UNIT_KEY, Budget, Task, pick_task
from spectrain_workloads.drafter.metrics import NO_WINDOW
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.worker_intake import Intake
from spectrain_workloads.drafter.worker_reporting import Reporting

ALWAYS_SLICE_NS = 50_000_000     # policy Always: return to housekeeping this often
# A unit of work measured while the machine was busy can exceed every window, and the drafter then
# never works again to learn otherwise: with data but no work for this long, measure again
# (a few micro-steps), backing off x2 up to REMEASURE_MAX_S while it stays idle.
REMEASURE_AFTER_S, REMEASURE_MAX_S = 10.0, 300.0
# Measurements are taken inside an open window where one comes: outside windows the drafter shares
# the device with its target's compute and measures costs several times what it pays in a window,
# which keeps it out of windows it would fit (docs/benchmarks.md, the demo A/B). With no
# window for this long after data arrived (policy Always, a target that never idles) it measures anyway.
CALIBRATE_WAIT_S = 5.0


class WindowWork(Intake, Reporting):
    """The worker's work in windows (a part of drafter.worker.Worker, which sets these attributes)."""

    stop: Any                            # threading.Event: SIGTERM
    memory_cap_bytes: int | None
    candidate: dict[str, Any] | None     # the checkpoint waiting for its export verdict (worker_export)
    _last_verify: float
    _last_work: float
    _remeasure_s: float
    _due_since: float | None

    if TYPE_CHECKING:
        def _disabled(self) -> bool: ...     # drafter.worker.Worker: has the operator disabled it?
        def _begin_candidate_round(self, held_back: list[Any]) -> None: ...   # worker_export.ExportGate

    def _measure_due(self) -> bool:
        """Never measured, or idle with data for longer than the back-off (see REMEASURE_AFTER_S); while a
        candidate export waits for its verdict only the first measurement (a re-measurement applies the
        accumulated gradients, which would change the candidate's weights)."""
        if self.candidate is not None:
            return not self.calibrated
        return not self.calibrated or time.monotonic() - self._last_work > self._remeasure_s

    def _measure(self, trainer: DrafterTrainer) -> None:
        if self.calibrated:
            self._last_work, self._remeasure_s = time.monotonic(), min(2 * self._remeasure_s, REMEASURE_MAX_S)
            self.cost.forget()
            if self.combiner.accumulated > 0:     # the measurement discards gradients: step on these first
                trainer.optimizer_step(self.combiner.accumulated)
                self.combiner.note_optimizer_step()
        self._calibrate(trainer, self.buffer.newest_length() or self.s.seq_cap)

    def _measure_now(self) -> bool:
        """A measurement is due: is there data to learn the sequence length from, and an open window
        to measure in (or has none come for CALIBRATE_WAIT_S)?"""
        if not self.buffer.trainable():
            self._due_since = None
            return False
        now = time.monotonic()
        if self._due_since is None:
            self._due_since = now
        budget = self.gate.budget(time.monotonic_ns())
        return budget.remaining_ns > 0 or now - self._due_since >= CALIBRATE_WAIT_S   # > 0: a window (or policy Always)

    def _calibrate(self, trainer: DrafterTrainer, length: int) -> None:
        """Measure the unit of work (and the verification chunk) once data shows the sequence length.

        One-off, in an open window where possible (`_measure_now`), on synthetic data of that length:
        the first call pays lazy initialisation (allocator, kernels), so it is run and discarded.
        """
        begin = time.monotonic_ns()
        cap = trainer.memory_cap_samples(self.memory_cap_bytes, length)
        if cap is not None:
            self.combiner.memory_cap_samples = min(self.combiner.memory_cap_samples, cap)
        samples = trainer.synthetic_samples(1, length)
        for i in range(4):
            t0 = time.monotonic_ns()
            trainer.micro_step(samples)
            if i:
                self.cost.observe(UNIT_KEY, time.monotonic_ns() - t0)
        trainer.discard_grads()
        for i in range(2):
            trainer.begin_verify(samples)
            t0 = time.monotonic_ns()
            trainer.verify_chunk()
            if i:
                self.cost.observe(VERIFY_KEY, time.monotonic_ns() - t0)
        trainer.verifier.last, trainer.verifier.rounds = None, 0
        if self.candidate is not None and "result" not in self.candidate:
            self._begin_candidate_round(self.buffer.eval_batch())   # the round this one replaced
        self.calibrated, self._due_since = True, None
        self.ready_ns = time.monotonic_ns()
        self.metrics.log("calibrated", length=length, unit_ns=self.gate.unit_ns(), start_ns=begin,
                         calibrate_ns=self.ready_ns - begin,
                         memory_cap_samples=self.combiner.memory_cap_samples)

    def _next_task(self, budget: Budget, starting: bool) -> Task | None:
        """(task, cost key, predicted cost, micro-batch) of the first task that fits, or None
        (the order and the rules: gating.pick_task)."""
        tr = self.trainer
        assert tr is not None
        # while a candidate export is measured its weights must stay: no optimizer step
        optim = (("optim", OPTIM_KEY, self.cost.estimate(OPTIM_KEY), 0)
                 if self.combiner.accumulated > 0 and self.candidate is None else None)
        due = time.monotonic() - self._last_verify >= self.s.verify_every_s and self.buffer.eval_fresh() > 0
        verify = ("verify", VERIFY_KEY, self.cost.estimate(VERIFY_KEY), 0) if tr.verifier.in_progress or due else None
        plan = self.combiner.plan(budget.remaining_ns, self.buffer.trainable())
        train = None if plan is None else ("train", micro_key(plan.micro_batch), plan.cost_ns, plan.micro_batch)
        return pick_task(self.gate, budget, starting=starting, optim=optim, optim_due=self.combiner.step_due(),
                         verify=verify, train=train)

    def _work(self) -> bool:
        """Run tasks while the gate allows; True if at least one ran."""
        tr = self.trainer
        assert tr is not None
        if self.s.policy == IDLE_ONLY and not self.tracker.open:
            return False
        entered, started, did = time.monotonic_ns(), set(), False
        while not self.stop.is_set() and not self._disabled():
            self._on_events(self.consumer.poll_windows())   # the end record stops us here
            now = time.monotonic_ns()
            budget = self.gate.budget(now)
            wid = budget.window.window_id if budget.window else NO_WINDOW
            task = self._next_task(budget, starting=wid not in started)
            if task is None and self._drain_data():
                continue   # the buffer ran dry but fresh data had arrived: plan again with it
            if task is None:
                if not self.buffer.trainable() and self.state != WAITING:
                    self._set_state("Waiting", "NoData")
                break
            name, key, cost, b = task
            if wid not in started and self.state != ACTIVE:
                self._set_state("Active", "")
            started.add(wid)
            loss: float | None = None
            t0 = time.monotonic_ns()
            if name == "train":
                loss = tr.micro_step(self.buffer.take(b))
                self.combiner.note_micro_step(b)
            elif name == "optim":
                tr.optimizer_step(self.combiner.accumulated)
                self.combiner.note_optimizer_step()
            else:
                if not tr.verifier.in_progress:
                    tr.begin_verify(self.buffer.eval_batch())
                    self._last_verify = time.monotonic()
                result = tr.verify_chunk()
                if result is not None:
                    self._acceptance(result.to_dict())
                    if self.candidate is not None and "result" not in self.candidate:
                        # its own round (paired with LATEST), decided between windows (housekeeping); a
                        # periodic round that completes before that does not replace it
                        self.candidate["result"] = result
            t1 = time.monotonic_ns()
            self.cost.observe(key, t1 - t0)
            if name != "verify" and self.replicas is not None:
                self.replicas.work_ns += t1 - t0
            kind = budget.window.kind if budget.window else "None"
            self.metrics.task(wid, kind, name, t0, t1, samples=b, loss=loss)
            did = True
            if self.s.policy == ALWAYS and t1 - entered > ALWAYS_SLICE_NS:
                break
            self._drain_data(limit=4)
        return did
