"""bench-ring: cost of the shared-memory ring (BENCHMARKS.md keys).

publish_us_p50          one window_start() on the target side (a reader attached, not sleeping)
wake_us_p50 / _p99      publish -> return of wait_windows() in another process that was asleep
                        on the futex (the reader is given time to fall asleep before each publish)
spin_wake_us_p50 / _p99 the same with a spin=True reader
data_gbps               1 MB payloads through publish_data (the target's cost: one copy in; the
                        reader gets views) on the default layout, 32 x 1 MiB slots
memcpy_gbps             np.copyto of the same 1 MB into a pool of buffers with the ring's footprint
                        (32 MB: like the ring's slots, they are not cache-resident), same run,
                        interleaved; memcpy_hot_gbps: into one cache-hot buffer
data_vs_memcpy          data_gbps / memcpy_gbps (data_vs_memcpy_hot: / memcpy_hot_gbps)
data_e2e_gbps           publish_data + next_data + valid() in one thread
waiting_reader_cpu_fraction  CPU time / wall time of a reader blocked in wait_windows()

Run: python -m bench.ring [--quick]   (make bench-ring [QUICK=1])
"""

from __future__ import annotations

import multiprocessing as mp
import os
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
PAYLOAD = 1_000_000  # "1 MB": fits the default 1 MiB data slot with its meta
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
    c.wait_windows(0.05)   # steady state: the first wait pays one-time costs (ctypes/futex setup)
    ready.set()
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < wall_s:
        c.wait_windows(wall_s)
    out.put((time.process_time() - cpu0) / (time.monotonic() - t0))
    c.close()


def bench_publish(path: Path, n: int) -> float:
    p = RingProducer.create(path, RingLayout(window_slots=4096))
    c = RingConsumer.open(path, timeout_s=5)
    samples: list[float] = []
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


def bench_data(path: Path, reps: int, per_rep: int) -> dict[str, float]:
    """1 MB payloads through the default layout (32 slots of 1 MiB), against memcpy of the same
    bytes into one hot buffer and into a pool with the ring's footprint (a ring's writes rotate
    through data_slots MiB and so leave the cache, as that pool's do)."""
    layout = RingLayout()
    p = RingProducer.create(path, layout)
    c = RingConsumer.open(path, timeout_s=5)
    src = np.random.default_rng(0).integers(0, 255, PAYLOAD, dtype=np.uint8)
    hot = np.empty_like(src)
    pool = [np.empty_like(src) for _ in range(layout.data_slots)]
    meta = {"step": 0, "dtype": "uint8"}
    per_rep = min(per_rep, layout.data_slots - 1)  # the reader drains between reps: nothing dropped
    for _ in range(2 * layout.data_slots):  # fault every slot's and buffer's pages in once
        p.publish_data(meta, {"x": src})
        c.next_data()
    for buf in pool:
        np.copyto(buf, src)
    t_hot, t_pool, t_pub, t_e2e = [], [], [], []
    k = 0
    clock = time.perf_counter
    for _ in range(reps):  # interleaved, so all four see the same machine state
        t = clock()
        for _ in range(per_rep):
            np.copyto(hot, src)
        t_hot.append(clock() - t)
        t = clock()
        for _ in range(per_rep):
            k = (k + 1) % len(pool)
            np.copyto(pool[k], src)
        t_pool.append(clock() - t)
        t = clock()
        for _ in range(per_rep):
            p.publish_data(meta, {"x": src})
        t_pub.append(clock() - t)
        while (rec := c.next_data()) is not None:
            assert rec.valid()
        t = clock()
        for _ in range(per_rep):
            p.publish_data(meta, {"x": src})
            rec = c.next_data()
            assert rec is not None and rec.valid()
        t_e2e.append(clock() - t)
    assert c.data_dropped == 0
    c.close()
    p.close()
    gb = per_rep * PAYLOAD / 1e9
    return {"hot": gb / median(t_hot), "pool": gb / median(t_pool), "publish": gb / median(t_pub),
            "e2e": gb / median(t_e2e)}


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
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="spectrain-bench-ring-", dir="/dev/shm"))
    try:
        publish = bench_publish(work / "ring-publish", 5_000 if quick else 50_000)
        wake = bench_wake(work / "ring-wake", 300 if quick else 2_000, spin=False)
        spin = bench_wake(work / "ring-spin", 200 if quick else 1_000, spin=True)
        data = bench_data(work / "ring-data", 15 if quick else 61, 16 if quick else 31)
        idle = bench_idle_cpu(work / "ring-idle", 2.0 if quick else 5.0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "publish_us_p50": publish,
        "wake_us_p50": percentile(wake, 50),
        "wake_us_p99": percentile(wake, 99),
        "spin_wake_us_p50": percentile(spin, 50),
        "spin_wake_us_p99": percentile(spin, 99),
        "data_gbps": data["publish"],
        "memcpy_gbps": data["pool"],
        "data_vs_memcpy": data["publish"] / data["pool"],
        "memcpy_hot_gbps": data["hot"],
        "data_vs_memcpy_hot": data["publish"] / data["hot"],
        "data_e2e_gbps": data["e2e"],
        "waiting_reader_cpu_fraction": idle,
        "wake_samples": len(wake),
        "loadavg_1m": max(load_before, os.getloadavg()[0]),  # latency tails depend on it (shared host)
    }
    write_results("ring", results, quick)
    print_table(f"bench-ring ({'quick' if quick else 'full'}; fence: {FENCE_IMPL})", results)


if __name__ == "__main__":
    main()
