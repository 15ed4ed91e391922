"""One drafter worker: follows one target rank's ring and trains in its idle windows.

Loop: block on the ring (window events or data; no spinning, so an idle drafter costs the target
nothing); when a usable window is open, run tasks back to back, each only if the gate says it
fits, checking for the window's end before every task. Data is copied out of the ring as soon
as it arrives (a window that opens right after the step's data must not wait for the next
event to see it), and again whenever the buffer runs dry inside a window. Between windows: the
housekeeping (heartbeat on the back channel, summary, checkpoints, picking
up the target's rewritten embedding/head). The worker only reads target state.

Exports (the exporting rank): a checkpoint is a *candidate* export. It is exported only once its
weights are finite and its acceptance length on the held-back samples (SampleBuffer's eval set, never
trained on) is at least `export_acceptance_floor` x the last exported version's. The measurement is
a verification round like the periodic ones, run chunk by chunk in idle windows (at shutdown, when
the target is done, at once); meanwhile the weights stay those of the candidate: no optimizer step,
no combining round and no re-measurement of costs until it is decided (micro-steps go on, their
gradients accumulate). Without held-back samples yet (the first versions) the finite check alone
decides. A rejected candidate is logged (`export_rejected`) and counted (`exportsRejected`).
Export versions are checkpoint versions, and on the exporting rank those start above the export
root's high-water mark (export.export_high_water): a restart that lost its checkpoints never
reuses a number, and the fleet's combined versions (the coordinator's) move forward with them.
With engine AllReduce the ring numbers its versions itself (`combinedVersion`, kept in the
checkpoint to rejoin from); the exporting rank still exports them under its own checkpoint numbers.

Disabled by the operator (`control`, sidecar.DrafterControl): checked at most every CONTROL_EVERY_S
in the loops; the worker then drops its work, model, optimizer and samples, says Disabled on the
back channel and in the summary, closes the ring and the fleet, and idles until stopped.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spectrain_workloads import nvml
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.combiner import (
    OPTIM_KEY,
    VERIFY_KEY,
    BatchCombiner,
    Sample,
    SampleBuffer,
    micro_key,
)
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.gating import (
    UNIT_KEY,
    Budget,
    CostModel,
    Gate,
    Task,
    WindowTracker,
    pick_task,
)
from spectrain_workloads.drafter.metrics import NO_WINDOW, Metrics, write_summary
from spectrain_workloads.drafter.models import TargetShared, load_target_shared, shared_stamp
from spectrain_workloads.drafter.replicas import make_replicas
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.verify import Acceptance

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
WAIT_S = 0.05                    # longest block on the ring between housekeeping checks
# Window events can arrive faster than WAIT_S (dozens per second on a pipeline): housekeeping
# (the fleet's rounds, checkpoints, heartbeats) is put off for a window at most this long.
HOUSEKEEPING_GAP_S = 0.25
# A candidate export not measured within this long (no idle window fit a verification chunk) is given
# up, counted with the rejected ones, and its weights move on: the freeze it imposes stays bounded.
GATE_WAIT_S = 10.0


def _tensor(arr: np.ndarray, dtype: str | None) -> torch.Tensor:
    t = torch.from_numpy(np.array(arr, copy=True))    # copy out of the shared slot
    if dtype == "bfloat16" and t.dtype == torch.int16:
        t = t.view(torch.bfloat16)                    # the ring carries bf16 as an int16 view
    return t


def _prewarm() -> None:
    """Pay torch's lazy imports (the optimizers pull in torch._dynamo: seconds on a busy CPU)
    before waiting for the target, so the drafter is ready as soon as the target's weights are."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


class Worker:
    def __init__(self, *, settings: DrafterSettings, rank: int, ring_path: Path, run_dir: Path,
                 export_dir: Path | None, device: torch.device, stop: threading.Event,
                 memory_cap_bytes: int | None = None, ring_wait_s: float = 1.0, fleet: Fleet | None = None,
                 control: Any = None, prometheus: Any = None) -> None:
        self.s, self.rank, self.ring_path, self.run_dir = settings, rank, ring_path, run_dir
        self.export_dir, self.device, self.stop = export_dir, device, stop
        self.memory_cap_bytes = memory_cap_bytes
        self.fleet = fleet                   # the other drafters of the job (samples, combined weights)
        self.ring_wait_s = ring_wait_s
        # NVML's view of the GPU (MPS client? caps, memory), once: the summary's `gpu` field.
        self.gpu = nvml.report().to_dict() if device.type == "cuda" else None
        self.cost = CostModel()
        self.tracker = WindowTracker()
        self.gate = Gate(policy=settings.policy, kinds=settings.kinds, safety_margin_ms=settings.safety_margin_ms,
                         min_window_ms=settings.min_window_ms, cost=self.cost, tracker=self.tracker)
        self.buffer = SampleBuffer(max_bytes=int(settings.buffer_mb * 2**20), max_reuse=settings.max_reuse,
                                   eval_every=settings.eval_every, eval_samples=settings.eval_samples)
        self.combiner = BatchCombiner(max_micro_batch=settings.max_micro_batch,
                                      samples_per_step=settings.samples_per_step, cost=self.cost)
        self.metrics = Metrics(run_dir / "metrics" / f"drafter-rank-{rank}.jsonl", kinds=settings.kinds)
        # weights through the fleet's star or the ring (spec.drafter.exchange.engine): one interface
        self.replicas = make_replicas(fleet, rank, self.metrics.log) if fleet is not None else None
        self.ckpt_root = ex.checkpoint_root(run_dir, rank)
        self.trainer: DrafterTrainer | None = None
        self.consumer: Any = None
        self.state, self.reason = ("Disabled", "PolicyOff") if settings.policy == "Off" else ("Waiting", "NoRing")
        self.version = 0
        self.artifact = ""
        self.steps_at_ckpt = 0
        self.data_seen = 0
        self._stamp: tuple[int, ...] | None = None
        self._last: dict[str, float] = {}
        self._last_verify = time.monotonic()
        self.ready_ns = 1 << 62          # when the drafter was ready to work (monotonic ns)
        self.calibrated = False
        self._last_work = time.monotonic()
        self._remeasure_s = REMEASURE_AFTER_S
        self._due_since: float | None = None       # since when a measurement is due (data, no window yet)
        self.control = control               # sidecar.DrafterControl: has the operator disabled this drafter?
        self.disabled_by_operator = False
        self.prometheus = prometheus         # drafter.prometheus.DrafterCollector: every summary, as metrics
        self._fleet_summary: dict[str, Any] = {}
        # the export gate (exporting rank): the checkpoint waiting for its verdict, the last exported
        # version's acceptance length (the reference of the floor), rejections
        self.candidate: dict[str, Any] | None = None
        self.reference: float | None = None
        self.reference_stderr = 0.0
        self.exported_version = 0
        self.exports_rejected = 0
        self.export_rejected_reason = ""
        self._finishing = False              # shutdown: the target is done, gate verifications run at once
        if export_dir is not None:
            last = ex.latest_export_meta(export_dir) or {}
            self.exported_version = int(last.get("version", 0))
            gate = last.get("gate") or {}
            self.reference, self.reference_stderr = gate.get("acceptance_length"), float(gate.get("stderr") or 0.0)

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        try:
            self._set_state(self.state, self.reason)
            if self._disabled():
                return self._idle()
            if self.s.policy != "Off":
                _prewarm()
            if not self._open_ring() or (self.s.policy != "Off" and not self._setup_trainer()):
                return self._idle() if self.disabled_by_operator else 0
            while not self.stop.is_set() and not self._disabled():
                if self.trainer is not None and self._measure_due() and self._measure_now():
                    self._measure(self.trainer)
                did = self._work() if self.calibrated else False
                if self.disabled_by_operator:
                    break
                if did:
                    self._last_work, self._remeasure_s = time.monotonic(), REMEASURE_AFTER_S
                if not did:
                    # Sleep until a window event or data arrives (either can unblock work: a window
                    # opened with an empty buffer waits for the step's data, not for the next event).
                    events, data = self._wait_input(WAIT_S)
                    if (self.trainer is not None and (data or any(not e.is_end for e in events))
                            and (self._could_start() or self._measure_due())
                            and time.monotonic() - self._last.get("housekeeping", 0.0) < HOUSEKEEPING_GAP_S):
                        continue   # work (or a measurement) may start now: straight to it, housekeeping later
                self._drain_data()
                self._housekeeping()
            return self._idle() if self.disabled_by_operator else 0
        finally:
            self._shutdown()

    # ------------------------------------------------------------ disabled in place
    def _disabled(self) -> bool:
        """Has the operator disabled this drafter? (At most a stat and a read every CONTROL_EVERY_S.)
        The first time: drop everything at once (`_disable`)."""
        if not self.disabled_by_operator and self.control is not None and self.control.disabled():
            self._disable()
        return self.disabled_by_operator

    def _disable(self) -> None:
        from spectrain_workloads.drafter.sidecar import REASON_DISABLED

        self.disabled_by_operator = True
        self._set_state("Disabled", REASON_DISABLED)
        self.metrics.log("disabled", by="operator", optimizer_steps=self.combiner.optimizer_steps)
        print(f"spectrain-drafter: rank {self.rank} disabled by the operator; idle until stopped", flush=True)
        if self.consumer is not None:
            self._publish()                  # the last word on the back channel, then the ring is let go
            self.consumer.close()
            self.consumer = None
        if self.fleet is not None:
            self.fleet.close()               # out of the exchange: peers go on without this rank
        if self.replicas is not None:        # it holds the model's parameters: keep only its figures
            self.replicas.close()
            self._fleet_summary = self.replicas.summary()
            self.replicas = None
        self.candidate = None
        self.trainer = None                  # model, optimizer, gradients, the target's frozen copies
        self.buffer = SampleBuffer(max_bytes=1, max_reuse=1, eval_every=1, eval_samples=1)
        gc.collect()
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()         # hand the memory back to the target's process
        self._summary(flush=True)

    def _idle(self) -> int:
        """Disabled: stay up (a native sidecar that exits is restarted) and touch nothing until stopped."""
        self._summary(flush=True)
        while not self.stop.wait(1.0):
            pass
        return 0

    def _shutdown(self) -> None:
        """SIGTERM (or end): flush a checkpoint if anything was learnt since the last one."""
        if self.disabled_by_operator:
            self._summary(flush=True)
            self.metrics.close()
            return
        self._finishing = True
        try:
            if self.candidate is not None:
                self._gate_now()
            if self.consumer is not None:
                # end records already in the ring: account those windows rather than log their
                # work as unwindowed
                self._on_events(self.consumer.poll_windows())
            if self.trainer is not None and self.combiner.accumulated > 0:
                # gradients of micro-steps since the last optimizer step: apply them rather than
                # lose them (they are not checkpointed), so a short run still exports what it learnt
                self.trainer.optimizer_step(self.combiner.accumulated)
                self.combiner.note_optimizer_step()
            if self.replicas is not None and self.replicas.sync is not None and self._joins_rounds():
                if self.replicas.final_round(self.combiner.samples_trained, self.version + 1) is not None:
                    self._checkpoint("combined")          # the coordinator exports the last version
            if self.trainer is not None and self.combiner.optimizer_steps > self.steps_at_ckpt:
                self._checkpoint("shutdown")
            if (self.export_dir is not None and self.version == 0 and self.s.policy != "Off"
                    and ex.export_high_water(self.export_dir) == 0):
                # The job ended before anything was exported (a run shorter than the drafter's start):
                # export what there is, the initial drafter at worst, so every job leaves a drafter
                # that loads for its target (speculation with it stays lossless).
                shared = load_target_shared(self.run_dir) if self.trainer is None else None
                if shared is not None:
                    self._build_trainer(shared)
                if self.trainer is not None:
                    self._checkpoint("final")
            self.metrics.flush_unwindowed()
            self.reason = "Stopped"
            self._publish()
            self._summary(flush=True)
        finally:
            if self.replicas is not None:
                self.replicas.close()             # the ring's thread ends before the process does
            self.metrics.close()
            if self.consumer is not None:
                self.consumer.close()

    def _open_ring(self) -> bool:
        from spectrain_workloads.ring import RingConsumer, RingError, RingVersionError

        while not self.stop.is_set() and not self._disabled():
            try:
                # "oldest": windows still in the ring seed the per-kind history, data trains
                self.consumer = RingConsumer.open(self.ring_path, timeout_s=self.ring_wait_s, start="oldest")
                return True
            except RingVersionError:
                raise
            except (RingError, TimeoutError, FileNotFoundError):
                self._summary_every(1.0)
        return False

    def _setup_trainer(self) -> bool:
        """Wait for the target's shared weights (pumping the ring meanwhile), build, resume, measure."""
        self._set_state("Waiting", "NoTargetWeights")
        shared = None
        while shared is None and not self.stop.is_set() and not self._disabled():
            shared = load_target_shared(self.run_dir)
            if shared is None:
                self._on_events(self.consumer.wait_windows(timeout_s=0.2))
                self._drain_data()
                self._housekeeping()
        if shared is None or self.disabled_by_operator:
            return False
        self._build_trainer(shared)
        self._set_state("Waiting", "NoData" if not self.buffer.trainable() else "NoWindow")
        return True

    def _build_trainer(self, shared: TargetShared) -> None:
        """The drafter for the target's shared weights, resumed from its newest checkpoint."""
        self._stamp = shared.stamp
        t0 = time.monotonic_ns()
        trainer = DrafterTrainer(self.s, shared, self.device)
        resumed = ex.load_checkpoint(self.ckpt_root, trainer.model, trainer.optimizer)
        ex.clean_temp(self.ckpt_root)
        if resumed is not None:
            self.version = int(resumed["version"])
            self.combiner.load_state_dict(resumed.get("combiner", {}))
            self.cost.load_state_dict(resumed.get("cost", {}))
            self.tracker.load_state_dict(resumed.get("tracker", {}))
            self.metrics.load_state_dict(resumed.get("metrics", {}))
            if self.prometheus is not None:      # the checkpoint's totals are not this process's work
                self.prometheus.baseline({**self.metrics.summary(), "samplesTrained": self.combiner.samples_trained,
                                          "optimizerSteps": self.combiner.optimizer_steps})
            self.steps_at_ckpt = self.combiner.optimizer_steps
            self.artifact = resumed.get("artifact", "")
        if self.export_dir is not None:
            # never a number an export (of this or an earlier incarnation) already used
            self.version = max(self.version, ex.export_high_water(self.export_dir))
        self.trainer = trainer
        if self.replicas is not None:
            self.replicas.start(trainer.model, self.combiner.samples_trained, self.version,
                                state=(resumed or {}).get("fleet"))
        self.metrics.log("setup", resumed_version=resumed and int(resumed["version"]), version=self.version,
                         setup_ns=time.monotonic_ns() - t0)

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
            trainer.begin_verify(self.buffer.eval_batch())   # the candidate's round, which this one replaced
        self.calibrated, self._due_since = True, None
        self.ready_ns = time.monotonic_ns()
        self.metrics.log("calibrated", length=length, unit_ns=self.gate.unit_ns(), start_ns=begin,
                         calibrate_ns=self.ready_ns - begin,
                         memory_cap_samples=self.combiner.memory_cap_samples)

    # ------------------------------------------------------------ ring input
    def _on_events(self, events: list[Any]) -> None:
        if not events:
            return
        unit = self.gate.unit_ns()
        threshold = (unit or 0) + self.gate.margin_ns
        for cw in self.tracker.update(events):
            # Windows that began before the drafter could work feed the history, not the accounting
            # (unless it did work in them: that work is accounted with its window).
            if cw.start_ns >= self.ready_ns or cw.window_id in self.metrics.pending:
                self.metrics.window_closed(cw, threshold)

    def _could_start(self) -> bool:
        """Would the gate let work start in an open window now (data permitting)?"""
        return self.calibrated and self.gate.allows(self.gate.budget(time.monotonic_ns()), None, starting=True)

    def _wait_input(self, timeout_s: float) -> tuple[list[Any], int]:
        """Block up to timeout_s for window events or data; apply both; -> (events, sequences added)."""
        events: list[Any] = []
        added = 0

        def read() -> bool:
            nonlocal added
            got = self.consumer.poll_windows()
            self._on_events(got)
            events.extend(got)
            added += self._drain_data()
            return bool(got) or added > 0

        self.consumer.wait_until(read, timeout_s)
        return events, added

    def _drain_data(self, limit: int = 64) -> int:
        """Copy up to `limit` published sequences out of the ring; -> how many joined the buffer."""
        added = 0
        for _ in range(limit):
            rec = self.consumer.next_data()
            if rec is None:
                break
            arrays, meta = rec.arrays, rec.meta
            if "tokens" not in arrays:
                continue
            tokens = _tensor(arrays["tokens"], None).long()
            hidden = _tensor(arrays["hidden"], meta.get("dtype")) if "hidden" in arrays else None
            if not rec.valid():
                continue   # overwritten while copying
            if self.fleet is not None:
                self.fleet.share(tokens, hidden, int(meta.get("step", -1)))
            added += self._add_sequence(tokens, None if hidden is None else hidden.float(), int(meta.get("step", -1)))
        if self.fleet is not None:
            for tok, hid, step, _src in self.fleet.take_samples(max(0, limit - added)):
                added += self._add_sequence(tok, None if hid is None else hid.float(), step)
        return added

    def _add_sequence(self, tokens: torch.Tensor, hidden: torch.Tensor | None, step: int) -> int:
        chunks = self._chunks(tokens, hidden, step)
        if not chunks or (self.trainer is not None and not self.trainer.usable(chunks[0])):
            return 0
        self.data_seen += 1
        self.buffer.add_sequence(chunks)
        return 1

    def _chunks(self, tokens: torch.Tensor, hidden: torch.Tensor | None, step: int) -> list[Sample]:
        """A published sequence cut into chunks of seq_cap positions (the unit of work is one chunk:
        the smaller it is, the shorter the windows the drafter can use). A tail shorter than a
        chunk is dropped, unless the whole sequence is (then it is one chunk of its own)."""
        T, c = tokens.numel(), self.s.seq_cap
        if T < 4:
            return []
        bounds = [(0, T)] if T <= c else [(i, i + c) for i in range(0, T - c + 1, c)]
        return [Sample(tokens=tokens[a:b].clone(), hidden=None if hidden is None else hidden[a:b].clone(), step=step)
                for a, b in bounds]

    # ------------------------------------------------------------ work inside windows
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
        if self.s.policy == "IdleOnly" and not self.tracker.open:
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
                if not self.buffer.trainable() and self.state != "Waiting":
                    self._set_state("Waiting", "NoData")
                break
            name, key, cost, b = task
            if wid not in started and self.state != "Active":
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
                    if self.candidate is not None:
                        self.candidate["result"] = result   # exported between windows (housekeeping)
            t1 = time.monotonic_ns()
            self.cost.observe(key, t1 - t0)
            if name != "verify" and self.replicas is not None:
                self.replicas.work_ns += t1 - t0
            kind = budget.window.kind if budget.window else "None"
            self.metrics.task(wid, kind, name, t0, t1, samples=b, loss=loss)
            did = True
            if self.s.policy == "Always" and t1 - entered > ALWAYS_SLICE_NS:
                break
            self._drain_data(limit=4)
        return did

    def _acceptance(self, acc: dict[str, Any]) -> None:
        self.metrics.acceptance = {**acc, "version": self.version,
                                   "samples_trained": self.combiner.samples_trained}
        self.metrics.log("acceptance", **self.metrics.acceptance)
        self._publish()

    # ------------------------------------------------------------ housekeeping (between windows)
    def _due(self, name: str, every_s: float) -> bool:
        now = time.monotonic()
        if now - self._last.get(name, 0.0) >= every_s:
            self._last[name] = now
            return True
        return False

    def _housekeeping(self) -> None:
        if self._disabled():
            return
        self._last["housekeeping"] = time.monotonic()
        now = time.monotonic_ns()
        for w in self.tracker.expire(now):
            self.metrics.window_lost(w.window_id)
        if self.consumer is not None and self._due("alive", 0.5) and not self.consumer.producer_alive(max_age_s=2.0):
            self.tracker.clear_open()   # the target is gone: its open windows are not idle time any more
        if self._due("heartbeat", self.s.heartbeat_every_s):
            self._publish()
        if self.s.policy == "Always" and self._due("flush", 1.0):
            self.metrics.flush_unwindowed()
        self._summary_every(1.0)
        if self.trainer is None:
            return
        if self.candidate is not None and "result" in self.candidate:
            self._decide(self.candidate["result"])
        if self.candidate is not None:
            if time.monotonic() - self.candidate["since"] > GATE_WAIT_S:
                self._reject(f"not measured within {GATE_WAIT_S:g} s: no idle window fit a verification chunk",
                             {"acceptance_length": None, "reference": self.reference,
                              "reference_stderr": self.reference_stderr, "floor": self.s.export_acceptance_floor,
                              "held_back_chunks": len(self.buffer.eval)})
            return      # the candidate's weights stay until its verdict: no round, no checkpoint
        if self._due("target", 2.0):
            stamp = shared_stamp(self.run_dir)
            if stamp is not None and stamp != self._stamp:
                shared = load_target_shared(self.run_dir)
                if shared is not None:
                    self.trainer.refresh_target(shared)
                    self._stamp = shared.stamp
        if self.replicas is not None and self._joins_rounds():
            if self.replicas.round(self.combiner.samples_trained, self.version + 1) is not None:
                self._checkpoint("combined")      # the coordinator exports the combined version
        if self.combiner.optimizer_steps > self.steps_at_ckpt and (
                self.version == 0 or self._due("checkpoint", self.s.checkpoint_every_s)):
            # the first optimizer step exports at once (a deployable artifact early), then periodically
            self._checkpoint("first" if self.version == 0 else "periodic")

    def _joins_rounds(self) -> bool:
        """A member contributes once it has trained; the coordinator combines from the start, since the
        members' work reaches the export only through it, even when its own windows fit nothing
        (its own parameters then weigh nothing: fleet.combine weights by work)."""
        assert self.replicas is not None
        return self.combiner.optimizer_steps > 0 or self.replicas.joins_untrained

    def _checkpoint(self, why: str) -> None:
        tr = self.trainer
        assert tr is not None
        self.version += 1
        self._last["checkpoint"] = time.monotonic()
        t0 = time.monotonic_ns()
        meta = {"preset": self.s.preset, "rank": self.rank, "target_model_config_digest": tr.target_digest,
                "target_model_config": tr.target_cfg.to_dict(), "samples_trained": self.combiner.samples_trained,
                "optimizer_steps": self.combiner.optimizer_steps, "acceptance": self.metrics.acceptance,
                "loss_weights": {"hidden": self.s.hidden_loss_weight, "ce": self.s.ce_loss_weight}}
        state = {"settings": self.s.to_dict(), "combiner": self.combiner.state_dict(),
                 "cost": self.cost.state_dict(), "tracker": self.tracker.state_dict(),
                 "metrics": self.metrics.state_dict(), "artifact": self.artifact, **tr.state_dict(), **meta,
                 "fleet": self.replicas.state_dict() if self.replicas is not None else {}}
        path = ex.save_checkpoint(self.ckpt_root, self.version, tr.model, tr.optimizer, state,
                                  keep=self.s.keep_checkpoints)
        self.steps_at_ckpt = self.combiner.optimizer_steps
        self.metrics.log("checkpoint", version=self.version, path=str(path), artifact=self.artifact, why=why,
                         write_ns=time.monotonic_ns() - t0, optimizer_steps=self.combiner.optimizer_steps)
        if self.export_dir is not None:
            self._propose(why, meta)
        self._publish()

    # ------------------------------------------------------------ the export gate (exporting rank)
    def _propose(self, why: str, meta: dict[str, Any]) -> None:
        """The checkpoint just written is a candidate export: measure it on the held-back samples (in
        idle windows; at shutdown at once), or with none held back yet, decide on finiteness alone."""
        tr = self.trainer
        assert tr is not None
        self.candidate = {"version": self.version, "why": why, "meta": meta, "since": time.monotonic()}
        held_back = self.buffer.eval_batch()
        if not held_back:
            self._decide(None)
            return
        tr.begin_verify(held_back)          # a periodic round in progress measured earlier weights
        self._last_verify = time.monotonic()
        if self._finishing:
            self._gate_now()

    def _gate_now(self) -> None:
        """Finish the candidate's verification round here (the target is done: no window to wait for)."""
        tr = self.trainer
        assert tr is not None and self.candidate is not None
        result = self.candidate.get("result")          # measured in a window, not yet decided
        while result is None and tr.verifier.in_progress:
            result = tr.verify_chunk()
            if result is not None:
                self._acceptance(result.to_dict())
        self._decide(result)

    def _decide(self, result: Acceptance | None) -> None:
        """Export the candidate (measured: `result`), or count and log why not."""
        tr, c = self.trainer, self.candidate
        assert tr is not None and c is not None and self.export_dir is not None
        floor = self.s.export_acceptance_floor
        acceptance = None if result is None else result.acceptance_length
        stderr = 0.0 if result is None else ex.acceptance_stderr(result.per_depth, result.chains)
        gate = {"acceptance_length": acceptance, "stderr": stderr, "reference": self.reference,
                "reference_stderr": self.reference_stderr, "floor": floor, "held_back_chunks": len(self.buffer.eval)}
        reason = ex.acceptance_verdict(acceptance, self.reference, floor, stderr=stderr,
                                       reference_stderr=self.reference_stderr)
        if reason is None:
            meta = {**c["meta"], "acceptance": self.metrics.acceptance, "gate": gate}
            try:
                path = ex.export_drafter(self.export_dir, c["version"], tr.model, meta)
            except ex.ExportRefused as exc:
                reason = str(exc)
            else:
                self.candidate = None
                self.artifact, self.exported_version = str(path), c["version"]
                if acceptance is not None:
                    self.reference, self.reference_stderr = acceptance, stderr
                self.metrics.log("export", version=c["version"], path=self.artifact, why=c["why"], **gate)
                return
        self._reject(reason, gate)

    def _reject(self, reason: str, gate: dict[str, Any]) -> None:
        c = self.candidate
        assert c is not None
        self.candidate = None
        self.exports_rejected += 1
        self.export_rejected_reason = reason
        self.metrics.log("export_rejected", version=c["version"], why=c["why"], reason=reason, **gate)
        print(f"spectrain-drafter: rank {self.rank}: version {c['version']} not exported: {reason}", flush=True)

    # ------------------------------------------------------------ reporting
    def _set_state(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.reason) or not self._last.get("state_logged"):
            self.metrics.log("state", state=state, reason=reason)
            self._last["state_logged"] = 1.0
        self.state, self.reason = state, reason

    def _publish(self) -> None:
        if self.consumer is None:
            return
        acc = self.metrics.acceptance or {}
        self.consumer.publish_back({"state": self.state, "reason": self.reason, "version": self.version,
                                    "path": self.artifact, "acceptance": acc.get("acceptance_length"),
                                    "top1": acc.get("top1"), "pid": os.getpid()})

    def _summary_every(self, every_s: float) -> None:
        if self._due("summary", every_s):
            self._summary()

    def summary(self) -> dict[str, Any]:
        costs = {f"{k[0]}/{k[1]}" if isinstance(k, tuple) else str(k): (self.cost.estimate(k) or 0) / 1e6
                 for k in self.cost.keys()}
        unit = self.gate.unit_ns()
        return {
            **self.metrics.summary(), "state": self.state, "reason": self.reason, "version": self.version,
            "artifact": self.artifact, "arch": self.s.arch, "policy": self.s.policy,
            "unitMs": None if unit is None else unit / 1e6, "costsMs": costs,
            "samplesTrained": self.combiner.samples_trained, "optimizerSteps": self.combiner.optimizer_steps,
            "exportedVersion": self.exported_version, "exportsRejected": self.exports_rejected,
            "exportRejectedReason": self.export_rejected_reason,
            "microSteps": self.combiner.micro_steps, "dataReceived": self.data_seen,
            **(self.replicas.summary() if self.replicas is not None else self._fleet_summary),
            "dataDropped": getattr(self.consumer, "data_dropped", 0),
            "windowsMissed": getattr(self.consumer, "windows_missed", 0),
            "ringRecordsCorrupt": getattr(self.consumer, "records_corrupt", 0),
            "mpsActiveThreadPercentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "gpu": self.gpu,
            "updatedAt": time.time(),
        }

    def _summary(self, flush: bool = False) -> None:
        summary = self.summary()
        write_summary(self.run_dir, self.rank, summary, flush=flush)
        if self.prometheus is not None:
            self.prometheus.update(summary)
