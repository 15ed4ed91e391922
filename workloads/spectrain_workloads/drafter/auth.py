"""The fleet's authenticated channel: the job's key, the handshake, and a MAC on every frame.

Why HMAC-SHA256 per frame and not mutual TLS: the channel needs integrity and identity, not
secrecy (samples and drafter weights are the job's own data on the pod network), and the CPU cost
is the same (this machine, OpenSSL 3.0 with SHA-NI and AES-NI, CPU time): HMAC-SHA256 0.99 ms per
MiB per end, 6% of a core per end at the default 64 MB/s cap; TLS 1.3 AES-GCM with mutual
certificates 1.67 ms per MiB over both ends (2.17 against 0.50 for plain TCP on loopback). TLS
would need a CA and a certificate per pod minted by the operator (Python 3.11's ssl has no
pre-shared keys), and frame caps and sequence checks above it all the same; HMAC needs one Secret.

Handshake (the connecting side C sends frames, the listening side S receives them):
    C -> S  hello_c = MAGIC | version u16 | rank u32 | generation u64 | len u16 | job UID | nonce_c
    S -> C  hello_s (the same fields, S's rank and nonce_s) | HMAC(key, "S" | hello_c | hello_s)
    C -> S  HMAC(key, "C" | hello_c | hello_s)
Each side checks the magic, version, job UID and generation against its own, and the other's tag.
A recorded handshake cannot be replayed: the other side's fresh nonce is in what must be tagged.
Both then use the session key HMAC(key, "K" | hello_c | hello_s), so a frame recorded on one
connection fails on every other. A frame is
    prefix (seq u64, kind u8, header length u32, payload length u64) | header | tag_h | payload | tag_p
    tag_h = HMAC(session, "H" | job UID | generation | sender rank | prefix | header)
    tag_p = HMAC(session, "P" | tag_h | payload)
so the header (and the length it declares) is verified before a byte of the payload is buffered,
and `seq` must be exactly the next one (a replayed or reordered frame fails).

What the key does not do: every drafter of the job holds it, so a compromised drafter of the same
job can still claim any rank; the checks of what is received (drafter.checks) bound what it can do.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_FLEET_KEY_FILE
from spectrain_api.secretfile import require_private

MAGIC = b"SPTRFLT\x00"
PROTOCOL_VERSION = 1
NO_MAC_FLAG = 0x8000             # in the version field: a MAC-less drafter (bench only) never pairs with a keyed one
KEY_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32
MAX_UID_BYTES = 256
_HELLO = struct.Struct(">8sHIQH")                  # magic, version, rank, generation, UID length
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
    """Who this drafter is to its peers. key None turns the MACs off: bench-fleet's measurement of
    their cost only (the sidecar always reads a key)."""

    key: bytes | None
    job_uid: str
    generation: int

    def __post_init__(self) -> None:
        if self.key is not None and len(self.key) != KEY_BYTES:
            raise ConfigError(f"the fleet key must be {KEY_BYTES} bytes, got {len(self.key)}")
        if len(self.job_uid.encode()) > MAX_UID_BYTES:
            raise ConfigError(f"job UID longer than {MAX_UID_BYTES} bytes")


def load_key(path: str | os.PathLike[str] | None) -> bytes:
    """The job's key from its file: 64 hex characters (whitespace around them ignored), in a file
    only its owner and this pod can read (spectrain_api.secretfile)."""
    where = f"{ENV_FLEET_KEY_FILE} (the job's fleet-key Secret, mounted into the drafter container)"
    if not path:
        raise ConfigError(f"{ENV_FLEET_KEY_FILE} is not set: the drafter exchange needs the job's key; "
                          f"the operator mounts the fleet-key Secret and sets {where}")
    require_private(path, f"the fleet key ({ENV_FLEET_KEY_FILE})")
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the fleet key {path!r} named by {where}: {exc.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the fleet key {path!r} ({ENV_FLEET_KEY_FILE}) must hold {2 * KEY_BYTES} hex characters")
    return key


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


def _hello(ident: Identity, rank: int, nonce: bytes) -> bytes:
    uid = ident.job_uid.encode()
    return _HELLO.pack(MAGIC, _version(ident), rank, ident.generation, len(uid)) + uid + nonce


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
    rest = _recv_exact(sock, n_uid + NONCE_BYTES)
    _hello_rest(rest, n_uid, generation, ident)
    return fixed + rest, rank


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


def _session(ident: Identity, hello_c: bytes, hello_s: bytes, rank: int, peer_rank: int) -> Session:
    key = None if ident.key is None else _mac(ident.key, b"K", hello_c, hello_s)
    return Session(ident, key, rank, peer_rank, id=hashlib.sha256(hello_c + hello_s).hexdigest()[:16])


def client_handshake(sock: socket.socket, ident: Identity, rank: int, peer_rank: int) -> Session:
    """Authenticate to the drafter of `peer_rank` listening at the other end of `sock`."""
    hello_c = _hello(ident, rank, os.urandom(NONCE_BYTES))
    sock.sendall(hello_c)
    hello_s, srank = _read_hello(sock, ident)
    tag = _recv_exact(sock, TAG_BYTES) if ident.key is not None else b""
    if not hmac.compare_digest(tag, _mac(ident.key, b"S", hello_c, hello_s)):
        raise AuthError("handshake", "the listener does not hold the job's key")
    if srank != peer_rank:
        raise AuthError("rank", f"rank {srank} listens where rank {peer_rank} should")
    sock.sendall(_mac(ident.key, b"C", hello_c, hello_s))
    return _session(ident, hello_c, hello_s, rank, peer_rank)


class ServerHandshake:
    """The listening side's handshake, fed the bytes as they arrive (drafter.admission reads them from
    non-blocking sockets, no thread per connection). `want` is how many bytes the next message still
    needs (read no more: what follows the handshake is the first frame); `feed` returns what to send
    back (the listener's hello and tag, once the connecting side's hello is whole) and sets `session`
    once the connecting side's tag verifies; AuthError when anything fails. A connecting drafter's
    rank (what every frame of it is bound to) is checked to be another rank of this job."""

    def __init__(self, ident: Identity, rank: int, world: int) -> None:
        self.ident, self.rank, self.world = ident, rank, world
        self.buf = bytearray()
        self.received = 0                  # bytes so far: how far this connection got (admission's order)
        self.hello_c = self.hello_s = b""
        self.n_uid, self.generation, self.crank = -1, -1, -1
        self.session: Session | None = None

    @property
    def want(self) -> int:
        if not self.hello_s:
            return (_HELLO.size if self.n_uid < 0 else _HELLO.size + self.n_uid + NONCE_BYTES) - len(self.buf)
        return (TAG_BYTES if self.ident.key is not None else 0) - len(self.buf)

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
            self.hello_s = _hello(self.ident, self.rank, os.urandom(NONCE_BYTES))
            reply = self.hello_s + _mac(self.ident.key, b"S", self.hello_c, self.hello_s)
            if self.ident.key is None:
                self._done()
            return reply
        self._done()
        return b""

    def _done(self) -> None:
        if not hmac.compare_digest(bytes(self.buf), _mac(self.ident.key, b"C", self.hello_c, self.hello_s)):
            raise AuthError("handshake", "the connecting side does not hold the job's key")
        if not 0 <= self.crank < self.world or self.crank == self.rank:
            raise AuthError("rank", f"rank {self.crank} is not another rank of a world of {self.world}")
        self.session = _session(self.ident, self.hello_c, self.hello_s, self.crank, self.crank)


__all__ = ["AuthError", "Identity", "KINDS", "KIND_NAMES", "PREFIX", "ServerHandshake", "Session",
           "client_handshake", "load_key"]
