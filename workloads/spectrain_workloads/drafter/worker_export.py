"""A drafter worker's checkpoints and the export gate (the exporting rank).

Every rank checkpoints its drafter (model, optimizer, and the state of the combiner, the cost
model, the window tracker and the metrics, to resume from) at its first optimizer step, then every
checkpoint_every_s and at shutdown; the coordinator also after each round that combined a version.
The newest keep_checkpoints stay.

On the exporting rank a checkpoint is a *candidate* export. It is exported only once its
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
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from spectrain_api import rundir
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.combiner import SampleBuffer
from spectrain_workloads.drafter.gating import WindowTracker
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.verify import Acceptance
from spectrain_workloads.drafter.worker_reporting import Reporting

# A candidate export not measured within this long (no idle window fit a verification chunk) is given
# up, counted with the rejected ones, and its weights move on: the freeze it imposes stays bounded.
GATE_WAIT_S = 10.0


class ExportGate(Reporting):
    """The worker's checkpoints and exports (a part of drafter.worker.Worker, which sets these attributes)."""

    trainer: DrafterTrainer | None
    buffer: SampleBuffer
    tracker: WindowTracker
    ckpt_root: Path
    export_dir: Path | None              # set on the exporting rank only
    steps_at_ckpt: int
    candidate: dict[str, Any] | None     # the checkpoint waiting for its verdict
    reference: float | None              # the last exported version's acceptance length
    reference_stderr: float
    _last_verify: float
    _finishing: bool                     # shutdown: the target is done, verifications run at once

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
                path = ex.export_drafter(self.export_dir, c["version"], tr.model, meta,
                                         verifier_path=str(rundir.target_hf(self.run_dir)))
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

    def _settle_candidate(self) -> bool:
        """Between windows: export or reject a measured candidate; give up one not measured within
        GATE_WAIT_S. True while a candidate still waits (its weights stay: no round, no checkpoint)."""
        if self.candidate is not None and "result" in self.candidate:
            self._decide(self.candidate["result"])
        if self.candidate is not None:
            if time.monotonic() - self.candidate["since"] > GATE_WAIT_S:
                self._reject(f"not measured within {GATE_WAIT_S:g} s: no idle window fit a verification chunk",
                             {"acceptance_length": None, "reference": self.reference,
                              "reference_stderr": self.reference_stderr, "floor": self.s.export_acceptance_floor,
                              "held_back_chunks": len(self.buffer.eval)})
            return True
        return False
