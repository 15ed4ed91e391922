"""spec.drafter.arch Eagle3 in the API: the rules of spectrain_api.eagle3 (feature layers, draft
vocabulary, TTT steps, which stages publish features), the arch default of `from_manifest`, and the
checks `check_spec` makes of the EAGLE-3 fields. Torch-free, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from spectrain_api import config, eagle3
from spectrain_api.errors import ConfigError
from spectrain_api.names import (
    ASYNC_PIPELINE,
    BYTE_VOCAB_SIZE,
    DRAFTER_ARCHS,
    EAGLE,
    EAGLE3,
    INTERLEAVED,
    LM,
    PRETRAIN,
    RL,
    TARGET_PRESETS,
)
from spectrain_api.rules import check_spec, eagle3_target_errors

pytestmark = pytest.mark.unit

HF_PATH = "file:///models/llama"


def manifest(mode: str | None = None, drafter: dict[str, Any] | None = None, **target: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"target": {"image": "img:1", "checkpoint": {"claimName": "run"}, **target}}
    if mode is not None:
        spec["mode"] = mode
    if mode == RL:
        spec["target"]["rl"] = {}
    if drafter is not None:
        spec["drafter"] = drafter
    return {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "j"}, "spec": spec}


def errors(mode: str | None = None, drafter: dict[str, Any] | None = None, **target: Any) -> list[str]:
    return check_spec(config.from_manifest(manifest(mode, drafter, **target)))


def test_the_archs_and_their_constants() -> None:
    assert DRAFTER_ARCHS == (EAGLE, LM, EAGLE3) == ("Eagle", "LM", "Eagle3")


# ------------------------------------------------------------------------- feature layers

@pytest.mark.parametrize("L, expected", [(3, (0, 1, 2)), (4, (1, 2, 3)), (6, (3, 4, 5)), (7, (2, 3, 4)),
                                         (8, (2, 4, 5)), (32, (2, 16, 29))])
def test_default_feature_layers(L: int, expected: tuple[int, int, int]) -> None:
    assert eagle3.default_feature_layers(L) == expected
    assert eagle3.check_feature_layers(expected, L) == expected


@pytest.mark.parametrize("L", [0, 1, 2])
def test_default_feature_layers_need_three_layers(L: int) -> None:
    with pytest.raises(ConfigError, match=rf"at least 3 layers.*has {L}; use arch Eagle$"):
        eagle3.default_feature_layers(L)


@pytest.mark.parametrize("bad", [(1, 1, 2), (3, 2, 4), (0, 2, 7), (-1, 2, 3), (1, 2), (1, 2, 3, 4), (0, 1.5, 3),
                                 (0, True, 3)])
def test_check_feature_layers_names_field_value_range_and_fix(bad: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError) as exc:
        eagle3.check_feature_layers(bad, 7)
    msg = str(exc.value)
    assert msg.startswith(f"spec.drafter.featureLayers {list(bad)}: ")
    assert "strictly increasing" in msg and "[0, 7)" in msg and "leave it out" in msg
    assert "[2, 3, 4]" in msg   # the default for this target: the fix


def test_check_feature_layers_other_field_name_and_short_targets() -> None:
    with pytest.raises(ConfigError, match=r"^featureLayers \[0, 1, 2\]: .*\[0, 2\).*use arch Eagle"):
        eagle3.check_feature_layers([0, 1, 2], 2, field="featureLayers")
    assert eagle3.check_feature_layers([0, 1, 2], 3) == (0, 1, 2)


def test_feature_layers_of_a_drafter_spec() -> None:
    assert eagle3.feature_layers(config.DrafterSpec(arch=EAGLE3), 32) == (2, 16, 29)
    assert eagle3.feature_layers(config.DrafterSpec(arch=EAGLE3, feature_layers=[1, 5, 9]), 32) == (1, 5, 9)
    with pytest.raises(ConfigError, match="spec.drafter.featureLayers"):
        eagle3.feature_layers(config.DrafterSpec(arch=EAGLE3, feature_layers=[1, 5, 32]), 32)


# ------------------------------------------------------------------------- stages that publish features

@pytest.mark.parametrize("L, P, layers, expected", [
    (4, 1, (1, 2, 3), {0: (1, 2, 3)}),
    (4, 2, (1, 2, 3), {0: (1,), 1: (2, 3)}),
    (4, 4, (1, 2, 3), {1: (1,), 2: (2,), 3: (3,)}),
    (4, 2, (0, 1, 3), {0: (0, 1), 1: (3,)}),
    (8, 1, (2, 4, 5), {0: (2, 4, 5)}),
    (8, 2, (2, 4, 5), {0: (2,), 1: (4, 5)}),
    (8, 4, (2, 4, 5), {1: (2,), 2: (4, 5)}),
    (8, 4, (0, 1, 7), {0: (0, 1), 3: (7,)}),
])
def test_feature_stages(L: int, P: int, layers: tuple[int, ...], expected: dict[int, tuple[int, ...]]) -> None:
    assert eagle3.feature_stages(layers, L, P) == expected


def test_feature_stages_refuses_bad_layers_and_pipelines() -> None:
    with pytest.raises(ConfigError, match="spec.drafter.featureLayers"):
        eagle3.feature_stages((1, 2, 8), 8, 2)
    with pytest.raises(ConfigError, match="spec.target.parallelism.pipeline"):
        eagle3.feature_stages((1, 2, 3), 8, 0)


# ------------------------------------------------------------------------- draft vocabulary, TTT steps

def test_draft_vocab_size_default_and_errors() -> None:
    assert eagle3.resolve_draft_vocab_size(None, 264) == 264
    assert eagle3.resolve_draft_vocab_size(None, 128256) == 32768
    assert eagle3.resolve_draft_vocab_size(1, 264) == 1
    assert eagle3.resolve_draft_vocab_size(264, 264) == 264
    with pytest.raises(ConfigError) as exc:
        eagle3.resolve_draft_vocab_size(500, 264)
    assert str(exc.value).startswith("spec.drafter.draftVocabSize 500 > the target's vocab 264: ")
    assert str(exc.value).endswith("set it <= 264 or leave it out (default min(32768, vocab))")
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ConfigError, match=r"^spec.drafter.draftVocabSize .*: must be an integer >= 1"):
            eagle3.resolve_draft_vocab_size(bad, 264)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^draftVocabSize 9 > the target's vocab 8"):
        eagle3.resolve_draft_vocab_size(9, 8, field="draftVocabSize")


def test_ttt_steps_range() -> None:
    lo, hi = eagle3.TTT_STEPS_RANGE
    assert (lo, hi) == (1, 8)
    assert [eagle3.check_ttt_steps(k) for k in (lo, 3, hi)] == [lo, 3, hi]
    for bad in (0, 9, -1, True, 2.0):
        with pytest.raises(ConfigError, match=r"^spec.drafter.tttSteps .*: must be an integer in 1..8"):
            eagle3.check_ttt_steps(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- the arch default

def test_arch_default_resolution() -> None:
    assert config.from_manifest(manifest()).drafter.arch == EAGLE                          # a preset
    assert config.from_manifest(manifest(model={"preset": "small"})).drafter.arch == EAGLE
    assert config.from_manifest(manifest(model={"path": HF_PATH})).drafter.arch == EAGLE3  # Hugging Face
    assert config.from_manifest(manifest(PRETRAIN, {}, model={"path": HF_PATH})).drafter.arch == EAGLE3
    assert config.from_manifest(manifest(PRETRAIN, {"arch": None}, model={"path": HF_PATH})).drafter.arch == EAGLE3
    # mode RL's rollouts publish the final hidden state only: an HF target keeps EAGLE-1 there
    assert config.from_manifest(manifest(RL, model={"path": HF_PATH})).drafter.arch == EAGLE
    for arch in DRAFTER_ARCHS:                                                              # explicit: kept
        assert config.from_manifest(manifest(drafter={"arch": arch}, model={"path": HF_PATH})).drafter.arch == arch
        assert config.from_manifest(manifest(drafter={"arch": arch})).drafter.arch == arch
    assert config.JobConfig().drafter.arch == EAGLE                                         # built directly
    assert config.DrafterSpec().ttt_steps == 3
    assert config.DrafterSpec().feature_layers is None and config.DrafterSpec().draft_vocab_size is None


def test_new_fields_read_from_camel_case() -> None:
    d = config.from_manifest(manifest(drafter={"arch": EAGLE3, "featureLayers": [0, 1, 3], "draftVocabSize": 200,
                                               "tttSteps": 5})).drafter
    assert (d.feature_layers, d.draft_vocab_size, d.ttt_steps) == ([0, 1, 3], 200, 5)


def test_the_crd_has_no_arch_default_but_the_new_fields() -> None:
    from spectrain_operator import spec

    drafter = spec.defaulted(manifest())["spec"]["drafter"]
    assert "arch" not in drafter and drafter["tttSteps"] == 3
    assert "featureLayers" not in drafter and "draftVocabSize" not in drafter
    assert spec.validate(manifest(drafter={"featureLayers": [3, 2, 1], "arch": EAGLE3})) == [
        "spec.drafter.featureLayers must be strictly increasing"]
    assert spec.validate(manifest(drafter={"tttSteps": 9}))[0].startswith("spec.drafter.tttSteps")


# ------------------------------------------------------------------------- check_spec

def test_eagle3_on_presets_is_valid() -> None:
    assert errors(drafter={"arch": EAGLE3}) == []                                   # debug: 4 layers -> (1, 2, 3)
    assert errors(drafter={"arch": EAGLE3, "featureLayers": [0, 1, 3], "draftVocabSize": 264, "tttSteps": 8}) == []
    assert errors(drafter={"arch": EAGLE3}, model={"preset": "small"}) == []
    assert errors(PRETRAIN, model={"path": HF_PATH}) == []                          # the default arch on HF


@pytest.mark.parametrize("key, value", [("featureLayers", [0, 1, 2]), ("draftVocabSize", 100)])
@pytest.mark.parametrize("arch", [EAGLE, LM])
def test_eagle3_fields_with_another_arch(key: str, value: Any, arch: str) -> None:
    assert errors(drafter={"arch": arch, key: value}) == [
        f"spec.drafter.{key}: only spec.drafter.arch: {EAGLE3} reads it (arch is {arch}); "
        f"remove it or set arch {EAGLE3}"]


def test_eagle3_fields_without_arch_on_a_preset() -> None:
    # no arch on a preset resolves to Eagle: the field is then refused, naming it
    assert errors(drafter={"featureLayers": [0, 1, 2]})[0].startswith("spec.drafter.featureLayers: only")


@pytest.mark.parametrize("steps", [0, 9])
def test_ttt_steps_out_of_range(steps: int) -> None:
    errs = errors(drafter={"arch": EAGLE3, "tttSteps": steps})
    assert len(errs) == 1 and errs[0].startswith(f"spec.drafter.tttSteps {steps}: must be an integer in 1..8")


@pytest.mark.parametrize("mode", [RL, ASYNC_PIPELINE])
def test_eagle3_only_in_pretrain(mode: str) -> None:
    target: dict[str, Any] = {}
    if mode == ASYNC_PIPELINE:
        target = {"nodes": 2, "parallelism": {"pipeline": 2, "microbatches": 2}}
    errs = errors(mode, {"arch": EAGLE3}, **target)
    assert errs == [f"spec.drafter.arch: {EAGLE3} trains in mode {PRETRAIN} (its stages publish the feature "
                    f"layers); mode {RL}'s rollout engine and {ASYNC_PIPELINE} publish the final hidden state only: "
                    f"use arch {EAGLE}"]
    assert errors(mode, {"arch": EAGLE}, **target) == []


def test_eagle3_not_under_interleaved() -> None:
    par = {"pipeline": 2, "microbatches": 2, "schedule": INTERLEAVED}
    errs = errors(PRETRAIN, {"arch": EAGLE3}, nodes=2, parallelism=par)
    assert len(errs) == 1 and errs[0].startswith(f"spec.target.parallelism.schedule: arch {EAGLE3} does not train")
    assert errors(PRETRAIN, {"arch": EAGLE}, nodes=2, parallelism=par) == []


def test_feature_layers_against_the_preset() -> None:
    n = TARGET_PRESETS["debug"]["n_layers"]
    errs = errors(drafter={"arch": EAGLE3, "featureLayers": [1, 2, n]})
    assert len(errs) == 1 and errs[0].startswith(f"spec.drafter.featureLayers [1, 2, {n}]: ")
    assert f"[0, {n})" in errs[0]
    errs = errors(drafter={"arch": EAGLE3}, model={"preset": "debug", "overrides": {"n_layers": 2}})
    assert errs == ["spec.drafter.arch: Eagle3 needs a target of at least 3 layers (three distinct feature layers), "
                    "this one has 2; use arch Eagle"]


def test_draft_vocab_against_the_preset() -> None:
    errs = errors(drafter={"arch": EAGLE3, "draftVocabSize": 500})
    assert errs == [f"spec.drafter.draftVocabSize 500 > the target's vocab {BYTE_VOCAB_SIZE}: the draft vocabulary "
                    f"is a subset of the target's; set it <= {BYTE_VOCAB_SIZE} or leave it out (default min(32768, "
                    "vocab))"]


def test_hf_target_leaves_the_shape_to_the_workloads() -> None:
    # the layer count and vocab of a model at a path are known where its config.json is read
    assert errors(PRETRAIN, {"featureLayers": [1, 2, 999], "draftVocabSize": 10 ** 6}, model={"path": HF_PATH}) == []
    cfg = config.from_manifest(manifest(PRETRAIN, {"featureLayers": [1, 2, 999], "draftVocabSize": 10 ** 6},
                                        model={"path": HF_PATH}))
    errs = eagle3_target_errors(cfg, 32, 128256)
    assert [e.split(" ")[0] for e in errs] == ["spec.drafter.featureLayers", "spec.drafter.draftVocabSize"]
    assert eagle3_target_errors(cfg, None, None) == []
    cfg.drafter.arch = EAGLE
    assert eagle3_target_errors(cfg, 2, 1) == []


def test_feature_layers_off_the_last_stage_need_the_exchange() -> None:
    par = {"pipeline": 2, "microbatches": 2}
    off = {"arch": EAGLE3, "exchange": {"enabled": False}}
    over = {"preset": "debug", "overrides": {"n_layers": 8}}    # default (2, 4, 5): layer 2 on stage 0
    errs = errors(PRETRAIN, off, nodes=2, parallelism=par, model=over)
    assert len(errs) == 1 and errs[0].startswith("spec.drafter.exchange.enabled: false, but feature layers [2, 4, 5] "
                                                 "lie on pipeline stage(s) [0]")
    assert errors(PRETRAIN, {**off, "featureLayers": [4, 5, 6]}, nodes=2, parallelism=par, model=over) == []
    assert errors(PRETRAIN, off, model=over) == []            # one stage holds everything
    assert errors(PRETRAIN, {**off, "arch": EAGLE}, nodes=2, parallelism=par, model=over) == []
