"""The workloads' half of the status path (docs/design.md): progress and drafter summaries.

`report_progress(dict)` (target rank 0) and `report_drafter(dict)` (each drafter) always write
`progress.json` / `drafter/summary-rank-<r>.json` (spectrain_api.rundir) into $SPECTRAIN_RUN_DIR
atomically (temp file + rename), and, in a cluster (env SPECTRAIN_POD_NAME, SPECTRAIN_POD_NAMESPACE and a mounted
service-account token), merge-patch the pod's own annotation `spectrain.io/progress` /
`spectrain.io/drafter` with the JSON, at most every 10 s per annotation (`flush=True` forces it,
e.g. for the last report; one that arrives while a PATCH of its annotation is in flight is sent
right after it, not dropped). The PATCH runs on a background thread and never raises into the
training loop: failures are logged once and dropped. Torch-free.
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
from pathlib import Path
from typing import Any

from spectrain_api import rundir
from spectrain_api.fsio import atomic_write_json
from spectrain_api.names import (
    ANNOTATION_DRAFTER,
    ANNOTATION_PROGRESS,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_RUN_DIR,
)

THROTTLE_S = 10.0
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PATCH_TIMEOUT_S = 5.0

log = logging.getLogger("spectrain.podstatus")
_lock = threading.Lock()
_last_patch: dict[str, float] = {}
_in_flight: set[str] = set()
_flushed: dict[str, dict[str, Any]] = {}   # annotation -> a flushed payload waiting for the in-flight PATCH
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


def _in_cluster() -> tuple[str, str, str, str] | None:
    """(api server URL, namespace, pod name, token) when the pod may patch itself."""
    pod, ns = os.environ.get(ENV_POD_NAME), os.environ.get(ENV_POD_NAMESPACE)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    token_file = SA_DIR / "token"
    if not (pod and ns and host and token_file.is_file()):
        return None
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}", ns, pod, token_file.read_text().strip()


def _patch(annotation: str, payload: dict[str, Any] | None) -> None:
    """PATCH `payload`, then any payload flushed meanwhile, until none is waiting."""
    while payload is not None:
        _send(annotation, payload)
        with _lock:
            payload = _flushed.pop(annotation, None)
            if payload is None:
                _in_flight.discard(annotation)
            else:
                _last_patch[annotation] = time.monotonic()


def _send(annotation: str, payload: dict[str, Any]) -> None:
    global _warned
    try:
        where = _in_cluster()
        if where is None:
            return
        server, ns, pod, token = where
        body = json.dumps({"metadata": {"annotations": {annotation: json.dumps(payload, sort_keys=True)}}}).encode()
        req = urllib.request.Request(f"{server}/api/v1/namespaces/{ns}/pods/{pod}", data=body, method="PATCH",
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/merge-patch+json",
                                              "Accept": "application/json"})
        ca = SA_DIR / "ca.crt"
        ctx = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else ssl.create_default_context()
        with urllib.request.urlopen(req, timeout=PATCH_TIMEOUT_S, context=ctx) as resp:
            resp.read()
    except Exception as exc:  # never into the training loop
        if not _warned:
            log.warning("could not annotate the pod with %s (status reaches the operator later): %s",
                        annotation, exc)
            _warned = True


def _maybe_patch(annotation: str, payload: dict[str, Any], flush: bool) -> bool:
    """Start a background PATCH unless throttled or one is in flight; True when started."""
    if _in_cluster() is None:
        return False
    now = time.monotonic()
    with _lock:
        if annotation in _in_flight:
            if flush:
                _flushed[annotation] = payload     # sent by the in-flight PATCH's thread when it is done
            return False
        if not flush and now - _last_patch.get(annotation, -math.inf) < THROTTLE_S:
            return False
        _last_patch[annotation] = now
        _in_flight.add(annotation)
    threading.Thread(target=_patch, args=(annotation, payload), name="spectrain-podstatus", daemon=True).start()
    return True


def report_progress(progress: dict[str, Any], *, flush: bool = False) -> None:
    """Target rank 0: {step, totalSteps, loss, tokensPerSecond[, updatedAt]}. Never raises."""
    try:
        data = _clean(dict(progress))
        data.setdefault("updatedAt", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        run_dir = _run_dir()
        if run_dir is not None:
            atomic_write_json(run_dir / "progress.json", data, durable=False, sort_keys=True)
        _maybe_patch(ANNOTATION_PROGRESS, data, flush)
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
        _maybe_patch(ANNOTATION_DRAFTER, data, flush)
    except Exception as exc:
        log.warning("report_drafter failed: %s", exc)
