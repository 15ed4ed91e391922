"""The fleet's listener under attack: a real drafter fleet side in a process of its own
(tests/integration/fleet_victim.py: Fleet + Replicas over a small model), a real peer in this
process, and an attacker speaking raw sockets on loopback (with the job's key and the real peer pod's
identity, as a compromised drafter of that pod would, or without them). After every attack the victim is up, still takes the real peer's
frames, and everything it took or made is finite; what was refused is counted by cause.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_api.fleet_identity import peers_document
from spectrain_workloads.drafter import auth
from spectrain_workloads.drafter.auth import Identity, Session, client_handshake
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import FleetConfig, pack_params
from spectrain_workloads.drafter.identity import version_digest
from spectrain_workloads.drafter.listener import FRAME_STALL_S
from tests.fleet_ids import pod_identities
from tests.integration.fleet_victim import COORDINATOR, PIPELINE, TARGET, WORLD, model
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KEY, UID = os.urandom(32), "job-uid-1"
PODS = pod_identities(WORLD, UID)         # one rank per pod; the attacker holds its peer pod's identity
TIMEOUT = 60


class Victim:
    def __init__(self, tmp: Path, rank: int, **extra: Any) -> None:
        self.ports = free_ports(WORLD)
        self.rank, self.status_path = rank, tmp / f"victim-{rank}.json"
        self.log = open(tmp / f"victim-{rank}.log", "wb")
        peers = peers_document(UID, 0, 1, [p.public for p in PODS])
        cfg = {"rank": rank, "ports": self.ports, "key": KEY.hex(), "job_uid": UID, "status": str(self.status_path),
               "identity": PODS[rank].private.hex(), "peers": peers, **extra}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), str(REPO)])}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.fleet_victim", json.dumps(cfg)],
                                     cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        # the real peer: the other rank of the job, in this process
        self.peer = Fleet(FleetConfig(rank=1 - rank, world=WORLD, pipeline=PIPELINE, coordinator=COORDINATOR,
                                      addresses=[("127.0.0.1", p) for p in self.ports], key=KEY,
                                      pod=PODS[1 - rank], job_uid=UID,
                                      combine_every_s=0.2))
        self.peer.expect(dict(model().named_parameters()), TARGET)
        wait_for(lambda: self.status_path.exists(), TIMEOUT, what="the victim's first status")

    @property
    def port(self) -> int:
        return self.ports[self.rank]

    def status(self) -> dict[str, Any]:
        assert self.proc.poll() is None, f"the victim exited ({self.proc.returncode})"
        return json.loads(self.status_path.read_text())

    def rejected(self, cause: str) -> int:
        return int(self.status()["exchangeRejectedByCause"].get(cause, 0))

    def wait_rejected(self, cause: str, at_least: int) -> None:
        wait_for(lambda: self.rejected(cause) >= at_least, TIMEOUT, what=f"{at_least} rejected for {cause}")

    def close(self) -> None:
        self.peer.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()


def still_works(v: Victim) -> None:
    """The victim is up, takes a real frame of its peer, and all it took and made is finite."""
    if v.rank == COORDINATOR:       # the real member's contribution makes a new combined version
        before = v.status()["combinedVersion"]
        params = {n: p.detach() for n, p in model().named_parameters()}

        def new_version() -> bool:
            v.peer.contribute(1, params, work_total_s=0.1)
            return bool(v.status()["combinedVersion"] > before)
        wait_for(new_version, TIMEOUT, interval=0.2, what="a combined version with the real member's work")
    else:                           # the real last stage's sample is taken
        before = v.status()["samplesTaken"]

        def taken() -> bool:
            v.peer.share(torch.arange(16) % TARGET.vocab, torch.randn(16, TARGET.hidden), step=1)
            return bool(v.status()["samplesTaken"] > before)
        wait_for(taken, TIMEOUT, interval=0.2, what="a real sample taken")
    s = v.status()
    assert s["samplesBad"] == 0 and s["modelFinite"] and s["latestFinite"], s


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    v = Victim(tmp_path_factory.mktemp("member"), 0)
    yield v
    v.close()


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    v = Victim(tmp_path_factory.mktemp("coordinator"), COORDINATOR)
    yield v
    v.close()


# ------------------------------------------------------------ the attacker
def connect(v: Victim, *, rank: int | None = None, key: bytes = KEY, uid: str = UID) -> tuple[socket.socket, Session]:
    """An authenticated connection to the victim, as `rank` (default: its real peer's), with the peer
    pod's identity (a compromised drafter of that pod)."""
    s = socket.create_connection(("127.0.0.1", v.port), timeout=10)
    pod = PODS[1 - v.rank] if uid == UID else pod_identities(WORLD, uid)[1 - v.rank]
    return s, client_handshake(s, Identity(key, uid, 0, pod), 1 - v.rank if rank is None else rank, v.rank)


def frame(session: Session, kind: str, header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A sealed frame; a combined version signed by the sender's own pod (as its real drafter would)."""
    if kind == "combined" and isinstance(header.get("version"), int):
        digest = version_digest(UID, 0, header["version"], payload)
        header = {**header, "signature": PODS[session.rank].sign(digest).hex()}
    head, tag = session.seal(kind, json.dumps(header).encode(), payload)
    return head + payload + tag


def sample(tokens: torch.Tensor, hidden: torch.Tensor, rank: int = 1) -> tuple[dict[str, Any], bytes]:
    header = {"rank": rank, "step": 1, "shapes": [list(tokens.shape), list(hidden.shape)],
              "dtypes": ["int64", str(hidden.dtype).removeprefix("torch.")]}
    return header, tokens.numpy().tobytes() + hidden.numpy().tobytes()


def closed(s: socket.socket) -> bool:
    """The victim closed its end (a reset when bytes it never read were left behind)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def send_all(v: Victim, frames: list[tuple[str, dict[str, Any], bytes]], **kw: Any) -> None:
    s, session = connect(v, **kw)
    with s:
        for kind, header, payload in frames:
            s.sendall(frame(session, kind, header, payload))


# ------------------------------------------------------------ samples
@pytest.mark.parametrize(("cause", "tokens", "hidden"), [
    ("nonfinite", torch.arange(16), torch.full((16, TARGET.hidden), float("nan"))),
    ("token", torch.arange(16) + TARGET.vocab, torch.randn(16, TARGET.hidden)),
    ("token", torch.arange(16) - 1, torch.randn(16, TARGET.hidden)),
    ("shape", torch.arange(16), torch.randn(16, TARGET.hidden + 1)),
    # past the target's longest sequence: over the sample cap, refused from its prefix, connection closed
    ("oversize", torch.arange(TARGET.max_tokens + 1) % TARGET.vocab, torch.randn(TARGET.max_tokens + 1, TARGET.hidden)),
    ("dtype", torch.arange(16), torch.randn(16, TARGET.hidden).double()),
])
def test_bad_samples_are_dropped(member: Victim, cause: str, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
    before = member.rejected(cause)
    header, payload = sample(tokens, hidden)
    send_all(member, [("sample", header, payload)] * 5)
    member.wait_rejected(cause, before + (1 if cause == "oversize" else 5))
    still_works(member)


def test_frames_without_or_with_a_wrong_mac_replayed_or_of_another_job_are_dropped(member: Victim) -> None:
    header, payload = sample(torch.arange(16), torch.full((16, TARGET.hidden), float("nan")))
    counts = {c: member.rejected(c) for c in ("handshake", "mac", "sequence", "job", "rank")}
    with socket.create_connection(("127.0.0.1", member.port)) as s:      # no key: the old unauthenticated frame
        s.sendall(json.dumps({"kind": "sample", **header}).encode() + payload)
    s, session = connect(member)
    with s:                                                               # a flipped payload byte
        data = bytearray(frame(session, "sample", header, payload))
        data[-40] ^= 1
        s.sendall(data)
    s, session = connect(member)
    with s:                                                               # the same frame twice
        data = bytearray(frame(session, "sample", *sample(torch.arange(16), torch.randn(16, TARGET.hidden))))
        s.sendall(data + data)
    s, session = connect(member)
    with s:                                                               # a frame recorded on another connection
        s.sendall(data)
    with pytest.raises(auth.AuthError):
        connect(member, uid="another-job")
    with pytest.raises(auth.AuthError):
        connect(member, key=os.urandom(32))
    send_all(member, [("sample", {**header, "rank": 0}, payload)])        # a rank that is not the peer's
    for cause, n in (("handshake", 2), ("mac", 2), ("sequence", 1), ("job", 1), ("rank", 1)):
        member.wait_rejected(cause, counts[cause] + n)
    assert member.status()["samplesBad"] == 0
    still_works(member)


def test_a_1_gib_header_then_a_stall_allocates_nothing(member: Victim) -> None:
    rss = member.status()["rss"]
    oversize, stalled, handshake = (member.rejected(c) for c in ("oversize", "stalled", "handshake"))
    s, session = connect(member)
    with s:
        prefix = auth.PREFIX.pack(0, auth.KINDS["sample"], 2, 1 << 30)
        s.sendall(prefix + b"{}")                 # then nothing more
        member.wait_rejected("oversize", oversize + 1)
        assert closed(s)                          # closed without reading on
    with socket.create_connection(("127.0.0.1", member.port)) as raw:   # no key: a 1 GiB length as the first bytes
        raw.sendall((1 << 30).to_bytes(8, "big") * 4)
        member.wait_rejected("handshake", handshake + 1)
    s, session = connect(member)
    with s:                                       # a legal frame that stops half way
        data = frame(session, "sample", *sample(torch.arange(16), torch.randn(16, TARGET.hidden)))
        s.sendall(data[: len(data) // 2])
        wait_for(lambda: member.rejected("stalled") > stalled, FRAME_STALL_S + TIMEOUT, what="the stall dropped")
    assert member.status()["rss"] - rss < 64 << 20
    still_works(member)


# ------------------------------------------------------------ weights and versions
def test_forged_combined_versions_never_reach_the_model(member: Victim) -> None:
    own = {n: p.detach() for n, p in model().named_parameters()}
    huge = pack_params({n: p * 1e6 for n, p in own.items()})
    nan = pack_params({n: torch.full_like(p, float("nan")) for n, p in own.items()})
    foreign = pack_params({"other": torch.zeros(3)})
    counts = {c: member.rejected(c) for c in ("update_norm", "nonfinite", "keys", "version")}
    base = {"included": {"0": 1}, "work_s": 1.0}
    v = member.status()["combinedVersion"]
    send_all(member, [("combined", {**base, "version": v + 1}, huge)])
    member.wait_rejected("update_norm", counts["update_norm"] + 1)           # checked against the model on apply
    send_all(member, [("combined", {**base, "version": v + 2}, nan), ("combined", {**base, "version": v + 2}, foreign),
                      ("combined", {**base, "version": 1 << 62}, huge)])
    for cause in ("nonfinite", "keys", "version"):
        member.wait_rejected(cause, counts[cause] + 1)
    # the real coordinator's next versions still apply
    params = {n: p.detach() for n, p in model().named_parameters()}
    wait_for(lambda: member.peer.contributions, TIMEOUT, what="the member's contribution at the real coordinator")
    made = member.peer.combine(params, 1, 1.0, version=v + 3)
    assert made is not None
    wait_for(lambda: member.status()["combinedVersion"] == v + 3, TIMEOUT, what="the real version applied")
    still_works(member)


def test_forged_contributions_are_bounded_and_checked(coordinator: Victim) -> None:
    still_works(coordinator)                      # a real round first: the coordinator has a model's worth of state
    own = {n: p.detach() for n, p in model().named_parameters()}
    counts = {c: coordinator.rejected(c) for c in ("update_norm", "keys", "header", "role")}
    contrib = {"rank": 0, "seq": 99, "samples_total": 10, "incarnation": "forged"}
    send_all(coordinator, [
        ("contrib", {**contrib, "work_total_s": 1.0}, pack_params({n: p * 1e6 for n, p in own.items()})),
        ("contrib", {**contrib, "work_total_s": 1.0}, pack_params({"other": torch.zeros(3)})),
        ("contrib", {**contrib, "work_total_s": float("inf")}, pack_params(own)),
        ("combined", {"version": 5, "included": {}, "work_s": 1.0}, pack_params(own)),   # only the coordinator sends those
    ])
    for cause in ("update_norm", "keys", "header", "role"):
        coordinator.wait_rejected(cause, counts[cause] + 1)
    v = coordinator.status()["combinedVersion"]
    send_all(coordinator, [("contrib", {**contrib, "work_total_s": 1e30}, pack_params(own))])
    wait_for(lambda: coordinator.status()["combinedVersion"] > v, TIMEOUT, what="a round with the forged work")
    claimed = coordinator.status()["latestWorkByRank"]["0"]
    assert 0 < claimed < 60, claimed             # credited at most at the rate of wall time, not 1e30
    still_works(coordinator)


def test_a_hello_flood_costs_one_weights_frame_per_version(coordinator: Victim) -> None:
    still_works(coordinator)
    received = coordinator.peer.stats.snapshot().get("received_bytes", 0)
    version = coordinator.status()["combinedVersion"]
    send_all(coordinator, [("hello", {"rank": 0, "nonce": "n"}, b"")] * 2000)
    # every frame of the flood was read (one more frame after it arrives in order), then count what came back
    s, session = connect(coordinator)
    with s:
        s.sendall(frame(session, "hello", {"rank": 0, "nonce": "end"}))
    got = wait_for(lambda: coordinator.peer.stats.snapshot().get("received_bytes", 0) - received or None, TIMEOUT,
                   what="an answer")
    versions = coordinator.status()["combinedVersion"] - version + 1
    weights = len(pack_params({n: p.detach() for n, p in model().named_parameters()}))
    assert got <= (versions + 1) * weights, (got, versions, weights)
    still_works(coordinator)


# ------------------------------------------------------------ descriptors
def test_100_idle_connections_under_a_64_descriptor_limit(tmp_path: Path) -> None:
    v = Victim(tmp_path, 0, nofile=64, spare_fds=2)     # the pending budget (2) fills them: the next accept fails
    try:
        wait_for(lambda: v.status()["held"] > 0, TIMEOUT, what="the victim's descriptor table filled")
        idle = [socket.create_connection(("127.0.0.1", v.port), timeout=10) for _ in range(100)]
        try:
            v.wait_rejected("descriptors", 1)
            still_works(v)
            assert v.rejected("evicted") + v.rejected("descriptors") > 0
        finally:
            for s in idle:
                s.close()
        still_works(v)
    finally:
        v.close()


# ------------------------------------------------------------ sessions
def test_a_key_holder_parking_sessions_does_not_lock_out_the_real_rank(tmp_path: Path) -> None:
    """Authenticated sessions parked (idle, as the real peer's rank) before the real peer connects:
    one session per rank, the newest kept, so the real peer's replaces them; the parked ones are closed."""
    v = Victim(tmp_path, 0)
    parked: list[socket.socket] = []
    try:
        for _ in range(3 * WORLD + 2):
            try:
                parked.append(connect(v)[0])
            except OSError:                       # refused: the listener holds no more
                pass
        still_works(v)                            # the real peer's first connection, after the parking
        assert parked and all(closed(s) for s in parked)
        assert v.rejected("replaced") >= len(parked)
    finally:
        for s in parked:
            s.close()
        v.close()
