"""Prometheus metrics of the operator: reconciles, errors, latency, API calls, jobs by phase."""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from spectrain_api.names import PHASES

RECONCILES = Counter("spectrain_reconciles_total", "Reconcile passes, by result.", ["result"])
ERRORS = Counter("spectrain_reconcile_errors_total", "Errors while reconciling, by kind.", ["kind"])
LATENCY = Histogram("spectrain_reconcile_duration_seconds", "Duration of one reconcile pass.",
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
API_CALLS = Counter("spectrain_api_calls_total", "Requests to the Kubernetes API, by verb.", ["verb"])
API_RETRIES = Counter("spectrain_api_retries_total",
                      "API requests retried after a 429, a 5xx or a broken connection, by status.", ["status"])
LEADER = Gauge("spectrain_leader", "1 while this replica holds the leader Lease (or runs without election).")
CREATE_CONFLICTS = Counter("spectrain_create_conflicts_total",
                           "Creates answered 409 AlreadyExists (the object existed already), by kind.",
                           ["kind"])
JOBS = Gauge("spectrain_jobs", "SpecTrainJobs known to this operator, by phase.", ["phase"])

_phases: dict[tuple[str, str], str] = {}
_lock = threading.Lock()


def _publish() -> None:
    counts = dict.fromkeys(PHASES, 0)
    for phase in _phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase, count in counts.items():
        JOBS.labels(phase=phase).set(count)


def set_phase(namespace: str, name: str, phase: str) -> None:
    with _lock:
        _phases[(namespace, name)] = phase
        _publish()


def forget(namespace: str, name: str) -> None:
    with _lock:
        _phases.pop((namespace, name), None)
        _publish()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose /metrics on `port` (0: off)."""
    if port:
        start_http_server(port, addr=addr)
