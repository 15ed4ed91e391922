"""What a drafter worker tells the others: its state, the back channel, the summary.

Three channels. The ring's back channel (`_publish`: state, reason, the exported version and its
path, acceptance length and top-1, the pid) gives the target's side of the ring the drafter's last
word. The summary (`summary`, written by metrics.write_summary to the run directory) is what
status.drafter is made of, and Prometheus gets the same summary through drafter.prometheus. The
activity log (metrics.log, JSON lines) records every state change and acceptance measurement.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from spectrain_api.names import EAGLE3
from spectrain_workloads.drafter.combiner import BatchCombiner
from spectrain_workloads.drafter.eagle3_assembly import AssemblyStats
from spectrain_workloads.drafter.gating import CostModel, Gate
from spectrain_workloads.drafter.metrics import Metrics, write_summary
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.metrics import LOG_INTERVAL_S

# States a working drafter moves through at every window: logged to the activity log, not to stderr.
FLAPPING_REASONS = ("", "NoWindow", "NoData")


class Reporting:
    """The worker's reports (a part of drafter.worker.Worker, which sets these attributes)."""

    s: DrafterSettings
    rank: int
    run_dir: Path
    consumer: Any                        # ring.RingConsumer (its back channel), None before the ring is open
    gpu: dict[str, Any] | None
    cost: CostModel
    gate: Gate
    combiner: BatchCombiner
    metrics: Metrics
    replicas: Any                        # replicas.Replicas / ring_replicas.RingReplicas; None alone
    prometheus: Any                      # drafter.prometheus.DrafterCollector or None
    state: str
    reason: str
    version: int
    artifact: str
    data_seen: int
    exported_version: int
    exports_rejected: int
    rejected_by_cause: dict[str, int]
    export_rejected_reason: str
    _fleet_summary: dict[str, Any]
    _last: dict[str, float]

    def _due(self, name: str, every_s: float) -> bool:
        now = time.monotonic()
        if now - self._last.get(name, 0.0) >= every_s:
            self._last[name] = now
            return True
        return False

    def _acceptance(self, acc: dict[str, Any]) -> None:
        self.metrics.acceptance = {**acc, "version": self.version,
                                   "samples_trained": self.combiner.samples_trained}
        self.metrics.log("acceptance", **self.metrics.acceptance)
        self._publish()

    def _set_state(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.reason) or not self._last.get("state_logged"):
            self.metrics.log("state", state=state, reason=reason)
            self._last["state_logged"] = 1.0
            if reason not in FLAPPING_REASONS:   # a wait before training, Disabled, Degraded: say it
                print(f"[spectrain-drafter rank {self.rank}] {state}/{reason}", file=sys.stderr, flush=True)
        self.state, self.reason = state, reason

    def _publish(self) -> None:
        if self.consumer is None:
            return
        acc = self.metrics.acceptance or {}
        self.consumer.publish_back({"state": self.state, "reason": self.reason, "version": self.version,
                                    "path": self.artifact, "acceptance": acc.get("acceptance_length"),
                                    "top1": acc.get("top1"), "pid": os.getpid()})

    def _log_line(self, s: dict[str, Any]) -> None:
        """One line on stderr (what `kubectl logs -c drafter` shows) every LOG_INTERVAL_S and at the end."""
        acc = s.get("acceptanceLength")
        print(f"[spectrain-drafter rank {self.rank}] {s['state']}/{s['reason']} harvested "
              f"{s['harvestedSeconds']:.1f} s in {s['windowsWorked']} of {s['windowsSeen']} windows, "
              f"{s['samplesTrained']} samples, version {s['version']}, acceptance "
              f"{'n/a' if acc is None else f'{acc:.2f}'}, exported v{s['exportedVersion']}",
              file=sys.stderr, flush=True)

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
            "exportsRejectedByCause": dict(self.rejected_by_cause),
            "exportRejectedReason": self.export_rejected_reason,
            "microSteps": self.combiner.micro_steps, "dataReceived": self.data_seen,
            **(self.replicas.summary() if self.replicas is not None else self._fleet_summary),
            "dataDropped": getattr(self.consumer, "data_dropped", 0),
            "windowsMissed": getattr(self.consumer, "windows_missed", 0),
            "ringRecordsCorrupt": getattr(self.consumer, "records_corrupt", 0),
            **self._feature_summary(),
            "mpsActiveThreadPercentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "gpu": self.gpu,
            "updatedAt": time.time(),
        }

    def _feature_summary(self) -> dict[str, Any]:
        """EAGLE-3: the assembly's counters (drafter.eagle3_assembly), on every rank (zeros where
        nothing is assembled), and the parts sent to the assembler from here."""
        if self.s.arch != EAGLE3:
            return {}
        a, fleet = getattr(self, "assembler", None), getattr(self, "fleet", None)
        sent = fleet.stats.snapshot().get("parts_sent", 0) if fleet is not None else 0
        return {**(a.stats.to_dict() if a is not None else AssemblyStats().to_dict()),
                "featureSequencesPending": len(a.pending) if a is not None else 0,   # incomplete, still held
                "featurePartsEarly": getattr(self, "parts_early", 0),
                "featureRecordsMalformed": getattr(self, "parts_malformed", 0), "featurePartsSent": sent}

    def _summary(self, flush: bool = False) -> None:
        summary = self.summary()
        if flush or self._due("log", LOG_INTERVAL_S):
            self._log_line(summary)
        write_summary(self.run_dir, self.rank, summary, flush=flush)
        if self.prometheus is not None:
            self.prometheus.update(summary)
