"""`spectrain run` disables a failing drafter in place as the operator does: real processes (the
target and drafter commands replaced by small scripts that play them), the control file in the
kubelet's downward-API format, the run's fleet key and job identity."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from spectrain_api.names import (
    ANNOTATION_DRAFTER_DISABLED,
    ENV_DRAFTER_CONTROL,
    ENV_FLEET_KEY_FILE,
    ENV_JOB_UID,
    ENV_POD_IPS,
    ENV_RESTART_GENERATION,
    EXIT_PEER_FRAME,
)
from spectrain_operator import local, local_layout

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# Pod 0's drafter: exits EXIT_PEER_FRAME on its first two starts (a peer's frame), 1 on the next two
# (its own failures), and idles once its control file says it is disabled; pod 1's drafter runs
# until then and idles too. Each start and each idle is recorded in $MARKS.
DRAFTER = f"""
import os, sys, time, json, pathlib
marks = pathlib.Path(os.environ["MARKS"])
pod = os.environ["SPECTRAIN_POD_NAME"]
ctl = pathlib.Path(os.environ["{ENV_DRAFTER_CONTROL}"])
names = ["{ENV_FLEET_KEY_FILE}", "{ENV_JOB_UID}", "{ENV_RESTART_GENERATION}", "{ENV_POD_IPS}",
         "{ENV_DRAFTER_CONTROL}"]
(marks / (pod + ".env")).write_text(json.dumps({{n: os.environ.get(n) for n in names}}))
with open(marks / (pod + ".starts"), "a") as f:
    f.write("start\\n")
starts = len((marks / (pod + ".starts")).read_text().split())
while True:
    if "{ANNOTATION_DRAFTER_DISABLED}=" in ctl.read_text():
        (marks / (pod + ".idle")).write_text(ctl.read_text())
        while True:
            time.sleep(0.05)
    if pod.endswith("-0"):
        sys.exit({EXIT_PEER_FRAME} if starts <= 2 else 1)
    time.sleep(0.05)
"""

# The target: exits 0 once every pod's drafter idles (2 pods), 3 if that takes a minute.
TARGET = """
import os, sys, time, pathlib
marks = pathlib.Path(os.environ["MARKS"])
deadline = time.monotonic() + 60
while len(list(marks.glob("*.idle"))) < 2:
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
"""


def manifest(tmp_path: Path) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["drafter"]["maxFailures"] = 2
    assert job["spec"]["target"]["nodes"] == 2
    return job


def test_a_drafter_past_max_failures_is_disabled_in_place_and_the_target_finishes(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir = tmp_path / "run"
    run = local_layout.plan(manifest(tmp_path), run_dir, env_overrides={"MARKS": str(marks)})
    for c in run.containers:
        c.argv = [sys.executable, "-c", DRAFTER if c.name == "drafter" else TARGET]
    assert local.execute(run, poll_s=0.05) == 0
    out = json.loads((run_dir / "status.json").read_text())
    assert out == run.outcome and out["phase"] == "Succeeded"
    assert out["drafterDisabled"] is True
    assert out["drafterFailures"] == 2 and out["drafterPeerFailures"] == 2   # peer frames counted apart
    (degraded,) = out["conditions"]
    assert (degraded["type"], degraded["status"], degraded["reason"]) == ("DrafterDegraded", "True", "TooManyFailures")
    # pod 0's drafter: 2 peer frames + 2 own failures, then one more start in which it idles; the
    # target was never restarted (it ran once, to its end)
    assert (marks / "demo-0.starts").read_text().split() == ["start"] * 5
    assert (marks / "demo-1.starts").read_text().split() == ["start"]
    for pod in ("demo-0", "demo-1"):
        control = run_dir / "pods" / pod / "podinfo" / "annotations"
        assert control.read_text() == f'{ANNOTATION_DRAFTER_DISABLED}="TooManyFailures"\n'
        assert (marks / f"{pod}.idle").read_text() == control.read_text()
        env = json.loads((marks / f"{pod}.env").read_text())
        assert env[ENV_DRAFTER_CONTROL] == str(control)
        assert env[ENV_FLEET_KEY_FILE] == str(run_dir / "fleet" / "key")
        assert env[ENV_RESTART_GENERATION] == "0" and env[ENV_POD_IPS] == "127.0.0.1"
        assert env[ENV_JOB_UID] == (run_dir / "fleet" / "job-uid").read_text()


def test_one_fleet_key_and_job_uid_per_run_kept_for_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = local_layout.plan(manifest(tmp_path), run_dir)
    key_file = run_dir / "fleet" / "key"
    key = key_file.read_text()
    assert len(key) == 64 and all(ch in "0123456789abcdef" for ch in key)
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    uid = (run_dir / "fleet" / "job-uid").read_text()
    drafters = [c for c in first.containers if c.name == "drafter"]
    targets = [c for c in first.containers if c.name == "target"]
    assert {c.env[ENV_JOB_UID] for c in drafters} == {uid} and len(uid) == 36
    assert {c.env[ENV_FLEET_KEY_FILE] for c in drafters} == {str(key_file)}
    assert not any(ENV_FLEET_KEY_FILE in c.env or ENV_DRAFTER_CONTROL in c.env for c in targets)
    # --resume: the same key and identity
    again = local_layout.plan(manifest(tmp_path), run_dir)
    assert key_file.read_text() == key and (run_dir / "fleet" / "job-uid").read_text() == uid
    assert {c.env[ENV_JOB_UID] for c in again.containers if c.name == "drafter"} == {uid}
    # another run: another key and identity
    other = tmp_path / "other"
    local_layout.plan(manifest(tmp_path), other)
    assert (other / "fleet" / "key").read_text() != key and (other / "fleet" / "job-uid").read_text() != uid
