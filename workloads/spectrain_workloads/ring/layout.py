"""The ring file's binary format: layout parameters, header fields, record structs.

File (all integers native-endian; producer and consumer share a machine):

    0       header (4096 B): static part, producer-written line, consumer-written line
    4096    window channel: window_slots x 64 B records
    (page)  data channel:   data_slots x data_stride (slot header + descriptors + payload)
    (page)  back channel:   back_slots x back_slot_bytes (drafter -> target JSON)

Every slot starts with an 8-byte sequence word (seqlock): 2s-1 while record s is being
written, 2s once it is complete (s counts from 1; 0 = never written). docs/ring.md has the
diagram and the ordering argument. The offsets of magic (0), version (8) and generation (16)
never move, so any later version can still read them to report a mismatch or bump the
generation.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_RING_DIR

MAGIC = b"SPECRING"
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
PAGE = 4096

# Header byte offsets. Static part (written once before the file is renamed into place):
H_MAGIC = 0  # 8s
H_VERSION = 8  # u32
H_HEADER_BYTES = 12  # u32
H_GENERATION = 16  # u64, bumped by each re-create
H_STATE = 56  # u64, STATE_*
STATIC = struct.Struct("=8sIIQQQQq")  # magic, version, header_bytes, generation, pid, created_ns, total, rank
PARAMS_AT = 64
PARAMS = struct.Struct("=11Q")  # see Geometry.params()
# Producer-written cache line (kept apart from the consumer's to avoid false sharing):
H_HEARTBEAT = 192  # u64 CLOCK_MONOTONIC ns
H_WINDOW_HEAD = 200  # u64 seq of the newest complete window record
H_DATA_HEAD = 208  # u64 seq of the newest complete data record
H_NOTIFY = 216  # u32 futex word, bumped after every publish
# Consumer-written cache line:
H_WAITERS = 256  # u32 futex waiter flag: set by a sleeping reader, cleared by the producer's wake
H_BACK_HEAD = 264  # u64 seq of the newest complete back message
H_CONSUMER_PID = 272  # u64 pid of the last consumer that opened the file

STATE_INIT = 0
STATE_READY = 1
STATE_CLOSED = 2  # producer closed cleanly
STATE_SUPERSEDED = 3  # a restarted producer replaced this file: reopen the path

# Window record: seq word + body.
WINDOW_RECORD_BYTES = 64
WINDOW_BODY = struct.Struct("=qQQQQiiIHH")  # step, window_id, start, predicted, actual, rank, stage, flags, kind, is_end

# Data slot: seq word, slot header, MAX_ARRAYS descriptors, then payload (meta JSON, arrays).
MAX_ARRAYS = 8
MAX_NDIM = 6
DATA_HEAD = struct.Struct("=QIIQ")  # at +8: publish_ns, meta_len, n_arrays, used_bytes
DESCRIPTOR = struct.Struct(f"=40s16sIIQQ{MAX_NDIM}Q")  # name, dtype.str, ndim, 0, offset, nbytes, shape
DESCRIPTORS_AT = 64
DATA_SLOT_HEADER = DESCRIPTORS_AT + MAX_ARRAYS * DESCRIPTOR.size  # payload starts here (64-aligned)
ALIGN = 64  # arrays start on cache-line boundaries inside the payload

# Back slot: seq word, header, JSON bytes.
BACK_HEAD = struct.Struct("=QII")  # at +8: sent_ns, length, sender pid
BACK_SLOT_HEADER = 32

assert DESCRIPTOR.size == 128 and WINDOW_BODY.size + 8 == WINDOW_RECORD_BYTES


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _check(name: str, value: int, lo: int, hi: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"RingLayout.{name} must be an integer in [{lo}, {hi}], got {value!r}: {fix}")


@dataclass(kw_only=True)
class RingLayout:
    """Sizes of the three channels. The producer chooses them; consumers read them from the header."""

    window_slots: int = 4096
    data_slots: int = 32
    data_slot_bytes: int = 1 << 20  # payload bytes per data slot: meta JSON + arrays (64-B aligned each)
    back_slots: int = 64
    back_slot_bytes: int = 4096  # whole slot; a message may use back_slot_bytes - 32

    def __post_init__(self) -> None:
        _check("window_slots", self.window_slots, 2, 1 << 24,
               "a few thousand covers many steps of windows; the reader counts what it misses")
        _check("data_slots", self.data_slots, 2, 1 << 16, "use >= 2 so a slot can be read while the next is written")
        _check("data_slot_bytes", self.data_slot_bytes, 1024, 1 << 36,
               "size it for meta + hidden [T, H] + tokens [T] (+ top-k) of one sequence")
        _check("back_slots", self.back_slots, 2, 1 << 16, "a handful suffices: the target reads only the newest")
        _check("back_slot_bytes", self.back_slot_bytes, 256, 1 << 20, "messages are small JSON documents")
        if self.back_slot_bytes % 64:
            raise ConfigError(f"RingLayout.back_slot_bytes must be a multiple of 64, got {self.back_slot_bytes}: "
                              f"use {round_up(self.back_slot_bytes, 64)}")

    @property
    def file_bytes(self) -> int:
        """Size of the ring file (what the memory-backed volume must hold)."""
        return Geometry.of(self).total


@dataclass(frozen=True)
class Geometry:
    """Byte offsets of the channels, derived from a RingLayout; stored in the header and re-derived
    by readers, so a file whose stored offsets disagree is rejected as foreign or corrupt."""

    layout: RingLayout
    window_off: int
    data_off: int
    data_stride: int
    back_off: int
    total: int

    @staticmethod
    def of(layout: RingLayout) -> Geometry:
        window_off = HEADER_BYTES
        data_off = round_up(window_off + layout.window_slots * WINDOW_RECORD_BYTES, PAGE)
        stride = round_up(DATA_SLOT_HEADER + layout.data_slot_bytes, ALIGN)
        back_off = round_up(data_off + layout.data_slots * stride, PAGE)
        total = round_up(back_off + layout.back_slots * layout.back_slot_bytes, PAGE)
        return Geometry(layout, window_off, data_off, stride, back_off, total)

    def params(self) -> tuple[int, ...]:
        lay = self.layout
        return (lay.window_slots, WINDOW_RECORD_BYTES, self.window_off, lay.data_slots, lay.data_slot_bytes,
                self.data_stride, self.data_off, lay.back_slots, lay.back_slot_bytes, self.back_off, self.total)

    @staticmethod
    def from_params(values: tuple[int, ...]) -> Geometry:
        """Rebuild from a header's PARAMS; raises ConfigError/ValueError when they are not a valid layout."""
        ws, rec, _, ds, dsb, _, _, bs, bsb, _, _ = values
        if rec != WINDOW_RECORD_BYTES:
            raise ValueError(f"window record size {rec} != {WINDOW_RECORD_BYTES}")
        geo = Geometry.of(RingLayout(window_slots=ws, data_slots=ds, data_slot_bytes=dsb,
                                     back_slots=bs, back_slot_bytes=bsb))
        if geo.params() != tuple(values):
            raise ValueError(f"stored offsets {values} disagree with the layout's {geo.params()}")
        return geo


def ring_path(ring_dir: str | os.PathLike[str], local_rank: int) -> Path:
    """The ring file of local rank `local_rank` in the ring volume (docs/contracts.md)."""
    return Path(ring_dir) / f"ring-{int(local_rank)}"


def ring_path_from_env(local_rank: int) -> Path:
    """`ring_path($SPECTRAIN_RING_DIR, local_rank)`; a clear error when the variable is unset."""
    ring_dir = os.environ.get(ENV_RING_DIR)
    if not ring_dir:
        raise ConfigError(f"{ENV_RING_DIR} is not set: the operator (or `spectrain run`) sets it to the "
                          "memory-backed ring volume; set it by hand to a tmpfs directory such as /dev/shm/x")
    return ring_path(ring_dir, local_rank)
