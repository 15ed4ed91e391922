"""What the ring's channels carry, as Python values: window events, data records, back messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spectrain_api.names import WINDOW_KINDS
from spectrain_workloads.ring import sync

if TYPE_CHECKING:
    from spectrain_workloads.ring.mapping import Mapping


class WindowKind(enum.IntEnum):
    """Why the GPU is idle (DESIGN.md); the values are stored in window records, never renumber."""

    BUBBLE = 1
    COMMUNICATION = 2
    IMBALANCE = 3
    ROLLOUT_TAIL = 4

    @property
    def api_name(self) -> str:
        """The SpecTrainJob spelling (`drafter.activation.kinds`): Bubble, Communication, ..."""
        return _API_NAMES[self]

    @classmethod
    def from_api_name(cls, name: str) -> WindowKind:
        for kind, api in _API_NAMES.items():
            if api == name:
                return kind
        raise ValueError(f"unknown window kind {name!r}: use one of {', '.join(_API_NAMES.values())}")


# The API spelling of each kind is spectrain_api.names.WINDOW_KINDS, in the same order.
_API_NAMES = dict(zip(WindowKind, WINDOW_KINDS, strict=True))
KINDS_BY_VALUE = {int(k): k for k in WindowKind}


@dataclass(frozen=True, slots=True)
class WindowEvent:
    """One record of the window channel: the start of an idle window or, with is_end, its end.

    An end record repeats the start's fields, so a reader that missed the start can still use it.
    window_id is unique across producer restarts (generation in the high 32 bits)."""

    seq: int
    kind: WindowKind
    rank: int
    stage: int
    step: int
    window_id: int
    start_ns: int  # CLOCK_MONOTONIC
    predicted_duration_ns: int  # 0 = unknown / open-ended
    actual_duration_ns: int  # 0 on the start record
    flags: int
    is_end: bool

    @property
    def predicted_end_ns(self) -> int | None:
        """When the window is expected to close, or None when the duration is unknown."""
        return self.start_ns + self.predicted_duration_ns if self.predicted_duration_ns else None

    @property
    def end_ns(self) -> int | None:
        """When the window closed (end records only)."""
        return self.start_ns + self.actual_duration_ns if self.is_end else None


@dataclass(frozen=True, slots=True)
class BackMessage:
    """One drafter -> target message (state, heartbeat, exported version, acceptance metrics)."""

    seq: int
    sent_ns: int  # CLOCK_MONOTONIC of the drafter when it published: its heartbeat
    sender_pid: int
    data: dict[str, Any]


class DataRecord:
    """A training-data payload: `meta` (parsed JSON, a private copy) and `arrays`, read-only numpy
    views straight into the shared slot (no copy out).

    The producer never waits, so it may overwrite the slot while the views are in use: copy or
    consume what you need, then call valid(); if it is False, discard what you computed from it."""

    __slots__ = ("seq", "meta", "arrays", "publish_ns", "_mapping", "_word", "_expected")

    def __init__(self, seq: int, meta: dict[str, Any], arrays: dict[str, np.ndarray], publish_ns: int,
                 mapping: Mapping, word: int, expected: int) -> None:
        self.seq = seq
        self.meta = meta
        self.arrays = arrays
        self.publish_ns = publish_ns
        self._mapping = mapping
        self._word = word
        self._expected = expected

    def valid(self) -> bool:
        """True while the slot still holds this record (its seq word is unchanged)."""
        m = self._mapping
        if m.closed:
            return False
        if sync.SEQ_FENCE is not None:
            sync.SEQ_FENCE()  # order the caller's reads of the views before the re-check
        return bool(m.q[self._word] == self._expected)

    def __repr__(self) -> str:
        shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in self.arrays.items()}
        return f"DataRecord(seq={self.seq}, meta={self.meta!r}, arrays={shapes})"
