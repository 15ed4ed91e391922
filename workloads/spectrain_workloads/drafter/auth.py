"""The fleet's authenticated channel: the job's key, each pod's identity, the handshake, a MAC on every frame.

Why HMAC-SHA256 per frame and not mutual TLS: the channel needs integrity and identity, not
secrecy (samples and drafter weights are the job's own data on the pod network), and the CPU cost
is the same (this machine, OpenSSL 3.0 with SHA-NI and AES-NI, CPU time): HMAC-SHA256 0.99 ms per
MiB per end, 6% of a core per end at the default 64 MB/s cap; TLS 1.3 AES-GCM with mutual
certificates 1.67 ms per MiB over both ends (2.17 against 0.50 for plain TCP on loopback). TLS
would need a CA and a certificate per pod minted by the operator (Python 3.11's ssl has no
pre-shared keys), and frame caps and sequence checks above it all the same.

Two credentials (docs/design.md, "Trust"): the job's key (every drafter of the job holds it: "a
drafter of this job") and the pod's identity (drafter.identity: an Ed25519 key pair per pod and
restart generation, only the public halves shared: "the drafter of rank r's pod").

Handshake (the connecting side C sends frames, the listening side S receives them):
    C -> S  hello_c = MAGIC | version u16 | rank u32 | generation u64 | len u16 | job UID | nonce_c | X_c
    S -> C  hello_s (the same fields: S's rank, nonce_s, X_s) | HMAC(key, "S" | hello_c | hello_s)
            | Sig_S("S" | hello_c | hello_s)
    C -> S  HMAC(key, "C" | hello_c | hello_s) | Sig_C("C" | hello_c | hello_s)
X_c, X_s: fresh ephemeral X25519 public keys; Sig_P: an Ed25519 signature by the pod of the rank P
claims, verified with that pod's public key (drafter.identity.handshake_message). Each side checks
the magic, version, job UID and generation against its own, then the other's HMAC tag (the cheap
check first: a peer without the job's key never makes the listener verify a signature), then the
claimed rank, then its signature (cause "identity": a key holder claiming another pod's rank).
A recorded handshake cannot be replayed: the other side's fresh nonce and X25519 key are in what
must be tagged and signed. Both then use the session key
    HMAC(key, "K" | hello_c | hello_s | X25519(x_c, X_s))
which needs the job's key and one of the two ephemeral private keys: a drafter of the job that
records the handshake of two others cannot compute it. A frame is
    prefix (seq u64, kind u8, header length u32, payload length u64) | header | tag_h | payload | tag_p
    tag_h = HMAC(session, "H" | job UID | generation | sender rank | prefix | header)
    tag_p = HMAC(session, "P" | tag_h | payload)
so the header (and the length it declares) is verified before a byte of the payload is buffered,
and `seq` must be exactly the next one (a replayed or reordered frame fails).

What this does not do: a compromised drafter still speaks as its own pod's ranks (all of them when
the pod has several); the checks of what is received (drafter.checks) bound what it can do.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass, field

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_FLEET_IDENTITY_FILE, ENV_FLEET_KEY_FILE
from spectrain_api.secretfile import read_hex_key
from spectrain_workloads.drafter.identity import (
    EPHEMERAL_BYTES,
    SIG_BYTES,
    Ephemeral,
    PodIdentity,
    handshake_message,
)

MAGIC = b"SPTRFLT\x00"
PROTOCOL_VERSION = 2             # 2: per-pod identities (signed transcripts, X25519 in the session key)
NO_MAC_FLAG = 0x8000             # in the version field: a MAC-less drafter (bench only) never pairs with a keyed one
KEY_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32
MAX_UID_BYTES = 256
_HELLO = struct.Struct(">8sHIQH")                  # magic, version, rank, generation, UID length
FRESH_BYTES = NONCE_BYTES + EPHEMERAL_BYTES        # a hello's tail after the UID: nonce, X25519 public key
PROOF_BYTES = TAG_BYTES + SIG_BYTES                # a side's proof: job-key tag, pod signature
PREFIX = struct.Struct(">QBIQ")                    # seq, kind, header length, payload length
KINDS = {"sample": 1, "contrib": 2, "combined": 3, "hello": 4, "part": 5}
KIND_NAMES = {v: k for k, v in KINDS.items()}


class AuthError(ConnectionError):
    """The peer failed the handshake or a frame's MAC; `cause` is the counter it is counted under."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


@dataclass(frozen=True)
class Identity:
    """Who this drafter is to its peers: the job's key and its pod's identity. key None turns the
    MACs and the identities off: bench-fleet's measurement of their cost only (the sidecar always
    reads both)."""

    key: bytes | None = field(repr=False)
    job_uid: str
    generation: int
    pod: PodIdentity | None = None

    def __post_init__(self) -> None:
        if self.key is not None and len(self.key) != KEY_BYTES:
            raise ConfigError(f"the fleet key must be {KEY_BYTES} bytes, got {len(self.key)}")
        if len(self.job_uid.encode()) > MAX_UID_BYTES:
            raise ConfigError(f"job UID longer than {MAX_UID_BYTES} bytes")
        if (self.key is None) != (self.pod is None):
            raise ConfigError(f"a keyed drafter needs its pod's identity too ({ENV_FLEET_IDENTITY_FILE}): a rank "
                              "speaks only as itself; the MAC-less bench mode (key None) has neither")
        if self.pod is not None and (self.pod.peers.job_uid, self.pod.peers.generation) != (self.job_uid, self.generation):
            raise ConfigError(f"the pod identities are job {self.pod.peers.job_uid!r}'s generation "
                              f"{self.pod.peers.generation}, this drafter is job {self.job_uid!r}'s generation "
                              f"{self.generation}: mount this generation's fleet-identity Secret")

    @property
    def signs(self) -> bool:
        return self.pod is not None


def load_key(path: str | os.PathLike[str] | None) -> bytes:
    """The job's key from its file: 64 hex characters (whitespace around them ignored), in a file
    only its owner and this pod can read (spectrain_api.secretfile)."""
    return read_hex_key(path, KEY_BYTES, "the fleet key", ENV_FLEET_KEY_FILE,
                        "the operator, mounting the job's fleet-key Secret into the drafter container,")


def _mac(key: bytes | None, *parts: bytes | bytearray) -> bytes:
    if key is None:
        return b""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise AuthError("handshake", "closed during the handshake")
        buf += chunk
    return bytes(buf)


def _version(ident: Identity) -> int:
    return PROTOCOL_VERSION if ident.key is not None else PROTOCOL_VERSION | NO_MAC_FLAG


def _fresh(ident: Identity) -> tuple[Ephemeral | None, bytes]:
    """This side's ephemeral X25519 key for one handshake and its hello's fresh tail (nonce | X);
    the bench's MAC-less mode derives no session key: random bytes in X's place, no key pair."""
    eph = Ephemeral() if ident.key is not None else None
    return eph, os.urandom(NONCE_BYTES) + (eph.public if eph is not None else os.urandom(EPHEMERAL_BYTES))


def _hello(ident: Identity, rank: int, fresh: bytes) -> bytes:
    uid = ident.job_uid.encode()
    return _HELLO.pack(MAGIC, _version(ident), rank, ident.generation, len(uid)) + uid + fresh


def _hello_fixed(fixed: bytes, ident: Identity) -> tuple[int, int, int]:
    """(rank, generation, UID length) of a hello's fixed part; AuthError on a foreign protocol."""
    magic, version, rank, generation, n_uid = _HELLO.unpack(fixed)
    if magic != MAGIC:
        raise AuthError("handshake", "not a drafter peer")
    if version != _version(ident):
        raise AuthError("version", f"protocol {version:#x}, this drafter speaks {_version(ident):#x}")
    if n_uid > MAX_UID_BYTES:
        raise AuthError("handshake", "job UID too long")
    return rank, generation, n_uid


def _hello_rest(rest: bytes, n_uid: int, generation: int, ident: Identity) -> None:
    """The hello's job UID and generation against this drafter's; AuthError on another job's."""
    if rest[:n_uid] != ident.job_uid.encode():
        raise AuthError("job", "another job's drafter")
    if generation != ident.generation:
        raise AuthError("generation", f"restart generation {generation}, this drafter's is {ident.generation}")


def _read_hello(sock: socket.socket, ident: Identity) -> tuple[bytes, int]:
    """The peer's hello (raw bytes, its rank); AuthError on a foreign protocol, job or generation."""
    fixed = _recv_exact(sock, _HELLO.size)
    rank, generation, n_uid = _hello_fixed(fixed, ident)
    rest = _recv_exact(sock, n_uid + FRESH_BYTES)
    _hello_rest(rest, n_uid, generation, ident)
    return fixed + rest, rank


def _proof(ident: Identity, role: bytes, hello_c: bytes, hello_s: bytes) -> bytes:
    """This side's proof (PROOF_BYTES): the job-key tag, then its pod's signature of the transcript;
    b"" in the MAC-less mode."""
    if ident.pod is None:
        return b""
    return _mac(ident.key, role, hello_c, hello_s) + ident.pod.sign(handshake_message(role, hello_c, hello_s))


def _check_tag(ident: Identity, role: bytes, proof: bytes, hello_c: bytes, hello_s: bytes) -> None:
    """The proof's job-key tag (first: cheap, and what stops an outsider); AuthError "handshake"."""
    if ident.pod is not None and not hmac.compare_digest(proof[:TAG_BYTES], _mac(ident.key, role, hello_c, hello_s)):
        who = "listener" if role == b"S" else "connecting side"
        raise AuthError("handshake", f"the {who} does not hold the job's key")


def _check_signature(ident: Identity, role: bytes, proof: bytes, hello_c: bytes, hello_s: bytes, rank: int) -> None:
    """The proof's signature by the pod of the claimed `rank`; AuthError "identity" (a holder of the
    job's key speaking as another pod's rank, or with another generation's identity)."""
    if ident.pod is not None and not ident.pod.verify(rank, proof[TAG_BYTES:], handshake_message(role, hello_c, hello_s)):
        raise AuthError("identity", f"not signed by the pod of rank {rank}")


@dataclass
class Session:
    """One authenticated connection: the peer's rank, the session key, the next sequence number."""

    ident: Identity
    key: bytes | None
    rank: int                          # the sender's rank (this side's when sending)
    peer_rank: int
    started: float = field(default_factory=time.monotonic)
    seq: int = 0
    id: str = ""

    def _bind(self, sender: int) -> bytes:
        return self.ident.job_uid.encode() + struct.pack(">QI", self.ident.generation, sender)

    def seal(self, kind: str, head: bytes, payload: bytes) -> tuple[bytes, bytes]:
        """(prefix | header | tag_h, tag_p) of the next frame this side sends."""
        prefix = PREFIX.pack(self.seq, KINDS[kind], len(head), len(payload))
        self.seq += 1
        tag_h = _mac(self.key, b"H", self._bind(self.rank), prefix, head)
        return prefix + head + tag_h, _mac(self.key, b"P", tag_h, payload)

    def check_header(self, prefix: bytes, head: bytes, tag_h: bytes) -> None:
        """The header's MAC and sequence number, before its payload is read."""
        if not hmac.compare_digest(tag_h, _mac(self.key, b"H", self._bind(self.peer_rank), prefix, head)):
            raise AuthError("mac", "header MAC does not verify")
        seq = PREFIX.unpack(prefix)[0]
        if seq != self.seq:
            raise AuthError("sequence", f"frame {seq}, expected {self.seq}: replayed or reordered")
        self.seq += 1

    def payload_ok(self, tag_h: bytes, payload: bytes | bytearray, tag_p: bytes) -> bool:
        """The payload's MAC (bound to its verified header's tag)."""
        return self.key is None or hmac.compare_digest(tag_p, _mac(self.key, b"P", tag_h, payload))

    @property
    def tag_bytes(self) -> int:
        return 0 if self.key is None else TAG_BYTES


def _session(ident: Identity, hello_c: bytes, hello_s: bytes, rank: int, peer_rank: int,
             eph: Ephemeral | None, peer_hello: bytes) -> Session:
    """The session of a verified handshake: its key from the job's key, the transcript and the X25519
    secret of this side's ephemeral key and the peer's (the last EPHEMERAL_BYTES of its hello)."""
    key = None
    if ident.key is not None:
        assert eph is not None
        shared = eph.shared(peer_hello[-EPHEMERAL_BYTES:])
        if shared is None:
            raise AuthError("handshake", "the peer's X25519 key is of low order")
        key = _mac(ident.key, b"K", hello_c, hello_s, shared)
    return Session(ident, key, rank, peer_rank, id=hashlib.sha256(hello_c + hello_s).hexdigest()[:16])


def client_handshake(sock: socket.socket, ident: Identity, rank: int, peer_rank: int) -> Session:
    """Authenticate to the drafter of `peer_rank` listening at the other end of `sock`, as `rank`."""
    eph, fresh = _fresh(ident)
    hello_c = _hello(ident, rank, fresh)
    sock.sendall(hello_c)
    hello_s, srank = _read_hello(sock, ident)
    proof = _recv_exact(sock, PROOF_BYTES) if ident.signs else b""
    _check_tag(ident, b"S", proof, hello_c, hello_s)
    if srank != peer_rank:
        raise AuthError("rank", f"rank {srank} listens where rank {peer_rank} should")
    _check_signature(ident, b"S", proof, hello_c, hello_s, srank)
    sock.sendall(_proof(ident, b"C", hello_c, hello_s))
    return _session(ident, hello_c, hello_s, rank, peer_rank, eph, hello_s)


class ServerHandshake:
    """The listening side's handshake, fed the bytes as they arrive (drafter.admission reads them from
    non-blocking sockets, no thread per connection). `want` is how many bytes the next message still
    needs (read no more: what follows the handshake is the first frame); `feed` returns what to send
    back (the listener's hello and proof, once the connecting side's hello is whole) and sets `session`
    once the connecting side's proof verifies; AuthError when anything fails. A connecting drafter's
    rank (what every frame of it is bound to) is checked to be another rank of this job, and its
    signature (only after its job-key tag) to be by that rank's pod."""

    def __init__(self, ident: Identity, rank: int, world: int) -> None:
        self.ident, self.rank, self.world = ident, rank, world
        self.buf = bytearray()
        self.received = 0                  # bytes so far: how far this connection got (admission's order)
        self.hello_c = self.hello_s = b""
        self.n_uid, self.generation, self.crank = -1, -1, -1
        self.eph: Ephemeral | None = None
        self.session: Session | None = None

    @property
    def want(self) -> int:
        if not self.hello_s:
            return (_HELLO.size if self.n_uid < 0 else _HELLO.size + self.n_uid + FRESH_BYTES) - len(self.buf)
        return (PROOF_BYTES if self.ident.signs else 0) - len(self.buf)

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        self.received += len(data)
        if self.want > 0:
            return b""
        if not self.hello_s and self.n_uid < 0:
            self.crank, self.generation, self.n_uid = _hello_fixed(bytes(self.buf), self.ident)
            return b""
        if not self.hello_s:
            _hello_rest(bytes(self.buf[_HELLO.size:]), self.n_uid, self.generation, self.ident)
            self.hello_c, self.buf = bytes(self.buf), bytearray()
            self.eph, fresh = _fresh(self.ident)
            self.hello_s = _hello(self.ident, self.rank, fresh)
            reply = self.hello_s + _proof(self.ident, b"S", self.hello_c, self.hello_s)
            if not self.ident.signs:
                self._done()
            return reply
        self._done()
        return b""

    def _done(self) -> None:
        proof = bytes(self.buf)
        _check_tag(self.ident, b"C", proof, self.hello_c, self.hello_s)
        if not 0 <= self.crank < self.world or self.crank == self.rank:
            raise AuthError("rank", f"rank {self.crank} is not another rank of a world of {self.world}")
        _check_signature(self.ident, b"C", proof, self.hello_c, self.hello_s, self.crank)
        self.session = _session(self.ident, self.hello_c, self.hello_s, self.crank, self.crank, self.eph, self.hello_c)


__all__ = ["AuthError", "Identity", "KINDS", "KIND_NAMES", "PREFIX", "PROOF_BYTES", "ServerHandshake", "Session",
           "client_handshake", "load_key"]
