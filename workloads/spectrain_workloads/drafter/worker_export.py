"""A drafter worker's checkpoints and the export gate (the exporting rank).

Every rank checkpoints its drafter (model, optimizer, and the state of the combiner, the cost
model, the window tracker and the metrics, to resume from) at its first optimizer step, then every
checkpoint_every_s and at shutdown; the coordinator also after each round that combined a version.
The newest keep_checkpoints stay.

On the exporting rank a checkpoint is a *candidate* export. It becomes LATEST only once its weights
are finite and, on the held-back samples (SampleBuffer's eval set, never trained on), its acceptance
length is at least LATEST's and at least spec.drafter.export.minAcceptance (export.gate_verdict).
LATEST is not a number stored at its own export: the gate holds LATEST as a model
(export_latest.LatestDrafter) and measures both on the same samples in one paired verification
round, so no tolerance compounds from export to export and LATEST never steps down on the samples
of the day. The round runs chunk by chunk in idle windows (at shutdown, when the target is done, at
once), each chunk measured by the candidate and then by LATEST as two tasks of a plain chunk's
cost; meanwhile the weights stay those of the candidate: no optimizer step, no combining round and
no re-measurement of costs until it is decided (micro-steps go on, their gradients accumulate). Without held-back samples
yet the finite check alone decides the first version; once there is a LATEST or a floor, a candidate
that could not be measured is rejected. Rejections are logged (`export_rejected`) and counted by
cause (names.EXPORT_REJECT_CAUSES: `exportsRejectedByCause`, `exportsRejected`).
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
from spectrain_workloads.drafter.combiner import Sample, SampleBuffer
from spectrain_workloads.drafter.export_latest import LatestDrafter
from spectrain_workloads.drafter.gating import WindowTracker
from spectrain_workloads.drafter.train import DrafterTrainer
from spectrain_workloads.drafter.verify import Acceptance
from spectrain_workloads.drafter.worker_reporting import Reporting

# A candidate export not measured within this long (no idle window fit a verification chunk) is decided
# unmeasured (ExportGate._settle_candidate), and its weights move on: the freeze it imposes stays bounded.
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
    latest: LatestDrafter                # LATEST as a model, to measure candidates against
    rejected_by_cause: dict[str, int]    # names.EXPORT_REJECT_CAUSES -> candidates rejected for it
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
    def _load_latest(self) -> None:
        """After (re)building the trainer: hold the export root's LATEST to measure candidates against."""
        tr = self.trainer
        if self.export_dir is None or tr is None or not self.s.export_vs_latest or self.exported_version == 0:
            return
        why = self.latest.load(self.export_dir, tr.model)
        if why is not None:   # nothing to compare with: the floor and the finite check decide the next one
            self.metrics.log("latest_unavailable", version=self.exported_version, reason=why)
            print(f"spectrain-drafter: rank {self.rank}: cannot compare candidates with LATEST "
                  f"v{self.exported_version}: {why}", flush=True)

    def _begin_candidate_round(self, held_back: list[Sample]) -> None:
        """The candidate's verification round: paired with LATEST where there is one to compare with."""
        tr = self.trainer
        assert tr is not None
        reference = self.latest.module if self.s.export_vs_latest else None
        if reference is not None:
            self.latest.share_frozen(tr.model)
        tr.begin_verify(held_back, reference)

    def _propose(self, why: str, meta: dict[str, Any]) -> None:
        """The checkpoint just written is a candidate export: measure it (and LATEST) on the held-back
        samples (in idle windows; at shutdown at once), or with none held back yet, decide without."""
        tr = self.trainer
        assert tr is not None
        self.candidate = {"version": self.version, "why": why, "meta": meta, "since": time.monotonic()}
        held_back = self.buffer.eval_batch()
        if not held_back:
            self._decide(None)
            return
        self._begin_candidate_round(held_back)   # a periodic round in progress measured earlier weights
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

    def _gate_record(self, result: Acceptance | None) -> dict[str, Any]:
        """What the activity log and the export's config.json say about the verdict."""
        latest = None if result is None else result.reference
        return {"acceptance_length": None if result is None else result.acceptance_length,
                "stderr": 0.0 if result is None else ex.acceptance_stderr(result.per_depth, result.chains),
                "latest_version": self.latest.version if self.latest.module is not None else None,
                "latest_acceptance_length": None if latest is None else latest.acceptance_length,
                "min_acceptance": self.s.min_acceptance, "vs_latest": self.s.export_vs_latest,
                "held_back_chunks": len(self.buffer.eval)}

    def _decide(self, result: Acceptance | None, unmeasured_why: str = "") -> None:
        """Export the candidate (measured: `result`, paired with LATEST's where there is one), or count
        and log why not (`unmeasured_why`: why `result` is None, for the log)."""
        tr, c = self.trainer, self.candidate
        assert tr is not None and c is not None and self.export_dir is not None
        gate = self._gate_record(result)
        verdict = ex.gate_verdict(gate["acceptance_length"], gate["latest_acceptance_length"], self.s.min_acceptance,
                                  latest_exists=self.s.export_vs_latest and self.latest.module is not None)
        if verdict is not None and verdict[0] == "unmeasured" and unmeasured_why:
            verdict = verdict[0], f"{unmeasured_why}; {verdict[1]}"
        if verdict is None:
            meta = {**c["meta"], "acceptance": self.metrics.acceptance, "gate": gate}
            try:
                path = ex.export_drafter(self.export_dir, c["version"], tr.model, meta,
                                         verifier_path=str(rundir.target_hf(self.run_dir)))
            except ex.ExportRefused as exc:
                verdict = exc.cause, str(exc)
            else:
                self.candidate = None
                self.artifact, self.exported_version = str(path), c["version"]
                if self.s.export_vs_latest:
                    self.latest.take(tr.model, c["version"])
                self.metrics.log("export", version=c["version"], path=self.artifact, why=c["why"], **gate)
                return
        self._reject(*verdict, gate)

    def _reject(self, cause: str, reason: str, gate: dict[str, Any]) -> None:
        c = self.candidate
        assert c is not None
        self.candidate = None
        self.exports_rejected += 1
        self.rejected_by_cause[cause] = self.rejected_by_cause.get(cause, 0) + 1
        self.export_rejected_reason = reason
        self.metrics.log("export_rejected", version=c["version"], why=c["why"], cause=cause, reason=reason, **gate)
        print(f"spectrain-drafter: rank {self.rank}: version {c['version']} not exported ({cause}): {reason}",
              flush=True)

    def _settle_candidate(self) -> bool:
        """Between windows: export or reject a measured candidate; decide one not measured within
        GATE_WAIT_S as unmeasured (gate_verdict: rejected where LATEST or a floor must be met, exported
        on the finite check alone where neither exists, so that a job whose windows never fit a
        verification chunk still exports what it learnt). True while a candidate still waits (its
        weights stay: no round, no checkpoint)."""
        if self.candidate is not None and "result" in self.candidate:
            self._decide(self.candidate["result"])
        if self.candidate is not None:
            if time.monotonic() - self.candidate["since"] > GATE_WAIT_S:
                self._decide(None, f"not measured within {GATE_WAIT_S:g} s: no idle window fit a verification chunk")
            return self.candidate is not None
        return False
