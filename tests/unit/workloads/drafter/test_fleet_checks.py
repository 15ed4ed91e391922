"""drafter.checks: what a drafter takes from its peers (pure functions; no sockets)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from spectrain_workloads.drafter import checks
from spectrain_workloads.drafter.checks import TargetSpec
from spectrain_workloads.drafter.links import Rejected

pytestmark = pytest.mark.unit

SPEC = TargetSpec(vocab=50, hidden=4, max_tokens=32)


def _sample(tokens: torch.Tensor, hidden: torch.Tensor | None) -> tuple[dict[str, object], bytes]:
    arrays = [tokens] + ([] if hidden is None else [hidden])
    header = {"shapes": [list(a.shape) for a in arrays], "dtypes": [str(a.dtype).removeprefix("torch.") for a in arrays]}
    raw = [a.view(torch.int16) if a.dtype == torch.bfloat16 else a for a in arrays]
    return header, b"".join(a.numpy().tobytes() for a in raw)


def _cause(fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(Rejected) as exc:
        fn(*args, **kw)  # type: ignore[operator]
    return exc.value.cause


def test_a_good_sample_is_taken_as_sent() -> None:
    tokens, hidden = torch.arange(8), torch.randn(8, 4).to(torch.bfloat16)
    t, h = checks.sample_arrays(*_sample(tokens, hidden), SPEC)
    assert torch.equal(t, tokens) and h is not None and torch.equal(h, hidden)
    t, h = checks.sample_arrays(*_sample(tokens, None), SPEC)
    assert torch.equal(t, tokens) and h is None


@pytest.mark.parametrize(("cause", "tokens", "hidden"), [
    ("nonfinite", torch.arange(8), torch.full((8, 4), float("inf"))),
    ("nonfinite", torch.arange(8), torch.full((8, 4), float("nan")).to(torch.bfloat16)),
    ("token", torch.arange(8) + 45, torch.randn(8, 4)),
    ("token", torch.arange(8) - 3, None),
    ("shape", torch.arange(8), torch.randn(8, 5)),
    ("shape", torch.arange(8), torch.randn(7, 4)),
    ("shape", torch.arange(33) % 50, None),                  # longer than the target's sequences
    ("shape", torch.arange(8).int(), None),                  # tokens must be int64
    ("dtype", torch.arange(8), torch.randn(8, 4).double()),
])
def test_a_bad_sample_is_refused_by_cause(cause: str, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
    assert _cause(checks.sample_arrays, *_sample(tokens, hidden), SPEC) == cause


def test_a_sample_whose_payload_does_not_match_its_shapes_is_refused() -> None:
    header, payload = _sample(torch.arange(8), torch.randn(8, 4))
    assert _cause(checks.sample_arrays, header, payload[:-4], SPEC) == "shape"
    assert _cause(checks.sample_arrays, header, payload + b"1234", SPEC) == "shape"
    assert _cause(checks.sample_arrays, {"shapes": "x", "dtypes": []}, payload, SPEC) == "shape"
    assert _cause(checks.sample_arrays, {"shapes": [[True]], "dtypes": ["int64"]}, payload, SPEC) == "shape"


def test_weights_must_be_the_local_table_and_finite() -> None:
    local = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    table = checks.param_table(local)
    checks.check_weights({"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, table)
    assert _cause(checks.check_weights, {"a": torch.ones(2, 3)}, table) == "keys"
    assert _cause(checks.check_weights, {**local, "c": torch.ones(1)}, table) == "keys"
    assert _cause(checks.check_weights, {**local, "a": torch.ones(3, 2)}, table) == "shape"
    assert _cause(checks.check_weights, {**local, "b": torch.ones(4)}, table) == "shape"
    assert _cause(checks.check_weights, {**local, "a": torch.full((2, 3), float("nan"))}, table) == "nonfinite"
    # the cap on a weights frame follows the model: 6 fp32 + 4 bf16, plus safetensors' header
    assert 6 * 4 + 4 * 2 < checks.table_bytes(table) < 6 * 4 + 4 * 2 + 8192


def test_the_update_norm_is_bounded_relative_to_the_local_model() -> None:
    local = {"w": torch.ones(100)}                         # norm 10
    assert checks.update_ok({"w": torch.ones(100) * 3}, local)        # ||diff|| = 20 <= 40
    assert not checks.update_ok({"w": torch.ones(100) * 6}, local)    # 50 > 40
    assert not checks.update_ok({"w": torch.ones(100) * 1e30}, local)
    assert checks.update_ok({"w": torch.full((100,), 0.3)}, {"w": torch.zeros(100)})   # norm 3 <= 4 x max(0, 1)


def test_claimed_work_versions_and_header_fields() -> None:
    assert checks.credit_limit_s(received_at=110.0, since=100.0, slack_s=2.0) == 12.0
    assert checks.credit_limit_s(received_at=90.0, since=100.0, slack_s=2.0) == 2.0
    ahead = checks.MAX_VERSIONS_AHEAD
    assert checks.version_ok(3, 2, reply=False) and checks.version_ok(2 + ahead, 2, reply=False)
    assert not checks.version_ok(3 + ahead, 2, reply=False) and not checks.version_ok(1 << 62, 2, reply=False)
    assert checks.version_ok(1 << 40, 2, reply=True)            # the answer to this drafter's own hello
    assert not checks.version_ok(2, 2, reply=True)             # never backwards
    assert checks.field({"x": 3}, "x", float) == 3.0
    for header in ({}, {"x": True}, {"x": "1"}, {"x": math.inf}, {"x": -1.0}):
        assert _cause(checks.field, header, "x", float, low=0.0) == "header"
    assert _cause(checks.field, {"x": True}, "x", int) == "header"
    assert _cause(checks.incarnation, {"incarnation": "x" * 200}) == "header"


def test_target_spec_from_the_shared_model_config(tmp_path: Path) -> None:
    d = tmp_path / "target" / "shared"
    d.mkdir(parents=True)
    (d / "model_config.json").write_text(json.dumps({"vocab_size": 264, "dim": 64, "max_seq_len": 128, "n_layers": 2}))
    spec = TargetSpec.from_run_dir(tmp_path)
    assert spec == TargetSpec(264, 64, 128) and spec.sample_bytes == 128 * (8 + 64 * 4)
