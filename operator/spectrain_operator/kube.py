"""The only module that talks to the Kubernetes API (besides kopf's own watches).

Plain dicts in and out over the official client's transport (no model (de)serialisation, which
is slow and drops fields it does not know, e.g. native sidecars or DRA on an older client).
Every request first takes a token of the client's QPS/burst bucket, and a 429, a 5xx or a broken
connection is retried a few times with full-jitter exponential backoff that honours Retry-After
(ratelimit.py); what still fails reaches the reconciler, whose per-job requeue backs off further.
Creation is create-or-get: 409 AlreadyExists counts as success only when the existing object is
owned by the same job (ownerReferences UID); anything else is `OwnerConflict`, so replayed events
create nothing twice and nothing foreign is ever adopted. Errors: `TransientError` (retry later:
5xx, 429, timeouts, conflicts) or `RejectedError` (the API server refused the object: 400/403/422);
404 on delete is success.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from spectrain_api.names import API_VERSION, KIND
from spectrain_operator import metrics
from spectrain_operator.ratelimit import (
    DEFAULT_ATTEMPTS,
    DEFAULT_BURST,
    DEFAULT_QPS,
    Backoff,
    TokenBucket,
    parse_retry_after,
)
from spectrain_operator.status import Event, fmt_time

Obj = dict[str, Any]

# kind -> plural where lower(kind) + "s" is wrong
_PLURALS = {"Endpoints": "endpoints", "PodDisruptionBudget": "poddisruptionbudgets",
            "NetworkPolicy": "networkpolicies"}
_CORE = "v1"

# The oldest Kubernetes the operator runs against. 1.29: native sidecars (the drafter is an init
# container with restartPolicy Always) are on by default (beta; GA in 1.33), and the CRD's CEL
# rules (x-kubernetes-validations) are GA. Below it the drafter would be dropped silently (an
# older apiserver discards the unknown restartPolicy field) or block the target as a plain init
# container, so the operator refuses to start (EXIT_UNSUPPORTED_SERVER).
MIN_SERVER_VERSION = (1, 29)
# gpuSharing.mode DRA creates ResourceClaimTemplates of this API (GA, on by default, in 1.34).
DRA_API_VERSION = "resource.k8s.io/v1"
EXIT_UNSUPPORTED_SERVER = 3
# Answers worth retrying in place: throttled (429) or a server-side hiccup. 409 is not among them:
# a conflict needs a fresh read, which only the caller can do.
_RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
# Kinds the operator may create but not read (RBAC: create and delete, see the chart), so their owner
# cannot be checked on a 409: the caller decides (children.py: the fleet key; identities.py).
UNREADABLE_KINDS = frozenset({"Secret"})


class KubeError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class TransientError(KubeError):
    """Worth retrying: the server is busy, unreachable or the object changed under us.
    `retry_after`: the server's Retry-After in seconds, when it sent one."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message, status)
        self.retry_after = retry_after


class RejectedError(KubeError):
    """The API server refused the request (invalid object, forbidden); retrying will not help."""


class OwnerConflict(RejectedError):
    """An object of the name the operator creates exists but belongs to something else."""

    def __init__(self, obj: Obj, found_owners: list[str]):
        meta = obj["metadata"]
        kind, ns, name = obj.get("kind", "object"), meta.get("namespace", ""), meta.get("name", "")
        want = ", ".join(sorted({str(r.get("uid")) for r in meta.get("ownerReferences") or []}))
        has = ", ".join(found_owners) if found_owners else "none"
        super().__init__(
            f"{kind} {ns}/{name} already exists and is not owned by this job (its owner UIDs: {has}; this job's "
            f"UID: {want}); the operator never adopts an object it did not create. Delete or rename it "
            f"(kubectl -n {ns} delete {kind.lower()} {name}), then delete and recreate the job", 409)
        self.obj = obj


class UnverifiedConflict(TransientError):
    """A 409 on a kind the operator cannot read (UNREADABLE_KINDS): whose object it is is unknown."""

    def __init__(self, obj: Obj):
        meta = obj["metadata"]
        super().__init__(f"{obj.get('kind')} {meta.get('namespace')}/{meta.get('name')} already exists", 409)
        self.obj = obj


class UnsupportedServer(KubeError):
    """The API server is older than MIN_SERVER_VERSION."""


def server_version(info: Obj) -> tuple[int, int] | None:
    """(major, minor) of a /version answer: from gitVersion ("v1.29.3-eks-adc7111"), else from
    major/minor ("1", "29+" as some providers write it); None when neither parses."""
    m = re.match(r"v?(\d+)\.(\d+)", str(info.get("gitVersion") or ""))
    if m:
        return int(m.group(1)), int(m.group(2))
    major = re.match(r"\d+", str(info.get("major") or ""))
    minor = re.match(r"\d+", str(info.get("minor") or ""))
    if major and minor:
        return int(major.group()), int(minor.group())
    return None


def check_server_version(info: Obj) -> str:
    """The server's version string when it is supported; raise UnsupportedServer saying why not."""
    version = server_version(info)
    shown = str(info.get("gitVersion") or f"{info.get('major')}.{info.get('minor')}")
    need = ".".join(map(str, MIN_SERVER_VERSION))
    if version is None:
        raise UnsupportedServer(f"the Kubernetes API server reports no version the operator can read "
                                f"({json.dumps(info)[:200]}); it needs Kubernetes >= {need}")
    if version < MIN_SERVER_VERSION:
        raise UnsupportedServer(
            f"Kubernetes {shown} is older than {need}, the oldest this operator supports: it needs native "
            f"sidecars (initContainers with restartPolicy Always, on by default from 1.29) for the drafter "
            f"and CEL validation rules for the SpecTrainJob CRD; upgrade the cluster")
    return shown


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    plural = _PLURALS.get(kind, kind.lower() + "s")
    base = "/api/v1" if api_version == _CORE else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


class Kube:
    """A thin dict-in/dict-out client. Thread-safe (the kopf handlers run in a thread pool)."""

    def __init__(self, api_client: Any, *, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST,
                 attempts: int = DEFAULT_ATTEMPTS, backoff: Backoff | None = None,
                 sleep: Any = time.sleep):
        self.api = api_client
        self.calls: Counter[str] = Counter()
        self.creates_conflicted = 0
        self._lock = threading.Lock()
        self.instance = socket.gethostname()
        self.limiter = TokenBucket(qps, burst)
        self.attempts = max(1, attempts)
        self.backoff = backoff or Backoff()
        self._sleep = sleep

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, **limits: Any) -> Kube:
        """In-cluster credentials when running in a pod, else KUBECONFIG / ~/.kube/config."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            if kubeconfig:
                raise config.ConfigException("explicit kubeconfig")
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        cfg.connection_pool_maxsize = 32
        return cls(client.ApiClient(cfg), **limits)

    # ------------------------------------------------------------ transport

    def request(self, method: str, path: str, *, body: Any = None, query: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = 30.0,
                attempts: int | None = None) -> Obj | None:
        """One API call: throttled by the QPS bucket, retried in place on 429/5xx/transport errors
        (up to `attempts` tries, default the client's; full-jitter backoff, at least the server's
        Retry-After)."""
        tries = attempts or self.attempts
        attempt = 0
        while True:
            try:
                return self._request_once(method, path, body=body, query=query, content_type=content_type,
                                          timeout=timeout)
            except TransientError as exc:
                if exc.status is not None and exc.status not in _RETRIED_STATUSES:
                    raise
                attempt += 1
                if attempt >= tries:
                    raise
                metrics.API_RETRIES.labels(status=str(exc.status or "transport")).inc()
                self._sleep(self.backoff.delay(attempt - 1, exc.retry_after))

    def _request_once(self, method: str, path: str, *, body: Any, query: dict[str, Any] | None,
                      content_type: str, timeout: float) -> Obj | None:
        from urllib3.exceptions import HTTPError

        self.limiter.acquire()
        with self._lock:
            self.calls[method] += 1
        metrics.API_CALLS.labels(verb=method).inc()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            # The client only builds the URL and auth headers: its body serialiser turns "" into
            # null, so the body is encoded here and sent over the client's own TLS pool.
            _, url, headers_, _, _ = self.api.param_serialize(
                method=method, resource_path=path, query_params=list((query or {}).items()),
                header_params=headers, auth_settings=["BearerToken"])
            payload = None if body is None else json.dumps(body, allow_nan=False).encode()
            resp = self.api.rest_client.pool_manager.request(method, url, body=payload, headers=headers_,
                                                             timeout=timeout, retries=False)
            status, data = resp.status, resp.data
        except (HTTPError, OSError, ValueError) as exc:
            raise TransientError(f"{method} {path}: {exc}") from exc
        if status == 404 and method != "POST":
            return None
        if not 200 <= status < 300:
            text = f"{method} {path}: {status} {_reason(data)}"
            # POST 404: something the new object refers to is not visible yet, e.g. the Role of a
            # RoleBinding created a moment earlier (the apiserver's RBAC escalation check reads roles
            # from an informer cache). Not success: retry.
            if status in (409, 429) or status >= 500 or status == 404:
                raise TransientError(text, status, parse_retry_after(resp.headers.get("Retry-After")))
            raise RejectedError(text, status)
        return json.loads(data) if data else {}

    # ------------------------------------------------------------ server

    def server_info(self) -> Obj:
        """GET /version (readable by every authenticated user: system:public-info-viewer)."""
        return self.request("GET", "/version") or {}

    def serves(self, api_version: str) -> bool:
        """Whether the server serves `group/version` (its discovery document exists; readable by
        every authenticated user: system:discovery)."""
        return self.request("GET", f"/apis/{api_version}") is not None

    # ------------------------------------------------------------ objects

    def get_job(self, namespace: str, name: str) -> Obj | None:
        return self.request("GET", path_for(API_VERSION, KIND, namespace, name))

    def list_jobs(self, namespace: str | None = None) -> list[Obj]:
        out = self.request("GET", path_for(API_VERSION, KIND, namespace)) or {}
        return list(out.get("items") or [])

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        out = self.request("GET", path_for(_CORE, "Pod", namespace), query={"labelSelector": selector}) or {}
        return list(out.get("items") or [])

    def create(self, obj: Obj) -> Obj | None:
        """Create `obj` and return it as created; an existing object of that name owned by the same
        owner (ownerReferences UID) is success too (returns None then). Raises OwnerConflict for an
        object owned by something else, UnverifiedConflict for one of UNREADABLE_KINDS."""
        meta = obj["metadata"]
        try:
            return self.request("POST", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)
        except TransientError as exc:
            if exc.status != 409:
                raise
        with self._lock:
            self.creates_conflicted += 1
        metrics.CREATE_CONFLICTS.labels(kind=str(obj.get("kind", ""))).inc()
        self._check_owner(obj)
        return None

    def _check_owner(self, obj: Obj) -> None:
        """Raise unless the existing object named like `obj` shares an owner UID with it."""
        meta = obj["metadata"]
        want = {str(r.get("uid")) for r in meta.get("ownerReferences") or []}
        if not want:
            return
        if obj["kind"] in UNREADABLE_KINDS:
            raise UnverifiedConflict(obj)
        ns, name = meta.get("namespace"), meta["name"]
        if obj["kind"] == "Pod":
            # The operator lists pods (by label, every pass) but never GETs one: list by name.
            found = self.request("GET", path_for(_CORE, "Pod", ns), query={"fieldSelector": f"metadata.name={name}"})
            items = (found or {}).get("items") or []
            existing = items[0] if items else None
        else:
            existing = self.request("GET", path_for(obj["apiVersion"], obj["kind"], ns, name))
        if existing is None:   # deleted since the 409 (e.g. garbage collected): the next pass creates it
            raise TransientError(f"{obj['kind']} {ns}/{name}: existed at create, gone at read", 409)
        have = [str(r.get("uid")) for r in (existing.get("metadata") or {}).get("ownerReferences") or []]
        if not want.intersection(have):
            raise OwnerConflict(obj, have)

    def delete(self, api_version: str, kind: str, namespace: str, name: str, *,
               propagation: str = "Background", grace_seconds: int | None = None) -> None:
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        self.request("DELETE", path_for(api_version, kind, namespace, name), body=body)

    def delete_pod(self, namespace: str, name: str, *, grace_seconds: int | None = None) -> None:
        """Delete a pod (grace_seconds 0: at once, without waiting for its kubelet's confirmation)."""
        self.delete(_CORE, "Pod", namespace, name, grace_seconds=grace_seconds)

    def delete_secret(self, namespace: str, name: str) -> None:
        """Delete a Secret by name (a fleet identity of a retired or incomplete generation)."""
        self.delete(_CORE, "Secret", namespace, name)

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Merge-patch the pod's annotations (a pod already gone is fine: 404 is None)."""
        self.request("PATCH", path_for(_CORE, "Pod", namespace, name),
                     body={"metadata": {"annotations": annotations}}, content_type="application/merge-patch+json")

    def delete_job(self, namespace: str, name: str) -> None:
        self.delete(API_VERSION, KIND, namespace, name)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        return self.request("GET", path_for(api_version, kind, namespace, name))

    def replace(self, obj: Obj) -> Obj | None:
        """PUT `obj`; its metadata.resourceVersion makes it conditional (409 when it changed)."""
        meta = obj["metadata"]
        return self.request("PUT", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
                            body=obj)

    def patch_status(self, namespace: str, name: str, status: Obj, old: Obj | None = None, *,
                     attempts: int | None = None) -> Obj | None:
        """Merge-patch the status subresource; keys of `old` missing from `status` are removed."""
        body = dict(status)
        for key in (old or {}):
            body.setdefault(key, None)
        return self.request("PATCH", path_for(API_VERSION, KIND, namespace, name, "status"),
                            body={"status": body}, content_type="application/merge-patch+json", attempts=attempts)

    def missing_claims(self, namespace: str, claims: list[str]) -> list[str]:
        return [c for c in dict.fromkeys(claims)
                if self.request("GET", path_for(_CORE, "PersistentVolumeClaim", namespace, c)) is None]

    def post_event(self, job: Obj, event: Event, now: datetime | None = None) -> None:
        """A core/v1 Event about the job (best effort: an Event that cannot be posted is dropped)."""
        meta = job["metadata"]
        stamp = fmt_time(now or datetime.now(timezone.utc))
        obj = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid", ""),
                               "resourceVersion": meta.get("resourceVersion", "")},
            "reason": event.reason, "message": event.message[:1024], "type": event.type,
            "source": {"component": "spectrain-operator"}, "reportingComponent": "spectrain-operator",
            "reportingInstance": self.instance, "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            self.request("POST", path_for(_CORE, "Event", meta["namespace"]), body=obj)
        except KubeError:
            metrics.ERRORS.labels(kind="event").inc()


def _reason(body: Any) -> str:
    try:
        data = json.loads(body)
    except (TypeError, ValueError):
        return ""
    return str(data.get("message", "")) if isinstance(data, dict) else ""
