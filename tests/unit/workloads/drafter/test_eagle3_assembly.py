"""EAGLE-3 samples assembled from the stages' parts (drafter.eagle3_assembly) and the checks of a
part frame (drafter.checks.part_arrays)."""

from __future__ import annotations

import json

import pytest
import torch

from spectrain_workloads.drafter import checks
from spectrain_workloads.drafter.eagle3_assembly import FeatureAssembler, part_meta
from spectrain_workloads.drafter.fleet_records import raw_bytes
from spectrain_workloads.drafter.links import Rejected

H, T = 8, 6
LAYERS = (1, 3, 5)


def parts(seed: int = 0) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 50, (T,), generator=g), {i: torch.randn(T, H, generator=g) for i in LAYERS},
            torch.randn(T, H, generator=g))


@pytest.mark.parametrize("order", [("a", "b", "final"), ("final", "b", "a"), ("b", "final", "a")])
def test_a_sequence_completes_when_every_layer_and_the_final_hidden_are_in(order: tuple[str, ...]) -> None:
    tokens, f, final = parts()
    asm = FeatureAssembler(LAYERS, H)
    pieces = {"a": dict(features=f[1], layers=(1,)), "b": dict(features=torch.cat([f[3], f[5]], -1), layers=(3, 5)),
              "final": dict(final=final)}
    out = [asm.add(7, 2, tokens.clone(), **pieces[name]) for name in order]
    assert all(o is None for o in out[:-1]) and out[-1] is not None
    torch.testing.assert_close(out[-1], torch.cat([f[1], f[3], f[5], final], -1), rtol=0, atol=0)
    assert asm.stats.assembled == 1 and not asm.pending and asm.stats.parts == 3


def test_one_stage_holding_everything_completes_in_one_part() -> None:
    tokens, f, final = parts()
    asm = FeatureAssembler(LAYERS, H)
    out = asm.add(0, 0, tokens, features=torch.cat([f[i] for i in LAYERS], -1), layers=LAYERS, final=final)
    assert out is not None and out.shape == (T, 4 * H)


def test_parts_of_other_sequences_do_not_mix() -> None:
    (t0, f0, _), (t1, f1, fin1) = parts(0), parts(1)
    asm = FeatureAssembler(LAYERS, H)
    assert asm.add(1, 0, t0, features=f0[1], layers=(1,)) is None
    assert asm.add(1, 1, t1, final=fin1) is None                  # another seq_index
    assert asm.add(2, 0, t1, features=torch.cat([f1[3], f1[5]], -1), layers=(3, 5)) is None   # another step
    assert len(asm.pending) == 3 and asm.stats.assembled == 0


@pytest.mark.parametrize("bad", ["tokens", "layer", "repeat", "shape", "final_twice", "no_features"])
def test_a_contradicting_part_is_rejected_and_counted(bad: str) -> None:
    tokens, f, final = parts()
    asm = FeatureAssembler(LAYERS, H)
    asm.add(0, 0, tokens, features=f[1], layers=(1,), final=final)
    kw: dict = dict(features=f[3], layers=(3,))
    t = tokens
    if bad == "tokens":
        t = tokens.flip(0)
    elif bad == "layer":
        kw["layers"] = (2,)
    elif bad == "repeat":
        kw = dict(features=f[1], layers=(1,))
    elif bad == "shape":
        kw["features"] = f[3][:, :-1]
    elif bad == "final_twice":
        kw = dict(final=final)
    else:
        kw = dict(layers=(3,))
    assert asm.add(0, 0, t, **kw) is None
    assert asm.stats.rejected == 1
    assert asm.add(0, 0, tokens, features=torch.cat([f[3], f[5]], -1), layers=(3, 5)) is not None   # still whole


def test_memory_is_bounded_and_evictions_are_counted() -> None:
    asm = FeatureAssembler(LAYERS, H, max_pending=4)
    tokens, f, final = parts()
    for i in range(10):
        asm.add(0, i, tokens, final=final)
    assert len(asm.pending) == 4 and asm.stats.unmatched == 6
    assert list(asm.pending) == [(0, i) for i in range(6, 10)]     # the oldest went


def frame(tokens: torch.Tensor, features: torch.Tensor, layers: list, **extra: object) -> tuple[dict, bytes]:
    arrays = [tokens, features]
    header = {"layers": layers, "shapes": [list(a.shape) for a in arrays],
              "dtypes": [str(a.dtype).removeprefix("torch.") for a in arrays], **extra}
    return header, b"".join(raw_bytes(a) for a in arrays)


SPEC = checks.TargetSpec(vocab=50, hidden=H, max_tokens=16, width=4)


def test_a_good_part_frame_reads_back() -> None:
    tokens, f, _ = parts()
    header, payload = frame(tokens, torch.cat([f[3], f[5]], -1), [3, 5])
    t, feats, layers = checks.part_arrays(json.loads(json.dumps(header)), payload, SPEC, LAYERS)
    assert layers == (3, 5) and torch.equal(t, tokens) and torch.equal(feats, torch.cat([f[3], f[5]], -1))


@pytest.mark.parametrize("case", ["foreign_layer", "unsorted", "empty", "bool", "width", "nonfinite", "token"])
def test_a_bad_part_frame_is_rejected_with_its_cause(case: str) -> None:
    tokens, f, _ = parts()
    feats, layers = torch.cat([f[3], f[5]], -1), [3, 5]
    cause = "header"
    if case == "foreign_layer":
        layers = [3, 4]
    elif case == "unsorted":
        layers = [5, 3]
    elif case == "empty":
        layers = []
    elif case == "bool":
        layers = [True, 3]
    elif case == "width":
        layers, cause = [3], "shape"                     # two layers' worth of data for one
    elif case == "nonfinite":
        feats = feats.clone()
        feats[0, 0] = float("nan")
        cause = "nonfinite"
    else:
        tokens = tokens.clone()
        tokens[0] = 50
        cause = "token"
    header, payload = frame(tokens, feats, layers)
    with pytest.raises(Rejected) as exc:
        checks.part_arrays(header, payload, SPEC, LAYERS)
    assert exc.value.cause == cause


def test_an_eagle3_sample_is_four_blocks_wide() -> None:
    tokens, f, final = parts()
    full = torch.cat([f[1], f[3], f[5], final], -1)
    header = {"shapes": [[T], [T, 4 * H]], "dtypes": ["int64", "float32"]}
    t, hid = checks.sample_arrays(header, raw_bytes(tokens) + raw_bytes(full), SPEC)
    assert hid is not None and torch.equal(hid, full)
    narrow = {"shapes": [[T], [T, H]], "dtypes": ["int64", "float32"]}
    with pytest.raises(Rejected):
        checks.sample_arrays(narrow, raw_bytes(tokens) + raw_bytes(final), SPEC)


def test_a_ring_record_s_meta_is_checked_before_use() -> None:
    assert part_meta({"feature_layers": [3, 5], "seq_index": 4}) == ((3, 5), 4)
    assert part_meta({"seq_index": 0}) == ((), 0)                   # the last stage's hidden alone
    for bad in ({"feature_layers": 3, "seq_index": 0}, {"feature_layers": ["3"], "seq_index": 0},
                {"feature_layers": [True], "seq_index": 0}, {"feature_layers": [1], "seq_index": "0"},
                {"feature_layers": [1]}, {"feature_layers": [1], "seq_index": -1}):
        assert part_meta(bad) is None, bad
