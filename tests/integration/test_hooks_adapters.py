"""The hooks adapters in real 2-rank gloo processes (tests/integration/hooks_worker.py: GPipe, then
Interleaved1F1B, then FSDP2, STEPS steps each, in one pair of processes per run), without
the drafter: ScheduleGPipe and ScheduleInterleaved1F1B publish one Bubble window per idle slot of
the schedule, in order, every step; FSDP2 publishes a Communication window per all-gather /
reduce-scatter; and the weights are bitwise those of the same script with no SpecTrainJob env
(attach() -> the no-op publisher, nothing wrapped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.launch import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "hooks_worker.py"
STEPS = 6


def _run(out: Path, *, hooks_on: bool) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECTRAIN_")}
    base.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo",
                PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "workloads")]))
    if hooks_on:
        cfg = out / "cfg.json"
        cfg.write_text(json.dumps({"metadata": {"name": "t"}, "spec": {"mode": "Pretrain", "target": {
            "image": "x", "nodes": 2, "procsPerNode": 1, "parallelism": {"data": 1, "pipeline": 2, "microbatches": 4},
            "data": {"seqLen": 8, "batchSize": 8}, "steps": 3 * STEPS, "checkpoint": {"claimName": "run"}}}}))
        base.update(SPECTRAIN_RUN_DIR=str(out), SPECTRAIN_CONFIG=str(cfg), SPECTRAIN_DRAFTER_ENABLED="0")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out)], env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return [line for log in logs for line in log.splitlines() if " weights " in line]


def _windows(out: Path, rank: int) -> list[dict[str, Any]]:
    ws = [json.loads(line) for line in (out / "metrics" / f"windows-rank-{rank}.jsonl").read_text().splitlines()]
    return sorted(ws, key=lambda w: w["start_ns"])


def _idle_runs(order: list[str | None]) -> int:
    """Runs of idle steps (None) in a rank's pipeline_order, each before a compute action."""
    return sum(1 for i, a in enumerate(order) if a is None and (i + 1 < len(order) and order[i + 1] is not None))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    on, off = tmp_path_factory.mktemp("on"), tmp_path_factory.mktemp("off")
    return {"on": on, "weights_on": _run(on, hooks_on=True), "weights_off": _run(off, hooks_on=False)}


def _weights(lines: list[str], mode: str) -> list[str]:
    return sorted(line for line in lines if line.startswith(f"{mode} "))


@pytest.mark.parametrize("part, mode, expected", [(0, "GPipe", [1, 1]), (1, "Interleaved1F1B", [5, 4])])
def test_schedule_bubbles_are_the_schedules_idle_slots(runs: dict[str, Any], part: int, mode: str,
                                                       expected: list[int]) -> None:
    assert _weights(runs["weights_on"], mode) == _weights(runs["weights_off"], mode), "weights differ with hooks"
    assert len(_weights(runs["weights_on"], mode)) == 2
    for rank in range(2):
        n_slots = expected[rank]
        if mode == "Interleaved1F1B":    # the schedule's own idle steps: runs of None in pipeline_order
            order = json.loads((runs["on"] / f"order-{mode}-rank-{rank}.json").read_text())
            assert _idle_runs(order) == n_slots
        ws = [w for w in _windows(runs["on"], rank) if part * STEPS <= w["step"] < (part + 1) * STEPS]
        for step in range(part * STEPS, (part + 1) * STEPS):
            slots = [w["slot"] for w in ws if w["step"] == step and w["kind"] == "Bubble"]
            assert slots == list(range(n_slots)), (rank, step, slots)
        # every other receive wait is a Communication window; no send is one
        assert {w["channel"] for w in ws if w["kind"] == "Communication"} <= {"pp-recv-act", "pp-recv-grad"}


def test_fsdp2_collectives_are_communication_windows(runs: dict[str, Any]) -> None:
    assert _weights(runs["weights_on"], "fsdp") == _weights(runs["weights_off"], "fsdp"), "weights differ with hooks"
    for rank in range(2):
        ws = [w for w in _windows(runs["on"], rank) if w["kind"] == "Communication" and w["step"] >= 2 * STEPS]
        for step in range(2 * STEPS, 3 * STEPS):
            chans = sorted(w["channel"] for w in ws if w["step"] == step)
            # two sharded Linear layers: each gathered for the forward and the backward, its
            # gradients reduce-scattered once
            assert chans == sorted(["fsdp-ag-1", "fsdp-ag-1", "fsdp-ag-2", "fsdp-ag-2", "fsdp-rs-1", "fsdp-rs-2"])
        assert ws and all(w["actual_ns"] > 0 for w in ws)
