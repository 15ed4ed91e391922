"""Thin kopf handlers: every event of a job that may need acting on (a new job, one seen when the
operator starts or resumes, a spec change, a deletion) and every event of a pod carrying the job
label only triggers a reconcile pass of the job (reconciler.Reconciler.handle; a pod's, shortly
after it, with the other pod changes of the job meanwhile: Reconciler.pod_changed). The pass itself
is idempotent, so replayed or duplicated triggers are harmless.

Only event handlers are used: they keep no state on the objects. kopf's create/update/resume
handlers would write a diff base to every job, and a kopf timer would put a finalizer on it; the
reconciler's own requeue timers do the periodic resync instead (reconciler.py). So kopf writes
nothing to the jobs: no annotations, no finalizer, nothing in the status.

kopf runs standalone in every replica (its watches stay warm); whether a replica acts is decided
by the leader Lease (leader.py) through `Reconciler.active`: a follower's handlers return at once,
and the replica that takes the Lease over starts with one pass per job (`resync_all`), which
covers whatever happened while it followed. The pod watch is filtered by the server (a label
selector on the job label), so the operator never receives the cluster's other pods.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from spectrain_api.names import GROUP, PLURAL, VERSION
from spectrain_operator import builders
from spectrain_operator.kube import Kube, KubeError
from spectrain_operator.leader import LeaderElector
from spectrain_operator.reconciler import Reconciler

RESOURCE = (GROUP, VERSION, PLURAL)
# Pause between kopf's watch reconnections (its default, 0.1 s, lets a proxy or apiserver that
# drops every watch see ten reconnects a second per resource): a dropped watch costs at most this
# much delay, the relist that follows catches up on what it missed.
WATCH_RECONNECT_S = 1.0

log = logging.getLogger("spectrain.handlers")
_state: dict[str, Reconciler] = {}
_electors: list[LeaderElector] = []


def install(reconciler: Reconciler, elector: LeaderElector | None = None) -> None:
    """Use this reconciler (tests, benchmarks); otherwise startup builds one from the environment.
    With `elector`, the reconciler acts only while it holds the Lease."""
    _state["reconciler"] = reconciler
    _electors.clear()
    if elector is not None:
        reconciler.gate = elector.is_leader
        _electors.append(elector)


def reconciler() -> Reconciler:
    return _state["reconciler"]


def resync_all(namespaces: list[str]) -> None:
    """One pass for every job (in `namespaces`, or all when empty): what a replica does when it
    becomes the leader. Passes run on the requeue timers' pool, not in the caller's thread."""
    rec = reconciler()
    try:
        scopes: list[str | None] = list(namespaces) or [None]
        jobs = [j for ns in scopes for j in rec.kube.list_jobs(ns)]
    except KubeError as exc:
        log.error("listing jobs after taking the lead: %s; the handlers' events and resyncs follow", exc)
        return
    for job in jobs:
        meta = job.get("metadata") or {}
        if meta.get("namespace") and meta.get("name"):
            rec.requeue(meta["namespace"], meta["name"], 0.0)
    log.info("leading: resyncing %d jobs", len(jobs))


class _NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: event handlers never ask kopf what changed. (kopf's default storage would
    deep-copy the body of every event, pods included, to build one.)"""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False  # the reconciler posts its own, meaningful Events
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.execution.max_workers = int(os.environ.get("SPECTRAIN_WORKERS", "16"))
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.reconnect_backoff = WATCH_RECONNECT_S
    # Server-side: the apiserver sends only pods carrying the job label (kopf's `labels=` filter on
    # the handler below is client-side and would still receive, and hold, every pod of the cluster).
    settings.watching.label_selectors["v1", "pods"] = builders.LABEL_JOB
    if "reconciler" not in _state:
        install(Reconciler(Kube.from_environment(os.environ.get("SPECTRAIN_KUBECONFIG") or None)))


@kopf.on.cleanup()
def shutdown(**_: Any) -> None:
    for elector in _electors:
        elector.stop(release=True)   # a follower takes over at once instead of after the lease duration
    if "reconciler" in _state:
        _state["reconciler"].close()


def needs_pass(event_type: str | None, body: Mapping[str, Any]) -> bool:
    """Whether a job event can change what the operator should do.

    The initial listing (type None: the operator started) and
    ADDED: yes. MODIFIED: only when the spec changed since the last pass acted on it (generation
    != status.observedGeneration; also a status someone else overwrote), or the job is being
    deleted. The operator's own status writes are MODIFIED events too and need nothing.
    """
    if event_type in (None, "ADDED"):
        return True
    meta = body.get("metadata") or {}
    status = body.get("status")
    if meta.get("deletionTimestamp"):
        return True
    if not isinstance(status, Mapping):
        return True
    return bool(status.get("observedGeneration") != meta.get("generation"))


@kopf.on.event(*RESOURCE)
def job_event(type: str | None, body: Mapping[str, Any], namespace: str | None, name: str | None,
              **_: Any) -> None:
    if not namespace or not name:
        return
    if type == "DELETED":
        if "reconciler" in _state:
            reconciler().handle_deleted(namespace, name, dict(body))
        return
    if not reconciler().active:
        return   # the leader acts on it
    if needs_pass(type, body):
        # A new job's own event is as fresh as a read (see Reconciler.trigger): one GET less per job.
        reconciler().handle(namespace, name, copy.deepcopy(dict(body)) if type == "ADDED" else None)
    elif reconciler().reports_changed(namespace, name, body.get("status")):
        reconciler().pod_changed(namespace, name)   # a pod's report (the status path): batched like pod changes


@kopf.on.event("v1", "pods", labels={builders.LABEL_JOB: kopf.PRESENT})
def pod_event(namespace: str | None, labels: Mapping[str, str], type: str | None = None, **_: Any) -> None:
    if type == "ADDED":
        # A new pod: the pass that created it already accounted for it (and a pod that appears
        # while the operator is down is seen by the resume pass of its job). Its first status
        # change (scheduled, running) or its deletion is what matters, and triggers a pass.
        return
    job = labels.get(builders.LABEL_JOB)
    if namespace and job and reconciler().active:
        reconciler().pod_changed(namespace, job)   # batched: see reconciler.POD_EVENT_DELAY_S
