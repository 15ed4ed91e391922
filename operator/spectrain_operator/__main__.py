"""`python -m spectrain_operator`: run the operator (kopf) with the handlers of handlers.py.

    python -m spectrain_operator                      # all namespaces
    python -m spectrain_operator --namespace team-a   # only these namespaces (repeatable, globs ok)
    python -m spectrain_operator --standalone         # no leader election (one replica, tests)
    python -m spectrain_operator --leader-elect --lease-namespace spectrain-system   # HA replicas

At start the operator reads the API server's version: below kube.MIN_SERVER_VERSION (1.29) it logs
why and exits with code 3 (kube.EXIT_UNSUPPORTED_SERVER) before serving liveness, so the pod's
liveness probe fails and the pod shows CrashLoopBackOff with the reason in its log.

HA: run two or more replicas with --leader-elect: they compete for the coordination.k8s.io/v1
Lease --lease-name in --lease-namespace (leader.py); only its holder acts, a follower takes over
within --lease-duration seconds of the holder's death (at once when the holder stops gracefully).

API pressure: every request takes a token of a --qps/--burst bucket; a 429 or 5xx is retried with
full-jitter exponential backoff that honours Retry-After (ratelimit.py, kube.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import uuid

import kopf

from spectrain_operator.kube import (
    EXIT_UNSUPPORTED_SERVER,
    Kube,
    KubeError,
    TransientError,
    UnsupportedServer,
    check_server_version,
)
from spectrain_operator.leader import DEFAULT_LEASE_DURATION_S, DEFAULT_LEASE_NAME, LeaderElector
from spectrain_operator.ratelimit import DEFAULT_BURST, DEFAULT_QPS


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m spectrain_operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="namespace to watch (repeatable; glob patterns allowed); default: all namespaces")
    ap.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    elect = ap.add_mutually_exclusive_group()
    elect.add_argument("--standalone", action="store_true",
                       help="no leader election: this replica always acts (the default; one replica only)")
    elect.add_argument("--leader-elect", action="store_true",
                       help="act only while holding the leader Lease (HA: run several replicas)")
    ap.add_argument("--lease-name", default=_env("SPECTRAIN_LEASE_NAME", DEFAULT_LEASE_NAME),
                    help="name of the coordination.k8s.io Lease the replicas compete for; env SPECTRAIN_LEASE_NAME")
    ap.add_argument("--lease-namespace", default=os.environ.get("SPECTRAIN_OPERATOR_NAMESPACE"),
                    help="namespace of the Lease (the operator's own); env SPECTRAIN_OPERATOR_NAMESPACE")
    ap.add_argument("--lease-duration", type=int,
                    default=int(_env("SPECTRAIN_LEASE_DURATION", str(DEFAULT_LEASE_DURATION_S))),
                    help="seconds a Lease not renewed stays valid: a killed leader is replaced within about "
                         "this; env SPECTRAIN_LEASE_DURATION")
    ap.add_argument("--qps", type=float, default=float(_env("SPECTRAIN_API_QPS", str(DEFAULT_QPS))),
                    help="sustained API requests per second (0: unlimited); env SPECTRAIN_API_QPS")
    ap.add_argument("--burst", type=int, default=int(_env("SPECTRAIN_API_BURST", str(DEFAULT_BURST))),
                    help="API requests allowed at once above --qps; env SPECTRAIN_API_BURST")
    ap.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                    help="liveness endpoint URL ('' to disable)")
    ap.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    ap.add_argument("--log-format", choices=["plain", "full", "json"], default="full",
                    help="log line format (json for log collectors)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    if args.all_namespaces and args.namespace:
        ap.error("--all-namespaces and --namespace exclude each other")
    if args.leader_elect and not args.lease_namespace:
        ap.error("--leader-elect needs --lease-namespace (or SPECTRAIN_OPERATOR_NAMESPACE)")
    if args.lease_duration < 3:
        ap.error(f"--lease-duration must be at least 3 s, not {args.lease_duration}")
    if args.qps < 0:
        ap.error(f"--qps must be 0 (unlimited) or positive, not {args.qps} (env SPECTRAIN_API_QPS)")
    if args.qps > 0 and args.burst < 1:
        ap.error(f"--burst must be at least 1 with --qps {args.qps}")
    return args


def identity() -> str:
    """This process's Lease identity: the pod name (POD_ID from the Deployment) and a random
    suffix, so a restarted container is a new candidate rather than the old holder."""
    return f"{os.environ.get('POD_ID') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


log = logging.getLogger("spectrain.operator")


def check_server(kube: Kube, timeout: float = 60.0, pause: float = 2.0) -> str:
    """The API server's version, once it answers (retrying transient errors up to `timeout` s);
    raises kube.UnsupportedServer below the supported range, kube.KubeError when it never answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check_server_version(kube.server_info())
        except TransientError as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("reading the API server version: %s; retrying", exc)
            time.sleep(pause)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose, debug=args.debug,
                   log_format={"plain": kopf.LogFormat.PLAIN, "json": kopf.LogFormat.JSON}.get(
                       args.log_format, kopf.LogFormat.FULL))

    @kopf.on.startup()
    def _deployment_settings(settings: kopf.OperatorSettings, **_: object) -> None:
        # The served resources are fixed: no runtime observation of CRDs (or of namespaces, so
        # --namespace takes exact names), which keeps the chart's RBAC free of CRD/namespace reads.
        settings.scanning.disabled = True

    from spectrain_operator import handlers, metrics  # registers the handlers
    from spectrain_operator.reconciler import Reconciler

    kube = Kube.from_environment(os.environ.get("SPECTRAIN_KUBECONFIG") or None, qps=args.qps, burst=args.burst)
    try:
        version = check_server(kube)
    except UnsupportedServer as exc:
        log.error("not starting: %s", exc)
        return EXIT_UNSUPPORTED_SERVER
    except KubeError as exc:
        log.error("not starting: cannot read the Kubernetes API server's version: %s", exc)
        return 1
    log.info("Kubernetes API server %s", version)
    reconciler = Reconciler(kube)
    elector = None
    if args.leader_elect:
        elector = LeaderElector(kube, args.lease_namespace, args.lease_name, identity(), args.lease_duration,
                                on_started=lambda: handlers.resync_all(args.namespace))
    handlers.install(reconciler, elector)

    metrics.serve(args.metrics_port)
    if elector is None:
        metrics.LEADER.set(1)
    else:
        log.info("leader election: lease %s/%s, %d s, as %s", args.lease_namespace, args.lease_name,
                 args.lease_duration, elector.identity)
        elector.start()
    # kopf's own peering stays off: the Lease decides who acts, kopf only delivers the events.
    kopf.run(
        standalone=True,
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
