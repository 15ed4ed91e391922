"""The ring in one process: format, ordering, wraparound, exact loss accounting, views, back channel,
file errors (missing / truncated / foreign / version / permissions), close and resync, seals, corrupt
records, a hostile back channel, long ring directories."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spectrain_api.errors import ConfigError
from spectrain_workloads.ring import (
    LAYOUT_VERSION,
    PayloadTooLarge,
    ProducerDead,
    RingConsumer,
    RingError,
    RingLayout,
    RingProducer,
    RingVersionError,
    WindowKind,
    ring_path,
)

pytestmark = pytest.mark.unit

SMALL = RingLayout(window_slots=64, data_slots=4, data_slot_bytes=1 << 16, back_slots=4, back_slot_bytes=256)


@pytest.fixture
def ring() -> Iterator[Path]:
    d = Path("/dev/shm") / f"spectrain-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield ring_path(d, 0)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pair(ring: Path) -> Iterator[tuple[RingProducer, RingConsumer]]:
    p = RingProducer.create(ring, SMALL, rank=3)
    c = RingConsumer.open(ring, timeout_s=0)
    yield p, c
    c.close()
    p.close()


def test_layout_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"RingLayout\.data_slots must be .* got 1: use >= 2"):
        RingLayout(data_slots=1)
    with pytest.raises(ConfigError, match=r"RingLayout\.back_slot_bytes must be a multiple of 64.*use 320"):
        RingLayout(back_slot_bytes=300)
    assert RingLayout().file_bytes < 40 << 20  # default fits the default 256Mi volume with room


def test_window_kind_api_names_round_trip() -> None:
    assert [k.api_name for k in WindowKind] == ["Bubble", "Communication", "Imbalance", "RolloutTail"]
    assert all(WindowKind.from_api_name(k.api_name) is k for k in WindowKind)
    with pytest.raises(ValueError, match="Bubble, Communication"):
        WindowKind.from_api_name("bubble")


def test_windows_arrive_in_order_with_every_field(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    a = p.window_start(WindowKind.BUBBLE, stage=1, step=12, predicted_duration_ns=3_000_000, start_ns=1000)
    b = p.window_start(WindowKind.COMMUNICATION, stage=2, step=12, flags=5, start_ns=2000)
    p.window_end(a, actual_duration_ns=2_500_000)
    p.window_end(b, end_ns=2500)
    ev = c.poll_windows()
    assert [e.seq for e in ev] == [1, 2, 3, 4] and c.windows_missed == 0
    assert [(e.window_id, e.is_end) for e in ev] == [(a, False), (b, False), (a, True), (b, True)]
    assert (ev[0].kind, ev[0].rank, ev[0].stage, ev[0].step, ev[0].start_ns) == (WindowKind.BUBBLE, 3, 1, 12, 1000)
    assert ev[0].predicted_end_ns == 3_001_000 and ev[0].actual_duration_ns == 0 and ev[0].end_ns is None
    assert ev[1].predicted_end_ns is None and ev[1].flags == 5
    assert ev[2].actual_duration_ns == 2_500_000 and ev[2].predicted_duration_ns == 3_000_000
    assert ev[3].end_ns == 2500 and ev[3].kind is WindowKind.COMMUNICATION
    assert a >> 32 == p.generation == c.generation == 1
    assert c.poll_windows() == []
    with pytest.raises(RingError, match=f"window_end\\({a}\\): no open window"):
        p.window_end(a)


def test_100k_records_wrap_a_64_slot_ring_without_loss(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    seen: list[int] = []
    for batch in range(2000):
        for i in range(50):
            p.window_start(WindowKind.IMBALANCE, stage=0, step=batch * 50 + i)
        seen.extend(e.step for e in c.poll_windows())
    assert seen == list(range(100_000))
    assert c.windows_missed == 0 and p.windows_published == 100_000


def test_a_lagging_reader_counts_exactly_what_it_missed(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    for i in range(1000):
        p.window_start(WindowKind.BUBBLE, stage=0, step=i)
    ev = c.poll_windows(max_records=10)
    assert [e.step for e in ev] == list(range(936, 946)) and c.windows_missed == 936
    for i in range(1000, 1100):  # laps the reader again while it holds its place at 946
        p.window_start(WindowKind.BUBBLE, stage=0, step=i)
    ev = c.poll_windows()
    assert [e.step for e in ev] == list(range(1036, 1100))
    assert len(ev) + 10 + c.windows_missed == 1100


def test_data_keeps_dtypes_shapes_and_is_a_read_only_view(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    h = np.arange(24, dtype=np.float16).reshape(4, 6)
    arrays: dict[str, Any] = {"hidden": h, "tokens": np.arange(4, dtype=np.int64), "transposed": h.T, "scalar": np.float64(2.5),
              "empty": np.zeros((0, 3), np.int32), "mask": np.array([True, False])}
    seq = p.publish_data({"step": 7, "dtype": "float16"}, arrays)
    rec = c.next_data()
    assert rec is not None and rec.seq == seq == 1 and rec.meta == {"step": 7, "dtype": "float16"}
    for name, want in arrays.items():
        got = rec.arrays[name]
        assert got.dtype == np.asarray(want).dtype and np.array_equal(got, want), name
        assert not got.flags.writeable
    assert rec.arrays["transposed"].flags.c_contiguous
    with pytest.raises(ValueError):
        rec.arrays["hidden"][0, 0] = 1
    assert rec.valid() and c.next_data() is None


def test_large_arrays_keep_content_and_alignment_from_any_source_offset(ring: Path) -> None:
    p = RingProducer.create(ring, RingLayout(data_slots=2, data_slot_bytes=1 << 17))
    c = RingConsumer.open(ring, timeout_s=0)
    raw = np.random.default_rng(0).integers(0, 255, 1 << 18, dtype=np.uint8)
    for off in (0, 3, 20):  # unaligned uint8 sources, then float32 ones (co-aligned copy path)
        odd = raw[off:off + 70_000]
        f32 = raw[4 * off:4 * off + 4 * 12_000].view(np.float32)
        p.publish_data({"off": off}, {"odd": odd, "f32": f32})
        rec = c.next_data()
        assert rec is not None and np.array_equal(rec.arrays["odd"], odd)
        assert np.array_equal(rec.arrays["f32"], f32, equal_nan=True) and rec.arrays["f32"].flags.aligned
    exact = raw[5:5 + (1 << 17) - 64]  # fills the slot exactly: no room for co-alignment padding
    p.publish_data({}, {"x": exact})
    rec = c.next_data()
    assert rec is not None and np.array_equal(rec.arrays["x"], exact) and c.data_dropped == 0
    c.close()
    p.close()


def test_data_overwritten_under_a_reader_is_invalid_and_counted(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    x = np.zeros(1000, np.int32)
    p.publish_data({"i": 0}, {"x": x})
    rec = c.next_data()
    assert rec is not None and rec.valid()
    for i in range(1, 11):  # 4 slots: record 1's slot is reused by record 5
        p.publish_data({"i": i}, {"x": x + i})
    assert not rec.valid()
    assert int(rec.arrays["x"][0]) == 8  # a view, not a copy: it shows the slot's current record
    got = []
    while (r := c.next_data()) is not None:
        got.append(r.meta["i"])
    assert got == [7, 8, 9, 10] and c.data_dropped == 6


def test_oversized_payloads_name_the_layout_field(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    with pytest.raises(PayloadTooLarge, match=r"needs 65600 bytes .* RingLayout.data_slot_bytes is 65536"):
        p.publish_data({}, {"x": np.zeros(65536, np.uint8)})
    with pytest.raises(PayloadTooLarge, match="at most 8"):
        p.publish_data({}, {str(i): np.zeros(1) for i in range(9)})
    with pytest.raises(PayloadTooLarge, match="back_slot_bytes"):
        c.publish_back({"blob": "x" * 300})
    assert p.data_published == 0 and c.next_data() is None


def test_a_rejected_publish_leaves_the_ring_intact(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    p.window_start(WindowKind.BUBBLE, stage=0, step=1)
    with pytest.raises(ValueError, match="durations and times must be >= 0"):
        p.window_start(WindowKind.BUBBLE, stage=0, step=2, predicted_duration_ns=-1)
    with pytest.raises(ValueError, match="not a WindowKind"):
        p.window_start(9, stage=0, step=2)
    p.window_start(WindowKind.BUBBLE, stage=0, step=3)
    assert [e.step for e in c.poll_windows()] == [1, 3] and c.windows_missed == 0


def test_windows_and_data_may_be_published_from_two_threads(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    x = np.arange(256, dtype=np.float32)

    def data() -> None:
        for i in range(2000):
            p.publish_data({"i": i}, {"x": x})

    t = threading.Thread(target=data)
    t.start()
    steps: list[int] = []
    data_seen = 0
    for i in range(20_000):
        p.window_start(WindowKind.COMMUNICATION, stage=0, step=i)
        if i % 50 == 0:
            steps.extend(e.step for e in c.poll_windows())
            while c.next_data() is not None:
                data_seen += 1
    t.join()
    steps.extend(e.step for e in c.poll_windows())
    while c.next_data() is not None:
        data_seen += 1
    assert steps == list(range(20_000)) and c.windows_missed == 0
    assert data_seen + c.data_dropped == 2000 == p.data_published


def test_back_channel_gives_the_newest_message(ring: Path) -> None:
    p = RingProducer.create(ring, SMALL)
    c = RingConsumer.open(ring, timeout_s=0)
    assert p.latest_back() is None
    for v in range(1, 7):  # wraps the 4 back slots
        sent = c.publish_back({"state": "Active", "version": v})
    got = p.latest_back()
    assert got == sent and got is not None and got.data["version"] == 6 and got.sender_pid == os.getpid()
    c.close()
    c2 = RingConsumer.open(ring, timeout_s=0)  # a restarted drafter continues the sequence
    assert c2.publish_back({"state": "Waiting"}).seq == 7
    sent = c2.publish_back({"state": "Active"})
    assert p.latest_back() == sent
    c2.close()
    p.close()


def test_start_latest_skips_old_records_and_oldest_keeps_them(ring: Path) -> None:
    p = RingProducer.create(ring, SMALL)
    for i in range(100):
        p.window_start(WindowKind.BUBBLE, stage=0, step=i)
    p.publish_data({"i": 0}, {})
    latest = RingConsumer.open(ring, timeout_s=0)
    oldest = RingConsumer.open(ring, timeout_s=0, start="oldest")
    assert latest.poll_windows() == [] and latest.next_data() is None
    assert [e.step for e in oldest.poll_windows()] == list(range(36, 100)) and oldest.windows_missed == 0
    assert oldest.next_data() is not None
    with pytest.raises(ValueError, match="start must be"):
        RingConsumer.open(ring, timeout_s=0, start="newest")
    latest.close()
    oldest.close()
    p.close()


def test_ring_file_is_private_even_with_an_open_umask(ring: Path) -> None:
    old = os.umask(0)
    try:
        p = RingProducer.create(ring, SMALL)
    finally:
        os.umask(old)
    assert ring.stat().st_mode & 0o777 == 0o600
    assert [f.name for f in ring.parent.iterdir()] == [ring.name]  # no temp file left behind
    p.close()


def test_missing_file_is_a_clear_error(ring: Path) -> None:
    with pytest.raises(RingError, match=f"ring {ring} does not exist .*the target on this rank creates it"):
        RingConsumer.open(ring, timeout_s=0.05)
    with pytest.raises(RingError, match="ring directory .* does not exist"):
        RingProducer.create(ring.parent / "nope" / "ring-0")


def test_truncated_foreign_and_corrupt_files_are_clear_errors(ring: Path) -> None:
    RingProducer.create(ring, SMALL).close()
    whole = ring.read_bytes()
    ring.write_bytes(whole[:100])
    with pytest.raises(RingError, match=r"truncated \(100 bytes.*delete it"):
        RingConsumer.open(ring, timeout_s=0)
    ring.write_bytes(whole[:8192])
    with pytest.raises(RingError, match=r"truncated \(8192 bytes, its header says"):
        RingConsumer.open(ring, timeout_s=0)
    ring.write_bytes(b"\x7fELF" + bytes(len(whole) - 4))
    with pytest.raises(RingError, match="not a spectrain ring file .*SPECTRAIN_RING_DIR"):
        RingConsumer.open(ring, timeout_s=0)
    corrupt = bytearray(whole)
    struct.pack_into("=Q", corrupt, 64, 65)  # window_slots no longer matches the stored offsets
    ring.write_bytes(bytes(corrupt))
    with pytest.raises(RingError, match="corrupt header"):
        RingConsumer.open(ring, timeout_s=0)


def test_layout_version_mismatch_names_both_versions(ring: Path) -> None:
    RingProducer.create(ring, SMALL).close()
    raw = bytearray(ring.read_bytes())
    struct.pack_into("=I", raw, 8, 99)
    ring.write_bytes(bytes(raw))
    with pytest.raises(RingVersionError, match=f"layout version 99 but this spectrain reads layout version "
                                               f"{LAYOUT_VERSION}"):
        RingConsumer.open(ring, timeout_s=0)
    p = RingProducer.create(ring, SMALL)  # a producer replaces a file of another version
    assert p.generation == 2
    p.close()


def test_closed_producer_is_not_alive(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    assert c.producer_alive(max_age_s=1.0) and c.heartbeat_age_s() < 1.0 and not c.producer_closed()
    c.check_alive()
    p.close()
    assert not c.producer_alive() and c.producer_closed()
    with pytest.raises(ProducerDead, match="closed the ring"):
        c.check_alive()
    with pytest.raises(RingError, match="closed"):
        p.window_start(WindowKind.BUBBLE, stage=0, step=0)


def test_reader_drains_the_old_file_then_follows_a_new_generation(ring: Path) -> None:
    p1 = RingProducer.create(ring, SMALL)
    c = RingConsumer.open(ring, timeout_s=0)
    p1.window_start(WindowKind.BUBBLE, stage=0, step=1)
    p1.publish_data({"gen": 1}, {})
    p2 = RingProducer.create(ring, RingLayout(window_slots=128))  # the new generation may change the layout
    p2.window_start(WindowKind.ROLLOUT_TAIL, stage=0, step=2)
    assert [e.step for e in c.poll_windows()] == [1, 2]
    assert (c.generation, c.resyncs, c.layout.window_slots) == (2, 1, 128)
    assert c.data_dropped == 1  # the old file's unread data record: counted, not silently lost
    assert c.next_data() is None and c.producer_alive()
    p1.close()  # closing a superseded producer does not touch the new file
    assert c.producer_alive()
    c.close()
    p2.close()


def test_valid_is_false_after_the_reader_closes(pair: tuple[RingProducer, RingConsumer]) -> None:
    p, c = pair
    p.publish_data({}, {"x": np.ones(3)})
    rec = c.next_data()
    assert rec is not None and rec.valid()
    c.close()
    assert not rec.valid() and float(rec.arrays["x"].sum()) == 3.0  # still mapped while referenced


def test_ring_does_not_import_torch() -> None:
    code = "import sys, spectrain_workloads.ring; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_wait_until_wakes_on_data_as_well_as_windows(pair: tuple[RingProducer, RingConsumer]) -> None:
    """The drafter sleeps on either channel: data published into an open window wakes it."""
    p, c = pair
    assert c.wait_until(c.next_data, timeout_s=0) is None              # nothing yet: gives up at once
    published = threading.Event()

    def publish() -> None:
        p.publish_data({"i": 1}, {"x": np.arange(4, dtype=np.int64)})
        published.set()

    t = threading.Thread(target=publish)
    t.start()
    rec = c.wait_until(c.next_data, timeout_s=30)                     # woken by the publish, not the timeout
    t.join()
    assert published.is_set() and rec is not None and rec.meta == {"i": 1}
    p.window_start(WindowKind.BUBBLE, stage=0, step=7)
    assert [e.step for e in c.wait_until(c.poll_windows, timeout_s=30)] == [7]


def _received_fd(ring: Path) -> tuple[socket.socket, int]:
    """What any process that may connect to the ring path gets: the connection and the memfd."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(ring))
    _, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    return sock, fds[0]


def test_ring_memory_is_sealed_and_the_path_cannot_be_truncated(pair: tuple[RingProducer, RingConsumer],
                                                                ring: Path) -> None:
    p, c = pair
    sock, fd = _received_fd(ring)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        size = os.fstat(fd).st_size
        assert size == SMALL.file_bytes
        for length in (0, size - 4096, size + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, length)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: no further seal, none lifted
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert stat.S_ISSOCK(ring.lstat().st_mode)
        with pytest.raises(OSError, match="Invalid argument"):
            os.truncate(ring, 0)
        assert os.fstat(fd).st_size == size and fcntl.fcntl(fd, fcntl.F_GET_SEALS) == seals
    finally:
        os.close(fd)
        sock.close()
    p.window_start(WindowKind.BUBBLE, stage=0, step=1)  # the producer's stores still land
    assert [e.step for e in c.poll_windows()] == [1]


def test_an_unsealed_ring_is_refused(ring: Path) -> None:
    """A server at the path that hands out memory it could still shrink is not a spectrain target."""
    from spectrain_workloads.ring import layout as L
    from spectrain_workloads.ring.mapping import build_header

    geo = L.Geometry.of(SMALL)
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, geo.total)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(ring))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        socket.send_fds(conn, [build_header(geo, 1, 0, 0)], [fd])
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(RingError, match="not sealed against resizing"):
            RingConsumer.open(ring, timeout_s=0)
    finally:
        t.join()
        listener.close()
        os.close(fd)


def test_corrupt_records_are_skipped_and_counted(pair: tuple[RingProducer, RingConsumer]) -> None:
    from spectrain_workloads.ring import layout as L

    p, c = pair
    geo = L.Geometry.of(SMALL)
    for i in range(4):
        p.window_start(WindowKind.BUBBLE, stage=0, step=i)
    kind_at = L.WINDOW_BODY.size + 8 - 4  # kind u16, is_end u16 close the record
    struct.pack_into("=H", p._mm, geo.window_off + 1 * L.WINDOW_RECORD_BYTES + kind_at, 999)
    struct.pack_into("=H", p._mm, geo.window_off + 2 * L.WINDOW_RECORD_BYTES + kind_at + 2, 7)  # is_end
    assert [e.step for e in c.poll_windows()] == [0, 3]
    assert c.records_corrupt == 2 and c.windows_missed == 0
    x = np.arange(8, dtype=np.int32)
    for i in range(4):
        p.publish_data({"i": i}, {"x": x})

    def slot(seq: int) -> int:
        return geo.data_off + (seq - 1) % SMALL.data_slots * geo.data_stride

    struct.pack_into("=I", p._mm, slot(1) + 8 + 12, 99)  # n_arrays > MAX_ARRAYS
    struct.pack_into("=16s", p._mm, slot(2) + L.DESCRIPTORS_AT + 40, b"|O")  # object dtype
    p._mm[slot(3) + L.DATA_SLOT_HEADER] = ord("[")  # meta no longer a JSON object
    rec = c.next_data()
    assert rec is not None and rec.meta == {"i": 3} and np.array_equal(rec.arrays["x"], x)
    assert c.next_data() is None and c.records_corrupt == 5 and c.data_dropped == 0


def test_the_producer_survives_any_back_channel_content(ring: Path) -> None:
    from spectrain_workloads.ring import layout as L

    layout = RingLayout(window_slots=64, data_slots=2, data_slot_bytes=1 << 12, back_slots=4, back_slot_bytes=8192)
    p = RingProducer.create(ring, layout)
    c = RingConsumer.open(ring, timeout_s=0)
    geo = L.Geometry.of(layout)
    cap = layout.back_slot_bytes - L.BACK_SLOT_HEADER
    for body, length in ((b"[" * cap, cap), (b"\xff\xfe", 2), (b"[1, 2]", 6), (b'{"a": 1}', 0xFFFFFFFF),
                         (b"9" * 5000, 5000)):
        sent = c.publish_back({})
        base = geo.back_off + (sent.seq - 1) % layout.back_slots * layout.back_slot_bytes
        L.BACK_HEAD.pack_into(p._mm, base + 8, 0, length, 0)
        p._mm[base + L.BACK_SLOT_HEADER:base + L.BACK_SLOT_HEADER + len(body)] = body
        got = p.latest_back()
        assert got is None or (isinstance(got.data, dict) and length == 0xFFFFFFFF), (body[:8], got)
    p._q[L.H_BACK_HEAD >> 3] = (1 << 64) - 1  # any head: reads a slot of the channel, never beyond
    assert p.latest_back() is None
    assert c.publish_back({"state": "Active"}).data == {"state": "Active"}
    c.close()
    p.close()


def test_a_closed_ring_stays_readable_at_its_path(ring: Path) -> None:
    p = RingProducer.create(ring, SMALL)
    p.window_start(WindowKind.BUBBLE, stage=0, step=5)
    p.publish_data({"i": 1}, {"x": np.ones(4)})
    c = RingConsumer.open(ring, timeout_s=0)
    p._q[0] = 0  # a scribbled static header: the copy left behind is rewritten from the target's values
    p.close()
    assert stat.S_ISREG(ring.lstat().st_mode) and ring.stat().st_mode & 0o777 == 0o600
    assert c.producer_closed() and c.resyncs == 0  # the same ring under a new inode: no switch
    late = RingConsumer.open(ring, timeout_s=0, start="oldest")
    assert [e.step for e in late.poll_windows()] == [5] and late.producer_closed()
    rec = late.next_data()
    assert rec is not None and rec.meta == {"i": 1} and late.generation == 1
    late.close()
    c.close()
    assert RingProducer.create(ring, SMALL).generation == 2  # counts on from the closed ring


def test_a_ring_dir_too_long_for_a_socket_address_still_works(ring: Path) -> None:
    deep = ring.parent / ("d" * 100)
    deep.mkdir()
    path = ring_path(deep, 0)
    assert len(str(path)) > 107
    p = RingProducer.create(path, SMALL)
    c = RingConsumer.open(path, timeout_s=0)
    p.window_start(WindowKind.BUBBLE, stage=0, step=1)
    assert [e.step for e in c.poll_windows()] == [1] and stat.S_ISSOCK(path.lstat().st_mode)
    p2 = RingProducer.create(path, SMALL)  # the previous ring is reached the same way
    assert p2.generation == 2 and c.poll_windows() == [] and c.generation == 2
    c.close()
    p.close()
    p2.close()
