"""Child-process bodies for the ring process tests (spawned: importable, no pytest state).

Records carry their own checks: a window's fields are functions of its step, a data record's
meta holds the CRC of its payload. A reader that ever accepts a record whose checks fail has
seen a torn record.
"""

from __future__ import annotations

import zlib
from multiprocessing.synchronize import Event
from typing import Any

import numpy as np

from spectrain_workloads.ring import (
    DataRecord,
    RingConsumer,
    RingLayout,
    RingProducer,
    WindowEvent,
    WindowKind,
)

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
