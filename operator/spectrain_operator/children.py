"""Creating a pass's children: create-or-get of every object concurrently, and the fleet key's record.

The objects of one pass (ConfigMap, Service, ServiceAccount, Role, RoleBinding, NetworkPolicy, the
fleet-key Secret; then the generation's fleet identity Secrets, identities.py; then the pods) are
independent within their group, so they are created on a small pool; a 409 is the object already
there (kube.Kube.create compares its owner). The fleet-key Secret is the exception the operator
cannot check by reading (it may not read Secrets): the job's status records the UID of the one it
created, and a 409 on it is accepted only with that record.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spectrain_operator import objects
from spectrain_operator.identities import FleetIdentities
from spectrain_operator.kube import Kube, OwnerConflict, RejectedError, UnverifiedConflict

Obj = dict[str, Any]

CREATE_WORKERS = 16
# The status field recording the UID of the fleet-key Secret this operator created for the job: the
# operator may not read Secrets, so a 409 on that Secret is ours only when this UID was recorded.
FLEET_KEY_UID_FIELD = "fleetKeyUID"
FLEET_KEY_RECORD_ATTEMPTS = 12


class Children:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._pool = ThreadPoolExecutor(CREATE_WORKERS, thread_name_prefix="spectrain-create")
        self.identities = FleetIdentities(kube, self._pool)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def create_all(self, objs: list[Obj], job: Obj) -> tuple[list[Obj], BaseException | None]:
        """Create-or-get every object concurrently; (those newly created, the first error once all
        are done, a refusal before a transient error)."""
        futures = [self._pool.submit(self._create_one, obj, job) for obj in objs]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        rejected = [e for e in errors if isinstance(e, RejectedError)]
        created = [c for f in futures if f.exception() is None and (c := f.result()) is not None]
        return created, (rejected or errors or [None])[0]

    def _create_one(self, obj: Obj, job: Obj) -> Obj | None:
        try:
            return self.kube.create(obj)
        except UnverifiedConflict:
            # The fleet-key Secret exists and the operator cannot read it: it is the job's own only if
            # the job's status recorded the UID of the one this operator created (record_fleet_key).
            # Anyone who may create Secrets in the namespace could otherwise plant a key of their choosing.
            status = job.get("status")
            if isinstance(status, dict) and fleet_key_recorded(status):
                return None
            raise OwnerConflict(obj, ["unknown: the operator may not read Secrets; this job never recorded "
                                      "creating it (status." + FLEET_KEY_UID_FIELD + ")"]) from None

    def record_fleet_key(self, job: Obj, created: list[Obj]) -> None:
        """Write the UID of a fleet-key Secret just created into the job's status before any pod that
        mounts it exists (a pass failing in between leaves an orphan the garbage collector removes
        with the job, and the next pass makes a new one)."""
        uid = next((str(c["metadata"]["uid"]) for c in created
                    if c.get("kind") == "Secret" and c["metadata"].get("name") == objects.fleet_key_name(job)
                    and c["metadata"].get("uid")), None)
        if uid is None:
            return
        meta = job["metadata"]
        # More tries than a plain request: losing this record would make the job's own Secret look
        # foreign to the next pass (the write is an idempotent merge patch).
        self.kube.patch_status(meta["namespace"], meta["name"], {FLEET_KEY_UID_FIELD: uid},
                               attempts=FLEET_KEY_RECORD_ATTEMPTS)
        if not isinstance(job.get("status"), dict):
            job["status"] = {}
        job["status"][FLEET_KEY_UID_FIELD] = uid


def fleet_key_recorded(status: Obj) -> bool:
    """Whether the job's status shows the operator created its fleet-key Secret: the recorded UID,
    or (jobs from operator versions before the record) pods created once, which only ever happens
    after the Secret was created."""
    return bool(status.get(FLEET_KEY_UID_FIELD) or status.get("podsCreated") is True
                or status.get("startTime") or int(status.get("restarts") or 0) > 0)


__all__ = ["FLEET_KEY_UID_FIELD", "Children", "fleet_key_recorded"]
