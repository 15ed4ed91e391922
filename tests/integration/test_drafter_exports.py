"""Exports safe to serve, with the real sidecar next to a synthetic target (real ring, real data).

One exporting drafter, three incarnations on one export volume:
1. versions exported as it trains (v1..v3 at least);
2. restarted with its checkpoints wiped (a restart that lost them): the next export is above every
   version the volume ever had; the versions already there are left as they were;
3. restarted (resuming) with an absolute floor no version can meet (minAcceptance 60 tokens) and the
   comparison with LATEST on: every candidate is measured with LATEST (reloaded from the volume) on
   held-back samples in idle windows, in one paired round, and rejected: counted by cause in the
   summary, logged, never a directory; LATEST stays. The export loads, its sha256 checked.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_workloads.drafter.export import HIGH_WATER, load_drafter
from spectrain_workloads.drafter.synthetic import SyntheticSpec, SyntheticTarget, WindowSpec
from tests.integration.drafter_procs import Pod, drive, synthetic_target

pytestmark = pytest.mark.integration
torch.set_num_threads(1)

# windows long enough for a verification chunk (the gate measures candidates in them) on a loaded machine
SPEC = SyntheticSpec(windows=[WindowSpec(kind="Bubble", duration_ms=80.0)], compute_ms=4.0, data_per_step=2,
                     seq_len=64, seed=0)
SETTINGS = {"checkpoint_every_s": 0.3, "verify_every_s": 0.5, "export_vs_latest": False}


def _digest(d: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file())).hexdigest()


def _versions(export: Path) -> dict[int, Path]:
    return {int(p.name[1:]): p for p in export.glob("v*") if p.is_dir()}


def _incarnation(pod: Pod, target: SyntheticTarget, event: str, count: int, what: str, *,
                 cause: str | None = None, **settings: Any) -> list[dict[str, Any]]:
    """Start the drafter, drive the target until `count` new `event`s (of `cause`, if given), SIGTERM;
    -> those events (all causes)."""
    pod.settings = {**SETTINGS, **settings}
    before = len(pod.of(event))

    def new() -> list[dict[str, Any]]:
        return [e for e in pod.of(event)[before:] if cause is None or e.get("cause") == cause]

    proc = pod.start_drafter()
    drive(target, lambda: len(new()) >= count, 180, what, proc)
    assert pod.stop_drafter(signal.SIGTERM) == 0
    return pod.of(event)[before:]


def test_exports_never_reuse_a_version_and_are_gated_on_acceptance(tmp_path: Path) -> None:
    pod = Pod(tmp_path, drafter={"activation": {"safetyMarginMs": 1}})
    export = pod.run_dir / "drafter"
    target = synthetic_target(pod, SPEC)
    try:
        first = _incarnation(pod, target, "export", 3, "three exports")
        high = max(e["version"] for e in first)
        assert [e["version"] for e in first] == list(range(1, high + 1)), first
        kept = {v: _digest(p) for v, p in _versions(export).items()}

        shutil.rmtree(pod.run_dir / "drafter" / "rank-0")       # the checkpoints are lost
        second = _incarnation(pod, target, "export", 1, "an export of the restarted drafter")
        assert pod.of("setup")[-1]["resumed_version"] is None
        assert second[0]["version"] == high + 1, (high, second)
        high = max(e["version"] for e in second)
        assert json.loads((export / HIGH_WATER).read_text())["high_water"] == high
        assert all(_digest(p) == kept[v] for v, p in _versions(export).items() if v in kept)

        rejected = _incarnation(pod, target, "export_rejected", 2, "two candidates measured and rejected",
                                cause="below_floor", export_vs_latest=True, min_acceptance=60.0)
    finally:
        pod.kill()
        target.close()

    summary = pod.summary()
    assert pod.of("setup")[-1]["resumed_version"] >= high
    assert summary["exportsRejected"] == len(pod.of("export_rejected")) >= 2
    # measured (paired with LATEST, reloaded from the volume) and under the floor; or, before any sample
    # was held back after the restart, not measured: neither becomes LATEST
    by_cause = summary["exportsRejectedByCause"]
    assert sum(by_cause.values()) == summary["exportsRejected"] and by_cause["below_floor"] >= 2, by_cause
    assert {e["cause"] for e in rejected} <= {"below_floor", "unmeasured"}, rejected
    measured = [e for e in rejected if e["cause"] == "below_floor"]
    assert all(e["acceptance_length"] is not None and e["latest_acceptance_length"] is not None
               and e["latest_version"] == high and e["version"] > high and "minAcceptance 60" in e["reason"]
               for e in measured), measured
    assert "minAcceptance" in summary["exportRejectedReason"]
    assert max(_versions(export)) == high and (export / "LATEST").read_text().strip() == f"v{high}"
    assert summary["exportedVersion"] == high
    _, meta = load_drafter(export)
    assert meta["version"] == high and set(meta["sha256"]) == {"model.safetensors"}
    assert meta["gate"]["vs_latest"] is False and meta["gate"]["min_acceptance"] == 0.0
