"""A drafter the operator disabled before it started: the real sidecar process next to a synthetic
target. It never opens the ring (not mapped), builds no model, says Disabled/DisabledByOperator in its
summary and stays up until SIGTERM, then exits 0. (Disabled mid-run next to the real target, with the
target's result bitwise unchanged: test_drafter_target.py.)"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from spectrain_api import rundir
from spectrain_api.names import ANNOTATION_DRAFTER_DISABLED, ENV_DRAFTER_CONTROL
from spectrain_workloads.drafter.synthetic import SyntheticSpec, WindowSpec
from tests.integration.drafter_procs import Pod, drive, synthetic_target

pytestmark = pytest.mark.integration


def test_a_drafter_disabled_from_the_start_never_touches_the_ring(tmp_path: Path) -> None:
    control = tmp_path / "podinfo" / "annotations"
    control.parent.mkdir()
    control.write_text(f'{ANNOTATION_DRAFTER_DISABLED}="DrafterCrashLoop"\n')
    pod = Pod(tmp_path, env={ENV_DRAFTER_CONTROL: str(control)})
    spec = SyntheticSpec(windows=[WindowSpec(kind="Bubble", duration_ms=20.0)], compute_ms=2.0, seq_len=32)
    target = synthetic_target(pod, spec)
    try:
        proc = pod.start_drafter()
        summary = drive(target, lambda: rundir.drafter_summary(pod.run_dir, 0).exists() and pod.summary(),
                        60, "the disabled drafter's summary", proc)
        assert (summary["state"], summary["reason"]) == ("Disabled", "DisabledByOperator")
        for _ in range(20):
            target.run_step()
        assert proc.poll() is None, "a native sidecar that exits is restarted by the kubelet"
        assert str(pod.ring_dir / "ring-0") not in Path(f"/proc/{proc.pid}/maps").read_text()
        assert target.latest_back() is None, "nothing on the back channel: the ring was never opened"
        assert pod.stop_drafter(signal.SIGTERM) == 0
    finally:
        pod.kill()
        target.close()
    drafter_dir = rundir.drafter_dir(pod.run_dir)
    assert not pod.events(), "no model"
    assert sorted(p.name for p in drafter_dir.iterdir()) == [rundir.drafter_summary(pod.run_dir, 0).name], \
        "no checkpoint, no export: only the summary in the drafter's directory"
