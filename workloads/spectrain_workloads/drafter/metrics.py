"""The drafter's activity log and harvest accounting, feeding status.drafter (API.md).

Definitions (all from CLOCK_MONOTONIC timestamps):
- busy interval: one task (training micro-step, optimizer step, verification chunk), measured
  from its launch to its device synchronisation.
- usable window: a closed window of a kind in activation.kinds that lasted at least the
  drafter's unit of work + safety margin (shorter ones cannot be used by definition).
- harvested seconds (by kind): busy time inside windows, i.e. busy intervals intersected
  with the window's [start, end].
- harvest efficiency: busy time inside usable windows / total usable window time.
- overrun: for a window the drafter worked in, last task end - window end, when positive.

Log lines (drafter/metrics-rank-<r>.jsonl: spectrain_api.rundir, contracts.md): {"event": "work",
window_id, kind, start_ns, end_ns, busy_ns, busy_in_window_ns, tasks, microsteps, samples, loss, last_task_ns,
window_start_ns, window_end_ns, overrun_ns}, {"event": "acceptance", ...}, {"event": "checkpoint", ...},
{"event": "state", ...}, {"event": "setup", ...}.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spectrain_api import rundir
from spectrain_api.fsio import atomic_write_json
from spectrain_api.names import ENV_RUN_DIR
from spectrain_workloads.drafter.gating import ClosedWindow, quantile

NO_WINDOW = -1   # work under policy Always outside any window


@dataclass
class WorkRecord:
    window_id: int
    kind: str
    start_ns: int = 0
    end_ns: int = 0
    busy_ns: int = 0
    intervals: list[tuple[int, int]] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    microsteps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    last_task_ns: int = 0

    def add(self, task: str, t0: int, t1: int, *, samples: int = 0, loss: float | None = None) -> None:
        if not self.intervals:
            self.start_ns = t0
        self.end_ns = t1
        self.busy_ns += t1 - t0
        self.last_task_ns = t1 - t0
        self.intervals.append((t0, t1))
        self.tasks[task] = self.tasks.get(task, 0) + 1
        if task == "train":
            self.microsteps += 1
            self.samples += samples
            if loss is not None:
                self.loss_sum += loss

    def busy_within(self, start: int, end: int) -> int:
        return sum(max(0, min(b, end) - max(a, start)) for a, b in self.intervals)


class Metrics:
    def __init__(self, path: Path, *, kinds: list[str], history: int = 4096) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "a", buffering=1)   # line-buffered: a killed drafter loses at most a line
        self.kinds = set(kinds)
        self.pending: dict[int, WorkRecord] = {}
        self.harvested_ns: dict[str, int] = {}
        self.usable_ns = 0
        self.usable_busy_ns = 0
        self.busy_ns = 0
        self.windows_seen = 0
        self.windows_worked = 0
        self.windows_short = 0            # of an allowed kind but shorter than unit + margin
        # windows that fit no training micro-step but a verification chunk (acceptance on fresh
        # samples): used, without a gradient step
        self.windows_verify_only = 0
        self.short_worked = 0             # ... in which the drafter nevertheless worked (should stay 0)
        self.overruns_ns: deque[int] = deque(maxlen=history)
        self.losses: deque[float] = deque(maxlen=64)
        self.acceptance: dict[str, Any] | None = None

    # ------------------------------------------------------------ recording
    def log(self, event: str, **fields: Any) -> None:
        self._fh.write(json.dumps({"event": event, "t_ns": time.monotonic_ns(), **fields}) + "\n")

    def task(self, window_id: int, kind: str, task: str, t0: int, t1: int, *, samples: int = 0,
             loss: float | None = None) -> None:
        rec = self.pending.get(window_id)
        if rec is None:
            rec = self.pending[window_id] = WorkRecord(window_id, kind)
        rec.add(task, t0, t1, samples=samples, loss=loss)
        self.busy_ns += t1 - t0
        if loss is not None:
            self.losses.append(loss)

    def window_closed(self, w: ClosedWindow, usable_threshold_ns: int) -> None:
        """Account a closed window and write the work record of the drafter's activity in it."""
        self.windows_seen += 1
        allowed = w.kind in self.kinds
        usable = allowed and w.actual_ns >= usable_threshold_ns
        rec = self.pending.pop(w.window_id, None)
        inside = rec.busy_within(w.start_ns, w.end_ns) if rec else 0
        if allowed:
            self.harvested_ns[w.kind] = self.harvested_ns.get(w.kind, 0) + inside
        if usable:
            self.usable_ns += w.actual_ns
            self.usable_busy_ns += inside
        elif allowed:
            self.windows_short += 1
            self.short_worked += rec is not None
        if rec is None:
            return
        self.windows_worked += 1
        self.windows_verify_only += set(rec.tasks) == {"verify"}
        overrun = max(0, rec.end_ns - w.end_ns)
        self.overruns_ns.append(overrun)
        self._write_record(rec, w.start_ns, w.end_ns, overrun, inside)

    def window_lost(self, window_id: int) -> None:
        """The window's end record never arrived (ring overrun, target restart): log what was done."""
        rec = self.pending.pop(window_id, None)
        if rec is not None:
            self._write_record(rec, None, None, None, 0)

    def flush_unwindowed(self) -> None:
        """Write the records of work outside any window (policy Always) and of lost windows."""
        for wid in list(self.pending):
            rec = self.pending.pop(wid)
            self._write_record(rec, None, None, None, 0)

    def _write_record(self, rec: WorkRecord, ws: int | None, we: int | None, overrun: int | None,
                      inside: int) -> None:
        self.log("work", window_id=rec.window_id, kind=rec.kind, start_ns=rec.start_ns, end_ns=rec.end_ns,
                 busy_ns=rec.busy_ns, busy_in_window_ns=inside, tasks=rec.tasks, microsteps=rec.microsteps,
                 samples=rec.samples, loss=(rec.loss_sum / rec.microsteps) if rec.microsteps else None,
                 last_task_ns=rec.last_task_ns, window_start_ns=ws, window_end_ns=we, overrun_ns=overrun)

    # ------------------------------------------------------------ derived figures
    @property
    def harvest_efficiency(self) -> float | None:
        return self.usable_busy_ns / self.usable_ns if self.usable_ns else None

    def overrun_ms(self, q: float) -> float | None:
        return quantile(self.overruns_ns, q) / 1e6 if self.overruns_ns else None

    def summary(self) -> dict[str, Any]:
        """The figures behind status.drafter (camelCase like the API) plus diagnostics."""
        acc = self.acceptance or {}
        return {
            "harvestedSeconds": sum(self.harvested_ns.values()) / 1e9,
            "harvestedSecondsByKind": {k: v / 1e9 for k, v in sorted(self.harvested_ns.items())},
            "usableSeconds": self.usable_ns / 1e9,
            "harvestEfficiency": self.harvest_efficiency,
            "busySeconds": self.busy_ns / 1e9,
            "windowsSeen": self.windows_seen,
            "windowsWorked": self.windows_worked,
            "windowsTooShort": self.windows_short,
            "windowsVerifyOnly": self.windows_verify_only,
            "overrunMsP50": self.overrun_ms(0.5),
            "overrunMsP99": self.overrun_ms(0.99),
            "overrunMsMax": self.overrun_ms(1.0),
            "loss": (sum(self.losses) / len(self.losses)) if self.losses else None,
            "acceptanceLength": acc.get("acceptance_length"),
            "top1Agreement": acc.get("top1"),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"harvested_ns": self.harvested_ns, "usable_ns": self.usable_ns,
                "usable_busy_ns": self.usable_busy_ns, "busy_ns": self.busy_ns,
                "windows_seen": self.windows_seen, "windows_worked": self.windows_worked,
                "windows_short": self.windows_short, "windows_verify_only": self.windows_verify_only,
                "acceptance": self.acceptance}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.harvested_ns = {k: int(v) for k, v in s.get("harvested_ns", {}).items()}
        for name in ("usable_ns", "usable_busy_ns", "busy_ns", "windows_seen", "windows_worked", "windows_short",
                     "windows_verify_only"):
            setattr(self, name, int(s.get(name, 0)))
        self.acceptance = s.get("acceptance")

    def close(self) -> None:
        self._fh.close()


def write_summary(run_dir: str | os.PathLike[str], rank: int, summary: dict[str, Any], *, flush: bool = False) -> None:
    """The status path (podstatus.report_drafter: the summary file in $SPECTRAIN_RUN_DIR and, in a
    cluster, the pod annotation). A run dir given other than through that env var (tests driving
    a Worker directly) gets its summary file written here too."""
    from spectrain_workloads import podstatus

    data = {**summary, "rank": rank}
    podstatus.report_drafter(data, rank=rank, flush=flush)
    env_dir = os.environ.get(ENV_RUN_DIR)
    if not env_dir or Path(env_dir).resolve() != Path(run_dir).resolve():
        atomic_write_json(rundir.drafter_summary(run_dir, rank), data, durable=False, sort_keys=True)
