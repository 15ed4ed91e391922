"""Child-process bodies for the ring process tests (spawned: importable, no pytest state).

Records carry their own checks: a window's fields are functions of its step, a data record's
meta holds the CRC of its payload. A reader that ever accepts a record whose checks fail has
seen a torn record.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import select
import socket
import stat
import time
import zlib
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

import numpy as np

from spectrain_workloads.ring import (
    DataRecord,
    RingConsumer,
    RingError,
    RingLayout,
    RingProducer,
    WindowEvent,
    WindowKind,
)
from spectrain_workloads.ring import layout as L

PAYLOAD_POOL = 8


def window_fields(i: int) -> dict[str, int]:
    return {"stage": i % 7, "step": i, "predicted_duration_ns": (i * 2654435761) % (1 << 40),
            "flags": zlib.crc32(i.to_bytes(8, "little"))}


def window_ok(ev: WindowEvent) -> bool:
    want = window_fields(ev.step)
    actual_ok = ev.actual_duration_ns == (ev.step * 7919 if ev.is_end else 0)
    return (ev.stage == want["stage"] and ev.predicted_duration_ns == want["predicted_duration_ns"]
            and ev.flags == want["flags"] and ev.kind == WindowKind(1 + ev.step % 4) and actual_ok
            and ev.window_id & 0xFFFFFFFF == ev.step + 1)


def payloads(nbytes: int) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(PAYLOAD_POOL):
        a = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out.append((a, zlib.crc32(a.tobytes())))
    return out


def data_check(rec: DataRecord) -> bool | None:
    """True: intact and still valid; None: overwritten meanwhile (discarded); False: TORN."""
    intact = (zlib.crc32(rec.arrays["x"].data) == rec.meta["crc"]
              and bool((rec.arrays["tokens"] == rec.meta["i"]).all()))
    if not rec.valid():
        return None
    return intact


def produce(path: str, layout: dict[str, int], n: int | None, payload_bytes: int, data_every: int,
            ready: Event, go: Event) -> None:
    """Publish window starts/ends and data records; n=None: until killed."""
    p = RingProducer.create(path, RingLayout(**layout))
    pool = payloads(payload_bytes)
    ready.set()
    go.wait(60)
    i = 0
    while n is None or i < n:
        wid = p.window_start(1 + i % 4, **window_fields(i))
        if i % 2:
            p.window_end(wid, actual_duration_ns=i * 7919)
        if i % data_every == 0:
            a, crc = pool[i % PAYLOAD_POOL]
            p.publish_data({"i": i, "crc": crc}, {"x": a, "tokens": np.full(16, i, dtype=np.int64)})
        i += 1
    p.close()


def read_all(path: str, out: Any, ready: Event) -> None:
    """Read everything until the producer closes; report counts (and any torn record) on `out`."""
    c = RingConsumer.open(path, timeout_s=30, start="oldest")
    ready.set()
    stats = {"windows": 0, "windows_bad": 0, "data_ok": 0, "data_discarded": 0, "data_bad": 0}
    while True:
        closed = c.producer_closed()  # not the heartbeat: a starved host must not end the run early
        for ev in c.wait_windows(0.05):
            stats["windows"] += 1
            stats["windows_bad"] += not window_ok(ev)
        while (rec := c.next_data()) is not None:
            verdict = data_check(rec)
            key = "data_ok" if verdict else "data_discarded" if verdict is None else "data_bad"
            stats[key] += 1
        if closed:  # everything published before the close is drained by now
            break
    stats["windows_missed"] = c.windows_missed
    stats["data_dropped"] = c.data_dropped
    out.put(stats)
    c.close()


def wait_forever(path: str, ready: Event) -> None:
    """Block in wait_windows (until SIGKILLed)."""
    c = RingConsumer.open(path, timeout_s=30)
    ready.set()
    while True:
        c.wait_windows(5.0)


def receive(path: str, count: int, out: Any, ready: Event) -> None:
    """Wait for `count` window records with the blocking reader; report their steps."""
    c = RingConsumer.open(path, timeout_s=30, start="oldest")
    c.CHUNK_S = 600.0  # sleep until woken: only the producer's FUTEX_WAKE can deliver in time
    ready.set()
    steps: list[int] = []
    while len(steps) < count:
        steps.extend(ev.step for ev in c.wait_windows(600.0))
    out.put(steps)
    c.close()


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def receive_ring_fd(path: str, timeout_s: float) -> tuple[socket.socket, int, int]:
    """Connect to the target serving `path` the way any drafter can; (connection, memfd, size)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            _, fds, _, _ = socket.recv_fds(sock, L.HEADER_BYTES, 1)
            return sock, fds[0], os.fstat(fds[0]).st_size
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "succeeded"


def hostile_drafter(path: str, out: Any, seed: int) -> None:
    """A drafter that attacks the ring while the target trains: resize the memory (fd, path), lift
    the seals, punch holes, then scribble random bytes everywhere (headers, slots, the back
    channel, with plausible seq words too) until the target is gone, reading as a drafter would
    in between. Reports what each attack returned and the reader's counters."""
    sock, fd, size = receive_ring_fd(path, 120)
    report: dict[str, Any] = {"size": size, "attacks": {
        "ftruncate_fd_shrink": _attempt(lambda: os.ftruncate(fd, 4096)),
        "ftruncate_fd_grow": _attempt(lambda: os.ftruncate(fd, 2 * size)),
        "truncate_path": _attempt(lambda: os.truncate(path, 0)),
        "open_path_o_trunc": _attempt(lambda: os.close(os.open(path, os.O_RDWR | os.O_TRUNC))),
        "add_seal_write": _attempt(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)),
    }}
    report["size_after"] = os.fstat(fd).st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    holes = 0
    for off in range(0, size, 1 << 20):  # pages come back as zeros, the size stays: a scribble
        holes += libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, 1 << 16) == 0
    report["holes_punched"] = holes
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    u8 = np.frombuffer(mm, dtype=np.uint8)
    q = memoryview(mm).cast("Q")
    reader = RingConsumer.open(path, timeout_s=30, start="oldest")
    geo = L.Geometry.of(reader.layout)
    rng = np.random.default_rng(seed)
    scribbles = reads = 0
    heads = (0, 0)
    nasty = [b"[" * 5000, b"\xff\xfe", b"[1, 2]", b'{"state": ' + b"9" * 5000 + b"}"]
    def target_gone() -> bool:  # EOF on the hand-over connection, or the closed ring's copy at the path
        return bool(select.select([sock], [], [], 0)[0] and sock.recv(1) == b"") or not stat.S_ISSOCK(
            os.lstat(path).st_mode)

    while not target_gone():
        what = scribbles % 3
        # The newest record of each channel, every other one: its body under an intact seq word,
        # so the reader finds a complete-looking record that does not decode.
        wh, dh = q[L.H_WINDOW_HEAD >> 3], q[L.H_DATA_HEAD >> 3]
        if wh != heads[0] and wh % 2 and 0 < wh < 1 << 32:
            off = geo.window_off + ((wh - 1) % geo.layout.window_slots) * L.WINDOW_RECORD_BYTES + 8
            u8[off:off + 56] = rng.integers(0, 256, 56, dtype=np.uint8)
        if dh != heads[1] and dh % 2 and 0 < dh < 1 << 32:
            off = geo.data_off + ((dh - 1) % geo.layout.data_slots) * geo.data_stride + 8
            u8[off:off + L.DATA_SLOT_HEADER - 8] = rng.integers(0, 256, L.DATA_SLOT_HEADER - 8, dtype=np.uint8)
        heads = (wh, dh)
        if what == 0:  # anywhere, header included
            off = int(rng.integers(0, size - 4096))
            u8[off:off + 4096] = rng.integers(0, 256, 4096, dtype=np.uint8)
        elif what == 1:  # a random window record's body
            slot = int(rng.integers(0, geo.layout.window_slots))
            off = geo.window_off + slot * L.WINDOW_RECORD_BYTES + 8
            u8[off:off + 56] = rng.integers(0, 256, 56, dtype=np.uint8)
        else:  # a complete-looking back message the target would parse: nasty body, any length
            s = 1 + scribbles
            base = geo.back_off + ((s - 1) % geo.layout.back_slots) * geo.layout.back_slot_bytes
            body = nasty[s % len(nasty)][:geo.layout.back_slot_bytes - L.BACK_SLOT_HEADER]
            q[base >> 3] = 2 * s
            L.BACK_HEAD.pack_into(mm, base + 8, 0, int(rng.integers(0, 1 << 32)), 0)
            mm[base + L.BACK_SLOT_HEADER:base + L.BACK_SLOT_HEADER + len(body)] = body
            q[L.H_BACK_HEAD >> 3] = s
        scribbles += 1
        try:
            reads += len(reader.poll_windows())
            while reader.next_data() is not None:
                reads += 1
        except RingError as exc:  # a record must never raise; only the ring's end may
            report["reader_error"] = repr(exc)
            break
        time.sleep(0.0005)
    report.update(scribbles=scribbles, reads=reads, records_corrupt=reader.records_corrupt,
                  windows_missed=reader.windows_missed, data_dropped=reader.data_dropped)
    out.put(report)
