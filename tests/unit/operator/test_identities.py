"""Per-pod fleet identities (spectrain_operator.identities): the Secrets' contents, and the rule that
no pod is ever created with a private key its peers do not hold for it, with the operator killed
before each API call of a job's life (creation, a gang restart, retiring the old generation)."""

from __future__ import annotations

import base64
import copy
import json
import threading
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from spectrain_api import fleet_identity
from spectrain_operator import builders, identities, objects
from spectrain_operator import spec as specmod
from spectrain_operator.kube import TransientError
from spectrain_operator.reconciler import Reconciler
from tests.unit.operator.test_reconciler import NS, FakeKube, job

Obj = dict[str, Any]
NODES = 2   # test_reconciler.job(): two pods


def public_of(private: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def contents(secret: Obj) -> tuple[bytes, fleet_identity.PeerKeys]:
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    return bytes.fromhex(data[fleet_identity.IDENTITY_ITEM]), fleet_identity.parse_peers(data[fleet_identity.PEERS_ITEM], "test")


# ------------------------------------------------------------------------------ the Secrets

def test_one_secret_per_pod_with_its_own_private_key_and_every_public_key() -> None:
    j = specmod.apply_defaults(job())
    j["spec"]["target"]["procsPerNode"] = 4
    pairs = fleet_identity.mint(NODES)
    secrets = identities.identity_secrets(j, 3, pairs)
    assert [s["metadata"]["name"] for s in secrets] == ["k-fleet-id-3-0", "k-fleet-id-3-1"] \
        == [objects.fleet_identity_name(j, n, 3) for n in range(NODES)]
    for node, secret in enumerate(secrets):
        assert secret["type"] == "Opaque" and set(secret["data"]) == {"identity.key", "peers.json"}
        assert secret["metadata"]["ownerReferences"] == [objects.owner_reference(j)]
        assert secret["metadata"]["labels"] == {**objects.job_labels(j), builders.LABEL_GENERATION: "3"}
        private, peers = contents(secret)
        assert private == pairs[node][0]
        assert (peers.job_uid, peers.generation, peers.local_world) == ("uid-1", 3, 4)
        assert peers.public_keys == tuple(pub for _, pub in pairs)
        assert public_of(private) == peers.public_keys[node]   # it speaks for its own ranks only
    assert len({s["data"]["identity.key"] for s in secrets}) == NODES


def test_a_job_without_uid_or_a_wrong_number_of_pairs_is_refused_by_name() -> None:
    j = specmod.apply_defaults(job())
    with pytest.raises(ValueError, match=r"one key pair per pod \(spec.target.nodes = 2\), got 1"):
        identities.identity_secrets(j, 0, fleet_identity.mint(1))
    del j["metadata"]["uid"]
    with pytest.raises(ValueError, match=r"^metadata.uid: "):
        identities.identity_secrets(j, 0, fleet_identity.mint(NODES))


def test_the_record_is_parsed_defensively_and_only_generations_without_pods_retire() -> None:
    assert identities.recorded_generations({"fleetIdentityGenerations": [2, 0, 2, -1, True, "3", 1]}) == [0, 1, 2]
    for bad in (None, "forged", {"fleetIdentityGenerations": "0"}, {}):
        assert identities.recorded_generations(bad) == []

    def pod(gen: int) -> Obj:
        return {"metadata": {"labels": {builders.LABEL_GENERATION: str(gen)}, "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert identities.retirable([0, 1, 2, 3], [pod(1)], 3) == [0, 2]   # 1: a terminating pod still mounts it
    assert identities.retirable([3], [], 3) == []                     # the current one: suspend keeps it


# ------------------------------------------------------------------------------ crash consistency

class Killed(BaseException):
    """The operator process dies here (not an Exception: nothing in it may catch this)."""


class CrashingKube(FakeKube):
    """FakeKube that dies before its `kill_at`-th API call (and answers nothing after it, like a
    dead process), and checks the invariant on every change: a pod is created only when every
    Secret of its generation exists and they agree (its own private key, everyone's public keys),
    and no Secret of a generation changes while a pod of that generation exists."""

    def __init__(self, body: Obj, kill_at: int | None = None):
        super().__init__(body)
        # The job's fleet key exists and is recorded: a kill between creating it and recording it is
        # that Secret's own documented limit (docs/operations.md, The fleet key), not this rule's.
        body["status"] = {"fleetKeyUID": "uid-fk"}
        self.objects[("Secret", objects.fleet_key_name(body))] = {"kind": "Secret"}
        self.calls = 0
        self.kill_at = kill_at
        self.dead = False
        self.violations: list[str] = []
        self._lock = threading.Lock()

    def _call(self) -> None:
        with self._lock:
            if self.dead or self.calls == self.kill_at:
                self.dead = True
                raise Killed()
            self.calls += 1

    def secrets_of(self, gen: int) -> dict[int, Obj]:
        return {n: o for n in range(NODES) if (o := self.objects.get(("Secret", objects.fleet_identity_name(self.job, n, gen))))}

    def pods_of(self, gen: int) -> list[Obj]:
        return [o for (kind, _), o in self.objects.items() if kind == "Pod"
                and o["metadata"]["labels"][builders.LABEL_GENERATION] == str(gen)]

    def _secret_changes(self, name: str) -> None:
        gen = int(name.split("-")[-2])
        if self.pods_of(gen):
            self.violations.append(f"Secret {name} changed while pods of generation {gen} exist")

    def _check_pod(self, pod: Obj) -> None:
        gen, node = int(pod["metadata"]["labels"][builders.LABEL_GENERATION]), int(pod["metadata"]["labels"][builders.LABEL_NODE])
        mounted = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if v["name"] == "fleet-identity"]
        if not mounted:
            return   # no drafter: nothing to check
        if mounted != [objects.fleet_identity_name(self.job, node, gen)]:
            self.violations.append(f"pod {node} of generation {gen} mounts {mounted}")
        secrets = self.secrets_of(gen)
        if len(secrets) != NODES:
            self.violations.append(f"pod {node} of generation {gen} created with Secrets of nodes {sorted(secrets)}")
            return
        keys = {n: contents(s) for n, s in secrets.items()}
        peers = {json.dumps([k.hex() for k in p.public_keys]) for _, p in keys.values()}
        if len(peers) != 1 or any(public_of(priv) != p.public_keys[n] for n, (priv, p) in keys.items()):
            self.violations.append(f"pod {node} of generation {gen} created with inconsistent identities")

    def get_job(self, namespace: str, name: str) -> Obj | None:
        self._call()
        return super().get_job(namespace, name)

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        self._call()
        return super().list_pods(namespace, selector)

    def create(self, obj: Obj) -> Obj | None:
        self._call()
        with self._lock:
            if obj["kind"] == "Pod":
                self._check_pod(obj)
            elif obj["kind"] == "Secret" and ("Secret", obj["metadata"]["name"]) not in self.objects \
                    and obj["metadata"]["name"] != objects.fleet_key_name(self.job):
                self._secret_changes(obj["metadata"]["name"])
            return super().create(obj)

    def delete_secret(self, namespace: str, name: str) -> None:
        self._call()
        with self._lock:
            if ("Secret", name) in self.objects:
                self._secret_changes(name)
            super().delete_secret(namespace, name)

    def delete_pod(self, namespace: str, name: str) -> None:
        self._call()
        super().delete_pod(namespace, name)

    def patch_status(self, namespace: str, name: str, status: Obj, old: Obj | None = None,
                     attempts: int | None = None) -> None:
        self._call()
        super().patch_status(namespace, name, status, old)


def run_until(kube: CrashingKube, done: Any, passes: int = 12) -> None:
    """Passes as the operator runs them (a transient failure: the next pass retries; a kill: a new
    operator process takes over, the dead one's kube answering again) until `done()`."""
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        for _ in range(passes):
            if done():
                return
            try:
                r.reconcile_once(NS, "k")
            except Killed:
                r.close()
                kube.dead, kube.kill_at = False, None
                r = Reconciler(kube)  # type: ignore[arg-type]
            except TransientError:
                pass
        raise AssertionError(f"not done after {passes} passes: {sorted(kube.objects)}; status {kube.job.get('status')}")
    finally:
        r.close()


def fail(kube: CrashingKube, pod: str, code: int) -> None:
    """Play the kubelet: the pod's target exited with `code`."""
    kube.pod(pod)["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "target", "restartCount": 0, "state": {"terminated": {"exitCode": code, "reason": "Error"}}}]}


def life(kube: CrashingKube) -> None:
    """A job's pods of generation 0; one's target fails (a gang restart, no backoff); the pods of
    generation 1, and generation 0's Secrets deleted once its pods are gone."""
    run_until(kube, lambda: len(kube.pods_of(0)) == NODES and kube.job.get("status", {}).get("phase"))
    fail(kube, "k-1", 1)
    run_until(kube, lambda: len(kube.pods_of(1)) == NODES and not kube.secrets_of(0)
              and kube.job["status"].get(identities.IDENTITY_FIELD) == [1])


def test_no_pod_ever_gets_a_key_its_peers_do_not_hold_wherever_the_operator_is_killed() -> None:
    clean = CrashingKube(job())
    life(clean)
    assert clean.violations == [] and clean.calls > 10
    gen1 = clean.secrets_of(1)
    assert len(gen1) == NODES and not clean.secrets_of(0)
    for kill_at in range(clean.calls):
        kube = CrashingKube(job(), kill_at=kill_at)
        life(kube)
        assert kube.kill_at is None, f"the operator was never killed at call {kill_at}"
        assert kube.violations == [], f"killed before API call {kill_at}: {kube.violations}"
        assert len(kube.secrets_of(1)) == NODES and not kube.secrets_of(0)


def test_a_new_generation_gets_new_keys() -> None:
    kube = CrashingKube(job())
    run_until(kube, lambda: len(kube.pods_of(0)) == NODES)
    first = {contents(s)[1].public_keys for s in kube.secrets_of(0).values()}
    fail(kube, "k-0", 1)
    run_until(kube, lambda: len(kube.pods_of(1)) == NODES and not kube.secrets_of(0))
    second = {contents(s)[1].public_keys for s in kube.secrets_of(1).values()}
    assert len(first) == len(second) == 1 and not set(next(iter(first))) & set(next(iter(second)))
    assert kube.violations == []


def test_a_secret_of_the_name_already_there_is_deleted_and_the_generation_minted_afresh() -> None:
    """A 409 on a generation not recorded: an interrupted pass's (or someone's) Secret; no pod of the
    generation exists, so the pass deletes the generation's Secrets and the next one mints anew."""
    kube = CrashingKube(job())
    planted = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "k-fleet-id-0-1", "namespace": NS},
               "data": {"identity.key": base64.b64encode(b"00" * 32).decode()}}
    kube.objects[("Secret", "k-fleet-id-0-1")] = planted
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        with pytest.raises(identities.IdentitiesInterrupted, match="k-fleet-id-0-1 already existed"):
            r.reconcile_once(NS, "k")
        assert not kube.secrets_of(0) and not kube.pods_of(0)
        assert identities.IDENTITY_FIELD not in (kube.job.get("status") or {})
        r.reconcile_once(NS, "k")
        assert len(kube.pods_of(0)) == NODES and kube.job["status"][identities.IDENTITY_FIELD] == [0]
        assert kube.secrets_of(0)[1] is not planted and kube.violations == []
    finally:
        r.close()


def test_a_pass_from_a_stale_copy_of_the_job_leaves_a_recorded_generation_alone() -> None:
    """A replayed watch event's body lacks the record: its creates meet 409s, and the pass reads the
    job back before deleting anything."""
    kube = CrashingKube(job())
    run_until(kube, lambda: len(kube.pods_of(0)) == NODES)
    before = copy.deepcopy(kube.secrets_of(0))
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        r.reconcile_once(NS, "k", job=job())   # the ADDED body: no status at all
    finally:
        r.close()
    assert kube.secrets_of(0) == before and kube.violations == []


def test_jobs_without_a_drafter_get_no_identities_and_restart_without_drafter_retires_them() -> None:
    off = CrashingKube(job(drafter={"enabled": False}))
    run_until(off, lambda: len(off.pods_of(0)) == NODES)
    assert not [k for k in off.creates if k[0] == "Secret"]
    assert identities.IDENTITY_FIELD not in off.job["status"] and off.violations == []

    rules = [{"action": "RestartWithoutDrafter", "onExitCodes": {"values": [86]}}]
    kube = CrashingKube(job(runPolicy={"backoffSeconds": 0, "failurePolicy": {"rules": rules}}))
    run_until(kube, lambda: len(kube.pods_of(0)) == NODES)
    assert len(kube.secrets_of(0)) == NODES
    fail(kube, "k-0", 86)
    run_until(kube, lambda: len(kube.pods_of(1)) == NODES and not kube.secrets_of(0))
    assert kube.job["status"]["drafterDisabled"] is True
    assert not kube.secrets_of(1) and kube.job["status"][identities.IDENTITY_FIELD] == []
    assert all("initContainers" not in p["spec"] for p in kube.pods_of(1))
    assert kube.violations == []


def test_no_secrets_where_the_drafters_never_exchange() -> None:
    """activation.policy Off keeps the sidecar (it never uses the GPU) but it opens no fleet
    (fleet_identity.fleet_in_use): no identity is minted, none mounted, the pods start all the same."""
    kube = CrashingKube(job(drafter={"activation": {"policy": "Off"}}))
    run_until(kube, lambda: len(kube.pods_of(0)) == NODES)
    assert all(p["spec"]["initContainers"] for p in kube.pods_of(0))
    assert kube.secrets_of(0) == {} and kube.violations == []
