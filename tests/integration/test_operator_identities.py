"""Per-pod fleet identities against a real kube-apiserver (spectrain_operator.identities): one Secret
per pod and restart generation with that pod's private key and every pod's public key, new keys
for a gang restart and the old generation's Secrets deleted once its pods are gone, none left after
the job is deleted, none for a job without a drafter. The test plays the kubelet."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from spectrain_api import fleet_identity
from spectrain_api.names import GROUP, PLURAL, VERSION
from spectrain_operator import builders
from tests.integration.operator_harness import LABEL_JOB, Env, env_fixture  # noqa: F401  (the env fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

PROCS = 2
HOLD = "spectrain.io/test-hold"   # a finalizer that keeps a deleted pod terminating
GC_TIMEOUT = 75.0   # the controller-manager discovers the CRD at its 30 s resync, then collects in a second


def identity_secrets(env: Env, name: str) -> dict[str, Any]:
    """The job's fleet identity Secrets by name (the fleet key left out)."""
    items = env.core.list_namespaced_secret(env.ns, label_selector=f"{LABEL_JOB}={name}").items
    return {s.metadata.name: s for s in items if s.metadata.name != f"{name}-fleet-key"}


def read(secret: Any) -> tuple[bytes, fleet_identity.PeerKeys]:
    data = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    peers = fleet_identity.parse_peers(data[fleet_identity.PEERS_ITEM], secret.metadata.name)
    return bytes.fromhex(data[fleet_identity.IDENTITY_ITEM]), peers


def public_of(private: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def check_generation(env: Env, name: str, generation: int, uid: str, pods: list[dict[str, Any]]) -> tuple[bytes, ...]:
    """Every pod of `generation` mounts its own Secret, which holds its private key and the public keys
    of all; returns the generation's public keys."""
    secrets = identity_secrets(env, name)
    wanted = [f"{name}-fleet-id-{generation}-{node}" for node in range(len(pods))]
    assert sorted(n for n in secrets if n.startswith(f"{name}-fleet-id-{generation}-")) == wanted
    keys = None
    for node, pod in enumerate(pods):
        secret = secrets[wanted[node]]
        assert secret.type == "Opaque"
        (owner,) = secret.metadata.owner_references
        assert owner.uid == uid and owner.kind == "SpecTrainJob" and owner.controller is True
        assert secret.metadata.labels[LABEL_JOB] == name
        assert secret.metadata.labels[builders.LABEL_GENERATION] == str(generation)
        private, peers = read(secret)
        assert (peers.job_uid, peers.generation, peers.local_world) == (uid, generation, PROCS)
        assert keys is None or peers.public_keys == keys   # one peers document for the generation
        keys = peers.public_keys
        assert public_of(private) == keys[node]
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["fleet-identity"]["secret"]["secretName"] == wanted[node]
    assert keys is not None and len(set(keys)) == len(pods)
    return keys


def test_each_pod_gets_its_own_identity_rotated_per_generation_and_gone_with_the_job(env: Env) -> None:
    env.kube.start_controller_manager()
    name = "id1"
    env.create(env.manifest(name, {"target": {"procsPerNode": PROCS, "parallelism": {"data": 4}},
                                   "runPolicy": {"backoffSeconds": 0}}))
    pods = env.wait_pods(name, 2, generation=0)
    job = env.job(name)
    assert job is not None
    uid = job["metadata"]["uid"]
    first = check_generation(env, name, 0, uid, pods)
    assert env.status(name)["fleetIdentityGenerations"] == [0]

    # a gang restart: new pods of generation 1 with new key pairs. Pod 0 is held terminating (a
    # finalizer, as a kubelet stopping it would): its node waits, node 1's new pod does not, and
    # generation 0's Secrets stay while pod 0 still runs with its own mounted.
    env.run_pods(name, pods)
    env.core.patch_namespaced_pod(f"{name}-0", env.ns, {"metadata": {"finalizers": [HOLD]}})
    env.exit_pod(f"{name}-1", 1)
    env.wait_pods(name, 1, generation=1)
    assert env.status(name)["fleetIdentityGenerations"] == [0, 1]
    old = [n for n in identity_secrets(env, name) if n.startswith(f"{name}-fleet-id-0-")]
    assert old == [f"{name}-fleet-id-0-0", f"{name}-fleet-id-0-1"]
    env.core.patch_namespaced_pod(f"{name}-0", env.ns, {"metadata": {"finalizers": None}})
    pods = env.wait_pods(name, 2, generation=1)
    wait_for(lambda: env.status(name).get("fleetIdentityGenerations") == [1], 30, interval=0.1,
             what="generation 0 retired from the record")
    assert not [n for n in identity_secrets(env, name) if n.startswith(f"{name}-fleet-id-0-")]
    second = check_generation(env, name, 1, uid, pods)
    assert not set(first) & set(second)

    # `kubectl delete stj` (background propagation): the garbage collector takes every Secret
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)
    wait_for(lambda: not env.core.list_namespaced_secret(env.ns, label_selector=f"{LABEL_JOB}={name}").items,
             GC_TIMEOUT, interval=0.5, what="the job's Secrets garbage collected")
    env.operator.check_alive()


def test_a_job_without_a_drafter_gets_no_identity_secret(env: Env) -> None:
    name = "id0"
    env.create(env.manifest(name, {"drafter": {"enabled": False}}))
    pods = env.wait_pods(name, 2, generation=0)
    env.wait_phase(name, "Pending")
    assert env.core.list_namespaced_secret(env.ns, label_selector=f"{LABEL_JOB}={name}").items == []
    assert "fleetIdentityGenerations" not in env.status(name)
    assert all("fleet-identity" not in {v["name"] for v in p["spec"]["volumes"]} for p in pods)
