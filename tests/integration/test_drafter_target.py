"""The drafter next to the real target (2 pipeline ranks, gloo on CPU): isolation and crash recovery.

Two runs of the same job: `off` (SPECTRAIN_DRAFTER_ENABLED=0, no drafter, nothing published)
and `on` (a drafter sidecar per pod; the last stage's is SIGKILLed mid-run and restarted). The
drafters run with policy Always so that they hammer the CPU and the ring during the whole run,
the harshest setting for isolation (IdleOnly gating is covered with exact timestamps in
test_drafter_synthetic.py). The target's losses and final weights must be bitwise identical,
and the restarted drafter must resume from its last complete checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_workloads.launch import launch_local, node_ring_dir, stop, wait_all
from tests.integration.drafter_procs import REPO, read_jsonl
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

STEPS = 24
BASE_ENV = {"SPECTRAIN_DATA_MAX_BYTES": str(1 << 20), "SPECTRAIN_PUBLISH_FRACTION": "1.0"}


def _config(path: Path) -> Path:
    path.write_text(json.dumps({"metadata": {"name": "t"}, "spec": {"mode": "Pretrain", "seed": 7, "target": {
        "image": "x", "nodes": 2, "procsPerNode": 1,
        "parallelism": {"data": 1, "pipeline": 2, "microbatches": 4, "schedule": "1F1B"},
        "model": {"preset": "debug"}, "data": {"source": "builtin:python-stdlib", "seqLen": 32, "batchSize": 8},
        "optimizer": {"name": "AdamW", "lr": 0.003}, "steps": STEPS, "checkpoint": {"everySteps": 2, "keep": 2}},
        "drafter": {"activation": {"policy": "Always"}}}}))
    return path


def _drafter(root: Path, cfg: Path, node: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")]),
           "SPECTRAIN_CONFIG": str(cfg), "SPECTRAIN_RING_DIR": str(node_ring_dir(root / "ring", node, 2)),
           "SPECTRAIN_RUN_DIR": str(root), "SPECTRAIN_DEVICE": "cpu", "RANK": str(node), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1",
           "SPECTRAIN_DRAFTER_SETTINGS": json.dumps({"checkpoint_every_s": 0.3, "samples_per_step": 4})}
    log = open(root / f"drafter-{node}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "spectrain_workloads.drafter.sidecar"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _final_weights(root: Path, rank: int) -> dict[str, torch.Tensor]:
    state = torch.load(root / "target" / f"rank-{rank}" / f"step-{STEPS}" / "state.pt", map_location="cpu",
                       weights_only=False)
    return state["model"]


def _losses(root: Path, rank: int) -> list[Any]:
    return [line["loss"] for line in read_jsonl(root / "metrics" / f"target-rank-{rank}.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    off = tmp_path_factory.mktemp("off")
    procs = launch_local(_config(off / "cfg.json"), 2, off, off / "ring",
                         env={**BASE_ENV, "SPECTRAIN_DRAFTER_ENABLED": "0"})
    assert wait_all(procs, 240) == [0, 0]

    on = tmp_path_factory.mktemp("on")
    cfg = _config(on / "cfg.json")
    procs = launch_local(cfg, 2, on, on / "ring", env=BASE_ENV)
    drafters = [_drafter(on, cfg, n) for n in range(2)]
    events = on / "metrics" / "drafter-rank-1.jsonl"
    info: dict[str, Any] = {"off": off, "on": on}
    try:
        wait_for(lambda: [e for e in read_jsonl(events) if e["event"] == "checkpoint" and e["version"] >= 2],
                 120, interval=0.05, what="two checkpoints of the last stage's drafter")
        drafters[1].send_signal(signal.SIGKILL)          # mid-run, without warning
        drafters[1].wait()
        info["killed_at_step"] = len(_losses(on, 1))
        info["newest"] = max(e["version"] for e in read_jsonl(events) if e["event"] == "checkpoint")
        drafters[1] = _drafter(on, cfg, 1)
        info["codes"] = wait_all(procs, 240)
        info["setups"] = wait_for(lambda: [e for e in read_jsonl(events) if e["event"] == "setup"][1:], 60,
                                  what="the restarted drafter's setup")
        for d in drafters:
            d.send_signal(signal.SIGTERM)
        info["drafter_codes"] = [d.wait(timeout=60) for d in drafters]
    finally:
        stop(procs, grace_s=0)
        for d in drafters:
            if d.poll() is None:
                d.kill()
                d.wait()
    return info


def test_target_is_bitwise_identical_with_the_drafter_on_and_off(runs: dict[str, Any]) -> None:
    off, on = runs["off"], runs["on"]
    assert runs["codes"] == [0, 0] and runs["drafter_codes"] == [0, 0]
    assert runs["killed_at_step"] < STEPS, "the drafter was killed mid-run"
    for rank in (0, 1):
        assert _losses(on, rank) == _losses(off, rank) and len(_losses(on, rank)) == STEPS
        a, b = _final_weights(on, rank), _final_weights(off, rank)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the drafter did train next to it, on the target's published data
    s = json.loads((on / "drafter-summary-rank-1.json").read_text())
    assert s["samplesTrained"] > 0 and s["dataReceived"] > 0 and s["policy"] == "Always"
    assert not (off / "drafter").exists()


def test_killed_drafter_resumes_from_its_last_complete_checkpoint(runs: dict[str, Any]) -> None:
    on = runs["on"]
    resumed = runs["setups"][0]
    assert resumed["resumed_version"] == runs["newest"]
    ckpts = sorted(p.name for p in (on / "drafter" / "rank-1").iterdir())
    assert all(not n.startswith(".tmp-") for n in ckpts)
    # stage 0 sees windows but never data: it waits and writes no checkpoints
    s0 = json.loads((on / "drafter-summary-rank-0.json").read_text())
    assert s0["samplesTrained"] == 0 and s0["state"] == "Waiting"
