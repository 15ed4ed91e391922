"""Per-pod fleet identities: the files the operator (or `spectrain run`) writes and the drafters read.

The job's shared fleet key (drafter.auth) lets a drafter in; it cannot tell the job's ranks apart,
since every drafter holds it. So each pod also gets an Ed25519 key pair of its own, minted for one
restart generation: the private half only in that pod's Secret (`IDENTITY_ITEM`, 64 hex characters
of the 32-byte private key), the public halves of every pod of the generation in one document
(`PEERS_ITEM`, JSON) given to every pod. A pod speaks for its own ranks only: rank r belongs to pod
r // localWorldSize, whose public key verifies what r signs.

    peers.json = {"jobUID": str, "generation": int, "localWorldSize": int,
                  "publicKeys": [64 hex characters per pod, by pod index]}

A new restart generation gets new key pairs (the old pods' credentials verify nothing of the new
one). `mint` needs the `cryptography` package (both images have it).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_FLEET_IDENTITY_FILE, ENV_FLEET_PEERS_FILE, OFF
from spectrain_api.secretfile import read_hex_key

IDENTITY_ITEM = "identity.key"      # the pod's private key (its Secret's data key and file name)
PEERS_ITEM = "peers.json"           # every pod's public key (the same document for the whole generation)
KEY_BYTES = 32                      # Ed25519 private (seed) and public keys
MAX_PODS = 4096
_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PeerKeys:
    """Every pod's public key in one restart generation of one job."""

    job_uid: str
    generation: int
    local_world: int
    public_keys: tuple[bytes, ...]          # by pod index

    def pod_of(self, rank: int) -> int:
        return rank // self.local_world

    def public_key(self, rank: int) -> bytes | None:
        """The public key that verifies what `rank` signs; None for a rank of no pod."""
        pod = self.pod_of(rank) if rank >= 0 else -1
        return self.public_keys[pod] if 0 <= pod < len(self.public_keys) else None

    @property
    def world(self) -> int:
        return self.local_world * len(self.public_keys)


def fleet_in_use(policy: str, exchange_enabled: bool, world: int) -> bool:
    """Whether a job's drafters form a fleet (exchange with each other) and so need identities: the
    drafter's activation policy is not Off, spec.drafter.exchange.enabled, and more than one rank.
    The operator mints identity Secrets only then; the drafter opens the fleet only then."""
    return policy != OFF and exchange_enabled and world >= 2


def peers_document(job_uid: str, generation: int, local_world: int, public_keys: list[bytes]) -> str:
    """peers.json's text (the form `parse_peers` reads back)."""
    if any(len(k) != KEY_BYTES for k in public_keys):
        raise ValueError(f"every public key must be {KEY_BYTES} bytes")
    return json.dumps({"jobUID": job_uid, "generation": int(generation), "localWorldSize": int(local_world),
                       "publicKeys": [k.hex() for k in public_keys]}, sort_keys=True)


def parse_peers(text: str, where: str) -> PeerKeys:
    """A peers.json document; ConfigError naming `where` and what is wrong."""
    try:
        doc: Any = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: must be a JSON object with jobUID, generation, localWorldSize, publicKeys")
    uid, gen, lw, keys = doc.get("jobUID"), doc.get("generation"), doc.get("localWorldSize"), doc.get("publicKeys")
    if not isinstance(uid, str) or not uid:
        raise ConfigError(f"{where}: jobUID must be the job's UID (a non-empty string)")
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        raise ConfigError(f"{where}: generation must be the restart generation (an integer >= 0)")
    if not isinstance(lw, int) or isinstance(lw, bool) or lw < 1:
        raise ConfigError(f"{where}: localWorldSize must be an integer >= 1")
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_PODS:
        raise ConfigError(f"{where}: publicKeys must list 1 to {MAX_PODS} keys, one per pod")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not _HEX.fullmatch(k):
            raise ConfigError(f"{where}: publicKeys[{i}] must be {2 * KEY_BYTES} lowercase hex characters")
    return PeerKeys(uid, gen, lw, tuple(bytes.fromhex(k) for k in keys))


def load_peers(path: str | os.PathLike[str] | None, job_uid: str, generation: int) -> PeerKeys:
    """The generation's public keys from `path` (ENV_FLEET_PEERS_FILE), checked to be this job's and
    this generation's: a pod of another generation holds credentials nobody here accepts."""
    where = f"the fleet's public keys {str(path)!r} ({ENV_FLEET_PEERS_FILE})"
    if not path:
        raise ConfigError(f"{ENV_FLEET_PEERS_FILE} is not set: the drafter exchange needs every pod's public key; "
                          "the operator mounts them from the job's fleet-identity Secret")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror}") from None
    peers = parse_peers(text, where)
    if peers.job_uid != job_uid:
        raise ConfigError(f"{where} is job {peers.job_uid!r}'s, this drafter belongs to job {job_uid!r}")
    if peers.generation != generation:
        raise ConfigError(f"{where} is for restart generation {peers.generation}, this pod's is {generation}: "
                          "the operator mints new keys for each generation; this pod is stale")
    return peers


def load_identity(path: str | os.PathLike[str] | None) -> bytes:
    """This pod's private key (32 bytes) from `path` (ENV_FLEET_IDENTITY_FILE), in a file only its
    owner and this pod can read (spectrain_api.secretfile)."""
    return read_hex_key(path, KEY_BYTES, "the pod's fleet identity", ENV_FLEET_IDENTITY_FILE,
                        "the operator, mounting the pod's fleet-identity Secret into the drafter container,")


def mint(n_pods: int) -> list[tuple[bytes, bytes]]:
    """`n_pods` fresh Ed25519 key pairs: (private, public), 32 bytes each."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        NoEncryption,
        PrivateFormat,
        PublicFormat,
    )

    pairs = []
    for _ in range(n_pods):
        key = Ed25519PrivateKey.generate()
        pairs.append((key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
                      key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)))
    return pairs


__all__ = ["IDENTITY_ITEM", "KEY_BYTES", "PEERS_ITEM", "PeerKeys", "load_identity", "load_peers", "mint",
           "parse_peers", "peers_document"]
