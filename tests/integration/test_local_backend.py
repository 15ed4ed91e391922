"""The local backend runs the builders' pods as real processes: a short demo end to end,
Ctrl-C + --resume, the render/run identity, and `spectrain validate` on the invalid examples."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spectrain_api import rundir
from spectrain_operator import builders, local_layout, spec
from spectrain_operator.local_layout import run_volume
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPECTRAIN = [sys.executable, "-m", "spectrain_operator.cli"]


def short_demo(tmp_path: Path, steps: int = 8, every: int = 4) -> Path:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["target"]["steps"] = steps
    job["spec"]["target"]["checkpoint"] |= {"everySteps": every, "keep": 2}
    job["spec"]["target"]["data"]["seqLen"] = 64
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_local_backend_runs_exactly_the_rendered_pods(tmp_path: Path) -> None:
    manifest = short_demo(tmp_path)
    rendered = subprocess.run([*SPECTRAIN, "render", str(manifest)], capture_output=True, text=True,
                              check=True, cwd=ROOT).stdout
    pods = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] == "Pod"]
    run = local_layout.plan(local_layout.load_manifest(manifest), tmp_path / "run")
    expected = []
    for pod in pods:
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            expected.append((pod["metadata"]["name"], c["name"], c["command"][-1],
                             sorted(e["name"] for e in c.get("env", []))))
    got = [(c.pod, c.name, Path(c.argv[0]).name, sorted(n for n in c.env if n in {
        e for p in pods for cc in p["spec"].get("initContainers", []) + p["spec"]["containers"]
        for e in (x["name"] for x in cc.get("env", []))})) for c in run.containers]
    assert sorted(got) == sorted(expected)
    # Paths under mounts point into the run's directories, not the container paths.
    ring_dirs = {c.env["SPECTRAIN_RING_DIR"] for c in run.containers}
    assert all(d.startswith(str(run.shm_dir)) for d in ring_dirs)
    assert len(ring_dirs) == len(pods)   # one memory volume per pod, shared by its containers


def test_short_demo_end_to_end_with_resume(tmp_path: Path) -> None:
    # Enough steps that the Ctrl-C, sent at the first checkpoint (step 4), lands mid-run: a step of
    # this demo takes tens of ms, so the run would otherwise be over before the signal arrives.
    steps = 200
    manifest = short_demo(tmp_path, steps=steps, every=4)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*SPECTRAIN, "run", str(manifest), "--run-dir", str(run_dir), "-q"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (run_dir / "layout.json").exists() or proc.poll() is not None, 60, interval=0.1,
             what="the run's layout.json")
    data = run_volume(run_dir)
    # Ctrl-C once the first checkpoint exists: the run stops cleanly with a final checkpoint.
    wait_for(lambda: list(data.glob("target/rank-*/step-*")) or proc.poll() is not None, 240,
             interval=0.2, what="first target checkpoint")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    stopped_at = max(int(p.name.split("-")[1]) for p in data.glob("target/rank-0/step-*"))
    assert stopped_at < steps

    res = subprocess.run([*SPECTRAIN, "run", str(manifest), "--run-dir", str(run_dir), "--resume", "-q",
                          "--report"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr + "".join(
        p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log"))
    done = [json.loads(line)["step"] for line in (data / "metrics" / "target-rank-0.jsonl").read_text().splitlines()]
    assert max(done) + 1 == steps and stopped_at <= max(done)
    # Checkpoints: keep-last-2 per rank, and the drafter's deployable export.
    for rank in (0, 1):
        assert 1 <= len(list(data.glob(f"target/rank-{rank}/step-*"))) <= 2
    latest = data / "drafter" / "LATEST"
    assert latest.exists(), sorted(p.name for p in data.iterdir())
    export = data / "drafter" / latest.read_text().strip()
    assert (export / "model.safetensors").stat().st_size > 0 and (export / "config.json").exists()
    # Everything the drafters wrote is under drafter/ (their read-write part of the run volume).
    assert [r for r, _ in rundir.drafter_summaries(data)] == [0, 1]
    assert [r for r, _ in rundir.drafter_metrics_files(data)] == [0, 1]
    assert sorted(p.name for p in data.iterdir() if "drafter" in p.name) == [rundir.DRAFTER_DIR]
    assert not list((data / "metrics").glob("*drafter*"))
    # The report: markdown, a non-empty timeline image, and the headline on stdout.
    report = run_dir / "report" / "report.md"
    assert report.exists() and "timeline.png" in report.read_text()
    assert (run_dir / "report" / "timeline.png").stat().st_size > 10_000
    assert "harvest_efficiency" in res.stdout and str(report) in res.stdout
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["idle_s"] > 0 and summary["idle_s_by_kind"]["Bubble"] > 0
    # the report read the drafters' summaries and logs at their places
    assert summary["artifact"] and Path(summary["artifact"]).parent == data / rundir.DRAFTER_DIR
    from spectrain_workloads.report.data import load

    assert all(rd.summary.get("state") and rd.drafter for rd in load(run_dir).values())


def test_fresh_run_refuses_a_used_run_dir(tmp_path: Path) -> None:
    manifest = short_demo(tmp_path)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "job.json").write_text("{}")
    res = subprocess.run([*SPECTRAIN, "run", str(manifest), "--run-dir", str(tmp_path / "used")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and "--resume" in res.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "invalid").glob("*.yaml")), ids=lambda p: p.stem)
def test_validate_rejects_invalid_examples_naming_the_field(path: Path) -> None:
    res = subprocess.run([*SPECTRAIN, "validate", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines and all(ln.startswith(str(path)) for ln in lines)
    assert any("spec" in ln or "metadata" in ln for ln in lines), res.stdout


def test_run_refuses_an_invalid_manifest_before_starting_anything(tmp_path: Path) -> None:
    bad = ROOT / "examples" / "invalid" / "layers-not-divisible.yaml"
    res = subprocess.run([*SPECTRAIN, "run", str(bad), "--run-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "pipeline" in res.stderr
    assert not (tmp_path / "r" / "logs").exists()


def test_valid_examples_validate() -> None:
    files = [str(p) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    res = subprocess.run([*SPECTRAIN, "validate", *files], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout
    for f in files:
        job = spec.defaulted(local_layout.load_manifest(f))
        assert [o for o in builders.build_children(job) if o["kind"] == "Pod"]
