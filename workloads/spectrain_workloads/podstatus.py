"""The workloads' half of the status path (docs/design.md): progress and drafter summaries.

`report_progress(dict)` (target rank 0) and `report_drafter(dict)` (each drafter) always write
`progress.json` / `drafter/summary-rank-<r>.json` (spectrain_api.rundir) into $SPECTRAIN_RUN_DIR
atomically (temp file + rename), and, in a cluster (env SPECTRAIN_JOB_NAME, SPECTRAIN_POD_NAME,
SPECTRAIN_POD_NAMESPACE, SPECTRAIN_POD_UID and a mounted service-account token), merge-patch the
job's status subresource at `status.reports.<pod UID>.progress` / `.drafter` with the JSON text, at
most every 10 s per kind (`flush=True` forces it, e.g. for the last report; one that arrives while a
PATCH of its kind is in flight is sent right after it, not dropped). The pod's Role (the operator's
access.status_rbac) allows exactly that: `patch` on its own job's status and `get` on its job, nothing
of any pod. The PATCH runs on a background thread and never raises into the training loop: failures
are logged once and dropped; `drain()` before exiting waits for the last one. `job_status()` reads
the job's status back (the drafter's control asks it whether the operator disabled it). Torch-free.
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectrain_api import rundir
from spectrain_api.fsio import atomic_write_json
from spectrain_api.names import (
    ENV_JOB_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_RUN_DIR,
    GROUP,
    MAX_REPORT_CHARS,
    PLURAL,
    REPORT_DRAFTER,
    REPORT_POD,
    REPORT_PROGRESS,
    STATUS_REPORTS,
    VERSION,
)

THROTTLE_S = 10.0
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 5.0

log = logging.getLogger("spectrain.podstatus")
_lock = threading.Condition()          # guards the three below; notified when a kind's PATCHes are done
_last_patch: dict[str, float] = {}
_in_flight: set[str] = set()
_flushed: dict[str, dict[str, Any]] = {}   # report kind -> a flushed payload waiting for the in-flight PATCH
_warned = False


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (the API server rejects NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _run_dir() -> Path | None:
    value = os.environ.get(ENV_RUN_DIR)
    return Path(value) if value else None


@dataclass(frozen=True)
class Where:
    """How this pod reaches its job: the API server, the job, the pod and its credentials."""

    server: str
    namespace: str
    job: str
    pod: str
    uid: str
    token: str

    @property
    def job_url(self) -> str:
        return f"{self.server}/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{PLURAL}/{self.job}"


def _in_cluster() -> Where | None:
    """Where the status path goes, when this process runs in a pod of a job (else None)."""
    job, pod, ns, uid = (os.environ.get(v) for v in (ENV_JOB_NAME, ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_POD_UID))
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    token_file = SA_DIR / "token"
    if not (job and pod and ns and uid and host and token_file.is_file()):
        return None
    host = f"[{host}]" if ":" in host else host
    return Where(f"https://{host}:{port}", ns, job, pod, uid, token_file.read_text().strip())


def _request(where: Where, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    """One request with the pod's token; the decoded JSON answer (HTTPError on a status >= 400)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {where.token}", "Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/merge-patch+json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    ca = SA_DIR / "ca.crt"
    ctx = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else ssl.create_default_context()
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S, context=ctx) as resp:
        return json.loads(resp.read() or b"null")


def job_status() -> dict[str, Any] | None:
    """The job's status as the API server holds it now; None outside a cluster or on any failure."""
    try:
        where = _in_cluster()
        if where is None:
            return None
        job = _request(where, "GET", where.job_url)
        status = job.get("status") if isinstance(job, dict) else None
        return status if isinstance(status, dict) else {}
    except Exception as exc:
        log.debug("could not read the job's status: %s", exc)
        return None


def _patch(kind: str, payload: dict[str, Any] | None) -> None:
    """PATCH `payload`, then any payload flushed meanwhile, until none is waiting."""
    while payload is not None:
        _send(kind, payload)
        with _lock:
            payload = _flushed.pop(kind, None)
            if payload is None:
                _in_flight.discard(kind)
                _lock.notify_all()
            else:
                _last_patch[kind] = time.monotonic()


def _send(kind: str, payload: dict[str, Any]) -> None:
    global _warned
    try:
        where = _in_cluster()
        if where is None:
            return
        text = json.dumps(payload, sort_keys=True)
        if len(text) > MAX_REPORT_CHARS:
            raise ValueError(f"the {kind} report is {len(text)} characters, over {MAX_REPORT_CHARS}")
        report = {REPORT_POD: where.pod, kind: text}
        _request(where, "PATCH", f"{where.job_url}/status", {"status": {STATUS_REPORTS: {where.uid: report}}})
    except Exception as exc:  # never into the training loop
        if not _warned:
            log.warning("could not write the %s report into the job's status (status reaches the operator "
                        "later): %s", kind, exc)
            _warned = True


def _maybe_patch(kind: str, payload: dict[str, Any], flush: bool) -> bool:
    """Start a background PATCH unless throttled or one is in flight; True when started."""
    if _in_cluster() is None:
        return False
    now = time.monotonic()
    with _lock:
        if kind in _in_flight:
            if flush:
                _flushed[kind] = payload     # sent by the in-flight PATCH's thread when it is done
            return False
        if not flush and now - _last_patch.get(kind, -math.inf) < THROTTLE_S:
            return False
        _last_patch[kind] = now
        _in_flight.add(kind)
    threading.Thread(target=_patch, args=(kind, payload), name="spectrain-podstatus", daemon=True).start()
    return True


def drain(timeout_s: float = 2 * REQUEST_TIMEOUT_S) -> bool:
    """Wait (at most `timeout_s`) until no PATCH is in flight or waiting: a process calls it before it
    exits, so its last (flushed) report reaches the job's status rather than dying with the daemon
    thread. True when everything was sent (or given up on by `_send`)."""
    with _lock:
        return _lock.wait_for(lambda: not _in_flight, timeout_s)


def report_progress(progress: dict[str, Any], *, flush: bool = False) -> None:
    """Target rank 0: {step, totalSteps, loss, tokensPerSecond[, updatedAt]}. Never raises."""
    try:
        data = _clean(dict(progress))
        data.setdefault("updatedAt", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        run_dir = _run_dir()
        if run_dir is not None:
            atomic_write_json(run_dir / "progress.json", data, durable=False, sort_keys=True)
        _maybe_patch(REPORT_PROGRESS, data, flush)
    except Exception as exc:
        log.warning("report_progress failed: %s", exc)


def report_drafter(summary: dict[str, Any], rank: int | None = None, *, flush: bool = False) -> None:
    """Each drafter: {state, harvestedSeconds, harvestEfficiency, acceptanceLength, artifact}. Never raises."""
    try:
        data = _clean(dict(summary))
        r = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        run_dir = _run_dir()
        if run_dir is not None:
            atomic_write_json(rundir.drafter_summary(run_dir, r), data, durable=False, sort_keys=True)
        _maybe_patch(REPORT_DRAFTER, data, flush)
    except Exception as exc:
        log.warning("report_drafter failed: %s", exc)
