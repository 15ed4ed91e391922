"""Target metrics: JSON lines in the run dir, a Prometheus endpoint, and rank 0's progress.

- `metrics/target-rank-<r>.jsonl`: one line per step: {step, loss, step_time_s, tokens_per_s,
  idle_s_by_kind, windows_by_kind, pred_error_median_by_kind, time_ns}.
- `metrics/windows-rank-<r>.jsonl`: one line per closed window (harvest/window_history.py's Window.record:
  {window_id, kind, stage, step, start_ns, predicted_ns, actual_ns[, channel, bytes]}).
- Prometheus (prometheus-client) on SPECTRAIN_METRICS_PORT + local rank when the port is > 0.
- a line on stderr (the container's log): the first step, then one every LOG_INTERVAL_S, and the last.
- progress: rank 0 reports through `spectrain_workloads.podstatus.report_progress(dict)` (progress.json
  in $SPECTRAIN_RUN_DIR + the pod annotation in a cluster); a run dir given other than through
  that env var (tests calling the trainer directly) gets its progress.json written here too.

Windows reach the sink from the Instrument's `end_step()` (training thread, once per step); `window_closed` only appends to a
list under a lock, and the training thread writes the files at the end of each step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from spectrain_api.fsio import atomic_write_json
from spectrain_api.names import ENV_RUN_DIR, WINDOW_KINDS

LOG_INTERVAL_S = 30.0         # between two progress lines in the container's log
KINDS = WINDOW_KINDS[:3]      # the target trainer's kinds; RolloutTail (mode RL) is counted as it comes


def relative_error(rec: dict[str, Any]) -> float | None:
    """|predicted - actual| / actual, None for open-ended (predicted 0) or zero-length windows."""
    if rec["predicted_ns"] <= 0 or rec["actual_ns"] <= 0:
        return None
    return abs(rec["predicted_ns"] - rec["actual_ns"]) / rec["actual_ns"]


def write_progress(run_dir: str | Path, progress: dict[str, Any], *, flush: bool = False) -> None:
    """Report progress for status.progress through podstatus (the one status path)."""
    from spectrain_workloads.podstatus import report_progress

    report_progress(progress, flush=flush)
    env_dir = os.environ.get(ENV_RUN_DIR)
    if not env_dir or Path(env_dir).resolve() != Path(run_dir).resolve():
        path = Path(run_dir) / "progress.json"
        atomic_write_json(path, progress)


def _totals(wins: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """Idle seconds and window counts by kind; kinds outside KINDS (RolloutTail, mode RL) too."""
    idle = {k: 0.0 for k in KINDS}
    count = {k: 0 for k in KINDS}
    for w in wins:
        idle[w["kind"]] = idle.get(w["kind"], 0.0) + w["actual_ns"] / 1e9
        count[w["kind"]] = count.get(w["kind"], 0) + 1
    return idle, count


class _Prometheus:
    def __init__(self, port: int, rank: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from spectrain_workloads.metrics_endpoint import Endpoint

        reg = CollectorRegistry()
        lab = {"rank": str(rank)}
        self.step = Gauge("spectrain_target_step", "last completed training step", ["rank"], registry=reg).labels(**lab)
        self.loss = Gauge("spectrain_target_loss", "training loss of the last step", ["rank"], registry=reg).labels(**lab)
        self.step_time = Gauge("spectrain_target_step_seconds", "wall time of the last step", ["rank"],
                               registry=reg).labels(**lab)
        self.tps = Gauge("spectrain_target_tokens_per_second", "tokens per second of the last step", ["rank"],
                         registry=reg).labels(**lab)
        self.idle = Counter("spectrain_target_idle_seconds", "idle time by window kind", ["rank", "kind"],
                            registry=reg)
        self.windows = Counter("spectrain_target_windows", "closed idle windows by kind", ["rank", "kind"],
                               registry=reg)
        self.pred_err = Gauge("spectrain_target_prediction_error", "median relative prediction error, last step",
                              ["rank", "kind"], registry=reg)
        self.rank = str(rank)
        self.endpoint = Endpoint(reg, port)

    def count_windows(self, idle: dict[str, float], count: dict[str, int]) -> None:
        for k in idle:
            self.idle.labels(rank=self.rank, kind=k).inc(idle[k])
            self.windows.labels(rank=self.rank, kind=k).inc(count[k])


class MetricsWriter:
    def __init__(self, run_dir: str | Path, rank: int, *, local_rank: int = 0, port: int = 0,
                 progress: bool = False, total_steps: int = 0) -> None:
        self.run_dir = Path(run_dir)
        mdir = self.run_dir / "metrics"
        mdir.mkdir(parents=True, exist_ok=True)
        self._steps_f = open(mdir / f"target-rank-{rank}.jsonl", "a", buffering=1)
        self._win_f = open(mdir / f"windows-rank-{rank}.jsonl", "a")
        self.progress = progress
        self.total_steps = total_steps
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self.progress_interval_s = 1.0      # progress.json is fsynced; once a second is plenty
        self._last_progress = -1e9
        self.prom = _Prometheus(port + local_rank, rank) if port > 0 else None
        self.rank = rank
        self._last_log = -1e9
        self._idle_since_log = 0.0

    def window_closed(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(rec)

    def _take_windows(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def step(self, *, step: int, loss: float | None, step_time_s: float, tokens: int,
             extra: dict[str, Any] | None = None, final: bool = False, completed: int | None = None) -> dict[str, Any]:
        """Record step `step` (the metrics lines' key: 0-based for Pretrain, 1-based for RL);
        `completed`: steps done so far (default step + 1), what the log line and the job's
        status.progress.step show."""
        done = step + 1 if completed is None else completed
        wins = self._take_windows()
        for w in wins:
            self._win_f.write(json.dumps(w) + "\n")
        self._win_f.flush()
        idle, count = _totals(wins)
        errs: dict[str, list[float]] = {k: [] for k in KINDS}
        for w in wins:
            e = relative_error(w)
            if e is not None:
                errs.setdefault(w["kind"], []).append(e)
        tps = tokens / step_time_s if step_time_s > 0 else 0.0
        line = {"step": step, "loss": loss, "step_time_s": step_time_s, "tokens_per_s": tps,
                "idle_s_by_kind": idle, "windows_by_kind": count,
                "pred_error_median_by_kind": {k: statistics.median(v) for k, v in errs.items() if v},
                "time_ns": time.monotonic_ns(), **(extra or {})}
        self._steps_f.write(json.dumps(line) + "\n")
        if self.prom is not None:
            p = self.prom
            p.step.set(step)
            if loss is not None:
                p.loss.set(loss)
            p.step_time.set(step_time_s)
            p.tps.set(tps)
            p.count_windows(idle, count)
            for k in KINDS:
                if errs[k]:
                    p.pred_err.labels(rank=p.rank, kind=k).set(statistics.median(errs[k]))
        now = time.monotonic()
        self._idle_since_log += sum(idle.values())
        if final or now - self._last_log >= LOG_INTERVAL_S:
            self._log_line(done, loss, step_time_s, tps, now)
        if self.progress and (final or now - self._last_progress >= self.progress_interval_s):
            self._last_progress = now
            write_progress(self.run_dir, {
                "step": done, "totalSteps": self.total_steps, "loss": loss, "tokensPerSecond": tps,
                "updatedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, flush=final)
        return line

    def _log_line(self, done: int, loss: float | None, step_time_s: float, tps: float, now: float) -> None:
        """One line on stderr (what `kubectl logs` shows): the first step, then every LOG_INTERVAL_S."""
        span = now - self._last_log if self._last_log > 0 else None
        idle = f" idle {self._idle_since_log / span:.0%} of the last {span:.0f} s" if span else ""
        loss_s = "n/a" if loss is None else f"{loss:.4f}"
        print(f"[spectrain-target rank {self.rank}] step {done}/{self.total_steps or '?'} loss {loss_s} "
              f"step {step_time_s * 1e3:.1f} ms {tps:.0f} tokens/s{idle}", file=sys.stderr, flush=True)
        self._last_log, self._idle_since_log = now, 0.0

    def close(self) -> None:
        wins = self._take_windows()
        for w in wins:
            self._win_f.write(json.dumps(w) + "\n")
        self._win_f.close()
        self._steps_f.close()
        if self.prom is not None:
            # windows closed after the last step are idle time too (the report counts them)
            self.prom.count_windows(*_totals(wins))
            self.prom.endpoint.final()
            self.prom.endpoint.stop()
