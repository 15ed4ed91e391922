"""Per-pod fleet identities in a cluster: one Secret per drafter pod and restart generation
(spectrain_api.fleet_identity is what is in it), minted, recorded and retired by the operator.

Every pod of restart generation g mounts Secret `<job>-fleet-id-<g>-<node>` (objects.fleet_identity_name):
its own Ed25519 private key and the generation's peers document (every pod's public key). A drafter
believes a rank's signature only under the key the peers document names, so the one rule that
matters is: no pod may ever run with a private key that differs from the public key its peers hold
for it. The operator may create Secrets but not read them back (RBAC: create and delete, never get
or list), and it may be killed between any two API calls. So:

1. A generation's key pairs are minted together, and all of its Secrets are created in one pass,
   before any pod of that generation exists (`FleetIdentities.ensure`, called by the reconciler
   between the job's other children and its pods).
2. Only when every one of those creates answered 201 is the generation recorded in the job's status
   (`status.fleetIdentityGenerations`, IDENTITY_FIELD). Pods of a generation are created only once it
   is recorded; a recorded generation's Secrets are never created, changed or deleted again while
   its pods may exist. They are one consistent set: the set those pods mount.
3. A generation not recorded that meets a 409 (AlreadyExists) on any of its Secrets, or any other
   error, was started by an interrupted pass (or the name is taken by someone else): no pod of it
   exists, since pods wait for the record. The pass deletes every Secret name of that generation
   and fails (the next pass mints afresh). Before deleting it reads the job once more: a pass that
   started from a stale copy of the job (a replayed watch event) finds the generation recorded
   after all and leaves it alone.
4. Retired generations: once the job has no pod of an older recorded generation left (not even a
   terminating one), each pass deletes that generation's Secrets and drops it from the record with
   its status write (`FleetIdentities.retire`); the record is what tells the operator, which cannot
   list Secrets, what is left to delete. The garbage collector deletes the rest with the job
   (ownerReferences).

A kill at any point therefore leaves either nothing recorded (Secrets deleted and re-minted before
any pod) or a recorded, complete set. What cannot be detected: someone who may delete or create
Secrets in the namespace replacing a recorded generation's Secret (its pod then fails to verify or
does not start); docs/operations.md (Security) says who must not hold that.
"""

from __future__ import annotations

import base64
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spectrain_api import fleet_identity
from spectrain_operator import builders, objects
from spectrain_operator import pods as podlib
from spectrain_operator.kube import Kube, KubeError, TransientError, UnverifiedConflict
from spectrain_operator.objects import Obj
from spectrain_operator.objects import child_metadata as _meta

log = logging.getLogger("spectrain.identities")

# The status field listing the restart generations whose identity Secrets are complete and not yet
# deleted (rule 2 and 4 above): the operator's own record, written only by it.
IDENTITY_FIELD = "fleetIdentityGenerations"
# More tries than a plain request for the record that lets a generation's pods be created (an
# idempotent merge patch): losing it costs a re-mint of the whole generation.
RECORD_ATTEMPTS = 12


class IdentitiesInterrupted(TransientError):
    """A generation's identity Secrets already existed before this pass created them: an earlier pass
    was interrupted. They are deleted; the next pass mints the generation afresh."""


# ---------------------------------------------------------------- pure: the Secrets and the record

def identity_secrets(job: Obj, generation: int, pairs: list[tuple[bytes, bytes]]) -> list[Obj]:
    """One Secret per pod of restart `generation` (`pairs[node]`: that pod's (private, public) key),
    each holding its pod's private key and the generation's peers document; owned by the job,
    labelled with the job and the generation."""
    uid = str(job["metadata"].get("uid") or "")
    if not uid:
        raise ValueError("metadata.uid: the job has no UID yet; the peers document names it (the operator "
                         "mints identities only for jobs the API server has stored)")
    nodes = int(job["spec"]["target"]["nodes"])
    if len(pairs) != nodes:
        raise ValueError(f"fleet identities: need one key pair per pod (spec.target.nodes = {nodes}), got {len(pairs)}")
    peers = fleet_identity.peers_document(uid, generation, int(job["spec"]["target"]["procsPerNode"]),
                                          [public for _, public in pairs])
    labels = {builders.LABEL_GENERATION: str(generation)}
    return [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
             "metadata": _meta(job, objects.fleet_identity_name(job, node, generation), labels),
             "data": {fleet_identity.IDENTITY_ITEM: _b64(private.hex()), fleet_identity.PEERS_ITEM: _b64(peers)}}
            for node, (private, _) in enumerate(pairs)]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def recorded_generations(status: Any) -> list[int]:
    """status.fleetIdentityGenerations, parsed defensively (a value of the wrong shape reads as none
    recorded: the worst that does is one re-mint before any pod of the generation exists)."""
    raw = status.get(IDENTITY_FIELD) if isinstance(status, dict) else None
    if not isinstance(raw, list):
        return []
    return sorted({g for g in raw if isinstance(g, int) and not isinstance(g, bool) and g >= 0})


def retirable(recorded: list[int], pods: list[Obj], generation: int) -> list[int]:
    """The recorded generations older than `generation` of which no pod is left (terminating included:
    such a pod still runs with its Secret mounted)."""
    in_use = {podlib.pod_generation(p) for p in pods}
    return [g for g in recorded if g < generation and g not in in_use]


# ---------------------------------------------------------------- executing it (through kube.Kube)

class FleetIdentities:
    """Mints and retires a job's identity Secrets (the rules of the module docstring)."""

    def __init__(self, kube: Kube, pool: ThreadPoolExecutor) -> None:
        self.kube = kube
        self.pool = pool

    def ensure(self, job: Obj, generation: int) -> None:
        """Every Secret of `generation` exists, from one mint, and is recorded in the job's status
        (and in `job`); raises otherwise, having deleted what this pass could not complete."""
        if generation in recorded_generations(job.get("status")):
            return
        objs = identity_secrets(job, generation, fleet_identity.mint(int(job["spec"]["target"]["nodes"])))
        futures = [self.pool.submit(self.kube.create, obj) for obj in objs]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            conflict = next((e for e in errors if isinstance(e, UnverifiedConflict)), None)
            if conflict is not None and self._recorded_meanwhile(job, generation):
                return
            if conflict is not None:
                self._delete(job, generation)
                raise IdentitiesInterrupted(
                    f"fleet identity Secret {conflict.obj['metadata']['name']} already existed (a pass creating "
                    f"restart generation {generation}'s identities was interrupted): deleted that generation's "
                    "identity Secrets, minting them afresh on the next pass", 409)
            try:   # what this pass created, so that the next one starts clean (else its 409s do it)
                self._delete(job, generation)
            except KubeError:
                log.warning("could not delete the fleet identity Secrets of an incomplete generation", exc_info=True)
            raise errors[0]
        self._record(job, sorted({*recorded_generations(job.get("status")), generation}))

    def retire(self, job: Obj, pods: list[Obj], generation: int) -> list[int] | None:
        """Delete the Secrets of the recorded generations older than `generation` that no pod of
        `pods` (every pod of the job, listed this pass) belongs to; the record without them, or None
        when nothing was retired. The caller writes it with the pass's status."""
        recorded = recorded_generations(job.get("status"))
        gone = retirable(recorded, pods, generation)
        for old in gone:
            self._delete(job, old)
        return [g for g in recorded if g not in gone] if gone else None

    def _recorded_meanwhile(self, job: Obj, generation: int) -> bool:
        """Whether the stored job records `generation` although `job` did not (a stale copy)."""
        meta = job["metadata"]
        stored = self.kube.get_job(meta["namespace"], meta["name"])
        status = (stored or {}).get("status")
        if generation not in recorded_generations(status):
            return False
        job.setdefault("status", {})[IDENTITY_FIELD] = recorded_generations(status)
        return True

    def _delete(self, job: Obj, generation: int) -> None:
        """Delete every identity Secret name of `generation` (one already gone is fine)."""
        ns = job["metadata"]["namespace"]
        names = [objects.fleet_identity_name(job, node, generation) for node in range(int(job["spec"]["target"]["nodes"]))]
        futures = [self.pool.submit(self.kube.delete_secret, ns, name) for name in names]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            raise errors[0]
        log.info("%s/%s: deleted the fleet identity Secrets of restart generation %d", ns, job["metadata"]["name"],
                 generation)

    def _record(self, job: Obj, generations: list[int]) -> None:
        meta = job["metadata"]
        self.kube.patch_status(meta["namespace"], meta["name"], {IDENTITY_FIELD: generations}, attempts=RECORD_ATTEMPTS)
        if not isinstance(job.get("status"), dict):
            job["status"] = {}
        job["status"][IDENTITY_FIELD] = generations


__all__ = ["IDENTITY_FIELD", "FleetIdentities", "IdentitiesInterrupted", "identity_secrets",
           "recorded_generations", "retirable"]
