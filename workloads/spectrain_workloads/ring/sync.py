"""Memory ordering and wake-ups between ring processes: fences and a cross-process futex.

Why the ring's records are never torn (the seqlock argument; docs/ring.md has the long form)
--------------------------------------------------------------------------------------------
Writer of record s in a slot:  W1 seq := 2s-1 ; F ; W2 body ; F ; W3 seq := 2s ; F ; W4 head := s
Reader of record s:            R1 seq -> a ; F ; R2 copy body ; F ; R3 seq -> b ; accept iff a == b == 2s

If the reader accepts, R1 saw W3 of record s, so (W2 before W3, R1 before R2) the copy saw the
whole body of s; and R3 still seeing 2s means no W1 of a later record (2s+2S-1) became visible
before the copy finished, so nothing of a later body was mixed in. That needs exactly: stores in
program order (W1 < W2 < W3 < W4) and loads in program order (R1 < R2 < R3), plus single-copy
atomic 8-byte seq words.

- x86-64 (TSO) keeps store->store and load->load order in hardware; the compiler cannot reorder
  either because every access is a separate opaque C call made by the interpreter (struct
  pack_into/unpack_from, memoryview item access, mmap slicing). glibc's memcpy ends its
  non-temporal-store path with sfence. So F is free there: SEQ_FENCE is None.
- ARM64 (and other weakly ordered CPUs) reorders both; F must be `dmb ish` (in C: the release
  fence before W3/W4, the acquire fence after R1, `atomic_thread_fence(acquire)` before R3;
  Linux's seqcount uses smp_wmb/smp_rmb at exactly these points). SEQ_FENCE issues it.
- Seq words are read and written through a memoryview cast to 'Q': CPython copies the item
  with an 8-byte memcpy, compiled to one aligned load/store (single-copy atomic on both ISAs).
  struct's '<Q' would store byte by byte and could be seen half-written, so it is never used
  for seq words. In C: `atomic_store_explicit(&seq, v, memory_order_relaxed)` plus the fences.

The wake handshake is a Dekker pattern and needs a store->load fence on every ISA:
producer: bump notify ; FULL_FENCE ; read waiters flag (wake if set)
reader:   set waiters flag ; FUTEX_WAIT(notify, seen) -- the kernel takes the futex bucket lock
          (a full barrier) before it re-reads notify, so the reader needs no fence of its own.
Without FULL_FENCE the producer could read the flag before its notify store is visible while the
reader's kernel re-check still sees the old value: a lost wake-up. (Readers sleep in bounded
chunks, so even then the cost would be one chunk of latency, never a hang.)

Fences come from two instructions mapped executable from a memfd (as ld.so maps a library, so
the kernel keeps the instruction cache coherent on ARM): `mfence; ret` on x86-64, `dmb ish; ret`
on ARM64. Calling one through ctypes costs ~0.15 us. Where that mapping is refused (noexec
policies), a FUTEX_WAKE on a private word is the fallback: the kernel issues smp_mb() in it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable

_MACHINE = platform.machine().lower()
_X86_64 = _MACHINE in ("x86_64", "amd64")
_ARM64 = _MACHINE in ("aarch64", "arm64")
_SYS_FUTEX = 202 if _X86_64 else 98 if _ARM64 else None
FUTEX_WAIT = 0
FUTEX_WAKE = 1
FUTEX_PRIVATE_FLAG = 128
_INT_MAX = 2**31 - 1

_FENCE_CODE = (
    bytes([0x0F, 0xAE, 0xF0, 0xC3]) if _X86_64  # mfence; ret
    else (0xD5033BBF).to_bytes(4, "little") + (0xD65F03C0).to_bytes(4, "little") if _ARM64  # dmb ish; ret
    else None
)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> Callable[..., int] | None:
    if _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return fn  # type: ignore[no-any-return]


_syscall = _load_syscall()
FUTEX_AVAILABLE = _syscall is not None


def _machine_code_fence() -> Callable[[], None] | None:
    """A callable running the fence instruction, or None where executable mappings are refused."""
    if _FENCE_CODE is None or not hasattr(os, "memfd_create"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        fd = os.memfd_create("spectrain-ring-fence", os.MFD_CLOEXEC)
        try:
            os.write(fd, _FENCE_CODE.ljust(mmap.PAGESIZE, b"\0"))
            addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)  # the mapping keeps the memfd's page alive
    except (OSError, AttributeError):
        return None
    if not addr or addr == ctypes.c_void_p(-1).value:
        return None
    fence = ctypes.CFUNCTYPE(None)(addr)
    fence()  # fail here, at import, rather than mid-publish
    return fence  # type: ignore[no-any-return]


def _futex_fence() -> Callable[[], None] | None:
    if _syscall is None:
        return None
    word = ctypes.c_uint32(0)
    addr = ctypes.addressof(word)
    call = _syscall

    def fence() -> None:
        call(_SYS_FUTEX, addr, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, 0, None, None, 0)

    fence.word = word  # type: ignore[attr-defined]  # keep the word alive with the closure
    return fence


def _lock_fence() -> Callable[[], None]:
    # Last resort on unknown platforms: a lock round trip is an atomic RMW in libc; documented
    # as best effort only (ordering is exact on x86-64 and ARM64 through the paths above).
    lock = threading.Lock()

    def fence() -> None:
        lock.acquire()
        lock.release()

    return fence


def _pick_fence() -> tuple[Callable[[], None], str]:
    code = _machine_code_fence()
    if code is not None:
        return code, "mfence" if _X86_64 else "dmb ish"
    futex = _futex_fence()
    if futex is not None:
        return futex, "futex-syscall"
    return _lock_fence(), "lock"


FULL_FENCE, FENCE_IMPL = _pick_fence()
# Needed between seq words and record bodies only where the CPU reorders same-kind accesses.
SEQ_FENCE: Callable[[], None] | None = None if _X86_64 else FULL_FENCE


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word of a shared mapping (shared, not PRIVATE, futexes:
    the waiter and the waker are different processes). Without the syscall, wait() sleeps briefly."""

    FALLBACK_SLEEP_S = 0.0005

    def __init__(self, address: int) -> None:
        if address % 4:
            raise ValueError(f"futex word at {address:#x} is not 4-byte aligned")
        self._addr = address
        self._ts = _Timespec()
        self._ts_addr = ctypes.addressof(self._ts)

    def wait(self, expected: int, timeout_s: float) -> None:
        """Sleep while the word equals `expected`, at most `timeout_s`; returns early on a wake,
        a changed word or a signal. The caller re-checks its condition either way."""
        if timeout_s <= 0:
            return
        if _syscall is None:
            time.sleep(min(timeout_s, self.FALLBACK_SLEEP_S))
            return
        sec = int(timeout_s)
        self._ts.tv_sec = sec
        self._ts.tv_nsec = int((timeout_s - sec) * 1e9)
        _syscall(_SYS_FUTEX, self._addr, FUTEX_WAIT, expected & 0xFFFFFFFF, self._ts_addr, None, 0)

    def wake(self) -> int:
        """Wake every process sleeping on the word; returns how many woke (0 without the syscall)."""
        if _syscall is None:
            return 0
        return int(_syscall(_SYS_FUTEX, self._addr, FUTEX_WAKE, _INT_MAX, None, None, 0))
