"""Creating, validating and mapping ring files.

A producer never initialises a file in place: it builds `.<name>.<pid>.tmp` next to the ring
(mode 0600, space reserved with posix_fallocate so a full tmpfs fails here and not as SIGBUS
mid-publish), then renames it over the ring. A reader therefore sees either the previous file or
a complete new one. The previous file is marked SUPERSEDED and its sleepers are woken, so
readers that still map it reopen the path and resync on their own. Shrinking or rewriting a file
that another process maps would be unsafe (SIGBUS, torn headers); replacing it is not.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np

from spectrain_workloads.ring import layout as L
from spectrain_workloads.ring import sync
from spectrain_workloads.ring.errors import RingError, RingVersionError

_FIX_RECREATE = "delete it and (re)start the target on this rank, which creates the ring"


class Mapping:
    """One mapped ring file: word views over it, its geometry and identity."""

    def __init__(self, path: Path, fd: int, geometry: L.Geometry, *, generation: int, rank: int,
                 creator_pid: int) -> None:
        self.path = path
        self.geometry = geometry
        self.generation = generation
        self.rank = rank
        self.creator_pid = creator_pid
        st = os.fstat(fd)
        self.inode = (st.st_dev, st.st_ino)
        self.mm = mmap.mmap(fd, geometry.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
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
        """Tell readers of this (old) file that a new one replaced it, and wake them now."""
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
        del self._anchor
        self.u8 = self.ro_u8 = None  # type: ignore[assignment]
        try:
            for view in (self.q, self.u32, self.ro):
                view.release()
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view: the mapping goes away with the last of them


def _clean_stale_temps(path: Path) -> None:
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def _previous(path: Path) -> tuple[int, Mapping | None]:
    """Generation of the file now at `path` (0 if none or foreign) and a mapping of it when it is
    a valid ring of this layout version (to mark it SUPERSEDED)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return 0, None
    try:
        head = os.pread(fd, L.HEADER_BYTES, 0)
        if len(head) < 24 or head[:8] != L.MAGIC:
            return 0, None
        generation = int.from_bytes(head[L.H_GENERATION:L.H_GENERATION + 8], sys.byteorder)
        try:
            return generation, _validated(path, fd, head)
        except RingError:
            return generation, None
    finally:
        os.close(fd)


def create_file(path: Path, layout: L.RingLayout, rank: int) -> Mapping:
    """Write a fresh READY ring at `path` (generation = previous + 1) and return its mapping."""
    if not path.parent.is_dir():
        raise RingError(f"ring directory {path.parent} does not exist: mount the memory-backed ring volume "
                        f"there (SPECTRAIN_RING_DIR) or create the directory")
    geo = L.Geometry.of(layout)
    old_generation, old = _previous(path)
    _clean_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only narrow, but be explicit: the ring is private
        try:
            os.posix_fallocate(fd, 0, geo.total)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise RingError(f"ring {path} needs {geo.total} bytes but {path.parent} has less free: raise "
                                f"spec.ring.sizeLimit or shrink RingLayout (data_slots x data_slot_bytes)") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, geo.total)
        m = Mapping(path, fd, geo, generation=old_generation + 1, rank=rank, creator_pid=os.getpid())
        now = time.monotonic_ns()
        L.STATIC.pack_into(m.mm, 0, L.MAGIC, L.LAYOUT_VERSION, L.HEADER_BYTES, m.generation, os.getpid(), now,
                           geo.total, rank)
        L.PARAMS.pack_into(m.mm, L.PARAMS_AT, *geo.params())
        m.q[L.H_HEARTBEAT >> 3] = now
        sync.FULL_FENCE()
        m.q[L.H_STATE >> 3] = L.STATE_READY
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    if old is not None:
        old.mark_superseded()
        old.close()
    return m


def _validated(path: Path, fd: int, head: bytes) -> Mapping:
    st = os.fstat(fd)
    if len(head) < L.HEADER_BYTES:
        raise RingError(f"ring {path} is truncated ({st.st_size} bytes, shorter than the {L.HEADER_BYTES}-byte "
                        f"header): {_FIX_RECREATE}")
    magic, version, header_bytes, generation, pid, _created, total, rank = L.STATIC.unpack_from(head, 0)
    if magic != L.MAGIC:
        raise RingError(f"{path} is not a spectrain ring file (starts with {magic!r}, expected {L.MAGIC!r}): "
                        f"point SPECTRAIN_RING_DIR at the ring volume, or {_FIX_RECREATE}")
    if version != L.LAYOUT_VERSION:
        raise RingVersionError(f"ring {path} has layout version {version} but this spectrain reads layout "
                               f"version {L.LAYOUT_VERSION}: run target and drafter from the same spectrain "
                               f"release (image tag)")
    try:
        if header_bytes != L.HEADER_BYTES:
            raise ValueError(f"header size {header_bytes} != {L.HEADER_BYTES}")
        geo = L.Geometry.from_params(L.PARAMS.unpack_from(head, L.PARAMS_AT))
    except ValueError as exc:  # ConfigError is a ValueError
        raise RingError(f"ring {path} has a corrupt header ({exc}): {_FIX_RECREATE}") from exc
    if total != geo.total or st.st_size < geo.total:
        raise RingError(f"ring {path} is truncated ({st.st_size} bytes, its header says {geo.total}): "
                        f"{_FIX_RECREATE}")
    state = int.from_bytes(head[L.H_STATE:L.H_STATE + 8], sys.byteorder)
    if state == L.STATE_INIT:
        raise RingError(f"ring {path} was never completely initialised: {_FIX_RECREATE}")
    return Mapping(path, fd, geo, generation=generation, rank=rank, creator_pid=pid)


def open_file(path: Path, timeout_s: float) -> Mapping:
    """Map the ring at `path`, waiting up to `timeout_s` for it to appear; RingError otherwise."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise RingError(f"ring {path} does not exist (waited {timeout_s:g}s): the target on this rank "
                                f"creates it; check it runs and that both containers mount the same "
                                f"SPECTRAIN_RING_DIR") from None
            time.sleep(0.01)  # the file appears by an atomic rename; poll its name until the deadline
        except PermissionError as exc:
            try:
                st = os.stat(path)
                who = f"mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}"
            except OSError:
                who = "mode unknown"
            raise RingError(f"ring {path} cannot be opened read-write ({who}; this process runs as uid "
                            f"{os.getuid()}): run the drafter as the target's user (same runAsUser)") from exc
        except OSError as exc:
            raise RingError(f"ring {path} cannot be opened ({exc.strerror}): {_FIX_RECREATE}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RingError(f"ring {path} is not a regular file: {_FIX_RECREATE}")
        return _validated(path, fd, os.pread(fd, L.HEADER_BYTES, 0))
    finally:
        os.close(fd)
