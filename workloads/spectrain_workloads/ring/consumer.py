"""The drafter's side of the ring: read windows and data, write the back channel.

Reading never writes anything the producer waits on. Every record between the reader's cursor
and the channel head is either returned or counted as missed (windows_missed / data_dropped):
exact accounting, since a record is missed only when its slot's seq word shows a later record.
A waiting reader sleeps on the futex word in chunks of at most CHUNK_S, so it re-checks the
producer's heartbeat and a replaced ring even if no record arrives.

A record whose seq words are consistent but whose body does not decode (unknown window kind,
data header or descriptors out of bounds, meta that is not a JSON object) is skipped and counted
in records_corrupt: it never raises, so a corrupt ring cannot crash a drafter again after each
restart.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np

from spectrain_workloads.ring import layout as L
from spectrain_workloads.ring import sync
from spectrain_workloads.ring.errors import PayloadTooLarge, ProducerDead, RingError
from spectrain_workloads.ring.handover import open_ring
from spectrain_workloads.ring.mapping import Mapping, file_identity
from spectrain_workloads.ring.records import KINDS_BY_VALUE, BackMessage, DataRecord, WindowEvent

_Q_STATE = L.H_STATE >> 3
_Q_HEARTBEAT = L.H_HEARTBEAT >> 3
_Q_WINDOW_HEAD = L.H_WINDOW_HEAD >> 3
_Q_DATA_HEAD = L.H_DATA_HEAD >> 3
_Q_BACK_HEAD = L.H_BACK_HEAD >> 3
_Q_CONSUMER_PID = L.H_CONSUMER_PID >> 3
_I_NOTIFY = L.H_NOTIFY >> 2
_I_WAITERS = L.H_WAITERS >> 2
_DESCS_BYTES = L.MAX_ARRAYS * L.DESCRIPTOR.size
_DECODE = json.JSONDecoder().decode
_DTYPE_CACHE = 64  # parsed dtypes kept; real records use a handful


class _Corrupt(Exception):
    """A stable record (seq words agree) whose body does not decode."""


class RingConsumer:
    """Reader of the window and data channels, single writer of the back channel. One thread."""

    CHUNK_S = 0.1  # longest single sleep: bounds how late a dead/replaced producer is noticed
    RESYNC_CHECK_S = 0.05  # at most this often stat() the path while the producer looks gone

    def __init__(self, mapping: Mapping, *, start: str, spin: bool) -> None:
        if start not in ("latest", "oldest", "first"):
            raise ValueError(f"start must be 'latest' (only records published from now on) or 'oldest' "
                             f"(everything still in the ring), got {start!r}")
        self.spin = spin
        self.windows_missed = 0  # window records overwritten before this reader got to them
        self.data_dropped = 0  # data records overwritten before this reader got to them
        self.records_corrupt = 0  # complete records that did not decode: skipped
        self.resyncs = 0  # times a restarted producer's new ring was picked up
        self._next_resync_check = 0.0
        self._dtypes: dict[bytes, np.dtype[Any]] = {}
        self._attach(mapping, start)

    @classmethod
    def open(cls, path: str | os.PathLike[str], timeout_s: float = 30.0, *, start: str = "latest",
             spin: bool = False) -> RingConsumer:
        """Map the ring at `path`, waiting up to `timeout_s` for the target to create it.

        start="latest" reads only records published after this call (a restarted drafter skips
        stale windows); "oldest" also returns what is still in the ring. After a producer restart
        the reader always starts at the new ring's first record. spin=True busy-polls instead of
        sleeping (lowest latency; costs a core)."""
        return cls(open_ring(Path(path), timeout_s), start=start, spin=spin)

    def _attach(self, mapping: Mapping, start: str) -> None:
        self._m = mapping
        geo = mapping.geometry
        self.layout = geo.layout
        self._q, self._u32, self._mm = mapping.q, mapping.u32, mapping.mm
        self._woff, self._wslots = geo.window_off, geo.layout.window_slots
        self._doff, self._dslots, self._dstride = geo.data_off, geo.layout.data_slots, geo.data_stride
        self._dcap = geo.layout.data_slot_bytes
        self._boff, self._bslots, self._bsize = geo.back_off, geo.layout.back_slots, geo.layout.back_slot_bytes
        q = self._q
        if start == "latest":
            self._wcur, self._dcur = q[_Q_WINDOW_HEAD] + 1, q[_Q_DATA_HEAD] + 1
        elif start == "first":  # a new generation: everything in it is new to us; lapped = missed
            self._wcur = self._dcur = 1
        else:
            self._wcur = max(1, q[_Q_WINDOW_HEAD] - self._wslots + 1)
            self._dcur = max(1, q[_Q_DATA_HEAD] - self._dslots + 1)
        self._bseq = q[_Q_BACK_HEAD]  # continue after a previous drafter's messages
        q[_Q_CONSUMER_PID] = os.getpid()

    # -- identity -----------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._m.path

    @property
    def generation(self) -> int:
        return self._m.generation

    @property
    def rank(self) -> int:
        return self._m.rank

    @property
    def producer_pid(self) -> int:
        return self._m.creator_pid

    # -- windows ------------------------------------------------------------------------------
    def poll_windows(self, max_records: int | None = None) -> list[WindowEvent]:
        """Window records published since the last call, oldest first; never blocks."""
        out: list[WindowEvent] = []
        limit = max_records if max_records is not None else 1 << 62
        q, mm, fence, slots = self._q, self._mm, sync.SEQ_FENCE, self._wslots
        superseded = q[_Q_STATE] == L.STATE_SUPERSEDED  # read before head: drain, then switch files
        head = q[_Q_WINDOW_HEAD]
        if fence is not None:
            fence()
        cur = self._wcur
        if head - cur + 1 > slots:  # lapped: those records are gone for sure
            self.windows_missed += head - slots + 1 - cur
            cur = head - slots + 1
        unpack = L.WINDOW_BODY.unpack_from
        while cur <= head and len(out) < limit:
            off = self._woff + ((cur - 1) % slots) * L.WINDOW_RECORD_BYTES
            want = 2 * cur
            w1 = q[off >> 3]
            if w1 == want:
                if fence is not None:
                    fence()
                body = unpack(mm, off + 8)
                if fence is not None:
                    fence()
                if q[off >> 3] == want:
                    step, wid, start, predicted, actual, rank, stage, flags, kind, is_end = body
                    kind_e = KINDS_BY_VALUE.get(kind)
                    if kind_e is None or is_end > 1:
                        self.records_corrupt += 1
                    else:
                        out.append(WindowEvent(cur, kind_e, rank, stage, step, wid, start, predicted, actual,
                                               flags, bool(is_end)))
                    cur += 1
                    continue
            elif w1 < want:
                break  # not complete yet (cannot follow a head store; defensive)
            # Overwritten before or while we copied it: skip to the oldest record that may survive.
            newest = q[_Q_WINDOW_HEAD]
            skip_to = max(cur + 1, newest - slots + 1)
            self.windows_missed += skip_to - cur
            cur = skip_to
            head = max(head, newest)
        self._wcur = cur
        if superseded and cur > head and len(out) < limit and self._resync():
            out.extend(self.poll_windows(limit - len(out)))
        return out

    def wait_windows(self, timeout_s: float = 0.5, *, spin: bool | None = None, raise_if_dead: bool = False,
                     max_age_s: float = 1.0) -> list[WindowEvent]:
        """Like poll_windows, but sleep up to `timeout_s` for the first record (woken by the
        producer's publish). With raise_if_dead, a heartbeat older than max_age_s raises
        ProducerDead instead of waiting on."""
        return self._wait(self.poll_windows, timeout_s, spin, raise_if_dead, max_age_s)  # type: ignore[no-any-return]

    def wait_until(self, read: Any, timeout_s: float = 0.5, *, spin: bool | None = None) -> Any:
        """Call `read()` until it returns something truthy or `timeout_s` passes, sleeping on the
        ring's notify word in between (woken by any publish: window or data)."""
        return self._wait(read, timeout_s, spin, False, 1.0)

    # -- data ---------------------------------------------------------------------------------
    def next_data(self) -> DataRecord | None:
        """The oldest unread data record (views into the slot), or None; never blocks."""
        q, fence, slots = self._q, sync.SEQ_FENCE, self._dslots
        superseded = q[_Q_STATE] == L.STATE_SUPERSEDED
        head = q[_Q_DATA_HEAD]
        if fence is not None:
            fence()
        cur = self._dcur
        if head - cur + 1 > slots:
            self.data_dropped += head - slots + 1 - cur
            cur = head - slots + 1
        while cur <= head:
            base = self._doff + ((cur - 1) % slots) * self._dstride
            want = 2 * cur
            w1 = q[base >> 3]
            if w1 < want:
                break
            if w1 == want:
                try:
                    rec = self._read_slot(base, want)
                except _Corrupt:
                    self.records_corrupt += 1
                    cur += 1
                    continue
                if rec is not None:
                    self._dcur = cur + 1
                    return rec
            newest = q[_Q_DATA_HEAD]
            skip_to = max(cur + 1, newest - slots + 1)
            self.data_dropped += skip_to - cur
            cur = skip_to
            head = max(head, newest)
        self._dcur = cur
        if superseded and cur > head and self._resync():
            return self.next_data()
        return None

    def wait_data(self, timeout_s: float = 0.5, *, spin: bool | None = None, raise_if_dead: bool = False,
                  max_age_s: float = 1.0) -> DataRecord | None:
        """Like next_data, but sleep up to `timeout_s` for a record."""
        return self._wait(self.next_data, timeout_s, spin, raise_if_dead, max_age_s)  # type: ignore[no-any-return]

    def _read_slot(self, base: int, want: int) -> DataRecord | None:
        """Copy the slot's header and meta, build views, re-check the seq word; None if overwritten,
        _Corrupt if stable but not decodable (every field is bounded before use)."""
        mm, q, fence = self._mm, self._q, sync.SEQ_FENCE
        if fence is not None:
            fence()
        publish_ns, meta_len, n_arrays, used = L.DATA_HEAD.unpack_from(mm, base + 8)
        descs = mm[base + L.DESCRIPTORS_AT:base + L.DESCRIPTORS_AT + _DESCS_BYTES]
        payload = base + L.DATA_SLOT_HEADER
        meta_raw = mm[payload:payload + min(meta_len, self._dcap)]
        if fence is not None:
            fence()
        if q[base >> 3] != want:
            return None
        if n_arrays > L.MAX_ARRAYS or used > self._dcap or meta_len > used:
            raise _Corrupt
        try:
            meta = _DECODE(meta_raw.decode())
            if not isinstance(meta, dict):
                raise ValueError("meta is not a JSON object")
            arrays = {}
            ro = self._m.ro_u8
            for k in range(n_arrays):
                name, dtype_raw, ndim, _, at, nbytes, *shape = L.DESCRIPTOR.unpack_from(descs, k * L.DESCRIPTOR.size)
                dtype = self._dtypes.get(dtype_raw)
                if dtype is None:
                    dtype = np.dtype(dtype_raw.rstrip(b"\0").decode())
                    if len(self._dtypes) < _DTYPE_CACHE:  # scribbled descriptors must not grow it
                        self._dtypes[dtype_raw] = dtype
                if at + nbytes > used or ndim > L.MAX_NDIM or dtype.hasobject:
                    raise ValueError(f"array at {at}+{nbytes}, ndim {ndim}, dtype {dtype} out of bounds")
                start = payload + at
                arrays[name.rstrip(b"\0").decode()] = ro[start:start + nbytes].view(dtype).reshape(shape[:ndim])
        except (ValueError, TypeError, RecursionError) as exc:
            raise _Corrupt from exc
        return DataRecord(want >> 1, meta, arrays, publish_ns, self._m, base >> 3, want)

    # -- back channel -------------------------------------------------------------------------
    def publish_back(self, data: dict[str, Any]) -> BackMessage:
        """Publish a small JSON message to the target (state, version, path, acceptance...)."""
        raw = json.dumps(data, separators=(",", ":")).encode()
        cap = self._bsize - L.BACK_SLOT_HEADER
        if len(raw) > cap:
            raise PayloadTooLarge(f"back message is {len(raw)} bytes but a back slot holds {cap} "
                                  f"(RingLayout.back_slot_bytes - 32): send less, or raise back_slot_bytes")
        self._check_resync()
        q, fence = self._q, sync.SEQ_FENCE
        s = self._bseq + 1
        base = self._boff + ((s - 1) % self._bslots) * self._bsize
        q[base >> 3] = 2 * s - 1
        if fence is not None:
            fence()
        now = time.monotonic_ns()
        L.BACK_HEAD.pack_into(self._mm, base + 8, now, len(raw), os.getpid())
        self._mm[base + L.BACK_SLOT_HEADER:base + L.BACK_SLOT_HEADER + len(raw)] = raw
        if fence is not None:
            fence()
        q[base >> 3] = 2 * s
        if fence is not None:
            fence()
        q[_Q_BACK_HEAD] = s
        self._bseq = s
        return BackMessage(seq=s, sent_ns=now, sender_pid=os.getpid(), data=data)

    # -- liveness / resync --------------------------------------------------------------------
    def heartbeat_age_s(self) -> float:
        """Seconds since the producer last published or beat."""
        return (time.monotonic_ns() - self._q[_Q_HEARTBEAT]) / 1e9

    def producer_alive(self, max_age_s: float = 1.0) -> bool:
        """True if the producer's heartbeat is at most `max_age_s` old and it has not closed the
        ring. A restarted producer's new file is picked up here (and by every read)."""
        self._check_resync()
        return self._q[_Q_STATE] == L.STATE_READY and self.heartbeat_age_s() <= max_age_s

    def producer_closed(self) -> bool:
        """True once the producer closed the ring cleanly (everything it published is readable)."""
        self._check_resync()
        return bool(self._q[_Q_STATE] == L.STATE_CLOSED)

    def check_alive(self, max_age_s: float = 1.0) -> None:
        """Raise ProducerDead (with the heartbeat's age) unless producer_alive(max_age_s)."""
        if not self.producer_alive(max_age_s):
            state = {L.STATE_CLOSED: "closed the ring", L.STATE_SUPERSEDED: "was replaced"}.get(
                self._q[_Q_STATE], "stopped beating")
            raise ProducerDead(f"ring {self.path}: producer pid {self.producer_pid} (generation "
                               f"{self.generation}) {state}; heartbeat {self.heartbeat_age_s():.2f}s old > "
                               f"{max_age_s}s. The target on this rank died, hung or finished; the reader "
                               f"resyncs by itself when a new target re-creates the ring")

    def _check_resync(self) -> None:
        q = self._q
        state = q[_Q_STATE]
        if state == L.STATE_SUPERSEDED:
            self._resync()
        elif state != L.STATE_READY or time.monotonic_ns() - q[_Q_HEARTBEAT] > 1_000_000_000:
            now = time.monotonic()
            if now >= self._next_resync_check:  # a new file may sit at the path without marking ours
                self._next_resync_check = now + self.RESYNC_CHECK_S
                try:
                    st = os.stat(self._m.path)
                except OSError:
                    return
                if (st.st_dev, st.st_ino) != self._m.inode:
                    self._resync()

    def _resync(self) -> bool:
        """Switch to the ring now at the path. Records of the old ring this reader has not read are
        counted as missed/dropped (poll_windows and next_data drain their channel before switching).
        The same ring under a new inode (its producer closed and left a copy) is not a switch."""
        try:
            st = os.lstat(self._m.path)
        except OSError:
            return False
        if stat.S_ISREG(st.st_mode) and file_identity(self._m.path) == self._m.identity:
            self._m.inode = (st.st_dev, st.st_ino)
            return False
        try:
            new = open_ring(self._m.path, 0)
        except RingError:
            return False  # not there yet (or unusable): keep the old ring, retry on the next call
        if new.identity == self._m.identity:
            self._m.inode = new.inode
            new.close()
            return False
        q, old = self._q, self._m
        self.windows_missed += max(0, q[_Q_WINDOW_HEAD] - self._wcur + 1)
        self.data_dropped += max(0, q[_Q_DATA_HEAD] - self._dcur + 1)
        self._attach(new, "first")
        old.close()
        self.resyncs += 1
        return True

    def _wait(self, read: Any, timeout_s: float, spin: bool | None, raise_if_dead: bool, max_age_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        spin = self.spin if spin is None else spin
        while True:
            mapping = self._m
            seen = self._u32[_I_NOTIFY]  # before reading: a publish after this changes the word
            if sync.SEQ_FENCE is not None:
                sync.SEQ_FENCE()
            got = read()
            if got:
                return got
            if self._m is not mapping:
                continue  # resynced to a new file: `seen` belongs to the old one
            if raise_if_dead:
                self.check_alive(max_age_s)
            else:
                self._check_resync()
            left = deadline - time.monotonic()
            if left <= 0:
                return got
            if spin:
                u32, stop = self._u32, time.monotonic() + min(left, self.CHUNK_S)
                while u32[_I_NOTIFY] == seen and time.monotonic() < stop:
                    pass
            else:
                self._u32[_I_WAITERS] = 1  # the producer clears it when it wakes us
                self._m.futex.wait(seen, min(left, self.CHUNK_S))

    def close(self) -> None:
        """Unmap (views of returned DataRecords stay readable until dropped; valid() is False)."""
        self._m.close()

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
