"""One drafter worker: follows one target rank's ring and trains in its idle windows.

Loop: block on the ring (window events or data; no spinning, so an idle drafter costs the target
nothing); when a usable window is open, run tasks back to back, each only if the gate says it
fits, checking for the window's end before every task. Data is copied out of the ring as soon
as it arrives (a window that opens right after the step's data must not wait for the next
event to see it), and again whenever the buffer runs dry inside a window. Between windows: the
housekeeping (heartbeat on the back channel, summary, checkpoints, picking
up the target's rewritten embedding/head). The worker only reads target state.

The worker is one object made of parts, one concept a module: worker_intake (the ring's window
events and data into the tracker and the buffer), worker_tasks (measuring what tasks cost, running
them in windows), worker_export (checkpoints and the export gate), worker_reporting (state, the
back channel, the summary). This module holds the state they share (set up here), the loop, the
lifecycle (setup, resume, disable, shutdown) and the housekeeping between windows.

Disabled by the operator (`control`, a drafter.control.DrafterControl): checked at most every
CONTROL_EVERY_S in the loops; the worker then drops its work, model, optimizer and samples, says
Disabled on the back channel and in the summary, closes the ring and the fleet, and idles until
stopped.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import torch

from spectrain_api import rundir
from spectrain_api.names import ALWAYS, EXPORT_REJECT_CAUSES, OFF
from spectrain_workloads import nvml
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.combiner import BatchCombiner, SampleBuffer
from spectrain_workloads.drafter.control import REASON_DISABLED
from spectrain_workloads.drafter.eagle3_assembly import FeatureAssembler
from spectrain_workloads.drafter.export_latest import LatestDrafter
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.gating import CostModel, Gate, WindowTracker
from spectrain_workloads.drafter.metrics import Metrics
from spectrain_workloads.drafter.models import TargetShared, load_target_shared, shared_stamp
from spectrain_workloads.drafter.replicas import make_replicas
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.worker_export import ExportGate
from spectrain_workloads.drafter.worker_tasks import REMEASURE_AFTER_S, WindowWork

WAIT_S = 0.05                    # longest block on the ring between housekeeping checks
# Window events can arrive faster than WAIT_S (dozens per second on a pipeline): housekeeping
# (the fleet's rounds, checkpoints, heartbeats) is put off for a window at most this long.
HOUSEKEEPING_GAP_S = 0.25


def _prewarm() -> None:
    """Pay torch's lazy imports (the optimizers pull in torch._dynamo: seconds on a busy CPU)
    before waiting for the target, so the drafter is ready as soon as the target's weights are."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


class Worker(WindowWork, ExportGate):
    """One rank's drafter: sets up the state its parts share, runs the loop, winds down."""

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
        self.metrics = Metrics(rundir.drafter_metrics(run_dir, rank), kinds=settings.kinds)
        # weights through the fleet's star or the ring (spec.drafter.exchange.engine): one interface
        self.replicas = make_replicas(fleet, rank, self.metrics.log) if fleet is not None else None
        self.ckpt_root = ex.checkpoint_root(run_dir, rank)
        self.trainer: DrafterTrainer | None = None
        self.consumer: Any = None
        self.state, self.reason = ("Disabled", "PolicyOff") if settings.policy == OFF else ("Waiting", "NoRing")
        self.version = 0
        self.artifact = ""
        self.steps_at_ckpt = 0
        self.data_seen = 0
        self.assembler: FeatureAssembler | None = None     # EAGLE-3 (`_build_trainer`)
        self.parts_early = 0
        self.parts_malformed = 0       # EAGLE-3 ring records whose meta is not well formed
        self._stamp: tuple[int, ...] | None = None
        self._last: dict[str, float] = {}
        self._last_verify = time.monotonic()
        self.ready_ns = 1 << 62          # when the drafter was ready to work (monotonic ns)
        self.calibrated = False
        self._last_work = time.monotonic()
        self._remeasure_s = REMEASURE_AFTER_S
        self._due_since: float | None = None       # since when a measurement is due (data, no window yet)
        self.control = control               # control.DrafterControl: has the operator disabled this drafter?
        self.disabled_by_operator = False
        self.prometheus = prometheus         # drafter.prometheus.DrafterCollector: every summary, as metrics
        self._fleet_summary: dict[str, Any] = {}
        # the export gate (exporting rank): the checkpoint waiting for its verdict, LATEST as a model
        # (loaded with the trainer), rejections by cause
        self.candidate: dict[str, Any] | None = None
        self.latest = LatestDrafter()
        self.exported_version = 0
        self.exports_rejected = 0
        self.rejected_by_cause = dict.fromkeys(EXPORT_REJECT_CAUSES, 0)
        self.export_rejected_reason = ""
        self._finishing = False              # shutdown: the target is done, gate verifications run at once
        if export_dir is not None:
            self.exported_version = int((ex.latest_export_meta(export_dir) or {}).get("version", 0))

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        try:
            self._set_state(self.state, self.reason)
            if self._disabled():
                return self._idle()
            if self.s.policy != OFF:
                _prewarm()
            if not self._open_ring() or (self.s.policy != OFF and not self._setup_trainer()):
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
        self.latest = LatestDrafter()        # LATEST's copy too
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
            if (self.export_dir is not None and self.version == 0 and self.s.policy != OFF
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
        self._load_latest()
        layers = trainer.feature_layers
        if layers is not None and self.assembler is None:
            self.assembler = FeatureAssembler(layers, trainer.target_cfg.dim)
            if self.fleet is not None:
                self.fleet.use_features(layers)
        if self.replicas is not None:
            self.replicas.start(trainer.model, self.combiner.samples_trained, self.version,
                                state=(resumed or {}).get("fleet"))
        self.metrics.log("setup", resumed_version=resumed and int(resumed["version"]), version=self.version,
                         setup_ns=time.monotonic_ns() - t0)

    # ------------------------------------------------------------ housekeeping (between windows)
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
        if self.s.policy == ALWAYS and self._due("flush", 1.0):
            self.metrics.flush_unwindowed()
        self._summary_every(1.0)
        if self.trainer is None:
            return
        if self._settle_candidate():
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

