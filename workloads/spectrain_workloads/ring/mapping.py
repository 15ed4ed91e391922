"""A ring's memory: the sealed memfd, its mappings and the header that describes it.

The target owns the memory: a sealed memfd (MFD_ALLOW_SEALING, then F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL), so no process holding it can change its size, and the target's stores can never
fault (a shrunk tmpfs file would SIGBUS them). A reader maps the memfd it was handed only once the
header checks out and the seals are there; a closed ring's copy (a regular file) it reads into
private memory instead. How the memfd travels between them, and where the copy comes from, is
handover.py.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

from spectrain_workloads.ring import layout as L
from spectrain_workloads.ring import sync
from spectrain_workloads.ring.errors import RingError, RingVersionError

FIX_RECREATE = "delete it and (re)start the target on this rank, which creates the ring"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# The header's parts that only the target writes, once: STATIC (up to the state word) and PARAMS.
STATIC_RANGES = ((0, L.H_STATE), (L.PARAMS_AT, L.PARAMS_AT + L.PARAMS.size))
# (dev, ino) of what is at the path; (generation, creator pid, created ns) of the ring itself.
Inode = tuple[int, int]
Identity = tuple[int, int, int]


class Mapping:
    """One mapped ring: word views over it, its geometry and identity. `mm` is the memfd's shared
    mapping, or a private copy of a closed ring's file. `conn` (readers of a live ring) is the
    hand-over connection, held with the mapping: the target drops it when this reader closes, and
    it reads EOF once the target is gone (the heartbeat stays the liveness signal)."""

    def __init__(self, path: Path, mm: mmap.mmap, geometry: L.Geometry, *, generation: int, rank: int,
                 creator_pid: int, created_ns: int, inode: Inode, conn: socket.socket | None = None) -> None:
        self.path = path
        self.geometry = geometry
        self.generation = generation
        self.rank = rank
        self.creator_pid = creator_pid
        self.identity: Identity = (generation, creator_pid, created_ns)
        self.inode = inode
        self.conn = conn
        self.mm = mm
        # Item access on these compiles to one aligned load/store per word (see sync.py).
        self.q = memoryview(self.mm).cast("Q")
        self.u32 = memoryview(self.mm).cast("I")
        self.ro = memoryview(self.mm).toreadonly()
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)  # producer: copy target for arrays
        self.ro_u8 = np.frombuffer(self.ro, dtype=np.uint8)  # consumer: read-only views handed out
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base_address = ctypes.addressof(self._anchor)
        self.futex = sync.Futex(self.base_address + L.H_NOTIFY)
        self.closed = False

    def mark_superseded(self) -> None:
        """Tell readers of this (old) ring that a new one replaced it, and wake them now."""
        self.q[L.H_STATE >> 3] = L.STATE_SUPERSEDED
        i = L.H_NOTIFY >> 2
        self.u32[i] = (self.u32[i] + 1) & 0xFFFFFFFF
        sync.FULL_FENCE()
        self.futex.wake()

    def close(self) -> None:
        """Unmap. Views still held by callers (DataRecord arrays) keep the memory mapped until
        they are dropped; valid() on them returns False from now on."""
        if self.closed:
            return
        self.closed = True
        if self.conn is not None:
            self.conn.close()
        del self._anchor
        self.u8 = self.ro_u8 = None  # type: ignore[assignment]
        try:
            for view in (self.q, self.u32, self.ro):
                view.release()
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view: the mapping goes away with the last of them


def build_header(geo: L.Geometry, generation: int, rank: int, created_ns: int) -> bytes:
    """The static header (HEADER_BYTES, state READY) as the target writes and sends it."""
    head = bytearray(L.HEADER_BYTES)
    L.STATIC.pack_into(head, 0, L.MAGIC, L.LAYOUT_VERSION, L.HEADER_BYTES, generation, os.getpid(), created_ns,
                       geo.total, rank)
    L.PARAMS.pack_into(head, L.PARAMS_AT, *geo.params())
    head[L.H_STATE:L.H_STATE + 8] = L.STATE_READY.to_bytes(8, sys.byteorder)
    return bytes(head)


def parse_header(path: Path, head: bytes, size: int) -> tuple[L.Geometry, int, int, int, int]:
    """Validate a header (+ the size of what it describes): geometry, generation, rank, pid, created."""
    if len(head) < L.HEADER_BYTES:
        raise RingError(f"ring {path} is truncated ({size} bytes, shorter than the {L.HEADER_BYTES}-byte "
                        f"header): {FIX_RECREATE}")
    magic, version, header_bytes, generation, pid, created, total, rank = L.STATIC.unpack_from(head, 0)
    if magic != L.MAGIC:
        raise RingError(f"{path} is not a spectrain ring file (starts with {magic!r}, expected {L.MAGIC!r}): "
                        f"point SPECTRAIN_RING_DIR at the ring volume, or {FIX_RECREATE}")
    if version != L.LAYOUT_VERSION:
        raise RingVersionError(f"ring {path} has layout version {version} but this spectrain reads layout "
                               f"version {L.LAYOUT_VERSION}: run target and drafter from the same spectrain "
                               f"release (image tag)")
    try:
        if header_bytes != L.HEADER_BYTES:
            raise ValueError(f"header size {header_bytes} != {L.HEADER_BYTES}")
        geo = L.Geometry.from_params(L.PARAMS.unpack_from(head, L.PARAMS_AT))
    except ValueError as exc:  # ConfigError is a ValueError
        raise RingError(f"ring {path} has a corrupt header ({exc}): {FIX_RECREATE}") from exc
    if total != geo.total or size < geo.total:
        raise RingError(f"ring {path} is truncated ({size} bytes, its header says {geo.total}): "
                        f"{FIX_RECREATE}")
    state = int.from_bytes(head[L.H_STATE:L.H_STATE + 8], sys.byteorder)
    if state == L.STATE_INIT:
        raise RingError(f"ring {path} was never completely initialised: {FIX_RECREATE}")
    return geo, generation, rank, pid, created


def create_memory(path: Path, geo: L.Geometry, generation: int, rank: int) -> tuple[int, Mapping, bytes]:
    """A fresh READY ring for `path` (not served yet): its sealed memfd, the target's mapping of it
    and the header sent to readers. The memfd is closed again if anything here fails."""
    memfd = os.memfd_create(f"spectrain-{path.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        try:
            # Reserve the pages now: a memory limit is hit here, not as a fault mid-publish.
            os.posix_fallocate(memfd, 0, geo.total)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise RingError(f"ring {path} needs {geo.total} bytes of memory and cannot get them: raise the "
                                f"target container's memory limit or shrink RingLayout (data_slots x "
                                f"data_slot_bytes)") from exc
            raise
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, SEALS)
        now = time.monotonic_ns()
        hello = build_header(geo, generation, rank, now)
        mm = mmap.mmap(memfd, geo.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        for lo, hi in STATIC_RANGES:
            mm[lo:hi] = hello[lo:hi]
        m = Mapping(path, mm, geo, generation=generation, rank=rank, creator_pid=os.getpid(), created_ns=now,
                    inode=(0, 0))
        m.q[L.H_HEARTBEAT >> 3] = now
        sync.FULL_FENCE()
        m.q[L.H_STATE >> 3] = L.STATE_READY
    except BaseException:
        os.close(memfd)
        raise
    return memfd, m, hello


def map_received(path: Path, head: bytes, fd: int, inode: Inode, conn: socket.socket) -> Mapping:
    """Map the memfd `fd` a target handed over with `head`, once both check out. The caller
    closes `fd` (the mapping keeps the memory); `conn` is held by the Mapping."""
    size = os.fstat(fd).st_size
    geo, generation, rank, pid, created = parse_header(path, head, size)
    # Sealed against resizing, so nobody can make this process's accesses fault either.
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
        raise RingError(f"ring {path}: the memory received is not sealed against resizing: it is not "
                        f"a spectrain target's ring; {FIX_RECREATE}")
    mm = mmap.mmap(fd, geo.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return Mapping(path, mm, geo, generation=generation, rank=rank, creator_pid=pid, created_ns=created,
                   inode=inode, conn=conn)


def read_copy(path: Path, inode: Inode) -> Mapping:
    """A closed ring left as a file: copied into private memory (it has no writer any more, and a
    private copy cannot fault whatever happens to the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        geo, generation, rank, pid, created = parse_header(path, os.pread(fd, L.HEADER_BYTES, 0), size)
        mm = mmap.mmap(-1, geo.total)
        view, got = memoryview(mm), 0
        try:
            while got < geo.total and (n := os.preadv(fd, [view[got:]], got)) > 0:
                got += n
        finally:
            view.release()
        if got < geo.total:
            mm.close()
            raise RingError(f"ring {path} is truncated ({got} bytes, its header says {geo.total}): {FIX_RECREATE}")
    finally:
        os.close(fd)
    return Mapping(path, mm, geo, generation=generation, rank=rank, creator_pid=pid, created_ns=created, inode=inode)


def file_identity(path: Path) -> Identity | None:
    """The identity in the header of a ring file at `path` (None for a socket or a non-ring), so a
    reader can tell its own ring's closed copy from a new ring without reading the whole file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        head = os.pread(fd, L.STATIC.size, 0)
    finally:
        os.close(fd)
    if len(head) < L.STATIC.size:
        return None
    magic, _, _, generation, pid, created, _, _ = L.STATIC.unpack_from(head, 0)
    return (generation, pid, created) if magic == L.MAGIC else None
