"""The ring between real processes (multiprocessing 'spawn'): wake-ups, torn-record freedom under a
concurrent writer, exact loss accounting, SIGKILL of either side, producer restart (after a clean close
or a SIGKILL)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from spectrain_workloads.ring import (
    ProducerDead,
    RingConsumer,
    RingError,
    RingLayout,
    RingProducer,
    WindowKind,
)
from tests.integration import ring_workers as W
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

CTX = mp.get_context("spawn")
_I_WAITERS = 256 >> 2  # layout.H_WAITERS as a u32 index: white-box view of a sleeping reader


@pytest.fixture
def ring(request: pytest.FixtureRequest) -> Iterator[Path]:
    d = Path("/dev/shm") / f"spectrain-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    procs: list[mp.process.BaseProcess] = []
    request.node.procs = procs
    yield d / "ring-0"
    for p in procs:  # never leave a child behind, even when an assertion failed
        if p.is_alive():
            p.kill()
        p.join(10)
    shutil.rmtree(d, ignore_errors=True)


def spawn(request: pytest.FixtureRequest, target: Callable[..., object], *args: object) -> mp.process.BaseProcess:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    request.node.procs.append(p)
    return p


def kill(p: mp.process.BaseProcess) -> None:
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL


def test_sleeping_reader_is_woken_by_each_publish(ring: Path, request: pytest.FixtureRequest) -> None:
    prod = RingProducer.create(ring, RingLayout(window_slots=64))
    out, ready = CTX.Queue(), CTX.Event()
    spawn(request, W.receive, str(ring), 20, out, ready)
    assert ready.wait(30)
    for i in range(20):
        # publish only once the reader is asleep on the futex, so every record needs a wake-up
        wait_for(lambda: prod._u32[_I_WAITERS] == 1, 10, 0.001, "the reader to sleep")
        prod.window_start(WindowKind.BUBBLE, stage=0, step=i)
    assert out.get(timeout=30) == list(range(20))
    assert prod.wakes_issued == 20
    prod.close()


def test_concurrent_writer_never_yields_torn_records_and_counts_every_loss(
        ring: Path, request: pytest.FixtureRequest) -> None:
    n, data_every = 30_000, 10
    # tiny channels so the writer laps the readers constantly and overwrites slots mid-read
    layout = {"window_slots": 16, "data_slots": 2, "data_slot_bytes": 1 << 16}
    ready, go = CTX.Event(), CTX.Event()
    producer = spawn(request, W.produce, str(ring), layout, n, 60_000, data_every, ready, go)
    assert ready.wait(30)
    out, reader_ready = CTX.Queue(), CTX.Event()
    spawn(request, W.read_all, str(ring), out, reader_ready)
    assert reader_ready.wait(30)
    c = RingConsumer.open(ring, timeout_s=5, start="oldest")
    go.set()
    windows = bad = data_ok = data_bad = discarded = 0
    while True:
        closed = c.producer_closed()  # not the heartbeat: a starved host must not end the run early
        for ev in c.wait_windows(0.05):
            windows += 1
            bad += not W.window_ok(ev)
        while (rec := c.next_data()) is not None:
            verdict = W.data_check(rec)
            data_ok += verdict is True
            data_bad += verdict is False
            discarded += verdict is None
        if closed:
            break
    producer.join(30)
    assert producer.exitcode == 0
    n_windows, n_data = n + n // 2, n // data_every  # every odd window also has an end record
    assert bad == 0 and data_bad == 0, "a reader accepted a torn record"
    assert windows + c.windows_missed == n_windows
    assert data_ok + discarded + c.data_dropped == n_data
    assert windows > 0 and data_ok > 0
    other = out.get(timeout=30)
    assert other["windows_bad"] == 0 and other["data_bad"] == 0
    assert other["windows"] + other["windows_missed"] == n_windows
    assert other["data_ok"] + other["data_discarded"] + other["data_dropped"] == n_data
    c.close()


def test_producer_sigkill_mid_write_is_reported_dead_and_nothing_corrupt_is_returned(
        ring: Path, request: pytest.FixtureRequest) -> None:
    ready, go = CTX.Event(), CTX.Event()
    layout = {"window_slots": 64, "data_slots": 4, "data_slot_bytes": 1 << 20}
    producer = spawn(request, W.produce, str(ring), layout, None, 1 << 19, 1, ready, go)
    assert ready.wait(30)
    c = RingConsumer.open(ring, timeout_s=5, start="oldest")
    go.set()
    verdicts: list[bool | None] = []

    def drain() -> int:
        assert producer.exitcode in (None, -signal.SIGKILL), "the producer failed on its own"
        while (rec := c.next_data()) is not None:
            verdicts.append(W.data_check(rec))
        return len(verdicts)

    wait_for(lambda: drain() >= 20, 30, 0.001, "20 data records from the producer")
    assert c.producer_alive(max_age_s=1.0)
    kill(producer)  # it publishes 512 KB payloads back to back: almost surely mid-copy
    killed = time.monotonic()
    with pytest.raises(ProducerDead, match="heartbeat"):
        while True:
            c.wait_windows(0.2, raise_if_dead=True, max_age_s=1.0)
            drain()
    detected = time.monotonic() - killed
    drain()
    assert False not in verdicts, "a torn data record was returned"
    assert not c.producer_alive(max_age_s=1.0)
    # design bound: heartbeat age 1 s + one wait chunk (0.1 s); the rest is slack for a loaded host
    assert detected < 2.0, f"dead producer noticed only after {detected:.2f}s"
    assert c.next_data() is None  # the slot being written when it died is never returned
    c.close()


def test_reader_sigkill_leaves_the_producer_publishing_without_syscalls(
        ring: Path, request: pytest.FixtureRequest) -> None:
    prod = RingProducer.create(ring, RingLayout(window_slots=256, data_slots=4, data_slot_bytes=1 << 16))
    ready = CTX.Event()
    reader = spawn(request, W.wait_forever, str(ring), ready)
    assert ready.wait(30)
    wait_for(lambda: prod._u32[_I_WAITERS] == 1, 10, 0.001, "the reader to sleep")
    kill(reader)
    wakes_before = prod.wakes_issued
    x = np.arange(1000, dtype=np.float32)
    for i in range(10_000):
        prod.window_end(prod.window_start(WindowKind.IMBALANCE, stage=0, step=i))
        if i % 100 == 0:
            prod.publish_data({"i": i}, {"x": x})
    assert prod.windows_published == 20_000 and prod.data_published == 100
    # a dead sleeper costs at most the one wake that clears its flag; then the fast path again
    assert prod.wakes_issued - wakes_before <= 1
    assert prod._u32[_I_WAITERS] == 0
    prod.close()


def test_restarted_producer_is_picked_up_without_reopening(ring: Path, request: pytest.FixtureRequest) -> None:
    layout = {"window_slots": 64, "data_slots": 2, "data_slot_bytes": 4096}
    ready, go = CTX.Event(), CTX.Event()
    first = spawn(request, W.produce, str(ring), layout, 10, 1024, 5, ready, go)
    assert ready.wait(30)
    c = RingConsumer.open(ring, timeout_s=5, start="oldest")
    go.set()
    first.join(30)
    events = c.poll_windows()
    assert [e.step for e in events if not e.is_end] == list(range(10))
    assert c.generation == 1 and not c.producer_alive()

    ready2, go2 = CTX.Event(), CTX.Event()
    second = spawn(request, W.produce, str(ring), layout, 10, 1024, 5, ready2, go2)
    assert ready2.wait(30)
    # the same reader object notices the new file (heartbeat check alone is enough to resync)
    wait_for(c.producer_alive, 10, 0.001, "the restarted producer to be seen alive")
    assert c.generation == 2 and c.resyncs == 1
    go2.set()
    events = []
    while len(events) < 15:  # 10 starts + 5 ends
        events.extend(c.wait_windows(5.0))
    assert [e.seq for e in events] == list(range(1, 16))
    assert [e.step for e in events if not e.is_end] == list(range(10))
    assert all(e.window_id >> 32 == 2 for e in events) and c.windows_missed == 0
    second.join(30)
    assert second.exitcode == 0
    c.close()


def test_a_producer_killed_without_closing_is_replaced_and_followed(
        ring: Path, request: pytest.FixtureRequest) -> None:
    """Nothing of a SIGKILLed target's ring survives but its socket: the next target replaces it,
    readers follow by the path's inode, and the new generation is above any reached before."""
    layout = {"window_slots": 64, "data_slots": 2, "data_slot_bytes": 4096}
    ready, go = CTX.Event(), CTX.Event()
    first = spawn(request, W.produce, str(ring), layout, None, 1024, 5, ready, go)
    assert ready.wait(30)
    c = RingConsumer.open(ring, timeout_s=5, start="oldest")
    go.set()
    wait_for(lambda: len(c.poll_windows()) > 0, 10, 0.001, "records from the first producer")
    kill(first)
    with pytest.raises(RingError, match="socket nobody serves"):
        RingConsumer.open(ring, timeout_s=0)
    wait_for(lambda: not c.producer_alive(), 10, 0.01, "the killed producer to look dead")
    second = RingProducer.create(ring, RingLayout(**layout))
    assert second.generation > 1
    wait_for(c.producer_alive, 10, 0.001, "the reader to follow the new ring")
    assert c.generation == second.generation and c.resyncs == 1
    second.window_start(WindowKind.BUBBLE, stage=0, step=42)
    assert [e.step for e in c.wait_windows(5.0)] == [42]
    c.close()
    second.close()
