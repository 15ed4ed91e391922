"""spectrain_api (names, config, rules): one rule set for `spectrain validate` and the workloads.

- every enum value the CRD admits is accepted by the workloads (config builds, the debug-size
  model / drafter / schedule / optimizer / task constructs);
- a grid of specs: whatever `spectrain validate` accepts, the workloads accept at start;
- the CRD's enums and defaults are the contract's and the config dataclasses' (generation fails on drift).
"""

from __future__ import annotations

import copy
import itertools
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_api import config, names
from spectrain_api.config import JobConfig, from_manifest
from spectrain_api.errors import ConfigError
from spectrain_api.names import ASYNC_PIPELINE, PRETRAIN, RL
from spectrain_api.rules import check_spec, require_valid
from spectrain_operator import spec
from spectrain_workloads.drafter.models import build_drafter
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.harvest.schedule import Schedule
from spectrain_workloads.model import Transformer, model_config
from spectrain_workloads.optim import build_optimizer
from spectrain_workloads.ring.records import WindowKind
from spectrain_workloads.rl.grpo import GRPOConfig
from spectrain_workloads.rl.tasks import get_task
from spectrain_workloads.specdec.config import RolloutConfig
from spectrain_workloads.target.async_pipeline import delays
from spectrain_workloads.target.trainer import make_layout
from spectrain_workloads.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
IMAGE = "example.org/spectrain/workloads:0.1.0"


def manifest(spec_: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "job"},
            "spec": {**spec_, "target": {"image": IMAGE, "checkpoint": {"claimName": "run"}, **spec_.get("target", {})}}}


def workload_start(m: dict[str, Any]) -> JobConfig:
    """What the entrypoints check and build before training, without processes or data files."""
    cfg = from_manifest(spec.apply_defaults(m))
    require_valid(cfg)
    DrafterSettings.from_spec(cfg.drafter, seed=cfg.seed)
    t = cfg.target
    if cfg.mode == PRETRAIN:
        make_layout(cfg, cfg.world_size)
    elif cfg.mode == RL:
        assert t.rl is not None
        RolloutConfig.from_rl(t.rl, seed=cfg.seed)
        GRPOConfig(group_size=t.rl.group_size, prompts_per_step=t.data.batch_size, lr=t.optimizer.lr)
        get_task(t.rl.task)
    else:
        config.preset_model_config(t.model)
        delays(t.parallelism.pipeline)
    return cfg


def crd_enum(*path: str) -> list[str]:
    node = spec.schema()["properties"]["spec"]
    for key in path:
        node = node["items"] if key == "[]" else node["properties"][key]
    return list(node["enum"])


def debug_size(preset: str) -> dict[str, Any]:
    """Overrides that keep a preset's structure (GQA, explicit FFN width) at debug size."""
    p = names.TARGET_PRESETS[preset]
    return {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
            "n_kv_heads": 2 if p.get("n_kv_heads") else None, "ffn_dim": 96 if p.get("ffn_dim") else None}


# ------------------------------------------------------------------------- every enum value

@pytest.mark.parametrize("preset", crd_enum("target", "model", "preset"))
def test_every_target_preset_builds(preset: str) -> None:
    cfg = workload_start(manifest({"target": {"model": {"preset": preset}, "data": {"seqLen": 64}}}))
    full = model_config(preset, vocab_size=ByteTokenizer.vocab_size)
    assert full.n_layers == names.TARGET_PRESETS[preset]["n_layers"]
    small = model_config(cfg.target.model.preset, debug_size(preset), vocab_size=ByteTokenizer.vocab_size)
    logits = Transformer(small)(torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, ByteTokenizer.vocab_size)


@pytest.mark.parametrize("arch", crd_enum("drafter", "arch"))
@pytest.mark.parametrize("preset", crd_enum("drafter", "preset"))
def test_every_drafter_arch_and_preset_builds(arch: str, preset: str) -> None:
    cfg = workload_start(manifest({"drafter": {"arch": arch, "preset": preset}}))
    settings = DrafterSettings.from_spec(cfg.drafter)
    target = model_config("debug", vocab_size=ByteTokenizer.vocab_size)
    drafter = build_drafter(settings, target, seed=0)
    assert sum(p.numel() for p in drafter.parameters()) > 0


@pytest.mark.parametrize("mode", crd_enum("mode"))
def test_every_mode_starts(mode: str) -> None:
    target: dict[str, Any] = {"nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 2}}
    if mode == RL:
        target = {"rl": {}}
    assert workload_start(manifest({"mode": mode, "target": target})).mode == mode


@pytest.mark.parametrize("schedule", crd_enum("target", "parallelism", "schedule"))
def test_every_schedule_builds(schedule: str) -> None:
    m = manifest({"target": {"nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 4, "schedule": schedule}}})
    cfg = workload_start(m)
    s = Schedule(name=cfg.target.parallelism.schedule, n_stages=2, microbatches=4)
    assert s.name == schedule


@pytest.mark.parametrize("kind", crd_enum("drafter", "activation", "kinds", "[]"))
@pytest.mark.parametrize("policy", crd_enum("drafter", "activation", "policy"))
def test_every_window_kind_and_policy(kind: str, policy: str) -> None:
    cfg = workload_start(manifest({"drafter": {"activation": {"kinds": [kind], "policy": policy}}}))
    assert DrafterSettings.from_spec(cfg.drafter).kinds == [kind]
    assert WindowKind.from_api_name(kind).api_name == kind


@pytest.mark.parametrize("name", crd_enum("target", "optimizer", "name"))
@pytest.mark.parametrize("geometry", crd_enum("target", "optimizer", "basisRotation", "geometry"))
@pytest.mark.parametrize("source", crd_enum("target", "optimizer", "basisRotation", "source"))
def test_every_optimizer_builds(name: str, geometry: str, source: str) -> None:
    m = manifest({"target": {"optimizer": {"name": name, "basisRotation": {"geometry": geometry, "source": source}}}})
    cfg = workload_start(m)
    opt = build_optimizer(torch.nn.Linear(8, 8), cfg.target.optimizer)
    assert opt.param_groups


@pytest.mark.parametrize("task", crd_enum("target", "rl", "task"))
@pytest.mark.parametrize("strategy", crd_enum("target", "rl", "speculative", "strategy"))
def test_every_rl_task_and_strategy(task: str, strategy: str) -> None:
    cfg = workload_start(manifest({"mode": RL, "target": {"rl": {"task": task, "speculative": {"strategy": strategy}}}}))
    assert cfg.target.rl is not None and get_task(cfg.target.rl.task).__class__.__name__


def test_crd_enums_are_the_contracts() -> None:
    assert crd_enum("mode") == list(names.MODES)
    assert crd_enum("target", "model", "preset") == list(names.TARGET_PRESETS)
    assert crd_enum("drafter", "preset") == list(names.DRAFTER_PRESETS)
    assert crd_enum("drafter", "arch") == list(names.DRAFTER_ARCHS)
    assert crd_enum("drafter", "exchange", "engine") == list(names.EXCHANGE_ENGINES)
    assert crd_enum("drafter", "activation", "kinds", "[]") == list(names.WINDOW_KINDS)
    assert crd_enum("target", "parallelism", "schedule") == list(names.SCHEDULES)
    assert crd_enum("target", "rl", "task") == list(names.RL_TASKS)


# ------------------------------------------------------------------------- validate => workloads accept

def _grid() -> list[dict[str, Any]]:
    rng = random.Random(0)
    axes = itertools.product(list(names.MODES), [1, 2, 3], [1, 2], [1, 2, 3, 4], [4, 6, 8],
                             list(names.SCHEDULES), [None, 6], ["debug", "small"], ["debug", "base"])
    combos = list(axes)
    rng.shuffle(combos)
    out = []
    for mode, pipeline, data, micro, batch, schedule, layers, preset, dpreset in combos[:400]:
        target: dict[str, Any] = {
            "nodes": pipeline * data, "parallelism": {"data": data, "pipeline": pipeline, "microbatches": micro,
                                                      "schedule": schedule},
            "data": {"batchSize": batch, "seqLen": 64},
            "model": {"preset": preset, "overrides": {"n_layers": layers} if layers else {}}}
        if mode == RL:
            target["rl"] = {}
        out.append(manifest({"mode": mode, "target": target, "drafter": {"preset": dpreset}}))
    return out


def test_whatever_validate_accepts_the_workloads_accept_and_refusals_name_the_field() -> None:
    accepted = refused = 0
    for m in _grid():
        errors = spec.validate(m)
        if not errors:
            workload_start(copy.deepcopy(m))
            accepted += 1
            continue
        refused += 1
        assert all(e.startswith(("spec.", "metadata.")) for e in errors), errors
    assert accepted > 40 and refused > 40, (accepted, refused)


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "invalid").glob("*.yaml")), ids=lambda p: p.name)
def test_invalid_examples_refused_by_the_cli(path: Path) -> None:
    from spectrain_operator import cli

    assert cli.main(["validate", "-q", str(path)]) == 1


def test_workload_rules_refused_by_both_sides() -> None:
    """Specs that passed `spectrain validate` before the contract, and that the workloads refuse."""
    cases = {
        "spec.target.data.batchSize": {"target": {"nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 4},
                                                  "data": {"batchSize": 6}}},
        "spec.target.parallelism.pipeline": {"mode": RL, "target": {"nodes": 2, "rl": {},
                                                                    "parallelism": {"pipeline": 2, "microbatches": 2}}},
        "spec.target.parallelism.data": {"mode": ASYNC_PIPELINE, "target": {
            "nodes": 4, "parallelism": {"data": 2, "pipeline": 2, "microbatches": 2}}},
        "spec.drafter.preset": {"drafter": {"preset": "7b"}},
        "spec.target.data.source": {"target": {"data": {"source": "builtin:wikipedia"}}},
        "spec.target.model.overrides": {"target": {"model": {"overrides": {"dim": 60, "n_heads": 8}}}},
    }
    for field, s in cases.items():
        m = manifest(s)
        assert any(e.startswith(field) for e in spec.validate(m)), (field, spec.validate(m))
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            require_valid(from_manifest(spec.apply_defaults(m)))


def test_check_spec_is_empty_for_the_defaults() -> None:
    assert check_spec(JobConfig()) == []


def test_exchange_rules_name_their_fields() -> None:
    cfg = JobConfig()
    cfg.drafter.exchange.bandwidth_m_bps = 0
    cfg.drafter.exchange.combine_every_seconds = 0.5
    errors = check_spec(cfg)
    assert [e.split(":")[0] for e in errors] == ["spec.drafter.exchange.bandwidthMBps",
                                                 "spec.drafter.exchange.combineEverySeconds"], errors
    assert "spec.drafter.exchange.enabled: false" in errors[0]


@pytest.mark.parametrize("bad", [-0.5, 65, float("nan"), float("inf"), True, "2.5"])
def test_min_acceptance_rule_names_its_field_and_the_fix(bad: Any) -> None:
    cfg = JobConfig()
    cfg.drafter.export.min_acceptance = bad
    (error,) = check_spec(cfg)
    assert error.startswith("spec.drafter.export.minAcceptance: ") and "or 0 for no floor" in error, error
    with pytest.raises(ConfigError, match=r"spec\.drafter\.export\.minAcceptance"):
        DrafterSettings(min_acceptance=bad)       # the drafter checks its setting with the same rule


def test_min_acceptance_travels_from_the_manifest_to_the_drafter_settings() -> None:
    cfg = workload_start(manifest({"drafter": {"export": {"minAcceptance": 2.5}}}))   # CRD defaults applied
    assert check_spec(cfg) == [] and cfg.drafter.export.min_acceptance == 2.5
    assert DrafterSettings.from_spec(cfg.drafter).min_acceptance == 2.5
    assert DrafterSettings.from_spec(JobConfig().drafter).min_acceptance == 0.0


# ------------------------------------------------------------------------- generation from the contract

def test_crd_defaults_come_from_the_config_dataclasses() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import crd_def

    node = crd_def.o("x", {"lr": crd_def.n("lr", default=0.5), "name": crd_def.s("name")})

    from dataclasses import dataclass

    @dataclass
    class Opt:
        name: str = "AdamW"
        lr: float = 0.5

    crd_def.workload_defaults(node, Opt, "spec.x")
    assert node["properties"]["name"]["default"] == "AdamW"
    node["properties"]["lr"]["default"] = 0.1
    with pytest.raises(ValueError, match=r"spec\.x\.lr: default 0\.1 here, 0\.5 in Opt\.lr"):
        crd_def.workload_defaults(node, Opt, "spec.x")
    del node["properties"]["name"]
    with pytest.raises(ValueError, match=r"spec\.x\.name: the workloads read it"):
        crd_def.workload_defaults(node, Opt, "spec.x")
    target = spec.schema()["properties"]["spec"]["properties"]["target"]["properties"]
    assert target["parallelism"]["properties"]["schedule"]["default"] == JobConfig().target.parallelism.schedule


def test_the_seam_names_are_spelled_once() -> None:
    """The pods' SPECTRAIN_* variables, the annotations, the API group, kind and plural and the
    supervisor's verdict key are spelled only in spectrain_api.names; a literal anywhere else in
    the operator, the workloads or the API package is a second definition that can drift from the
    one the other side reads."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    seam = {v for k, v in vars(names).items()
            if k.startswith(("ENV_", "ANNOTATION_")) or k in ("GROUP", "KIND", "PLURAL", "API_VERSION",
                                                             "SUPERVISOR_VERDICT_KEY")}
    assert len(seam) > 25
    files = [f for d in ("operator/spectrain_operator", "operator/spectrain_api", "workloads/spectrain_workloads")
             for f in (root / d).rglob("*.py") if f != root / "operator/spectrain_api/names.py"]
    hits = [f"{f.relative_to(root)}:{node.lineno}: {node.value}" for f in files
            for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, ast.Constant) and node.value in seam]
    assert not hits, hits


def test_the_spec_enums_are_compared_through_their_names() -> None:
    """Code that branches on a spec enum (mode, schedule, arch, policy, phase, ...) compares with the
    constant spectrain_api.names unpacks from the CRD's tuple, never a second spelling of the value;
    Kubernetes' own words that happen to be equal (a pod's phase "Failed", restartPolicy "Always")
    stay literal in the modules that read pods."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    enums = {v for k, t in vars(names).items() if k.isupper() and isinstance(t, tuple)
             for v in t if isinstance(v, str) and any(getattr(names, c, None) == v for c in vars(names)
                                                       if c.isupper() and c != k)}
    assert {"Eagle", "Failed", "Interleaved1F1B", "IdleOnly"} <= enums
    kube_words = {"pods.py": set(names.PHASES), "faults.py": set(names.PHASES), "local_layout.py": {"Always"}}
    hits = []
    for d in ("operator/spectrain_operator", "workloads/spectrain_workloads"):
        for f in (root / d).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Compare):
                    hits += [f"{f.relative_to(root)}:{c.lineno}: {c.value!r}" for c in (node.left, *node.comparators)
                             if isinstance(c, ast.Constant) and c.value in enums
                             and c.value not in kube_words.get(f.name, set())]
    assert not hits, hits
