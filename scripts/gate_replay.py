"""Replay a run's idle windows through the drafter's gate with other settings: how much of them the
drafter would fill, and how far past their ends it would run.

    python scripts/gate_replay.py runs/demo [--rank 0] [--kind Bubble] [--confidence 0.8 0.7]
                                            [--margin-ms 2] [--task-ms 6]
    make gate-replay RUN=runs/demo RANK=0

The windows are the target's own records (metrics/windows-rank-<r>.jsonl: start, prediction,
actual length), fed in their order to the drafter's real WindowTracker, Gate and CostModel
(drafter/gating.py). In each window the drafter starts `--latency-ms` after the window opens and
runs tasks back to back while the gate allows one (the gate prices a task at the CostModel's p90
of the durations drawn so far), and stops when the window has ended, as the worker does. A task
lasts `--task-ms` times a seeded draw from U(0.7, 1.4); the default is the run's own mean task
length (busy time / tasks over the drafter's work records of that kind).

What it leaves out: the drafter's other work (verification, housekeeping, data copies) and how an
overrun slows the target. It answers "what would another confidence or margin give on these
windows", not "what did the drafter do" (that is the report).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from spectrain_api import rundir
from spectrain_workloads.drafter.gating import MS, UNIT_KEY, CostModel, Gate, WindowTracker
from spectrain_workloads.ring import WindowEvent, WindowKind

KINDS = {k.api_name: k for k in WindowKind}


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _event(w: dict[str, Any], end: bool) -> WindowEvent:
    """The ring record the drafter read for a logged window's start (end=False) or end."""
    return WindowEvent(seq=0, kind=KINDS[w["kind"]], rank=0, stage=w.get("stage", 0), step=w["step"],
                       window_id=w["window_id"], start_ns=w["start_ns"], predicted_duration_ns=w["predicted_ns"],
                       actual_duration_ns=w["actual_ns"] if end else 0, flags=0, is_end=end)


def mean_task_ms(drafter_log: list[dict[str, Any]], kind: str) -> float | None:
    """The run's mean task length in windows of `kind`: in-window busy time / tasks run."""
    work = [e for e in drafter_log if e.get("event") == "work" and e.get("kind") == kind]
    tasks = sum(sum(e.get("tasks", {}).values()) for e in work)
    return sum(e["busy_ns"] for e in work) / tasks / MS if tasks else None


def replay(windows: list[dict[str, Any]], *, kind: str, confidence: float, margin_ms: float, task_ms: float,
           latency_ms: float = 0.7, seed: int = 0) -> dict[str, float]:
    """Harvested share of the `kind` windows' time, overrun seconds, share of worked windows overrun."""
    rng = random.Random(seed)
    tracker, cost = WindowTracker(), CostModel()
    gate = Gate(policy="IdleOnly", kinds=[kind], safety_margin_ms=margin_ms, min_window_ms=0.0, cost=cost,
                tracker=tracker, confidence=confidence)

    def draw() -> int:
        return int(task_ms * MS * rng.uniform(0.7, 1.4))

    for _ in range(cost.window):
        cost.observe(UNIT_KEY, draw())          # the worker's calibration before the first window
    idle = busy = over = 0
    worked = overran = 0
    for w in sorted((w for w in windows if w["kind"] == kind), key=lambda w: w["start_ns"]):
        start, end = w["start_ns"], w["start_ns"] + w["actual_ns"]
        tracker.update([_event(w, False)])
        t, first = start + int(latency_ms * MS), True
        while t < end:
            budget = gate.budget(t)
            if budget.window is None or not gate.allows(budget, cost.estimate(UNIT_KEY), starting=first):
                break
            d = draw()
            busy += min(t + d, end) - t
            cost.observe(UNIT_KEY, d)
            t, first = t + d, False
        if not first:
            worked += 1
            overran += t > end
            over += max(0, t - end)
        idle += w["actual_ns"]
        tracker.update([_event(w, True)])
    return {"harvested_fraction": busy / idle if idle else 0.0, "overrun_s": over / 1e9,
            "windows_overrun_fraction": overran / worked if worked else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a `spectrain run --run-dir` directory (or its run/ subdirectory)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--kind", default="Bubble", choices=sorted(KINDS))
    ap.add_argument("--confidence", type=float, nargs="+", default=[0.8, 0.75, 0.7, 0.65])
    ap.add_argument("--margin-ms", type=float, nargs="+", default=[2.0])
    ap.add_argument("--task-ms", type=float, default=None, help="mean task length (default: the run's)")
    a = ap.parse_args(argv)
    if not all(0 < c < 1 for c in a.confidence):
        ap.error(f"--confidence values must be in (0, 1), got {a.confidence}")
    if min(a.margin_ms) < 0 or (a.task_ms is not None and a.task_ms <= 0):
        ap.error("--margin-ms must be >= 0 and --task-ms > 0")
    data = a.run / "run" if (a.run / "run" / "metrics").is_dir() else a.run
    path = data / "metrics" / f"windows-rank-{a.rank}.jsonl"
    if not path.is_file():
        ap.error(f"{path} does not exist: RUN is the --run-dir of a `spectrain run` (RANK one of its ranks)")
    windows = _read(path)
    task_ms = a.task_ms or mean_task_ms(_read(rundir.drafter_metrics(data, a.rank)), a.kind)
    if task_ms is None:
        raise SystemExit(f"rank {a.rank}'s drafter ran no task in {a.kind} windows: pass --task-ms")
    print(f"rank {a.rank}, {a.kind} windows, task {task_ms:.2f} ms (x U(0.7, 1.4))")
    print(f"{'confidence':>10} {'margin ms':>9} {'harvested':>9} {'overrun s':>9} {'windows overrun':>15}")
    for c in a.confidence:
        for m in a.margin_ms:
            r = replay(windows, kind=a.kind, confidence=c, margin_ms=m, task_ms=task_ms)
            print(f"{c:>10.2f} {m:>9.1f} {r['harvested_fraction']:>9.3f} {r['overrun_s']:>9.2f} "
                  f"{r['windows_overrun_fraction']:>15.3f}")


if __name__ == "__main__":
    main()
