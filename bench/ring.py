"""bench-ring: cost of the shared-memory ring (BENCHMARKS.md keys).

publish_us_p50          one window_start() on the target side (a reader attached, not sleeping)
wake_us_p50 / _p99      publish -> return of wait_windows() in another process that was asleep
                        on the futex (the reader is given time to fall asleep before each publish)
spin_wake_us_p99        the same with a spin=True reader
data_gbps               1 MiB payloads through publish_data + next_data + valid() (one copy)
memcpy_gbps             np.copyto of the same 1 MiB, interleaved with the above in this run
data_vs_memcpy          data_gbps / memcpy_gbps
waiting_reader_cpu_fraction  CPU time / wall time of a reader blocked in wait_windows()

Run: python -m bench.ring [--quick]   (make bench-ring [QUICK=1])
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import median, parse_args, percentile, print_table, write_results
from spectrain_workloads.ring import FENCE_IMPL, RingConsumer, RingLayout, RingProducer, WindowKind

CTX = mp.get_context("spawn")
MIB = 1 << 20
_I_WAITERS = 256 >> 2  # layout.H_WAITERS as a u32 index (to publish only once the reader sleeps)


def _wake_reader(path: str, count: int, spin: bool, ready: Event, out: Any) -> None:
    c = RingConsumer.open(path, timeout_s=30, spin=spin)
    ready.set()
    lat: list[float] = []
    while len(lat) < count:
        for ev in c.wait_windows(5.0):
            lat.append((time.monotonic_ns() - ev.start_ns) / 1e3)
    out.put(lat)
    c.close()


def _idle_reader(path: str, wall_s: float, ready: Event, out: Any) -> None:
    c = RingConsumer.open(path, timeout_s=30)
    ready.set()
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < wall_s:
        c.wait_windows(wall_s)
    out.put((time.process_time() - cpu0) / (time.monotonic() - t0))
    c.close()


def bench_publish(path: Path, n: int) -> float:
    p = RingProducer.create(path, RingLayout(window_slots=4096))
    c = RingConsumer.open(path, timeout_s=5)
    samples = []
    clock = time.perf_counter_ns
    for i in range(n):
        t = clock()
        p.window_start(WindowKind.BUBBLE, stage=0, step=i)
        samples.append(clock() - t)
        if i % 1000 == 999:
            c.poll_windows()
    c.close()
    p.close()
    return median(samples) / 1e3


def bench_wake(path: Path, n: int, spin: bool) -> list[float]:
    p = RingProducer.create(path, RingLayout(window_slots=4096))
    ready, out = CTX.Event(), CTX.Queue()
    child = CTX.Process(target=_wake_reader, args=(str(path), n, spin, ready, out), daemon=True)
    child.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("wake reader did not start")
        u32 = p._u32
        for i in range(n):
            if not spin:
                deadline = time.monotonic() + 5
                while u32[_I_WAITERS] != 1 and time.monotonic() < deadline:
                    time.sleep(0.0002)
            time.sleep(0.002)  # let it reach the futex (or spin loop) before we publish
            p.window_start(WindowKind.BUBBLE, stage=0, step=i)
        lat: list[float] = out.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        p.close()
    return lat


def bench_data(path: Path, reps: int, per_rep: int) -> tuple[float, float]:
    p = RingProducer.create(path, RingLayout(window_slots=64, data_slots=8, data_slot_bytes=MIB + 4096))
    c = RingConsumer.open(path, timeout_s=5)
    src = np.random.default_rng(0).integers(0, 255, MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    meta = {"step": 0, "dtype": "uint8"}
    for _ in range(16):  # fault in every slot's pages once
        p.publish_data(meta, {"x": src})
        c.next_data()
    data_s, copy_s = [], []
    for _ in range(reps):  # interleaved: both see the same machine state
        t = time.perf_counter()
        for _ in range(per_rep):
            np.copyto(dst, src)
        copy_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(per_rep):
            p.publish_data(meta, {"x": src})
            rec = c.next_data()
            assert rec is not None and rec.valid()
        data_s.append(time.perf_counter() - t)
    c.close()
    p.close()
    gb = per_rep * MIB / 1e9
    return gb / median(data_s), gb / median(copy_s)


def bench_idle_cpu(path: Path, wall_s: float) -> float:
    p = RingProducer.create(path, RingLayout(window_slots=64))
    ready, out = CTX.Event(), CTX.Queue()
    child = CTX.Process(target=_idle_reader, args=(str(path), wall_s, ready, out), daemon=True)
    child.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("idle reader did not start")
        fraction: float = out.get(timeout=wall_s + 60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        p.close()
    return fraction


def main() -> None:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "bench-ring")
    quick = args.quick
    work = Path(tempfile.mkdtemp(prefix="spectrain-bench-ring-", dir="/dev/shm"))
    try:
        publish = bench_publish(work / "ring-publish", 5_000 if quick else 50_000)
        wake = bench_wake(work / "ring-wake", 300 if quick else 2_000, spin=False)
        spin = bench_wake(work / "ring-spin", 200 if quick else 1_000, spin=True)
        data_gbps, memcpy_gbps = bench_data(work / "ring-data", 7 if quick else 21, 20 if quick else 50)
        idle = bench_idle_cpu(work / "ring-idle", 2.0 if quick else 5.0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "publish_us_p50": publish,
        "wake_us_p50": percentile(wake, 50),
        "wake_us_p99": percentile(wake, 99),
        "spin_wake_us_p99": percentile(spin, 99),
        "data_gbps": data_gbps,
        "memcpy_gbps": memcpy_gbps,
        "data_vs_memcpy": data_gbps / memcpy_gbps,
        "waiting_reader_cpu_fraction": idle,
        "wake_samples": len(wake),
    }
    write_results("ring", results, quick)
    print_table(f"bench-ring ({'quick' if quick else 'full'}; fence: {FENCE_IMPL})", results)


if __name__ == "__main__":
    main()
