"""The pods' own identities (drafter.identity, drafter.auth) on real sockets: a rank speaks only as
its own pod, a stale generation's credentials verify nothing, a recorded handshake plus the job's
key does not give the session key, and a combined version counts only signed by the exporting rank."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_workloads.drafter import auth
from spectrain_workloads.drafter.admission import Limits
from spectrain_workloads.drafter.auth import AuthError, Identity, ServerHandshake, Session, client_handshake
from spectrain_workloads.drafter.checks import TargetSpec
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import FleetConfig, pack_params
from spectrain_workloads.drafter.identity import PodIdentity, version_digest
from spectrain_workloads.drafter.links import Frame, Stats
from spectrain_workloads.drafter.listener import Server
from tests.fleet_ids import pod_identities
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.unit

KEY, UID, GEN = os.urandom(32), "uid-7", 2
PODS = pod_identities(3, UID, GEN)                # one rank per pod: rank r is pod r
LIMITS = Limits.for_job(world=3, ranks_per_host=3, combine_every_s=1.0)


def ident(pod: PodIdentity, key: bytes = KEY) -> Identity:
    return Identity(key, UID, GEN, pod)


def handshake(client: Identity, crank: int, server: Identity, srank: int, world: int = 3) -> tuple[Any, Any]:
    """(client side, listener side) of one handshake over a socketpair, each a Session or the
    AuthError it failed with; the listener's ServerHandshake fed as drafter.admission feeds it."""
    a, b = socket.socketpair()
    out: dict[str, Any] = {}

    def listen() -> None:
        hs = ServerHandshake(server, srank, world)
        try:
            while hs.session is None:
                data = b.recv(hs.want)
                if not data:
                    raise AuthError("handshake", "closed")
                b.sendall(hs.feed(data))
            out["s"] = hs.session
        except AuthError as exc:
            out["s"] = exc
        finally:
            b.close()                      # a refused client sees the close
    t = threading.Thread(target=listen)
    t.start()
    try:
        out["c"] = client_handshake(a, client, crank, srank)
    except (AuthError, OSError) as exc:
        out["c"] = exc
        a.close()                          # as links.Link does: the listener sees the close
    t.join(10)
    a.close()
    return out["c"], out["s"]


def _cause(x: Any) -> str:
    assert isinstance(x, AuthError), x
    return x.cause


def test_matching_identities_share_a_fresh_session_key_per_handshake() -> None:
    c1, s1 = handshake(ident(PODS[0]), 0, ident(PODS[1]), 1)
    c2, s2 = handshake(ident(PODS[0]), 0, ident(PODS[1]), 1)
    assert isinstance(c1, Session) and isinstance(s1, Session) and (c1.peer_rank, s1.peer_rank) == (1, 0)
    assert c1.key == s1.key and c2.key == s2.key and c1.key != c2.key     # two sessions, two keys
    head, tag_p = c1.seal("sample", b"{}", b"payload")                     # the listener verifies the frame
    n = auth.PREFIX.size
    s1.check_header(head[:n], head[n:-auth.TAG_BYTES], head[-auth.TAG_BYTES:])
    assert s1.payload_ok(head[-auth.TAG_BYTES:], b"payload", tag_p)


def test_a_key_holder_with_its_own_pods_identity_cannot_claim_another_pods_rank() -> None:
    insider = ident(PODS[2])                          # holds the job's key and pod 2's private key
    _, s = handshake(insider, 0, ident(PODS[1]), 1)   # claims rank 0 to rank 1's listener
    assert _cause(s) == "identity"
    c, _ = handshake(ident(PODS[0]), 0, insider, 1)   # listens where rank 1 should
    assert _cause(c) == "identity"
    c, s = handshake(insider, 2, ident(PODS[1]), 1)   # as itself: admitted
    assert isinstance(c, Session) and isinstance(s, Session) and s.peer_rank == 2
    # a pod speaks for all its ranks and only those: 2 pods of 2 local ranks (pod 0: ranks 0, 1)
    pods = pod_identities(2, UID, GEN, local_world=2)
    assert isinstance(handshake(ident(pods[0]), 1, ident(pods[1]), 3, world=4)[1], Session)
    assert _cause(handshake(ident(pods[0]), 2, ident(pods[1]), 3, world=4)[1]) == "identity"


def test_a_stale_generations_identity_verifies_nothing() -> None:
    old = pod_identities(3, UID, GEN - 1)
    with pytest.raises(ConfigError, match=f"generation {GEN - 1}.*generation {GEN}"):
        ident(old[0])                                  # the old peers.json: refused before any handshake
    stale = PodIdentity(old[0].private, PODS[0].peers)  # the old private key beside the new peers.json
    with pytest.raises(ConfigError, match="not the key .* lists for rank 0"):
        stale.check_rank(0)                            # what the drafter says at start (Fleet)
    _, s = handshake(ident(stale), 0, ident(PODS[1]), 1)
    assert _cause(s) == "identity"                     # and what a peer says when it is not checked


class _Recorder:
    """A socket that keeps the bytes the handshake sent and received (a party on the path)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent, self.received = sock, bytearray(), bytearray()

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        data = self.sock.recv(n)
        self.received += data
        return data


class _Keep:
    """A links.Receiver keeping every frame."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []

    def cap(self, kind: str) -> int:
        return 1 << 16

    def admit(self, kind: str, header: dict[str, Any], peer: Session) -> str | None:
        return None

    def handle(self, frame: Frame, peer: Session) -> None:
        self.frames.append(frame)

    def defer(self, kind: str) -> bool:
        return False


@pytest.fixture
def listener() -> Iterator[tuple[Server, _Keep]]:
    keep = _Keep()
    srv = Server([("127.0.0.1", free_ports(1)[0])], keep, Stats(), ident=ident(PODS[1]), rank=1, world=3, limits=LIMITS)
    yield srv, keep
    srv.close()


def test_a_recorded_handshake_and_the_job_key_do_not_give_the_session_key(listener: tuple[Server, _Keep]) -> None:
    srv, keep = listener
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        rec = _Recorder(sock)
        session = client_handshake(rec, ident(PODS[0]), 0, 1)    # type: ignore[arg-type]
        n = len(auth._hello(ident(PODS[0]), 0, b"\0" * auth.FRESH_BYTES))
        hello_c, hello_s = bytes(rec.sent[:n]), bytes(rec.received[:n])
        # what a third drafter holding the job's key derives from the recorded hellos (protocol 1's key)
        guess = hmac.new(KEY, b"K" + hello_c + hello_s, hashlib.sha256).digest()
        assert guess != session.key
        forged = Session(session.ident, guess, 0, 1)
        real = json.dumps({"n": 1}).encode()
        head, tag = session.seal("sample", real, b"r")
        sock.sendall(head + b"r" + tag)                           # the real frame is taken
        wait_for(lambda: len(keep.frames) == 1, 10, what="the real frame")
        forged.seq = session.seq                                  # the next frame, MACed with the guess
        head, tag = forged.seal("sample", json.dumps({"n": 2}).encode(), b"f")
        sock.sendall(head + b"f" + tag)
        wait_for(lambda: srv.stats.rejected().get("mac", 0) == 1, 10, what="the forged frame refused")
    assert [f.header for f in keep.frames] == [{"n": 1}]


def test_an_outsider_never_makes_the_listener_verify_a_signature(listener: tuple[Server, _Keep],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    srv, _ = listener
    pod = srv.admission.ident.pod
    assert pod is not None
    verified: list[int] = []
    real_verify = pod.verify
    monkeypatch.setattr(pod, "verify", lambda rank, *a: verified.append(rank) or real_verify(rank, *a))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s, pytest.raises(AuthError):
        client_handshake(s, ident(PODS[0], key=os.urandom(32)), 0, 1)   # another key, rank 0's real identity
    wait_for(lambda: srv.stats.rejected().get("handshake", 0) == 1, 10, what="the outsider refused")
    assert verified == []
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        client_handshake(s, ident(PODS[0]), 0, 1)
        wait_for(lambda: verified == [0], 10, what="the key holder's signature verified")


# ------------------------------------------------------------ combined versions
TARGET = TargetSpec(vocab=100, hidden=4, max_tokens=16)
WEIGHTS = {"weight": torch.zeros(2, 3)}


def test_a_combined_version_counts_only_signed_by_the_exporting_rank() -> None:
    """Member rank 0 of 3 (the exporting rank 2 coordinates): a combined version on rank 1's session is
    refused for its role, and on the coordinator's session unsigned or signed by another pod for its
    signature, counted by cause; one the coordinator's pod signed is taken."""
    ports = free_ports(3)
    member = Fleet(FleetConfig(rank=0, world=3, pipeline=1, coordinator=2, addresses=[("127.0.0.1", p) for p in ports],
                               key=KEY, pod=PODS[0], job_uid=UID, generation=GEN))
    member.expect(WEIGHTS, TARGET)
    payload = pack_params({"weight": torch.ones(2, 3) * 0.1})

    def signed(pod: PodIdentity, version: int) -> dict[str, Any]:
        return {"version": version, "included": {"2": 1}, "work_s": 1.0,
                "signature": pod.sign(version_digest(UID, GEN, version, payload)).hex()}

    def send(rank: int, headers: list[dict[str, Any]]) -> None:
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as s:
            session = client_handshake(s, ident(PODS[rank]), rank, 0)
            for h in headers:
                head, tag = session.seal("combined", json.dumps(h).encode(), payload)
                s.sendall(head + payload + tag)
    try:
        send(1, [signed(PODS[1], 1)])                               # rank 1 is not the coordinator
        wait_for(lambda: member.stats.rejected().get("role", 0) == 1, 10, what="refused for its role")
        unsigned = {k: v for k, v in signed(PODS[2], 1).items() if k != "signature"}
        other_version = {**signed(PODS[2], 2), "version": 1}        # the coordinator's signature of version 2
        send(2, [signed(PODS[1], 1), unsigned, other_version])
        wait_for(lambda: member.stats.rejected().get("signature", 0) == 3, 10, what="three refused for the signature")
        assert member.take_combined() is None
        send(2, [signed(PODS[2], 1)])
        got = wait_for(member.take_combined, 10, what="the signed version taken")
        assert got.version == 1 and torch.equal(got.params["weight"], torch.ones(2, 3) * 0.1)
        assert member.stats.rejected() == {"role": 1, "signature": 3}
    finally:
        member.close()


def test_the_coordinator_signs_what_it_broadcasts() -> None:
    ports = free_ports(2)
    fleets = [Fleet(FleetConfig(rank=r, world=2, pipeline=1, coordinator=1, addresses=[("127.0.0.1", p) for p in ports],
                                key=KEY, pod=PODS[r], job_uid=UID, generation=GEN, combine_every_s=0.2)) for r in (0, 1)]
    try:
        for f in fleets:
            f.expect(WEIGHTS, TARGET)
        own = {"weight": torch.ones(2, 3)}
        fleets[0].contribute(1, own, work_total_s=0.1)
        wait_for(lambda: fleets[1].contributions, 10, what="the member's contribution")
        assert fleets[1].combine(own, 1, 0.1, version=1) is not None
        got = wait_for(fleets[0].take_combined, 10, what="the signed version at the member")
        assert got.version == 1 and fleets[0].stats.rejected() == {}
    finally:
        for f in fleets:
            f.close()
