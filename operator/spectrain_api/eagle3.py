"""The rules of an EAGLE-3 drafter (`spec.drafter.arch: Eagle3`), defined once: the operator's
`check_spec` (spectrain_api.rules) and the workloads (drafter/eagle3.py, the feature-publishing
stages) call these. Torch-free: the operator image has no torch.

Feature layers follow the serving engines and speculators: layer id i means the target's residual
stream *before* layer i (transformers' `hidden_states[i]`, index 0 = the embeddings), so valid ids
are 0..L-1 for a target of L layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spectrain_api.errors import ConfigError

FEATURE_LAYERS_FIELD = "spec.drafter.featureLayers"
DRAFT_VOCAB_FIELD = "spec.drafter.draftVocabSize"
TTT_STEPS_FIELD = "spec.drafter.tttSteps"
MIN_TARGET_LAYERS = 3             # three distinct feature layers
DEFAULT_LAYERS_MIN = 7            # (2, L//2, L-3) is strictly increasing from L = 7 on
DRAFT_VOCAB_DEFAULT = 32768       # speculators / SpecForge's usual draft vocabulary
TTT_STEPS_RANGE = (1, 8)          # training-time-test unroll steps (spec.drafter.tttSteps)
TTT_STEPS_DEFAULT = 3             # speculators' `ttt_steps` default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L//2, L-3) for L >= 7: speculators `models/utils.py resolve_target_layer_ids`, SGLang's
    `set_eagle3_layers_to_capture(None)` and vLLM's `get_eagle3_aux_hidden_state_layers` default,
    all "residual stream before layer i" (= transformers hidden_states[i]); the last three layers
    (L-3, L-2, L-1) for 3 <= L < 7; ConfigError below 3 layers."""
    L = num_layers
    if not _is_int(L) or L < MIN_TARGET_LAYERS:
        raise ConfigError(f"spec.drafter.arch: Eagle3 needs a target of at least {MIN_TARGET_LAYERS} layers "
                          f"(three distinct feature layers), this one has {L}; use arch Eagle")
    if L < DEFAULT_LAYERS_MIN:
        return L - 3, L - 2, L - 1
    return 2, L // 2, L - 3


def check_feature_layers(layers: Sequence[int], num_layers: int,
                         field: str = FEATURE_LAYERS_FIELD) -> tuple[int, int, int]:
    """Three strictly increasing layer ids in [0, L): the engines concatenate the captured states in
    layer order, so fc's three input blocks are [low, mid, high] whatever the config lists; L itself
    (transformers' last hidden_states entry) carries the final norm, not the residual stream."""
    try:
        ids = list(layers)
    except TypeError:
        ids = [layers]   # type: ignore[list-item]
    ok = (len(ids) == 3 and all(_is_int(x) for x in ids)
          and all(0 <= x < num_layers for x in ids) and ids[0] < ids[1] < ids[2])
    if not ok:
        hint = (f"e.g. the default {list(default_feature_layers(num_layers))}"
                if _is_int(num_layers) and num_layers >= MIN_TARGET_LAYERS else "use arch Eagle")
        raise ConfigError(f"{field} {ids}: EAGLE-3 needs three strictly increasing target layers in "
                          f"[0, {num_layers}) (a target of {num_layers} layers); list three such layers or leave "
                          f"it out for the default (2, L//2, L-3), which needs L >= {DEFAULT_LAYERS_MIN} "
                          f"(the last three layers below that; {hint})")
    return ids[0], ids[1], ids[2]


def feature_layers(drafter: Any, num_layers: int) -> tuple[int, int, int]:
    """The feature layers of a drafter spec (config.DrafterSpec): its `feature_layers` checked against a
    target of `num_layers` layers, or the default when it gives none."""
    given = drafter.feature_layers
    return default_feature_layers(num_layers) if given is None else check_feature_layers(given, num_layers)


def resolve_draft_vocab_size(requested: int | None, vocab_size: int, field: str = DRAFT_VOCAB_FIELD) -> int:
    """The draft vocabulary's size: `requested`, in [1, V], or min(32768, V) when None."""
    V = vocab_size
    if requested is None:
        return min(DRAFT_VOCAB_DEFAULT, V)
    if not _is_int(requested) or requested < 1:
        raise ConfigError(f"{field} {requested!r}: must be an integer >= 1 (the draft vocabulary's size); "
                          f"set it in [1, {V}] or leave it out (default min({DRAFT_VOCAB_DEFAULT}, vocab) = "
                          f"{min(DRAFT_VOCAB_DEFAULT, V)})")
    if requested > V:
        raise ConfigError(f"{field} {requested} > the target's vocab {V}: the draft vocabulary is a subset of the "
                          f"target's; set it <= {V} or leave it out (default min({DRAFT_VOCAB_DEFAULT}, vocab))")
    return requested


def check_ttt_steps(steps: int, field: str = TTT_STEPS_FIELD) -> int:
    """Training-time-test unroll steps in TTT_STEPS_RANGE."""
    lo, hi = TTT_STEPS_RANGE
    if not _is_int(steps) or not lo <= steps <= hi:
        raise ConfigError(f"{field} {steps!r}: must be an integer in {lo}..{hi} (training-time-test unroll "
                          f"steps); set it in that range or leave it out (default {TTT_STEPS_DEFAULT})")
    return steps


def _stage_ranges(num_layers: int, pipeline: int) -> list[range]:
    """The target layers each pipeline stage runs: an even split, stage s holds
    [s*L//P, (s+1)*L//P)."""
    if not _is_int(pipeline) or pipeline < 1:
        raise ConfigError(f"spec.target.parallelism.pipeline: must be >= 1, got {pipeline!r}")
    return [range(s * num_layers // pipeline, (s + 1) * num_layers // pipeline) for s in range(pipeline)]


def feature_stages(layers: Sequence[int], num_layers: int, pipeline: int) -> dict[int, tuple[int, ...]]:
    """stage -> the feature layers whose input (the residual stream before that layer) it holds,
    in increasing order; only stages holding at least one of them. These stages publish features."""
    ids = check_feature_layers(layers, num_layers)
    out: dict[int, tuple[int, ...]] = {}
    for s, held in enumerate(_stage_ranges(num_layers, pipeline)):
        mine = tuple(i for i in ids if i in held)
        if mine:
            out[s] = mine
    return out


__all__ = [
    "DRAFT_VOCAB_DEFAULT", "TTT_STEPS_DEFAULT", "TTT_STEPS_RANGE", "check_feature_layers", "check_ttt_steps",
    "default_feature_layers", "feature_layers", "feature_stages", "resolve_draft_vocab_size",
]
