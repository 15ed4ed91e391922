"""Drafter checkpoints (atomic, versioned, fall back past damage) and exports (`load_drafter`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.models import EagleDrafter, build_drafter
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.drafter.sidecar import parse_memory
from spectrain_workloads.model import Transformer, model_config

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

CFG = model_config("debug", {"n_layers": 2, "max_seq_len": 32})


def trained(arch: str = "Eagle", seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = build_drafter(DrafterSettings(arch=arch, seed=seed), CFG)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    out = m(tokens, torch.randn(2, 8, CFG.dim))[0] if isinstance(m, EagleDrafter) else m(tokens)
    out.float().pow(2).mean().backward()
    opt.step()
    return m, opt


def test_checkpoint_roundtrip_restores_model_optimizer_and_state(tmp_path: Path) -> None:
    m, opt = trained()
    ex.save_checkpoint(tmp_path, 3, m, opt, {"combiner": {"samples_trained": 7}}, keep=3)
    m2, opt2 = trained(seed=1)
    state = ex.load_checkpoint(tmp_path, m2, opt2)
    assert state is not None and state["version"] == 3 and state["combiner"] == {"samples_trained": 7}
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)


def test_keep_last_n_damaged_newest_falls_back_and_temp_dirs_are_ignored(tmp_path: Path) -> None:
    m, opt = trained()
    for v in range(1, 6):
        ex.save_checkpoint(tmp_path, v, m, opt, {"v": v}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4", "ckpt-5"]
    (tmp_path / "ckpt-5" / "model.safetensors").write_bytes(b"\0garbage")
    half = tmp_path / ".tmp-ckpt-6-12345"          # what a SIGKILL mid-write leaves
    half.mkdir()
    (half / "state.json").write_text("{")
    assert ex.latest_checkpoint_version(tmp_path) == 5
    state = ex.load_checkpoint(tmp_path, *trained(seed=2))
    assert state is not None and state["version"] == 4 and state["v"] == 4
    ex.clean_temp(tmp_path)
    assert not half.exists()
    assert ex.load_checkpoint(tmp_path / "nothing", *trained()) is None


@pytest.mark.parametrize("arch", ["Eagle", "LM"])
def test_export_latest_and_load_drafter(tmp_path: Path, arch: str) -> None:
    m, _ = trained(arch)
    ex.export_drafter(tmp_path, 1, trained(arch, seed=5)[0], {"note": "old"})
    path = ex.export_drafter(tmp_path, 2, m, {"target_model_config_digest": "abc"})
    assert (tmp_path / "LATEST").read_text().strip() == "v2" and path == tmp_path / "v2"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["arch"] == arch and cfg["version"] == 2 and cfg["vocab_size"] == CFG.vocab_size
    assert cfg["target_model_config_digest"] == "abc"
    loaded, meta = ex.load_drafter(tmp_path)
    assert meta["version"] == 2 and not loaded.training
    assert type(loaded) is (EagleDrafter if arch == "Eagle" else Transformer)
    tokens = torch.randint(0, CFG.vocab_size, (1, 6))
    with torch.no_grad():
        if arch == "Eagle":
            hidden = torch.randn(1, 6, CFG.dim)
            torch.testing.assert_close(loaded(tokens, hidden)[0], m(tokens, hidden)[0], rtol=0, atol=0)
        else:
            torch.testing.assert_close(loaded(tokens), m(tokens), rtol=0, atol=0)
    old, meta1 = ex.load_drafter(tmp_path / "v1")
    assert meta1["note"] == "old"


def test_load_drafter_errors_say_what_to_point_at(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="LATEST or config.json"):
        ex.load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(ConfigError, match="format"):
        ex.load_drafter(tmp_path)


def test_parse_mps_memory_limit() -> None:
    assert parse_memory("8G") == 8 << 30
    assert parse_memory("8Gi") == 8 << 30
    assert parse_memory("512M") == 512 << 20
    assert parse_memory("1024") == 1024
    assert parse_memory("0=2G,1=4G", 1) == 4 << 30
    assert parse_memory("0=2G", 3) is None
    with pytest.raises(ConfigError, match="pinnedMemoryLimit"):
        parse_memory("lots")
