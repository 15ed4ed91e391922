"""One reconcile pass for one SpecTrainJob, and the per-job serialisation around it.

A pass reads the job and its pods fresh (never a possibly stale watch body; the one exception is
a new job's ADDED event, see `trigger`), asks status.decide
what to do, executes the plan through kube.Kube (children before pods, create-or-get), posts the
Events, and writes the status once, only when it changed. Passes for one job never overlap:
triggers that arrive while a pass runs are coalesced into one more pass.

Requeues (backoff, deadlines, TTL, retries after an API error or a pass that raised (full-jitter
exponential backoff per job, at least the server's Retry-After: ratelimit.py), and the periodic resync every
`resync_s` that replaces kopf timers) live in one timer thread here rather than in kopf: kopf
puts a finalizer on every object that has a timer (one more write per job, and jobs that cannot
be deleted while no operator runs), and its create/update handlers keep a diff base in an
annotation (another write). With level-based passes neither is needed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from spectrain_api.names import FAILED, STATUS_REPORTS
from spectrain_operator import access, builders, gpu_sharing, metrics, objects, scheduling
from spectrain_operator import pods as podlib
from spectrain_operator import spec as specmod
from spectrain_operator import status as statusmod
from spectrain_operator.children import FLEET_KEY_UID_FIELD, Children
from spectrain_operator.identities import IDENTITY_FIELD
from spectrain_operator.kube import DRA_API_VERSION, Kube, RejectedError, TransientError
from spectrain_operator.ratelimit import REQUEUE_BASE_S, REQUEUE_CAP_S, Backoff
from spectrain_operator.timers import Key, Timers

Obj = dict[str, Any]
log = logging.getLogger("spectrain.reconciler")

_VALIDATION_CACHE_MAX = 4096
_ERROR_MESSAGE_CHARS = 1000   # condition ReconcileError's message: one line, bounded
# Status fields that are the reconciler's records rather than status.decide's (the fleet key's UID,
# the generations whose fleet identities exist): every status write keeps them.
_RECORDS = (FLEET_KEY_UID_FIELD, IDENTITY_FIELD)


def env_seconds(name: str, default: float) -> float:
    """A duration knob from the operator's environment: a positive number of seconds."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number of seconds "
                         f"(default {default}); fix or unset it in the operator's Deployment")
    return value


RESYNC_SECONDS = env_seconds("SPECTRAIN_RESYNC_SECONDS", 30.0)
# A pod's change (bound, running, exited, deleted) is acted on this long after it, so that the
# changes of a job's pods within it make one pass (one pod list) rather than one each: a large job's
# pods are bound and started in a burst, and a pass per change would list all its pods each time
# (bench-operator_scale, docs/benchmarks.md).
POD_EVENT_DELAY_S = env_seconds("SPECTRAIN_POD_EVENT_DELAY_SECONDS", 0.5)
# How long an answer "the server does not serve resource.k8s.io/v1" is trusted (one served is
# trusted for good): a cluster upgraded under a running operator is noticed within this.
_API_ABSENT_TTL_S = 60.0


@dataclass
class _JobSlot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    dirty: bool = False


class Reconciler:
    def __init__(self, kube: Kube, *, clock: Callable[[], datetime] | None = None,
                 resync_s: float = RESYNC_SECONDS, retry: Backoff | None = None):
        self.kube = kube
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self.resync_s = resync_s
        self.retry = retry or Backoff(REQUEUE_BASE_S, REQUEUE_CAP_S)
        self._failures: dict[Key, int] = {}
        self._reports_seen: dict[Key, str] = {}   # the last status.reports seen per job (reports_changed)
        self._slots: dict[Key, _JobSlot] = {}
        self._slots_lock = threading.Lock()
        self._validation: dict[tuple[str, int], list[str]] = {}
        self._served: dict[str, tuple[bool, float]] = {}
        self.passes = 0
        self.closed = False
        # Whether this replica may act: the leader Lease (leader.py) when elections are on. Consulted
        # before every pass, so a replica that loses the Lease stops at its next pass.
        self.gate: Callable[[], bool] = lambda: True
        # Creates of one pass go out concurrently (one round trip for the children, one for the
        # pods, instead of one per object): a burst of new jobs is bound by API latency.
        self.children = Children(kube)
        self._timers = Timers(self._fire)

    @property
    def active(self) -> bool:
        return self.gate()

    @active.setter
    def active(self, value: bool) -> None:
        self.gate = lambda: value

    # ------------------------------------------------------------ triggering

    def _slot(self, key: tuple[str, str]) -> _JobSlot:
        with self._slots_lock:
            return self._slots.setdefault(key, _JobSlot())

    def trigger(self, namespace: str, name: str, fresh: Obj | None = None) -> None:
        """Reconcile the job now, or make the pass running for it run once more.

        `fresh`: the job as its ADDED watch event carried it. Nothing can have written to a job
        the operator has only just heard of, nor created its pods, so the first pass of this call
        uses it instead of reading the job and listing its pods; passes that follow read both.
        """
        slot = self._slot((namespace, name))
        slot.dirty = True
        while True:
            if not slot.lock.acquire(blocking=False):
                return
            try:
                while slot.dirty and not self.closed:
                    slot.dirty = False
                    if fresh is None:
                        self.reconcile_once(namespace, name)
                    else:
                        self.reconcile_once(namespace, name, job=fresh)
                        fresh = None
            finally:
                slot.lock.release()
            if not slot.dirty or self.closed:
                return

    def handle(self, namespace: str, name: str, fresh: Obj | None = None) -> None:
        """`trigger`, for kopf handlers and timers: an error is logged and the pass requeued (after
        a transient API error or a pass that raised: soon, the pause growing per failure; after a
        request the API server refused: at the next resync); nothing raises. A pass that raised is
        also reported on the job (condition and Event ReconcileError, `_report_error`)."""
        if not self.active:
            return   # another replica leads; this one resyncs every job when it takes over
        key = (namespace, name)
        try:
            self.trigger(namespace, name, fresh)
            self._failures.pop(key, None)
        except TransientError as exc:
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            delay = self.retry.delay(failures - 1, exc.retry_after)
            log.warning("reconcile of %s/%s: %s; retrying in %.1f s", namespace, name, exc, delay)
            self.requeue(namespace, name, delay)
        except RejectedError as exc:
            # The operator itself is not allowed to do something (RBAC) or sent something invalid:
            # retrying at once will not help; the resync tries again.
            log.error("reconcile of %s/%s: %s", namespace, name, exc)
            self.requeue(namespace, name, self.resync_s)
        except Exception as exc:
            # A bug, or a broken install (the shipped image missing a module): every pass may fail
            # the same way, so retry soon with a growing pause and say so on the job itself.
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            delay = self.retry.delay(failures - 1)
            log.exception("reconcile of %s/%s failed; retrying in %.1f s", namespace, name, delay)
            self._report_error(namespace, name, exc)
            self.requeue(namespace, name, delay)

    def _report_error(self, namespace: str, name: str, exc: Exception) -> None:
        """Condition ReconcileError on the job (reason: the exception's type; message: its first
        line) and, when it is new or says something new, a Warning Event of that reason. The next
        pass that succeeds clears it (status.decide). Best effort: what failed may be the API."""
        reason = type(exc).__name__
        line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), reason)
        text = (f"the operator failed to reconcile this job ({reason}: {line}); it retries with a "
                "growing pause, see its log")[:_ERROR_MESSAGE_CHARS]
        try:
            job = self.kube.get_job(namespace, name)
            if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
                return
            old: Obj = job["status"] if isinstance(job.get("status"), dict) else {}
            conds = statusmod.Conditions(old.get("conditions"), self.clock(),
                                         int((job.get("metadata") or {}).get("generation") or 0))
            known = conds.items.get(statusmod.RECONCILE_ERROR, {})
            if conds.is_true(statusmod.RECONCILE_ERROR) and known.get("reason") == reason \
                    and known.get("message") == text:
                return
            conds.set(statusmod.RECONCILE_ERROR, True, reason, text)
            self.kube.patch_status(namespace, name, {"conditions": conds.as_list()})
            log.info("%s/%s %s: %s", namespace, name, statusmod.RECONCILE_ERROR, text[:200])
            self.kube.post_event(job, statusmod.Event("Warning", statusmod.RECONCILE_ERROR, text))
        except Exception:
            log.warning("could not report the failed reconcile on %s/%s", namespace, name, exc_info=True)

    def requeue(self, namespace: str, name: str, seconds: float) -> None:
        """Reconcile the job again in `seconds` (or earlier, if an earlier requeue is pending)."""
        if not self.closed:
            self._timers.schedule((namespace, name), min(max(seconds, 0.2), 3600.0))

    def pod_changed(self, namespace: str, name: str) -> None:
        """A pod of the job changed: one pass POD_EVENT_DELAY_S from the first such change (the
        changes that come meanwhile join it; an earlier pending requeue stays)."""
        if not self.closed:
            self._timers.schedule((namespace, name), POD_EVENT_DELAY_S)

    def reports_changed(self, namespace: str, name: str, status: Any) -> bool:
        """Whether the pods' reports in this job status (status.reports, written by the status path)
        differ from the last ones seen for the job: a job event whose only news is a report needs one
        batched pass (`pod_changed`), as the pods' own changes do."""
        reports = status.get(STATUS_REPORTS) if isinstance(status, Mapping) else None
        seen = json.dumps(reports, sort_keys=True, default=dict) if reports else ""   # dict: kopf views
        if self._reports_seen.get((namespace, name), "") == seen:
            return False
        self._reports_seen[(namespace, name)] = seen
        return True

    def _fire(self, key: Key) -> None:
        if self.closed:
            return
        if not self.active:   # paused by peering: the active replica reconciles; look again later
            self.requeue(*key, self.resync_s)
            return
        self.handle(*key)

    def forget(self, namespace: str, name: str) -> None:
        with self._slots_lock:
            self._slots.pop((namespace, name), None)
        self._failures.pop((namespace, name), None)
        self._reports_seen.pop((namespace, name), None)
        self._timers.cancel((namespace, name))
        metrics.forget(namespace, name)

    def close(self) -> None:
        self.closed = True
        self.children.close()
        self._timers.close()

    # ------------------------------------------------------------ one pass

    def _spec_errors(self, job: Obj) -> list[str]:
        meta = job.get("metadata") or {}
        key = (str(meta.get("uid", "")), int(meta.get("generation") or 0))
        if key[0] and key in self._validation:
            return self._validation[key]
        errors = specmod.validate(job)
        if len(self._validation) > _VALIDATION_CACHE_MAX:
            self._validation.clear()
        if key[0]:
            self._validation[key] = errors
        return errors

    def serves(self, api_version: str) -> bool:
        """Whether the API server serves `api_version` (cached; see _API_ABSENT_TTL_S)."""
        known = self._served.get(api_version)
        now = time.monotonic()
        if known is not None and (known[0] or now - known[1] < _API_ABSENT_TTL_S):
            return known[0]
        served = self.kube.serves(api_version)
        self._served[api_version] = (served, now)
        return served

    def _server_errors(self, job: Obj) -> list[str]:
        """What this cluster cannot run of a valid spec: mode DRA without resource.k8s.io/v1."""
        try:
            mode = gpu_sharing.sharing_mode(job)
        except ValueError:
            return []  # the spec checks report it
        if mode == "DRA" and not self.serves(DRA_API_VERSION):
            return [f"spec.gpuSharing.mode: DRA needs the {DRA_API_VERSION} API (Kubernetes >= 1.34), which this "
                    "cluster does not serve; use mode PodLocalMPS or SingleContainer, or upgrade the cluster"]
        return []

    def reconcile_once(self, namespace: str, name: str, job: Obj | None = None) -> statusmod.Plan | None:
        started = time.perf_counter()
        try:
            plan = self._pass(namespace, name, job)
        except Exception as exc:
            metrics.RECONCILES.labels(result="error").inc()
            metrics.ERRORS.labels(kind=type(exc).__name__).inc()
            raise
        finally:
            metrics.LATENCY.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(result="ok").inc()
        return plan

    def _pass(self, namespace: str, name: str, fresh: Obj | None = None) -> statusmod.Plan | None:
        self.passes += 1
        raw = fresh if fresh is not None else self.kube.get_job(namespace, name)
        if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        errors = self._spec_errors(raw)
        job = specmod.apply_defaults(raw)
        if not errors:
            errors = self._server_errors(job)
        if errors and not isinstance(job.get("spec"), dict):
            job["spec"] = {}
        if errors:
            return self._finish_invalid(job, errors)
        now = self.clock()
        # A job the operator has only just heard of (its ADDED event) has no pods yet: only a pass
        # creates them. (The apiserver serves this list from etcd, decoding every pod of the
        # namespace: for a burst of new jobs, the most expensive request of their first pass.)
        pods = [] if fresh is not None else self.kube.list_pods(namespace, objects.selector(job))
        plan = statusmod.decide(job, pods, now)
        if plan.create_nodes:
            plan = self._create(job, pods, now, plan)
        if fresh is None:   # (a new job's pods were not listed, nor has it old generations)
            remaining = self.children.identities.retire(job, pods, plan.generation)
            if remaining is not None:
                plan.status[IDENTITY_FIELD] = remaining
        self._execute(job, plan, None if fresh is not None else pods)
        if plan.status.get("phase") == FAILED:  # no more pods: let Kueue finish the pod group
            self._release_kueue(namespace, pods)
        return plan

    def handle_deleted(self, namespace: str, name: str, job: Obj) -> None:
        """`deleted`, for the kopf handler: an error is logged, nothing raises."""
        try:
            self.deleted(namespace, name, job)
        except Exception:
            log.exception("cleanup of deleted job %s/%s failed", namespace, name)

    def deleted(self, namespace: str, name: str, job: Obj) -> None:
        """The job is gone (its DELETED event): forget it; if Kueue queued it, let Kueue finish
        its pod group (the garbage collector deletes the pods; Kueue would keep them)."""
        self.forget(namespace, name)
        if scheduling.kueue_queue(job) and self.active:
            self._release_kueue(namespace, self.kube.list_pods(namespace, objects.selector(job)))

    def _release_kueue(self, namespace: str, pods: list[Obj]) -> None:
        for pod_name in scheduling.kueue_release(pods):
            self.kube.annotate_pod(namespace, pod_name, {scheduling.KUEUE_RETRIABLE_ANNOTATION: "false"})

    def _create(self, job: Obj, pods: list[Obj], now: datetime, plan: statusmod.Plan) -> statusmod.Plan:
        ns = job["metadata"]["namespace"]
        claims = specmod.claims(job["spec"])
        missing = set(self.kube.missing_claims(ns, [c for _, c in claims])) if claims else set()
        if missing:
            errors = [f"{path}: PersistentVolumeClaim {claim!r} not found in namespace {ns}; create it, "
                      "then recreate the job" for path, claim in claims if claim in missing]
            return statusmod.decide(job, pods, now, errors)
        try:
            pod_objs, extras = builders.pods(job, generation=plan.generation, drafter_disabled=plan.drafter_disabled,
                                             drafter_off=plan.drafter_off, nodes=plan.create_nodes)
            # Everything but the pods first (the ServiceAccount must exist before a pod naming it
            # is admitted), then the pods; within each group, order does not matter. The fleet key's
            # bytes are fresh on every such pass, but create-or-get keeps the first Secret: one key
            # per job, never rotated while the job lives.
            key = secrets.token_bytes(access.FLEET_KEY_BYTES)
            created, error = self.children.create_all([*builders.children(job, fleet_key=key), *extras], job)
            # Recorded even when another child failed: the next pass will meet this Secret as a 409.
            self.children.record_fleet_key(job, created)
            if error is not None:
                raise error
            # The generation's fleet identities, all of them, before any of its pods (identities.py).
            if builders.fleet_runs(job, plan.drafter_disabled):
                self.children.identities.ensure(job, plan.generation)
            _, error = self.children.create_all(pod_objs, job)
            if error is not None:
                raise error
        except (ValueError, RejectedError) as exc:  # a builder refusing the spec, or the API server refusing a child
            return statusmod.decide(job, pods, now, [str(exc)])
        return plan

    def _finish_invalid(self, job: Obj, errors: list[str]) -> statusmod.Plan | None:
        """A spec that is not even structurally usable for decide(): report it and stop."""
        if not specmod.schema_errors(job):
            now = self.clock()
            pods = self.kube.list_pods(job["metadata"]["namespace"], objects.selector(job))
            plan = statusmod.decide(job, pods, now, errors)
            self._execute(job, plan, pods)
            return plan
        old: Obj = job["status"] if isinstance(job.get("status"), dict) else {}
        stamp = statusmod.fmt_time(self.clock())
        conds = statusmod.Conditions(old.get("conditions"), self.clock(), int(job["metadata"].get("generation") or 0))
        conds.set("SpecInvalid", True, "InvalidSpec", "; ".join(errors[:8]))
        conds.set("Failed", True, "SpecInvalid", "; ".join(errors[:8]))
        conds.clear(statusmod.RECONCILE_ERROR, "Reconciled", "the operator's last pass succeeded")
        new = {"phase": "Failed", "observedGeneration": int(job["metadata"].get("generation") or 0),
               "conditions": conds.as_list(), "completionTime": old.get("completionTime") or stamp}
        self._write_status(job, new, old, [statusmod.Event("Warning", "Failed", "; ".join(errors[:8]))]
                           if old.get("phase") != FAILED else [])
        self.requeue(job["metadata"]["namespace"], job["metadata"]["name"], self.resync_s)
        return None

    def _execute(self, job: Obj, plan: statusmod.Plan, pods: list[Obj] | None) -> None:
        meta = job["metadata"]
        ns, name = meta["namespace"], meta["name"]
        for pod_name in plan.delete_pods:
            self.kube.delete_pod(ns, pod_name)
        for pod_name in plan.force_delete_pods:
            self.kube.delete_pod(ns, pod_name, grace_seconds=0)
        old: Obj = job["status"] if isinstance(job.get("status"), dict) else {}
        self._write_status(job, plan.status, old, plan.events, pods)
        metrics.set_phase(ns, name, plan.status.get("phase", "Pending"))
        if plan.delete_job:
            self.kube.delete_job(ns, name)
            self.forget(ns, name)
        else:
            self.requeue(ns, name, self.resync_s if plan.requeue_after is None
                         else min(plan.requeue_after, self.resync_s))

    def _write_status(self, job: Obj, new: Obj, old: Obj, events: list[statusmod.Event],
                      pods: list[Obj] | None = None) -> None:
        """Write `new` over `old` (only when they differ). status.reports is the pods' (podstatus):
        never written here except to delete the reports of pods not among `pods` (the job's pods,
        listed after the job was read; None: not listed, nothing deleted)."""
        meta = job["metadata"]
        # status.decide builds the status from its own fields; the reconciler's records must survive
        # every write (a key missing from `new` would be deleted by the patch).
        current = job["status"] if isinstance(job.get("status"), dict) else {}
        new = {**{k: current[k] for k in _RECORDS if current.get(k) is not None and k not in new}, **new}
        stale = podlib.stale_reports(old, pods) if pods is not None else []
        old = {k: v for k, v in old.items() if k != STATUS_REPORTS}
        if _pruned(new) != _pruned(old) or stale:
            body = {**new, STATUS_REPORTS: dict.fromkeys(stale)} if stale else new
            self.kube.patch_status(meta["namespace"], meta["name"], body, old)
        for event in events:
            log.info("%s/%s %s: %s", meta["namespace"], meta["name"], event.reason, event.message[:200])
            self.kube.post_event(job, event)


def _pruned(value: Any) -> Any:
    """`value` without null members: a merge patch stores no nulls (it deletes those keys), so a
    status that only differs from the stored one by nulls needs no write."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value
