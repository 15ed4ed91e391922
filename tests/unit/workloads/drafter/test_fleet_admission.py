"""drafter.admission + the listener's sessions on real loopback sockets: the pending budget and who
loses a slot, the handshake's deadlines, one session per rank, idle sessions closed and a link that
reconnects past that without losing a frame."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from spectrain_workloads.drafter import auth
from spectrain_workloads.drafter.admission import IDLE_ROUNDS, RTT_BOUND_S, Limits
from spectrain_workloads.drafter.fleet_records import FleetConfig
from spectrain_workloads.drafter.links import Frame, Link, Stats, TokenBucket
from spectrain_workloads.drafter.listener import Server
from tests.unit.workloads.drafter.test_fleet_auth import (
    CLIENT,
    IDENT,
    Collect,
    _closed,
    _connect,
    _frame,
    _rejected,
    serving,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.unit

COMBINE_S = 0.1
LIMITS = Limits.for_job(world=3, ranks_per_host=3, combine_every_s=COMBINE_S)   # 4 pending; idle 0.5 s


@pytest.fixture
def server() -> Iterator[tuple[Server, Collect]]:
    yield from serving(LIMITS)


def test_limits_follow_the_jobs_size() -> None:
    lim = Limits.for_job(world=64, ranks_per_host=8, combine_every_s=10.0)
    assert (lim.pending_total, lim.pending_per_source) == (126, 16)
    assert lim.idle_s == IDLE_ROUNDS * 10.0 + 2 * RTT_BOUND_S and lim.handshake_s == 2 * RTT_BOUND_S
    assert Limits.for_job(world=2, ranks_per_host=2, combine_every_s=1.0).pending_per_source == 2   # <= the total
    cfg = FleetConfig(rank=0, world=4, pipeline=2, coordinator=3, key=IDENT.key or b"", combine_every_s=5.0,
                      addresses=[("a", 1), ("a", 2), ("b", 1), ("b", 2)], rtt_bound_s=0.02)
    assert cfg.limits == Limits(6, 4, 0.02, IDLE_ROUNDS * 5.0 + 0.04)
    with socket.create_server(("127.0.0.1", 0)) as lsock, socket.create_connection(lsock.getsockname()):
        conn, _ = lsock.accept()
        with conn:                                      # loopback's measured RTO is far below the declared bound
            assert LIMITS.leg_s(conn) == RTT_BOUND_S
            tiny = Limits.for_job(world=2, ranks_per_host=1, combine_every_s=1.0, rtt_bound_s=1e-6)
            assert tiny.leg_s(conn) > 1e-6              # ... and the kernel's measure where it is longer


def test_silent_connections_lose_their_slots_to_a_real_peer(server: tuple[Server, Collect]) -> None:
    srv, recv = server
    silent = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(3 * LIMITS.pending_total)]
    try:
        # the budget holds 4: every newer silent one closed the oldest, and the real peer closes one more
        _rejected(srv, "evicted", 2 * LIMITS.pending_total)
        s, session = _connect(srv)
        with s:
            s.sendall(_frame(session, header={"n": 1}))
            wait_for(lambda: recv.frames, 10, what="the real peer's frame")
        t0 = time.monotonic()
        wait_for(lambda: all(_closed(c) for c in silent), 10, what="every silent connection closed")
        assert time.monotonic() - t0 < LIMITS.rtt_bound_s + 2                  # within a leg of their accept
        assert srv.stats.rejected()["stalled"] >= 1
    finally:
        for c in silent:
            c.close()


def test_half_a_hello_is_dropped_after_one_leg(server: tuple[Server, Collect]) -> None:
    srv, _ = server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(auth._hello(CLIENT, 0, b"n" * auth.FRESH_BYTES)[:10])
        assert _closed(s)
        assert time.monotonic() - t0 < LIMITS.rtt_bound_s + 2
    _rejected(srv, "stalled")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:   # a whole hello, then no tag
        s.sendall(auth._hello(CLIENT, 0, b"n" * auth.FRESH_BYTES))
        assert s.recv(1 << 10)
        assert _closed(s)
    _rejected(srv, "stalled", 2)


def test_one_session_per_rank_the_newest_kept(server: tuple[Server, Collect]) -> None:
    srv, recv = server
    parked = [_connect(srv) for _ in range(5)]          # a key holder parks sessions as rank 0
    try:
        _rejected(srv, "replaced", 4)
        assert all(_closed(s) for s, _ in parked[:4])
        s, session = _connect(srv)                      # the real rank 0 replaces the last one
        with s:
            s.sendall(_frame(session, header={"n": 2}))
            wait_for(lambda: recv.frames, 10, what="the real rank's frame")
            assert _closed(parked[4][0])
            assert len(srv.sessions) == 1
    finally:
        for p, _ in parked:
            p.close()


def test_idle_sessions_close_and_a_link_reconnects_without_losing_a_frame(server: tuple[Server, Collect]) -> None:
    srv, recv = server
    stats = Stats()
    link = Link(("127.0.0.1", srv.port), TokenBucket(1e9, 1e9), max_queue_bytes=1 << 20, stats=stats,
                ident=CLIENT, rank=0, peer_rank=1, handshake_s=LIMITS.handshake_s)
    try:
        link.send(Frame("sample", {"i": 0}, b"a"))
        wait_for(lambda: len(recv.frames) == 1, 10)
        wait_for(lambda: srv.stats.snapshot().get("sessions_idle"), 10, what="closed: quiet past IDLE_ROUNDS rounds")
        wait_for(lambda: not srv.sessions, 10, what="the idle session gone")
        for i in (1, 2):
            link.send(Frame("sample", {"i": i}, b"b"))
        wait_for(lambda: len(recv.frames) == 3, 10, what="both frames after the listener closed the link")
        assert [f.header["i"] for f, _ in recv.frames] == [0, 1, 2] and srv.stats.snapshot()["sessions"] == 2
    finally:
        link.close()
