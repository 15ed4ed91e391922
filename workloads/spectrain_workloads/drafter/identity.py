"""A drafter's own pod identity: what lets a rank speak only as itself (drafter.auth uses it).

The job's fleet key (drafter.auth) is held by every drafter of the job, so it proves "a drafter of
this job", never which one. Each pod also holds an Ed25519 key pair of its own for its restart
generation (spectrain_api.fleet_identity: the private half only in its own Secret, every pod's
public half in peers.json). With it
- each side of a handshake signs the transcript (both hellos, with their ranks, the job UID, the
  generation and both ephemeral X25519 keys) and its role; the other side verifies the signature with
  the public key of the pod of the rank claimed (`PodIdentity.verify`), so a drafter holding the job
  key and its own pod's key cannot claim another pod's rank;
- the session key mixes in an X25519 shared secret of two ephemeral keys (`Ephemeral`), so a drafter
  holding the job key that records a handshake between two other ranks cannot compute their key;
- the exporting rank signs every combined version (`version_digest`: job UID, generation, version,
  sha256 of the payload), and members verify it with the exporting rank's pod key.

Costs (this machine, `python -m bench.identity`): docs/design.md, "Trust".
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from spectrain_api import fleet_identity
from spectrain_api.errors import ConfigError
from spectrain_api.fleet_identity import PeerKeys
from spectrain_api.names import ENV_FLEET_IDENTITY_FILE, ENV_FLEET_PEERS_FILE

EPHEMERAL_BYTES = 32             # an X25519 public key, in every hello
SIG_BYTES = 64                   # an Ed25519 signature
HANDSHAKE_CONTEXT = b"spectrain-fleet-handshake/2"
VERSION_CONTEXT = b"spectrain-fleet-combined/1"
_VERSION = struct.Struct(">QQ")  # generation, version


@dataclass
class PodIdentity:
    """This pod's private key and every pod's public key (one restart generation of one job)."""

    private: bytes = field(repr=False)       # 32 bytes (fleet_identity.load_identity)
    peers: PeerKeys
    _signer: Ed25519PrivateKey = field(init=False, repr=False)
    _verifiers: dict[int, Ed25519PublicKey] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.private) != fleet_identity.KEY_BYTES:
            raise ConfigError(f"the pod's fleet identity must be {fleet_identity.KEY_BYTES} bytes, got {len(self.private)}")
        self._signer = Ed25519PrivateKey.from_private_bytes(self.private)

    @property
    def public(self) -> bytes:
        return self._signer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def check_rank(self, rank: int) -> None:
        """This pod's key is the one peers.json lists for `rank`'s pod (ConfigError naming the files if not):
        a drafter given another pod's Secret, or a stale one, would be refused by every peer."""
        if self.peers.public_key(rank) != self.public:
            raise ConfigError(f"the pod's fleet identity ({ENV_FLEET_IDENTITY_FILE}) is not the key "
                              f"{ENV_FLEET_PEERS_FILE} lists for rank {rank}'s pod (pod {self.peers.pod_of(rank)} of "
                              f"{len(self.peers.public_keys)}): mount this pod's own fleet-identity Secret of this "
                              "restart generation")

    def sign(self, message: bytes) -> bytes:
        return self._signer.sign(message)

    def verify(self, rank: int, signature: bytes, message: bytes) -> bool:
        """Whether `signature` over `message` is by the pod of `rank` (False for a rank of no pod)."""
        pod = self.peers.pod_of(rank) if rank >= 0 else -1
        key = self._verifiers.get(pod)
        if key is None:
            raw = self.peers.public_key(rank)
            if raw is None:
                return False
            key = self._verifiers[pod] = Ed25519PublicKey.from_public_bytes(raw)
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


class Ephemeral:
    """One handshake's X25519 key pair: its public half goes in the hello, its shared secret into the
    session key; never reused, never stored."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def shared(self, peer_public: bytes) -> bytes | None:
        """The 32-byte shared secret; None for a key of low order (no secret: the handshake fails)."""
        try:
            return self._key.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:
            return None


def handshake_message(role: bytes, hello_c: bytes, hello_s: bytes) -> bytes:
    """What each side of a handshake signs: its role (b"C" or b"S") and the whole transcript."""
    return HANDSHAKE_CONTEXT + role + hello_c + hello_s


def version_digest(job_uid: str, generation: int, version: int, payload: bytes | bytearray | memoryview) -> bytes:
    """What the exporting rank signs for a combined version: its job, generation, number and payload."""
    uid = job_uid.encode()
    return (VERSION_CONTEXT + struct.pack(">H", len(uid)) + uid + _VERSION.pack(generation, version)
            + hashlib.sha256(payload).digest())


def mint_local(job_uid: str, generation: int, local_world: int, n_pods: int) -> tuple[list[bytes], PeerKeys]:
    """Fresh identities for `n_pods` pods held in memory (tests, benchmarks): each pod's private key
    and the public keys, as fleet_identity.mint and peers.json give them."""
    pairs = fleet_identity.mint(n_pods)
    peers = fleet_identity.parse_peers(
        fleet_identity.peers_document(job_uid, generation, local_world, [pub for _, pub in pairs]), "minted")
    return [priv for priv, _ in pairs], peers


__all__ = ["EPHEMERAL_BYTES", "Ephemeral", "PodIdentity", "SIG_BYTES", "handshake_message", "mint_local",
           "version_digest"]
