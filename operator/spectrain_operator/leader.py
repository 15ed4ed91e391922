"""Leader election on a coordination.k8s.io/v1 Lease, the way client-go's leaderelection package
(Kueue, KubeRay, every controller-runtime manager) does it, so exactly one replica acts.

Every replica runs `LeaderElector` in a thread. Each round reads the Lease and
- creates it, holding it, when there is none;
- renews it (renewTime) when this replica holds it;
- takes it over (holderIdentity, acquireTime, leaseTransitions + 1) when its holder let it go
  (holderIdentity empty: a graceful release) or has not renewed it for leaseDurationSeconds;
- else waits. Writes are PUTs carrying the resourceVersion read, so of two replicas racing for an
  expired Lease the apiserver lets exactly one win (the other gets 409 and stays a follower).

Expiry is judged by the follower's own monotonic clock from the moment it saw the record change,
not by comparing renewTime with its wall clock, so skewed node clocks cannot make two leaders.
The leader considers itself leading only until `renew_deadline` (< lease duration) after the start
of its last successful renewal; a follower may take over only `lease duration` after it last saw
the record change; the difference is the margin for a pass that was running when leadership ended.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from spectrain_operator import metrics
from spectrain_operator.kube import Kube, KubeError, path_for

log = logging.getLogger("spectrain.leader")

LEASE_API = "coordination.k8s.io/v1"
DEFAULT_LEASE_NAME = "spectrain-operator"
DEFAULT_LEASE_DURATION_S = 15
# client-go's defaults are 15 s lease, 10 s renew deadline, 2 s retry period: the same ratios.
RENEW_DEADLINE_FRACTION = 2.0 / 3.0
RETRY_PERIOD_FRACTION = 2.0 / 15.0

Obj = dict[str, Any]


def micro_time(when: datetime) -> str:
    """A metav1.MicroTime: RFC 3339 with microseconds, UTC."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, lease_duration_s: int, *,
                 on_started: Callable[[], None] = lambda: None, on_stopped: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        if lease_duration_s < 1:
            raise ValueError(f"the lease duration must be at least 1 s, not {lease_duration_s}")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = lease_duration_s * RENEW_DEADLINE_FRACTION
        self.retry_period_s = lease_duration_s * RETRY_PERIOD_FRACTION
        self.on_started, self.on_stopped = on_started, on_stopped
        self._clock, self._wall = clock, wall
        self._leading_until = float("-inf")
        self._leading = False
        self._observed: tuple[str, str] | None = None   # (holder, renewTime) last seen
        self._observed_at = float("-inf")
        self._observed_duration = float(lease_duration_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.transitions_seen = 0

    # ------------------------------------------------------------ state

    def is_leader(self) -> bool:
        return self._leading and self._clock() < self._leading_until

    def start(self) -> LeaderElector:
        self._thread = threading.Thread(target=self._run, name="spectrain-leader", daemon=True)
        self._thread.start()
        return self

    def stop(self, release: bool = True) -> None:
        """Stop electing; with `release`, hand a held Lease back at once (holderIdentity emptied) so a
        follower takes over without waiting out the lease duration."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.retry_period_s + 30.0)
        if release and self.is_leader():
            self._release()
        self._set_leading(False)

    # ------------------------------------------------------------ loop

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                held = self.try_acquire_or_renew()
            except KubeError as exc:
                log.warning("leader lease %s/%s: %s", self.namespace, self.name, exc)
                held = False
            if held:
                self._leading_until = started + self.renew_deadline_s
                self._set_leading(True)
            elif self._leading and self._clock() >= self._leading_until:
                log.error("lost the leader lease %s/%s (not renewed within %.1f s): standing by",
                          self.namespace, self.name, self.renew_deadline_s)
                self._set_leading(False)
            self._stop.wait(self._next_wait())

    def _next_wait(self) -> float:
        if self._leading:
            return self.retry_period_s
        # A follower looks again when the holder's lease runs out, not a retry period later.
        expires_in = self._observed_at + self._observed_duration - self._clock()
        return max(0.05, min(self.retry_period_s, expires_in + 0.05))

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        metrics.LEADER.set(1 if leading else 0)
        if leading:
            log.info("became the leader: holding lease %s/%s as %s", self.namespace, self.name, self.identity)
            self.on_started()
        else:
            self._leading_until = float("-inf")
            self.on_stopped()

    # ------------------------------------------------------------ one round

    def try_acquire_or_renew(self) -> bool:
        now = self._wall()
        lease = self.kube.get(LEASE_API, "Lease", self.namespace, self.name)
        if lease is None:
            return self._create(now)
        spec: Obj = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        record = (holder, str(spec.get("renewTime") or ""))
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
            self._observed_duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and holder != self.identity and self._clock() < self._observed_at + self._observed_duration:
            return False   # someone else holds a live lease
        new = dict(spec)
        if holder != self.identity:
            new["holderIdentity"] = self.identity
            new["acquireTime"] = micro_time(now)
            new["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        new["leaseDurationSeconds"] = self.lease_duration_s
        new["renewTime"] = micro_time(now)
        body = {"apiVersion": LEASE_API, "kind": "Lease",
                "metadata": {**lease["metadata"], "resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": new}
        try:
            self.kube.replace(body)
        except KubeError as exc:
            if exc.status == 409:   # another replica wrote first: it leads, this one follows
                return False
            raise
        if holder != self.identity:
            self.transitions_seen += 1
        return True

    def _create(self, now: datetime) -> bool:
        body = {"apiVersion": LEASE_API, "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_duration_s,
                         "acquireTime": micro_time(now), "renewTime": micro_time(now), "leaseTransitions": 0}}
        try:
            self.kube.request("POST", path_for(LEASE_API, "Lease", self.namespace), body=body)
        except KubeError as exc:
            if exc.status == 409:   # another replica created it first
                return False
            raise
        return True

    def _release(self) -> None:
        try:
            lease = self.kube.get(LEASE_API, "Lease", self.namespace, self.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            now = micro_time(self._wall())
            spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": now,
                    "acquireTime": now}
            self.kube.replace({"apiVersion": LEASE_API, "kind": "Lease", "metadata": lease["metadata"],
                               "spec": spec})
            log.info("released the leader lease %s/%s", self.namespace, self.name)
        except KubeError as exc:
            log.warning("releasing the leader lease %s/%s: %s (a follower takes over when it expires)",
                        self.namespace, self.name, exc)
