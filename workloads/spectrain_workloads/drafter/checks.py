"""Checks of everything a drafter receives from its peers, before any of it is used.

Pure functions over headers and tensors; each failure raises links.Rejected with the cause it is
counted under (`exchangeRejectedByCause`). A peer holds the job's key (drafter.auth) but may still
be broken or compromised, so nothing it sends is trusted to be shaped, finite or honest:
- a sample must be what the target publishes: tokens [T] int64 with 0 <= id < vocab, hidden
  [T, w * H] with the target's H (w: 1, or 4 for an EAGLE-3 sample: three feature layers and the
  final hidden state) in a floating dtype, all finite, 1 <= T <= the target's max_seq_len; an
  EAGLE-3 part is the same with w = its 1..3 feature layers, named in its header;
- weights must be the local model's table exactly (names, shapes, dtypes), all finite, and an
  update no larger than UPDATE_NORM_FACTOR x the local model's norm (`update_ok`);
- claimed work is credited at most at the rate of wall time (`credit_limit_s`);
- a combined version may be at most MAX_VERSIONS_AHEAD past the newest one a drafter holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spectrain_workloads.drafter.links import Rejected

SAMPLE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SAMPLE_ELEMENT_BYTES = 4          # the widest hidden dtype accepted (float32)
# ||new - local|| <= factor x ||local|| over all trainable tensors. Every rank's drafter starts
# from the same seeded initialisation and is pulled back to the combined version every round, so
# honest updates are a fraction of the model's norm; two independently initialised models differ
# by ~sqrt(2) x it. 4 admits those (a rank resumed from an old checkpoint, a long partition) and
# stops a forged update from moving the average by more than a few model norms per round.
UPDATE_NORM_FACTOR = 4.0
MAX_VERSIONS_AHEAD = 4                # broadcasts a member may miss (latest-only queues) before it asks again
MAX_INCARNATION_CHARS = 128

ParamTable = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class TargetSpec:
    """What the target publishes: its vocabulary, hidden width H and longest sequence; `width`:
    how many [T, H] blocks a sample's hidden holds (eagle3_assembly.SAMPLE_WIDTH for EAGLE-3)."""

    vocab: int
    hidden: int
    max_tokens: int
    width: int = 1

    @property
    def sample_bytes(self) -> int:
        """Largest sample payload: tokens [T] int64 + hidden [T, w * H] float32 at T = max_tokens."""
        return self.max_tokens * (8 + self.width * self.hidden * MAX_SAMPLE_ELEMENT_BYTES)

    @classmethod
    def from_run_dir(cls, run_dir: str | Path) -> TargetSpec:
        """From the target's shared model config (target/shared/model_config.json), which the
        drafter has read before it builds its model."""
        from spectrain_workloads.drafter.models import shared_dir

        raw = json.loads((shared_dir(run_dir) / "model_config.json").read_text())
        return cls(int(raw["vocab_size"]), int(raw["dim"]), int(raw["max_seq_len"]))


def param_table(params: Mapping[str, torch.Tensor]) -> ParamTable:
    return {n: (tuple(p.shape), p.dtype) for n, p in params.items()}


def table_bytes(table: ParamTable) -> int:
    """Largest weights payload: the tensors plus safetensors' JSON header (< 256 bytes per tensor)."""
    elems = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in table.values())
    return elems + 256 * len(table) + 4096


def field(header: Mapping[str, Any], name: str, kind: Any, *, low: float | None = None) -> Any:
    """header[name] of type `kind` (bool is not an int; floats finite), at least `low`."""
    v: Any = header.get(name)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise Rejected("header", f"{name} is not {kind.__name__}")
    if kind is float and not math.isfinite(v):
        raise Rejected("header", f"{name} is not finite")
    if low is not None and v < low:
        raise Rejected("header", f"{name} = {v} < {low}")
    return v


def sample_arrays(header: Mapping[str, Any], payload: bytes | bytearray, spec: TargetSpec, *,
                  values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [T] int64, hidden [T, w * H] or None) of a sample frame, its layout checked against
    the target's before anything is cut out of the payload, then its values (`check_sample`; values
    False: bench-fleet's measure of their cost only)."""
    return _arrays(header, payload, spec, spec.width, hidden_optional=True, values=values)


def part_arrays(header: Mapping[str, Any], payload: bytes | bytearray, spec: TargetSpec,
                layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(tokens [T], features [T, n * H], its layer ids) of an EAGLE-3 part frame: n = 1..3 of the
    drafter's feature `layers`, increasing."""
    got = header.get("layers")
    if not isinstance(got, list) or not got or any(not isinstance(i, int) or isinstance(i, bool) for i in got) \
            or any(i not in layers for i in got) or sorted(set(got)) != got:
        raise Rejected("header", f"layers {got!r} are not increasing ids among the drafter's {list(layers)}")
    tokens, features = _arrays(header, payload, spec, len(got), hidden_optional=False)
    assert features is not None
    return tokens, features, tuple(got)


def _arrays(header: Mapping[str, Any], payload: bytes | bytearray, spec: TargetSpec, width: int, *,
            hidden_optional: bool, values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    shapes, dtypes = header.get("shapes"), header.get("dtypes")
    counts = (1, 2) if hidden_optional else (2,)
    if not isinstance(shapes, list) or not isinstance(dtypes, list) or len(shapes) != len(dtypes) \
            or len(shapes) not in counts or not all(isinstance(s, list) and all(isinstance(d, int) and
                                                                                 not isinstance(d, bool)
                                                                                 for d in s) for s in shapes):
        raise Rejected("shape", f"shapes/dtypes are not {' or '.join(map(str, counts))} arrays")
    if len(shapes[0]) != 1 or dtypes[0] != "int64":
        raise Rejected("shape", "tokens must be [T] int64")
    T = shapes[0][0]
    if not 1 <= T <= spec.max_tokens:
        raise Rejected("shape", f"T = {T} outside 1..{spec.max_tokens}")
    W = width * spec.hidden
    sizes = [T * 8]
    if len(shapes) == 2:
        if shapes[1] != [T, W]:
            raise Rejected("shape", f"hidden {shapes[1]}, the target's is [{T}, {W}]")
        if dtypes[1] not in SAMPLE_DTYPES:
            raise Rejected("dtype", f"hidden dtype {dtypes[1]!r}")
        sizes.append(T * W * SAMPLE_DTYPES[dtypes[1]].itemsize)
    if sum(sizes) != len(payload):
        raise Rejected("shape", f"payload of {len(payload)} bytes, the shapes need {sum(sizes)}")
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    tokens = torch.frombuffer(buf, dtype=torch.int64, count=T)
    hidden = None
    if len(shapes) == 2:
        hidden = torch.frombuffer(buf, dtype=SAMPLE_DTYPES[dtypes[1]], offset=sizes[0]).reshape(T, W)
    if values:
        check_sample(tokens, hidden, spec)
    return tokens, hidden


def check_sample(tokens: torch.Tensor, hidden: torch.Tensor | None, spec: TargetSpec) -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= spec.vocab):
        raise Rejected("token", f"token ids outside 0..{spec.vocab - 1}")
    if hidden is not None and not bool(torch.isfinite(hidden).all()):
        raise Rejected("nonfinite", "hidden states are not finite")


def check_weights(params: Mapping[str, torch.Tensor], table: ParamTable) -> None:
    """The local model's exact table (names, shapes, dtypes) and finite values."""
    if set(params) != set(table):
        raise Rejected("keys", f"{len(set(params) ^ set(table))} tensor names differ from the local model's")
    for n, p in params.items():
        shape, dtype = table[n]
        if tuple(p.shape) != shape or p.dtype != dtype:
            raise Rejected("shape", f"{n}: {tuple(p.shape)} {p.dtype}, the local model's is {shape} {dtype}")
        if not bool(torch.isfinite(p).all()):
            raise Rejected("nonfinite", f"{n} is not finite")


def update_ok(new: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor],
              factor: float = UPDATE_NORM_FACTOR) -> bool:
    """||new - local|| <= factor x ||local|| over every tensor (norms in float64 on the host)."""
    diff = sum(float((new[n].detach().to("cpu", torch.float64) - p.detach().to("cpu", torch.float64))
                     .square().sum()) for n, p in local.items())
    base = sum(float(p.detach().to("cpu", torch.float64).square().sum()) for p in local.values())
    # a local model of norm ~0 (all zero) admits an update of the factor itself
    return math.sqrt(diff) <= factor * max(math.sqrt(base), 1.0)


def credit_limit_s(received_at: float, since: float, slack_s: float) -> float:
    """Most window work a contribution received at `received_at` can hold since `since` (the last
    credited contribution of its process, or its connection's handshake): wall time plus slack."""
    return max(0.0, received_at - since) + slack_s


def version_ok(version: int, newest: int, *, reply: bool) -> bool:
    """A combined version a member may take: newer than what it holds and at most
    MAX_VERSIONS_AHEAD past it, unless it answers this drafter's own hello (`reply`: the
    coordinator echoed the hello's nonce), the way a (re)started drafter catches up."""
    return version > newest and (reply or version <= newest + MAX_VERSIONS_AHEAD)


def incarnation(header: Mapping[str, Any]) -> str:
    v = field(header, "incarnation", str)
    if len(v) > MAX_INCARNATION_CHARS:
        raise Rejected("header", "incarnation too long")
    return str(v)


__all__ = ["MAX_VERSIONS_AHEAD", "ParamTable", "SAMPLE_DTYPES", "TargetSpec", "UPDATE_NORM_FACTOR",
           "check_sample", "check_weights", "credit_limit_s", "field", "incarnation", "param_table",
           "sample_arrays", "table_bytes", "update_ok", "version_ok"]
