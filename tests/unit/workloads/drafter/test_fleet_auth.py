"""drafter.auth + the links' listener on real loopback sockets: the key, the handshake, frame
MACs and sequence numbers, and the listener's limits (payload caps, stalls); what it admits:
test_fleet_admission.py; the pods' own identities: test_fleet_identity.py."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spectrain_api.errors import ConfigError
from spectrain_api.names import (
    ENV_DRAFTER_STORE,
    ENV_FLEET_IDENTITY_FILE,
    ENV_FLEET_KEY_FILE,
    ENV_FLEET_PEERS_FILE,
    ENV_JOB_UID,
    ENV_POD_IPS,
    ENV_RESTART_GENERATION,
    IDLE_ONLY,
    OFF,
)
from spectrain_workloads.drafter import auth, listener
from spectrain_workloads.drafter.admission import Limits
from spectrain_workloads.drafter.auth import AuthError, Identity, Session, client_handshake, load_key
from spectrain_workloads.drafter.fleet_records import parse_peers, store_address
from spectrain_workloads.drafter.links import Frame, Link, Stats, TokenBucket
from spectrain_workloads.drafter.listener import Server
from tests.fleet_ids import pod_identities, write_identities
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.unit

KEY = os.urandom(32)
PODS = pod_identities(3, "uid-1", 3)              # one rank per pod
IDENT = Identity(KEY, "uid-1", 3, PODS[1])        # the listener's (rank 1)
CLIENT = Identity(KEY, "uid-1", 3, PODS[0])       # rank 0's
CAP = 4096
LIMITS = Limits.for_job(world=3, ranks_per_host=3, combine_every_s=1.0)     # 4 pending, 0.1 s a leg, idle 3.2 s


class Collect:
    """A links.Receiver keeping every frame (and from which rank), refusing `kind` "hello"."""

    def __init__(self) -> None:
        self.frames: list[tuple[Frame, int]] = []

    def cap(self, kind: str) -> int:
        return CAP

    def admit(self, kind: str, header: dict[str, Any], peer: Session) -> str | None:
        return "role" if kind == "hello" else None

    def handle(self, frame: Frame, peer: Session) -> None:
        self.frames.append((frame, peer.peer_rank))

    def defer(self, kind: str) -> bool:
        return False


def serving(limits: Limits) -> Iterator[tuple[Server, Collect]]:
    """A listener of rank 1 of 3 on a free loopback port, closed afterwards (the fixtures' body)."""
    recv = Collect()
    s = Server([("127.0.0.1", free_ports(1)[0])], recv, Stats(), ident=IDENT, rank=1, world=3, limits=limits)
    yield s, recv
    s.close()


@pytest.fixture
def server() -> Iterator[tuple[Server, Collect]]:
    yield from serving(LIMITS)


def _connect(server: Server, ident: Identity = CLIENT, rank: int = 0) -> tuple[socket.socket, Session]:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        return sock, client_handshake(sock, ident, rank, 1)
    except AuthError:
        sock.close()
        raise


def _frame(session: Session, kind: str = "sample", header: dict[str, Any] | None = None,
           payload: bytes = b"abc") -> bytes:
    head, tag = session.seal(kind, json.dumps(header or {"n": 1}).encode(), payload)
    return head + payload + tag


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _rejected(server: Server, cause: str, n: int = 1) -> None:
    wait_for(lambda: server.stats.rejected().get(cause, 0) >= n, 10, what=f"{n} rejected for {cause}")


def test_the_key_file(tmp_path: Path) -> None:
    p = tmp_path / "key"
    p.write_text(f"  {KEY.hex()}\n")
    p.chmod(0o600)                    # load_key refuses a key others can read (test_secretfile)
    assert load_key(p) == KEY
    with pytest.raises(ConfigError, match=ENV_FLEET_KEY_FILE):
        load_key(None)
    with pytest.raises(ConfigError, match="cannot read the fleet key"):
        load_key(tmp_path / "missing")
    p.write_text("zz" * 32)
    with pytest.raises(ConfigError, match="64 hex characters"):
        load_key(p)


def test_the_sidecar_needs_a_key_and_the_pods_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spectrain_workloads.drafter.sidecar import _fleet

    ex = SimpleNamespace(enabled=True, bandwidth_m_bps=64, combine_every_seconds=10, engine="Star")
    cfg = SimpleNamespace(drafter=SimpleNamespace(exchange=ex), target=SimpleNamespace(parallelism=SimpleNamespace(pipeline=1)))
    a, b = free_ports(2)
    monkeypatch.setenv("SPECTRAIN_DRAFTER_PEERS", f"127.0.0.1:{a},127.0.0.1:{b}")
    monkeypatch.delenv("SPECTRAIN_DRAFTER_BIND", raising=False)
    monkeypatch.delenv(ENV_POD_IPS, raising=False)
    with pytest.raises(ConfigError, match=ENV_POD_IPS):
        _fleet(cfg, 0, 2, 1, IDLE_ONLY)                          # never every interface by default
    monkeypatch.setenv(ENV_POD_IPS, "127.0.0.1")
    monkeypatch.delenv(ENV_FLEET_KEY_FILE, raising=False)
    with pytest.raises(ConfigError, match=f"{ENV_FLEET_KEY_FILE} is not set.*Secret"):
        _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    (tmp_path / "key").write_text(KEY.hex())
    (tmp_path / "key").chmod(0o600)
    monkeypatch.setenv(ENV_FLEET_KEY_FILE, str(tmp_path / "key"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name in (ENV_FLEET_IDENTITY_FILE, ENV_FLEET_PEERS_FILE, ENV_JOB_UID, ENV_RESTART_GENERATION):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=f"{ENV_FLEET_IDENTITY_FILE} is not set"):
        _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    monkeypatch.setenv(ENV_JOB_UID, "uid-1")
    stale = write_identities(tmp_path / "stale", 2, "uid-1", generation=1)     # the previous generation's
    for name, path in stale[0].items():
        monkeypatch.setenv(name, path)
    with pytest.raises(ConfigError, match=f"restart generation 1, this pod's is 0.*{ENV_FLEET_PEERS_FILE}|"
                                          f"{ENV_FLEET_PEERS_FILE}.*restart generation 1, this pod's is 0"):
        _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    ids = write_identities(tmp_path / "ids", 2, "uid-1")
    monkeypatch.setenv(ENV_FLEET_IDENTITY_FILE, ids[1][ENV_FLEET_IDENTITY_FILE])      # another pod's Secret
    monkeypatch.setenv(ENV_FLEET_PEERS_FILE, ids[0][ENV_FLEET_PEERS_FILE])
    with pytest.raises(ConfigError, match=f"{ENV_FLEET_IDENTITY_FILE}.*not the key {ENV_FLEET_PEERS_FILE} lists for rank 0"):
        _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")                                    # 2 pods of 2 ranks
    with pytest.raises(ConfigError, match=f"{ENV_FLEET_PEERS_FILE} lists 2 pods x 1 local ranks, but WORLD_SIZE is 4"):
        _fleet(cfg, 0, 4, 3, IDLE_ONLY)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv(ENV_FLEET_IDENTITY_FILE, ids[0][ENV_FLEET_IDENTITY_FILE])
    fleet = _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    try:
        assert fleet.server.socks[0].getsockname()[0] == "127.0.0.1" and fleet.ident.key == KEY
        assert fleet.ident.pod is not None and fleet.ident.pod.peers.public_key(1) != fleet.ident.pod.public
        assert fleet.star and fleet.cfg.store is None
    finally:
        fleet.close()
    # engine AllReduce: the store on the exporting rank's pod, after its drafter ports (one per local rank)
    ex.engine = "AllReduce"
    monkeypatch.delenv(ENV_DRAFTER_STORE, raising=False)
    fleet = _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    try:
        assert not fleet.star and fleet.cfg.store == ("127.0.0.1", b + 1)
    finally:
        fleet.close()
    monkeypatch.setenv(ENV_DRAFTER_STORE, "[::1]:7000")
    fleet = _fleet(cfg, 0, 2, 1, IDLE_ONLY)
    try:
        assert fleet.cfg.store == ("::1", 7000)
    finally:
        fleet.close()
    # no fleet where fleet_in_use says none (the operator mints no identity for those): activation
    # Off, the exchange disabled, a single rank; nothing is read, so the missing files do not matter
    monkeypatch.delenv(ENV_FLEET_IDENTITY_FILE)
    assert _fleet(cfg, 0, 2, 1, OFF) is None and _fleet(cfg, 0, 1, 0, IDLE_ONLY) is None
    ex.enabled = False
    assert _fleet(cfg, 0, 2, 1, IDLE_ONLY) is None


def test_the_store_follows_the_exporting_ranks_pod() -> None:
    peers = parse_peers("a:29600,b:29600", 4, 2)       # two pods of two local ranks
    assert store_address(peers, 3, 2) == ("b", 29602)   # past b's drafters (29600, 29601)
    assert store_address(peers, 2, 2) == ("b", 29602)
    assert store_address(peers, 1, 2) == ("a", 29602)


def test_frames_arrive_from_the_authenticated_rank_in_order(server: tuple[Server, Collect]) -> None:
    srv, recv = server
    link = Link(("127.0.0.1", srv.port), TokenBucket(1e9, 1e9), max_queue_bytes=1 << 20, stats=Stats(),
                ident=Identity(KEY, "uid-1", 3, PODS[2]), rank=2, peer_rank=1, handshake_s=LIMITS.handshake_s)
    try:
        for i in range(5):
            link.send(Frame("sample", {"i": i}, bytes([i]) * 100))
        link.send(Frame("contrib", {"i": 5}, b""))
        wait_for(lambda: len(recv.frames) == 6, 10)
        assert [(f.kind, f.header["i"], r) for f, r in recv.frames] == [("sample", i, 2) for i in range(5)] + [("contrib", 5, 2)]
        assert recv.frames[3][0].payload == bytes([3]) * 100
    finally:
        link.close()


def test_the_handshake_refuses_another_key_job_generation_or_rank(server: tuple[Server, Collect]) -> None:
    srv, _ = server
    with pytest.raises(AuthError) as exc:
        _connect(srv, Identity(os.urandom(32), "uid-1", 3, PODS[0]))
    assert exc.value.cause == "handshake"                 # the listener's tag fails with another key
    _rejected(srv, "handshake")
    for ident, cause in ((Identity(KEY, "uid-2", 3, pod_identities(1, "uid-2", 3)[0]), "job"),
                         (Identity(KEY, "uid-1", 4, pod_identities(1, "uid-1", 4)[0]), "generation")):
        with pytest.raises(AuthError):
            _connect(srv, ident)
        _rejected(srv, cause)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock, pytest.raises(AuthError) as exc:
        client_handshake(sock, CLIENT, 0, 2)            # the listener is rank 1, not 2
    assert exc.value.cause == "rank"
    s, session = _connect(srv, rank=1)                  # claiming the listener's own rank
    with s:
        _rejected(srv, "rank")
        assert _closed(s)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:   # a recorded client hello
        s.sendall(auth._hello(CLIENT, 0, b"n" * auth.FRESH_BYTES))
        s.recv(1 << 10)
        s.sendall(os.urandom(auth.PROOF_BYTES))        # cannot tag the listener's fresh nonce
    _rejected(srv, "handshake", 3)


def test_a_tampered_replayed_or_foreign_frame_ends_its_connection(server: tuple[Server, Collect]) -> None:
    srv, recv = server
    s, session = _connect(srv)
    good = _frame(session)
    with s:
        s.sendall(good + good)                          # the second one replays the first's sequence number
        _rejected(srv, "sequence")
    s, session = _connect(srv)
    with s:
        s.sendall(good)                                 # recorded on another connection
        _rejected(srv, "mac")
    for flip in (auth.PREFIX.size + 2, -1):             # the header, the payload's tag
        s, session = _connect(srv)
        with s:
            bad = bytearray(_frame(session))
            bad[flip] ^= 1
            s.sendall(bad)
    _rejected(srv, "mac", 3)
    s, session = _connect(srv)
    with s:                                             # authenticated, then refused by the receiver: skipped
        s.sendall(_frame(session, "hello", payload=b"h" * 100) + _frame(session, header={"n": 2}))
        wait_for(lambda: any(f.header == {"n": 2} for f, _ in recv.frames), 10)
    _rejected(srv, "role")
    assert [f.header for f, _ in recv.frames] == [{"n": 1}, {"n": 2}]


def test_caps_and_stalls(server: tuple[Server, Collect], monkeypatch: pytest.MonkeyPatch) -> None:
    srv, recv = server
    monkeypatch.setattr(listener, "FRAME_STALL_S", 0.3)
    s, session = _connect(srv)
    with s:
        s.sendall(auth.PREFIX.pack(0, auth.KINDS["sample"], 2, CAP + 1))     # over the cap: nothing more is read
        _rejected(srv, "oversize")
    s, session = _connect(srv)
    with s:
        s.sendall(_frame(session)[:-5])                 # the payload's tag never comes
        _rejected(srv, "stalled")
    s, session = _connect(srv)
    with s:
        s.sendall(_frame(session, header={"n": 3}))
        wait_for(lambda: recv.frames, 10)
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    with s:                                             # a connection that never authenticates
        _rejected(srv, "stalled", 2)
        assert _closed(s)
    assert time.monotonic() - t0 < LIMITS.rtt_bound_s + 5


def test_macs_off_is_a_separate_protocol(server: tuple[Server, Collect]) -> None:
    srv, _ = server
    with pytest.raises(OSError):                        # bench-fleet's measurement mode never talks to a keyed drafter
        _connect(srv, Identity(None, "uid-1", 3))
    _rejected(srv, "version")
