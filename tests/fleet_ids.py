"""Per-pod fleet identities for tests (spectrain_api.fleet_identity, drafter.identity): in memory for
a Fleet built in the test's process, or as the files the operator's Secret mounts for a sidecar."""

from __future__ import annotations

import os
from pathlib import Path

from spectrain_api import fleet_identity
from spectrain_api.names import ENV_FLEET_IDENTITY_FILE, ENV_FLEET_PEERS_FILE
from spectrain_workloads.drafter.identity import PodIdentity, mint_local


def pod_identities(n_pods: int, job_uid: str, generation: int = 0, local_world: int = 1) -> list[PodIdentity]:
    """One PodIdentity per pod of a fresh generation (each holds every pod's public key)."""
    private, peers = mint_local(job_uid, generation, local_world, n_pods)
    return [PodIdentity(p, peers) for p in private]


def write_identities(root: Path, n_pods: int, job_uid: str, generation: int = 0,
                     local_world: int = 1) -> list[dict[str, str]]:
    """Each pod's identity files under root/identity/<pod>/ as its Secret holds them (the private key
    mode 0600) and the env naming them, by pod index."""
    pairs = fleet_identity.mint(n_pods)
    peers = fleet_identity.peers_document(job_uid, generation, local_world, [pub for _, pub in pairs])
    envs = []
    for i, (private, _) in enumerate(pairs):
        d = root / "identity" / str(i)
        d.mkdir(parents=True, exist_ok=True)
        key = d / fleet_identity.IDENTITY_ITEM
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(private.hex())
        (d / fleet_identity.PEERS_ITEM).write_text(peers)
        envs.append({ENV_FLEET_IDENTITY_FILE: str(key), ENV_FLEET_PEERS_FILE: str(d / fleet_identity.PEERS_ITEM)})
    return envs
