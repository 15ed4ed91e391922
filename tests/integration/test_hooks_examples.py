"""The bring-your-own-trainer examples (examples/byo) under `spectrain run`: target and drafter
processes exactly as the pods would run them, the target being the user's script.

Per example two runs of the same script: `on`, `spectrain run` of its manifest (a drafter sidecar
per pod, the script's hooks publishing), and `off`, the script started directly with only
torchrun's variables (attach() returns the no-op publisher, nothing is wrapped). Checked: the
pipelining example's Bubble windows are, every step and on every rank, the idle slots of
Schedule1F1B with 2 stages and 4 microbatches, in order; the DDP example publishes one
Communication window per gradient bucket; in both the drafters harvest idle time; and the losses
and final weights are bitwise equal on and off.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from spectrain_api import rundir
from spectrain_operator.local_layout import run_volume
from tests.launch import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / "byo" / f"{name}.yaml").read_text())


# Both examples run as shipped (pipelining 60 steps, DDP 150). On a 2-core CPU the DDP example's
# windows are about one drafter unit long: the drafter works in a burst of windows after each cost
# measurement, until costs paid beside the target's compute keep it out, and measures again after
# REMEASURE_AFTER_S without work (drafter/worker_tasks.py). 150 steps leave each rank time for a second
# measurement, so a run harvests nothing only if every burst on both ranks comes up empty.
STEPS = {name: _example(name)["spec"]["target"]["steps"] for name in ("pipelining", "ddp")}


def _spectrain_run(tmp: Path, name: str) -> Path:
    res = subprocess.run([sys.executable, "-m", "spectrain_operator.cli", "run",
                          str(REPO / "examples" / "byo" / f"{name}.yaml"), "--run-dir", str(tmp / "run"), "-q"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp / "run"


def _direct_run(name: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECTRAIN_")}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    script = REPO / "examples" / "byo" / f"{name}_train.py"
    args = [str(a) for a in _example(name)["spec"]["target"]["args"]]
    procs = [subprocess.Popen([sys.executable, str(script), *args], env={**env, "RANK": str(r)}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return [line for log in logs for line in log.splitlines() if line.startswith(("step ", "rank "))]


def _target_lines(run: Path) -> list[str]:
    logs = sorted((run / "logs").glob("*.target.log"))
    assert len(logs) == 2
    return [line for log in logs for line in log.read_text().splitlines() if line.startswith(("step ", "rank "))]


def _windows(run: Path, rank: int) -> list[dict[str, Any]]:
    path = run_volume(run) / "metrics" / f"windows-rank-{rank}.jsonl"
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda w: w["start_ns"])


def _harvested_s(run: Path) -> float:
    return sum(json.loads(p.read_text())["harvestedSeconds"] for _, p in rundir.drafter_summaries(run_volume(run)))


@pytest.fixture(scope="module")
def pipelining(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {"run": _spectrain_run(tmp_path_factory.mktemp("pp"), "pipelining"), "off": _direct_run("pipelining")}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {"run": _spectrain_run(tmp_path_factory.mktemp("ddp"), "ddp"), "off": _direct_run("ddp")}


def test_pipelining_bubbles_are_schedule1f1b_idle_slots_in_order(pipelining: dict[str, Any]) -> None:
    # Schedule1F1B, 2 stages, 4 microbatches: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 and idles before B0
    # (stage 1's F0 + B0) and before B3 (stage 1's B3); rank 1 runs F0 B0 F1 B1 ... and idles before F0
    # (stage 0's F0, and the tail of the previous step). The other receives: B1, B2 on rank 0 and F1..F3
    # on rank 1, Communication windows at their microbatch.
    expected = {0: [("Bubble", 0), ("Communication", 1), ("Communication", 2), ("Bubble", 1)],
                1: [("Bubble", 0), ("Communication", 1), ("Communication", 2), ("Communication", 3)]}
    for rank in (0, 1):
        ws = _windows(pipelining["run"], rank)
        assert {w["step"] for w in ws} == set(range(STEPS["pipelining"]))
        for step in range(STEPS["pipelining"]):
            got = [(w["kind"], w["slot"] if w["kind"] == "Bubble" else w["pos"]) for w in ws
                   if w["step"] == step and w["kind"] != "Imbalance"]
            assert got == expected[rank], (rank, step, got)


def test_pipelining_drafter_harvests_and_training_is_bitwise_unchanged(pipelining: dict[str, Any]) -> None:
    on = _target_lines(pipelining["run"])
    assert sorted(on) == sorted(pipelining["off"])
    assert len([line for line in on if line.startswith("step ")]) == STEPS["pipelining"]
    assert _harvested_s(pipelining["run"]) > 0
    summary = json.loads(rundir.drafter_summary(run_volume(pipelining["run"]), 1).read_text())
    assert summary["dataReceived"] > 0 and summary["samplesTrained"] > 0   # the last stage's hidden states


def _model_bytes() -> int:
    spec = importlib.util.spec_from_file_location("ddp_train", REPO / "examples" / "byo" / "ddp_train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [str(spec.origin)]      # the script reads its step count from argv
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.argv = argv
    return sum(p.numel() * p.element_size() for p in mod.Model().parameters())


def test_ddp_publishes_a_communication_window_per_bucket(ddp: dict[str, Any]) -> None:
    total = _model_bytes()
    for rank in (0, 1):
        ws = [w for w in _windows(ddp["run"], rank) if w["kind"] == "Communication"]
        counts = set()
        for step in range(STEPS["ddp"]):
            buckets = [w for w in ws if w["step"] == step]
            names = sorted(int(w["channel"].removeprefix("dp-bucket-")) for w in buckets)
            assert names == list(range(len(names))), (rank, step, names)     # each bucket once
            assert sum(w["bytes"] for w in buckets) == total                    # every gradient in one bucket
            if step > 0:            # DDP rebuilds its buckets after the first step
                counts.add(len(names))
        assert len(counts) == 1 and counts.pop() >= 2


def test_ddp_drafter_harvests_and_training_is_bitwise_unchanged(ddp: dict[str, Any]) -> None:
    on = _target_lines(ddp["run"])
    assert sorted(on) == sorted(ddp["off"])
    assert len([line for line in on if line.startswith("step ")]) == 2 * STEPS["ddp"]
    assert _harvested_s(ddp["run"]) > 0
