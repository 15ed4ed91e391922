"""The drafter sidecar as a real process next to a synthetic target (real ring, real data).

Checked from timestamps in the drafter's activity log against the target's window log: busy
only inside windows, overrun bounded by the last task, nothing in windows shorter than the
unit or of kinds not in activation.kinds, open-ended windows used once history exists; SIGTERM
flushes a checkpoint + export. (SIGKILL and resume: test_drafter_target.py, next to the real target.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from spectrain_workloads.drafter.export import load_drafter
from spectrain_workloads.drafter.models import EagleDrafter, build_drafter
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.synthetic import SyntheticSpec, WindowSpec, target_hidden, text_sequences
from spectrain_workloads.drafter.verify import measure
from tests.integration.drafter_procs import TARGET_CFG, Pod, drive, synthetic_target

pytestmark = pytest.mark.integration
torch.set_num_threads(1)

MS = 1_000_000
SLACK_NS = 3 * MS     # poll-to-start latency and clock reads around a task, on a loaded machine

SCHEDULE = SyntheticSpec(
    windows=[
        WindowSpec(kind="Bubble", duration_ms=60.0),                                  # predicted, long
        WindowSpec(kind="Communication", duration_ms=0.3),                            # shorter than any unit
        WindowSpec(kind="RolloutTail", duration_ms=40.0),                             # kind filtered out
        WindowSpec(kind="Imbalance", duration_ms=50.0, predicted=False, jitter=0.2),  # open-ended
    ],
    compute_ms=4.0, data_per_step=2, seq_len=64, seed=0)
KINDS = ["Bubble", "Communication", "Imbalance"]


def test_drafter_works_only_inside_usable_windows_and_flushes_on_sigterm(tmp_path: Path) -> None:
    pod = Pod(tmp_path, drafter={"activation": {"kinds": KINDS, "safetyMarginMs": 1}},
              settings={"checkpoint_every_s": 2.0, "verify_every_s": 1.0})
    target = synthetic_target(pod, SCHEDULE)
    proc = pod.start_drafter()
    try:
        calibrated = drive(target, lambda: pod.of("calibrated"), 60, "the drafter's calibration", proc)[0]
        drive(target, lambda: sum(e["samples"] for e in pod.of("work")) >= 400 and pod.of("acceptance")
              and {e["kind"] for e in pod.of("work")} == {"Bubble", "Imbalance"},
              120, "400 trained samples, a verification, work in both usable kinds", proc)
        t_stop = time.monotonic()
        assert pod.stop_drafter(signal.SIGTERM) == 0
        assert time.monotonic() - t_stop < 20, "SIGTERM must be handled well inside the grace period"
    finally:
        pod.kill()
        target.close()

    windows = pod.windows()
    work = pod.of("work")
    unit_ns = calibrated["unit_ns"]
    assert unit_ns > 0.3 * MS
    # Costs are measured inside a usable window (where the target leaves the device to the drafter),
    # not while the target computes.
    assert any(w["kind"] in KINDS and w["start_ns"] <= calibrated["start_ns"] <= w["start_ns"] + w["actual_ns"]
               for w in windows.values()), "the unit was measured outside every usable window"
    kinds_worked = set()
    for rec in work:
        w = windows.get(rec["window_id"])
        assert w is not None, f"work outside any window: {rec}"
        end = w["start_ns"] + w["actual_ns"]
        assert rec["start_ns"] >= w["start_ns"], "started before the window opened"
        assert rec["end_ns"] - end <= rec["last_task_ns"] + SLACK_NS, "overran by more than one task"
        assert rec["overrun_ns"] == max(0, rec["end_ns"] - end)
        assert w["actual_ns"] >= unit_ns, "worked in a window shorter than the unit"
        assert w["kind"] in KINDS and w["kind"] != "Communication"
        assert rec["busy_ns"] <= rec["end_ns"] - rec["start_ns"]
        kinds_worked.add(w["kind"])
    assert kinds_worked == {"Bubble", "Imbalance"}, "predicted and open-ended windows are both used"

    summary = pod.summary()
    assert summary["reason"] == "Stopped" and summary["windowsWorked"] == len(work)
    assert 0 < summary["harvestEfficiency"] <= 1 and summary["harvestedSecondsByKind"].get("RolloutTail", 0) == 0
    assert summary["acceptanceLength"] >= 1.0 and summary["optimizerSteps"] >= 1
    last_ckpt = pod.of("checkpoint")[-1]
    # SIGTERM flushed everything learnt: the last checkpoint holds every optimizer step (it is the
    # shutdown one, unless a periodic checkpoint had just covered the last step).
    assert summary["version"] == last_ckpt["version"]
    assert last_ckpt["optimizer_steps"] == summary["optimizerSteps"]

    # The export is loadable and the drafter learnt: clearly above an untrained one on fresh text. It is
    # the newest candidate the export gate accepted; every checkpoint after it was refused with a cause.
    drafter, meta = load_drafter(pod.run_dir / "drafter")
    assert meta["version"] == pod.of("export")[-1]["version"] and meta["arch"] == "Eagle"
    later = {e["version"] for e in pod.of("checkpoint") if e["version"] > meta["version"]}
    assert later == {e["version"] for e in pod.of("export_rejected") if e["version"] > meta["version"]}, later
    tokens = text_sequences(6, 64, seed=99)
    hidden = target_hidden(target.model, tokens)
    fresh = build_drafter(DrafterSettings(seed=7), TARGET_CFG)
    assert isinstance(fresh, EagleDrafter)
    fresh.load_target_weights(drafter.embed.weight, drafter.lm_head.weight)
    data = [(tokens[i], hidden[i]) for i in range(6)]
    trained_acc, untrained_acc = measure(drafter, data, None, k=4), measure(fresh, data, None, k=4)
    assert trained_acc.top1 > untrained_acc.top1 + 0.1, (trained_acc.to_dict(), untrained_acc.to_dict())


def test_disabled_drafter_stays_up_idle_and_says_so(tmp_path: Path) -> None:
    spec = SyntheticSpec(windows=[WindowSpec(kind="Bubble", duration_ms=20.0)], compute_ms=2.0, seq_len=32)
    pod = Pod(tmp_path, env={"SPECTRAIN_DRAFTER_ENABLED": "0"})
    target = synthetic_target(pod, spec)
    try:
        proc = pod.start_drafter()
        back = drive(target, target.latest_back, 60, "a back-channel message", proc)
        assert back["state"] == "Disabled"
        for _ in range(20):
            target.run_step()
        assert proc.poll() is None, "a native sidecar that exits is restarted by the kubelet"
        assert pod.stop_drafter(signal.SIGTERM) == 0
    finally:
        pod.kill()
        target.close()
    assert not pod.of("work") and pod.summary()["state"] == "Disabled"
