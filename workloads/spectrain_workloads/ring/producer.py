"""The target's side of the ring: publish windows and data without ever waiting on a reader.

Publishing writes the slot (seqlock, see sync.py), advances the channel head, refreshes the
heartbeat and bumps the futex word. It issues a FUTEX_WAKE syscall only when a reader has set the
waiter flag, and clears the flag with it, so a reader that died while waiting costs at most one
syscall. The cost does not depend on readers in any other way: there is nothing to wait for.

The drafter can write every byte of the ring. The producer keeps its own cursors and reads only
two things a reader writes: the waiter flag (any value at most costs one wake per publish) and
the back channel, whose head, slot and length are bounded and whose JSON may be anything
(latest_back returns a dict or None, never raises). It never faults: the memory is sealed
against resizing (mapping.py).
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from spectrain_workloads.ring import layout as L
from spectrain_workloads.ring import sync
from spectrain_workloads.ring.errors import PayloadTooLarge, RingError
from spectrain_workloads.ring.handover import Ring, create_ring
from spectrain_workloads.ring.records import KINDS_BY_VALUE, BackMessage, WindowKind

_Q_HEARTBEAT = L.H_HEARTBEAT >> 3
_Q_WINDOW_HEAD = L.H_WINDOW_HEAD >> 3
_Q_DATA_HEAD = L.H_DATA_HEAD >> 3
_Q_BACK_HEAD = L.H_BACK_HEAD >> 3
_Q_STATE = L.H_STATE >> 3
_I_NOTIFY = L.H_NOTIFY >> 2
_I_WAITERS = L.H_WAITERS >> 2
_NO_SHAPE = (0,) * L.MAX_NDIM
_MAX_OPEN_WINDOWS = 1 << 16
_CO_ALIGN_MIN_BYTES = 1 << 16
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _place(meta_len: int, arrays: list[tuple[bytes, bytes, np.ndarray]], *, co_align: bool
           ) -> tuple[list[tuple[bytes, bytes, np.ndarray, int]], int]:
    """Offsets of the arrays in a slot's payload (after the meta JSON) and the bytes used.

    Arrays start on a cache line; with co_align, a large contiguous array starts at the same
    offset within its cache line as its source: memcpy (rep movsb / vector loops) runs ~1.5x
    faster on co-aligned buffers (bench-ring). Slot payloads are 64-B aligned, so the offset alone
    decides, and dtype alignment is kept whenever the source has it."""
    plan = []
    pos, end = L.round_up(meta_len, L.ALIGN), meta_len
    for raw_name, dtype, a in arrays:
        at = pos
        if co_align and a.nbytes >= _CO_ALIGN_MIN_BYTES and a.flags.c_contiguous:
            src_mod = a.__array_interface__["data"][0] % L.ALIGN
            if src_mod % a.itemsize == 0:
                at = pos + src_mod
        plan.append((raw_name, dtype, a, at))
        end = at + a.nbytes
        pos = L.round_up(end, L.ALIGN)
    return plan, end


class RingProducer:
    """Writer of the window and data channels; reader of the back channel. Each channel needs a
    single writer thread, but the window and the data channel may be published from two different
    threads without a lock. A daemon thread refreshes the heartbeat."""

    def __init__(self, ring: Ring, heartbeat_interval_s: float) -> None:
        self._ring = ring
        self._m = mapping = ring.mapping
        geo = mapping.geometry
        self.layout = geo.layout
        self._mm, self._q, self._u32 = mapping.mm, mapping.q, mapping.u32
        self._woff, self._wslots = geo.window_off, geo.layout.window_slots
        self._doff, self._dslots, self._dstride = geo.data_off, geo.layout.data_slots, geo.data_stride
        self._dcap = geo.layout.data_slot_bytes
        self._boff, self._bslots, self._bsize = geo.back_off, geo.layout.back_slots, geo.layout.back_slot_bytes
        self._rank = mapping.rank
        self._wseq = 0
        self._dseq = 0
        self._notify = itertools.count(1)  # next() is atomic under the GIL: unique values per publish
        self._wid_base = (mapping.generation & 0xFFFFFFFF) << 32
        self._wid_next = 0
        self._open: dict[int, tuple[int, int, int, int, int, int]] = {}
        self._back_cache: BackMessage | None = None
        self.wakes_issued = 0  # FUTEX_WAKE syscalls made (only when a reader was asleep)
        self._closed = False
        self._stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, args=(heartbeat_interval_s,),
                                           name=f"spectrain-ring-heartbeat-{mapping.path.name}", daemon=True)
        self._hb_thread.start()

    @classmethod
    def create(cls, path: str | os.PathLike[str], layout: L.RingLayout | None = None, rank: int = 0, *,
               heartbeat_interval_s: float = 0.1) -> RingProducer:
        """(Re)initialise the ring at `path` (new generation; readers of an older file resync)."""
        if not 0 < heartbeat_interval_s <= 0.5:
            raise ValueError(f"heartbeat_interval_s must be in (0, 0.5] so readers see a live producer within "
                             f"their 1 s limit, got {heartbeat_interval_s}")
        return cls(create_ring(Path(path), layout or L.RingLayout(), int(rank)), heartbeat_interval_s)

    # -- identity / counters ------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._m.path

    @property
    def generation(self) -> int:
        return self._m.generation

    @property
    def windows_published(self) -> int:
        return self._wseq

    @property
    def data_published(self) -> int:
        return self._dseq

    @property
    def open_windows(self) -> list[int]:
        return list(self._open)

    # -- window channel -----------------------------------------------------------------------
    def window_start(self, kind: WindowKind | int, *, stage: int, step: int, predicted_duration_ns: int = 0,
                     flags: int = 0, start_ns: int | None = None) -> int:
        """Publish the start of an idle window; returns its window_id (unique across restarts)."""
        if kind not in KINDS_BY_VALUE:
            raise ValueError(f"window kind {kind!r} is not a WindowKind ({', '.join(k.name for k in WindowKind)})")
        self._wid_next += 1
        wid = self._wid_base | self._wid_next
        start = time.monotonic_ns() if start_ns is None else start_ns
        self._put_window(int(kind), stage, step, wid, start, predicted_duration_ns, 0, flags, 0)
        if len(self._open) >= _MAX_OPEN_WINDOWS:  # a caller that never ends windows must not leak
            del self._open[next(iter(self._open))]
        self._open[wid] = (int(kind), stage, step, start, predicted_duration_ns, flags)
        return wid

    def window_end(self, window_id: int, *, actual_duration_ns: int | None = None,
                   end_ns: int | None = None) -> int:
        """Publish the end of window `window_id` (actual duration = end - start unless given); returns
        the record's seq. The end record repeats the start's fields."""
        try:
            kind, stage, step, start, predicted, flags = self._open.pop(window_id)
        except KeyError:
            raise RingError(f"window_end({window_id}): no open window with that id on {self.path} (ended "
                            f"twice, or started by another producer); open: {self.open_windows[:8]}") from None
        if actual_duration_ns is None:
            actual_duration_ns = max(0, (time.monotonic_ns() if end_ns is None else end_ns) - start)
        return self._put_window(kind, stage, step, window_id, start, predicted, actual_duration_ns, flags, 1)

    def _put_window(self, kind: int, stage: int, step: int, wid: int, start: int, predicted: int, actual: int,
                    flags: int, is_end: int) -> int:
        self._check_open()
        s = self._wseq + 1
        off = self._woff + ((s - 1) % self._wslots) * L.WINDOW_RECORD_BYTES
        q, i = self._q, off >> 3
        prev = q[i]
        q[i] = 2 * s - 1
        fence = sync.SEQ_FENCE
        if fence is not None:
            fence()
        try:
            L.WINDOW_BODY.pack_into(self._mm, off + 8, step, wid, start, predicted, actual, self._rank, stage,
                                    flags, kind, is_end)
        except struct.error as exc:
            q[i] = prev  # the slot keeps its previous complete record
            raise ValueError(f"window record field out of range (kind={kind}, stage={stage}, step={step}, "
                             f"start_ns={start}, predicted_duration_ns={predicted}, actual_duration_ns={actual}, "
                             f"flags={flags}): durations and times must be >= 0, stage/flags 32-bit") from exc
        if fence is not None:
            fence()
        q[i] = 2 * s
        if fence is not None:
            fence()
        q[_Q_WINDOW_HEAD] = s
        self._wseq = s
        self._notify_readers()
        return s

    # -- data channel -------------------------------------------------------------------------
    def publish_data(self, meta: dict[str, Any], arrays: dict[str, Any]) -> int:
        """Copy one payload into the next data slot (overwriting the oldest; never waits); returns its
        seq. `arrays` values: numpy arrays or anything np.asarray accepts through the buffer
        protocol or __array__ (CPU tensors; pass bfloat16 as an int16 view and say so in meta)."""
        self._check_open()
        meta_raw = _ENCODE(meta).encode()
        if len(arrays) > L.MAX_ARRAYS:
            raise PayloadTooLarge(f"{len(arrays)} arrays in one data record; the ring holds at most {L.MAX_ARRAYS}")
        checked = []
        for name, value in arrays.items():
            a = value if type(value) is np.ndarray else np.asarray(value)
            if a.dtype.hasobject or a.ndim > L.MAX_NDIM:
                raise ValueError(f"array {name!r}: dtype {a.dtype} / ndim {a.ndim} cannot go through the ring "
                                 f"(plain numeric dtypes, at most {L.MAX_NDIM} dims)")
            raw_name, dtype = name.encode(), a.dtype.str.encode()
            if len(raw_name) > 40 or len(dtype) > 16:
                raise ValueError(f"array name {name!r} longer than 40 bytes (or dtype {a.dtype.str} unsupported)")
            checked.append((raw_name, dtype, a))
        plan, end = _place(len(meta_raw), checked, co_align=True)
        if end > self._dcap:
            plan, end = _place(len(meta_raw), checked, co_align=False)  # the co-alignment padding is optional
        if end > self._dcap:
            raise PayloadTooLarge(f"data record needs {end} bytes (meta {len(meta_raw)} + arrays, 64-B aligned) but "
                                  f"RingLayout.data_slot_bytes is {self._dcap}: raise data_slot_bytes (and "
                                  f"spec.ring.sizeLimit) or publish shorter sequences")
        s = self._dseq + 1
        base = self._doff + ((s - 1) % self._dslots) * self._dstride
        payload = base + L.DATA_SLOT_HEADER
        q, i = self._q, base >> 3
        prev = q[i]
        q[i] = 2 * s - 1
        fence = sync.SEQ_FENCE
        if fence is not None:
            fence()
        try:
            mm, u8 = self._mm, self._m.u8
            mm[payload:payload + len(meta_raw)] = meta_raw
            for k, (raw_name, dtype, a, at) in enumerate(plan):
                start = payload + at
                if a.flags.c_contiguous:  # the one copy: a plain memcpy from the array's buffer
                    mm[start:start + a.nbytes] = a  # type: ignore[call-overload]  # exports a simple buffer
                elif a.nbytes:  # strided source: numpy gathers it straight into the slot (still one copy)
                    np.copyto(u8[start:start + a.nbytes].view(a.dtype).reshape(a.shape), a, casting="no")
                shape = tuple(a.shape) + _NO_SHAPE[a.ndim:]
                L.DESCRIPTOR.pack_into(mm, base + L.DESCRIPTORS_AT + k * L.DESCRIPTOR.size, raw_name, dtype,
                                       a.ndim, 0, at, a.nbytes, *shape)
            L.DATA_HEAD.pack_into(mm, base + 8, time.monotonic_ns(), len(meta_raw), len(plan), end)
        except BaseException:
            q[i] = prev  # leave the slot's previous record intact rather than half-written
            raise
        if fence is not None:
            fence()
        q[i] = 2 * s
        if fence is not None:
            fence()
        q[_Q_DATA_HEAD] = s
        self._dseq = s
        self._notify_readers()
        return s

    # -- back channel -------------------------------------------------------------------------
    def latest_back(self) -> BackMessage | None:
        """The newest drafter message, or None if there is none (never blocks, never raises on
        what the drafter wrote: a message that is not a JSON object is skipped)."""
        q, mm, fence = self._q, self._mm, sync.SEQ_FENCE
        for _ in range(4):  # retry only if the drafter rewrote the slot while we copied it
            head = q[_Q_BACK_HEAD]
            if head == 0:
                return None
            cached = self._back_cache
            if cached is not None and cached.seq == head:
                return cached
            base = self._boff + ((head - 1) % self._bslots) * self._bsize
            w1 = q[base >> 3]
            if w1 != 2 * head:
                continue
            if fence is not None:
                fence()
            sent_ns, length, pid = L.BACK_HEAD.unpack_from(mm, base + 8)
            body = base + L.BACK_SLOT_HEADER
            raw = mm[body:body + min(length, self._bsize - L.BACK_SLOT_HEADER)]
            if fence is not None:
                fence()
            if q[base >> 3] != w1:
                continue
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON / not UTF-8 / nested too deep
                return None
            if not isinstance(data, dict):
                return None
            self._back_cache = BackMessage(seq=head, sent_ns=sent_ns, sender_pid=pid, data=data)
            return self._back_cache
        return None

    # -- liveness / wake-ups ------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Refresh the heartbeat (publishing does it too; a background thread does it every interval)."""
        if not self._closed:
            self._q[_Q_HEARTBEAT] = time.monotonic_ns()

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.heartbeat()

    def _notify_readers(self) -> None:
        u32 = self._u32
        if sync.SEQ_FENCE is not None:
            sync.SEQ_FENCE()  # head before notify: a reader that sees the new notify must see the head
        self._q[_Q_HEARTBEAT] = time.monotonic_ns()
        # Every publish stores a value no earlier publish stored, so a reader asleep on any older
        # value is either woken or sees a change, also when the window and the data channel are
        # published from two threads (sync.py has the handshake).
        u32[_I_NOTIFY] = next(self._notify) & 0xFFFFFFFF
        sync.FULL_FENCE()  # store(notify) -> load(waiters): see sync.py, the Dekker handshake
        if u32[_I_WAITERS]:
            u32[_I_WAITERS] = 0
            self._m.futex.wake()
            self.wakes_issued += 1

    def _check_open(self) -> None:
        if self._closed:
            raise RingError(f"ring producer for {self.path} is closed")

    def close(self) -> None:
        """Mark the ring CLOSED (readers see producer_alive() False), stop the heartbeat, unmap."""
        if self._closed:
            return
        self._stop.set()
        self._hb_thread.join()
        self._closed = True
        if self._q[_Q_STATE] == L.STATE_READY:
            self._q[_Q_STATE] = L.STATE_CLOSED
            self._notify_readers()
        self._ring.close()

    def __enter__(self) -> RingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
