"""Real 2-stage asynchronous pipeline on gloo (loopback): it trains, it equals the simulator with
the same staleness, its staleness-0 variant equals synchronous training, and a resumed run ends
bitwise where the uninterrupted one does."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sysconfig
from pathlib import Path

import pytest
import torch

from spectrain_api.config import (
    BasisRotationSpec,
    CheckpointSpec,
    DataSpec,
    JobConfig,
    ModelSpec,
    OptimizerSpec,
    Parallelism,
    TargetSpec,
)
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus
from spectrain_workloads.model import Transformer, model_config
from spectrain_workloads.optim import build_optimizer
from spectrain_workloads.target import async_pipeline as ap
from spectrain_workloads.tokenizer import ByteTokenizer

pytestmark = pytest.mark.integration
STEPS = 10


def _cfg(source: str, steps: int = STEPS) -> JobConfig:
    return JobConfig(mode="AsyncPipeline", seed=0, target=TargetSpec(
        nodes=2, parallelism=Parallelism(pipeline=2, microbatches=2),
        model=ModelSpec(preset="debug", overrides={"dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32}),
        data=DataSpec(source=source, seq_len=16, batch_size=4),
        optimizer=OptimizerSpec(name="BasisRotation", lr=3e-3, basis_rotation=BasisRotationSpec(refresh_every=3)),
        steps=steps, checkpoint=CheckpointSpec(every_steps=5, keep=2, claim_name="run")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, source: str, root: str, ports: list[int]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", SPECTRAIN_DEVICE="cpu", SPECTRAIN_TORCH_THREADS="1",
                      GLOO_SOCKET_IFNAME="lo")
    os.environ.pop("SPECTRAIN_RING_DIR", None)
    phases = [("async", STEPS, None), ("sync", STEPS, 0), ("resumed", STEPS // 2, None), ("resumed", STEPS, None)]
    for port, (name, steps, cap) in zip(ports, phases, strict=True):
        os.environ.update(MASTER_PORT=str(port), SPECTRAIN_RUN_DIR=str(Path(root) / name))
        ap.run(_cfg(source, steps), max_staleness=cap)


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics" / "target-rank-1.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in range(2):
        out.update(torch.load(run_dir / "target" / f"rank-{r}" / f"step-{STEPS}" / "state.pt")["model"])
    return out


def _simulate(source: str, max_staleness: int | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = _cfg(source)
    mcfg = model_config("debug", cfg.target.model.overrides, vocab_size=ByteTokenizer.vocab_size)
    model = Transformer(mcfg)
    model.init_weights(cfg.seed)
    opts = [build_optimizer(ap.stage_named_params(model, k, 2), cfg.target.optimizer, stage=k, n_stages=2)
            for k in range(2)]
    loader = TokenLoader(load_corpus(source), LoaderSpec(seq_len=16, batch_size=4, seed=cfg.seed))
    res = ap.simulate(model, opts, loader.batch, STEPS, max_staleness=max_staleness,
                      lr_at=lambda t: ap.lr_scale(t, STEPS))
    return res.losses, model.state_dict()


def test_two_stage_async_pipeline(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text.write_bytes((stdlib / "json" / "decoder.py").read_bytes() + (stdlib / "json" / "encoder.py").read_bytes())
    source = f"file://{text}"
    ctx = mp.get_context("spawn")
    ports = [_free_port() for _ in range(4)]
    procs = [ctx.Process(target=_worker, args=(r, source, str(tmp_path), ports)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    torch.set_num_threads(1)
    async_losses = _losses(tmp_path / "async")
    assert len(async_losses) == STEPS
    assert sum(async_losses[-3:]) < sum(async_losses[:3])             # it trains

    sim_losses, sim_weights = _simulate(source, None)                 # same staleness, one process
    torch.testing.assert_close(torch.tensor(async_losses), torch.tensor(sim_losses), rtol=0, atol=1e-5)
    weights = _final_weights(tmp_path / "async")
    assert weights.keys() == sim_weights.keys()
    for n, w in weights.items():
        torch.testing.assert_close(w, sim_weights[n], rtol=0, atol=1e-5)

    sync_losses, _ = _simulate(source, 0)                             # staleness-0 equivalent
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "sync")), torch.tensor(sync_losses), rtol=0, atol=1e-5)
    assert sync_losses != sim_losses

    resumed = _final_weights(tmp_path / "resumed")                    # crash at step 5, resume to 10
    for n, w in weights.items():
        assert torch.equal(w, resumed[n]), n
    assert _losses(tmp_path / "resumed")[-STEPS // 2:] == async_losses[-STEPS // 2:]

    progress = json.loads((tmp_path / "async" / "progress.json").read_text())
    assert progress["step"] == STEPS and progress["loss"] == pytest.approx(async_losses[-1])
    assert (tmp_path / "async" / "target" / "shared" / "lm_head.safetensors").is_file()
    assert (tmp_path / "async" / "target" / "shared" / "embedding.safetensors").is_file()
    assert sorted(os.listdir(tmp_path / "async" / "target" / "rank-0")) == ["step-10", "step-5"]
