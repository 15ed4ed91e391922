"""A hostile drafter against a real target run: it tries to resize the ring (through its fd and its
path), to lift the seals, punches holes and scribbles random bytes over all of it while the target
trains. The target must finish with losses and weights bitwise equal to a run without it."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import ring_workers as W
from tests.launch import launch_local, wait_all

pytestmark = pytest.mark.integration

CTX = mp.get_context("spawn")
STEPS = 8
RUN_TIMEOUT_S = 240


@pytest.fixture
def shm() -> Iterator[Path]:
    d = Path("/dev/shm") / f"spectrain-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _config(path: Path) -> Path:
    manifest = {
        "apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "t"},
        "spec": {"mode": "Pretrain", "seed": 7, "target": {
            "image": "x", "nodes": 1, "procsPerNode": 1,
            "parallelism": {"data": 1, "pipeline": 1, "microbatches": 2},
            "model": {"preset": "debug"},
            "data": {"source": "builtin:python-stdlib", "seqLen": 32, "batchSize": 8},
            "optimizer": {"name": "AdamW", "lr": 0.003},
            "steps": STEPS, "checkpoint": {"everySteps": STEPS, "keep": 1}}}}
    path.write_text(json.dumps(manifest))
    return path


def _train(root: Path, ring_dir: Path, cfg: Path, hostile: bool) -> dict[str, Any] | None:
    """One single-rank target run (it publishes windows and hidden states to its ring); with
    `hostile`, the attacking drafter runs alongside it. Returns the attacker's report."""
    ring_dir.mkdir()
    procs = launch_local(cfg, 1, root, ring_dir, env={"SPECTRAIN_DATA_MAX_BYTES": str(1 << 20)})
    attacker, out = None, CTX.Queue()
    if hostile:
        attacker = CTX.Process(target=W.hostile_drafter, args=(str(ring_dir / "ring-0"), out, 1234), daemon=True)
        attacker.start()
    try:
        codes = wait_all(procs, RUN_TIMEOUT_S)
        assert codes == [0], (root / "logs" / "node-0.log").read_text()[-3000:]
        return out.get(timeout=60) if attacker is not None else None
    finally:
        if attacker is not None:
            attacker.join(10)
            if attacker.is_alive():
                attacker.kill()


def _losses(root: Path) -> list[float]:
    lines = (root / "metrics" / "target-rank-0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _weights(root: Path) -> dict[str, Any]:
    import torch

    state = torch.load(root / "target" / "rank-0" / f"step-{STEPS}" / "state.pt", weights_only=False)
    return dict(state["model"])


def test_a_drafter_that_truncates_or_scribbles_cannot_change_the_target(shm: Path, tmp_path: Path) -> None:
    import torch

    cfg = _config(tmp_path / "cfg.json")
    _train(tmp_path / "clean", shm / "clean", cfg, hostile=False)
    report = _train(tmp_path / "attacked", shm / "attacked", cfg, hostile=True)
    assert report is not None
    # The memory cannot change size, by its fd or by its path (a socket), and the seals stay.
    assert report["attacks"] == {"ftruncate_fd_shrink": "EPERM", "ftruncate_fd_grow": "EPERM",
                                 "truncate_path": "EINVAL", "open_path_o_trunc": "ENXIO",
                                 "add_seal_write": "EPERM"}, report
    assert report["size_after"] == report["size"] and report["holes_punched"] > 0
    assert report["scribbles"] > 50 and "reader_error" not in report, report
    assert report["records_corrupt"] > 0, report  # its own reader skipped what it broke, and counted it
    assert len(_losses(tmp_path / "clean")) == STEPS
    assert _losses(tmp_path / "attacked") == _losses(tmp_path / "clean")
    clean, attacked = _weights(tmp_path / "clean"), _weights(tmp_path / "attacked")
    assert clean.keys() == attacked.keys()
    assert all(torch.equal(clean[k], attacked[k]) for k in clean)
