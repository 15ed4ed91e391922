"""Thin kopf handlers: every cause (create, resume after an operator restart, a spec update, the
periodic resync, any event of a pod carrying the job label) only triggers a reconcile pass of the
job (reconciler.Reconciler.trigger). The pass itself is idempotent, so replayed or duplicated
triggers are harmless.

kopf's own bookkeeping lives in annotations (prefix spectrain.io), never in the status, and
handlers return nothing (kopf would store results in the status).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from spectrain_operator import builders
from spectrain_operator import spec as specmod
from spectrain_operator.kube import Kube, RejectedError, TransientError
from spectrain_operator.reconciler import Reconciler

RESOURCE = (specmod.GROUP, specmod.VERSION, specmod.PLURAL)
RESYNC_SECONDS = float(os.environ.get("SPECTRAIN_RESYNC_SECONDS", "30"))
RETRY_DELAY_S = 5.0

log = logging.getLogger("spectrain.handlers")
_state: dict[str, Reconciler] = {}


def install(reconciler: Reconciler) -> None:
    """Use this reconciler (tests, benchmarks); otherwise startup builds one from the environment."""
    _state["reconciler"] = reconciler


def reconciler() -> Reconciler:
    return _state["reconciler"]


def _trigger(namespace: str | None, name: str | None) -> None:
    if not namespace or not name:
        return
    try:
        reconciler().trigger(namespace, name)
    except TransientError as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
    except RejectedError as exc:
        # The operator itself is not allowed to do something (RBAC) or sent something invalid:
        # retrying the same handler will not help; the resync timer tries again later.
        raise kopf.PermanentError(str(exc)) from exc


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=specmod.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=specmod.GROUP, key="last-handled-configuration")
    settings.posting.enabled = False  # the reconciler posts its own, meaningful Events
    settings.execution.max_workers = int(os.environ.get("SPECTRAIN_WORKERS", "16"))
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if "reconciler" not in _state:
        install(Reconciler(Kube.from_environment(os.environ.get("SPECTRAIN_KUBECONFIG") or None)))


@kopf.on.cleanup()
def shutdown(**_: Any) -> None:
    if "reconciler" in _state:
        _state["reconciler"].close()


@kopf.on.create(*RESOURCE)
def created(namespace: str | None, name: str | None, **_: Any) -> None:
    _trigger(namespace, name)


@kopf.on.resume(*RESOURCE)
def resumed(namespace: str | None, name: str | None, **_: Any) -> None:
    _trigger(namespace, name)


@kopf.on.update(*RESOURCE, field="spec")
def updated(namespace: str | None, name: str | None, **_: Any) -> None:
    _trigger(namespace, name)


@kopf.on.delete(*RESOURCE, optional=True)
def deleted(namespace: str | None, name: str | None, **_: Any) -> None:
    if namespace and name and "reconciler" in _state:
        reconciler().forget(namespace, name)


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(namespace: str | None, name: str | None, **_: Any) -> None:
    try:
        _trigger(namespace, name)
    except (kopf.TemporaryError, kopf.PermanentError) as exc:
        log.warning("resync of %s/%s: %s", namespace, name, exc)


@kopf.on.event("v1", "pods", labels={builders.LABEL_JOB: kopf.PRESENT})
def pod_event(namespace: str | None, labels: Mapping[str, str], type: str | None = None, **_: Any) -> None:
    if type == "ADDED":
        # A new pod: the pass that created it already accounted for it (and a pod that appears
        # while the operator is down is seen by the resume pass of its job). Its first status
        # change (scheduled, running) or its deletion is what matters, and triggers a pass.
        return
    try:
        _trigger(namespace, labels.get(builders.LABEL_JOB))
    except (kopf.TemporaryError, kopf.PermanentError) as exc:
        log.warning("pod event of %s/%s: %s", namespace, labels.get(builders.LABEL_JOB), exc)
