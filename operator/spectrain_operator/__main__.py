"""`python -m spectrain_operator`: run the operator (kopf) with the handlers of handlers.py.

    python -m spectrain_operator                      # all namespaces
    python -m spectrain_operator --namespace team-a   # only these namespaces (repeatable, globs ok)
    python -m spectrain_operator --standalone         # no peering (single replica, tests)

At start the operator reads the API server's version: below kube.MIN_SERVER_VERSION (1.29) it logs
why and exits with code 3 (kube.EXIT_UNSUPPORTED_SERVER) before serving liveness, so the pod's
liveness probe fails and the pod shows CrashLoopBackOff with the reason in its log.

HA: run two replicas with the same --peering name (needs kopf's KopfPeering/ClusterKopfPeering
CRDs); only the highest --priority replica handles objects, the other takes over when it dies.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time

import kopf

from spectrain_operator.kube import (
    EXIT_UNSUPPORTED_SERVER,
    Kube,
    KubeError,
    TransientError,
    UnsupportedServer,
    check_server_version,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m spectrain_operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="namespace to watch (repeatable; glob patterns allowed); default: all namespaces")
    ap.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    ap.add_argument("--standalone", action="store_true", help="no peering: this replica always handles objects")
    ap.add_argument("--peering", default=None, help="peering name shared by the replicas (HA)")
    ap.add_argument("--priority", default=os.environ.get("SPECTRAIN_PEERING_PRIORITY", "0"),
                    help="peering priority of this replica: an integer, or 'random' (a distinct draw per "
                         "replica, for Deployments whose replicas share one pod spec); env SPECTRAIN_PEERING_PRIORITY")
    ap.add_argument("--peering-lifetime", type=int,
                    default=int(os.environ.get("SPECTRAIN_PEERING_LIFETIME", "60")),
                    help="seconds a replica's peering record lives without keep-alives: a killed active "
                         "replica is replaced after at most this; env SPECTRAIN_PEERING_LIFETIME")
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
    if args.priority == "random":
        args.priority = random.SystemRandom().randint(1, 2**31 - 1)
    try:
        args.priority = int(args.priority)
    except ValueError:
        ap.error(f"--priority must be an integer or 'random', not {args.priority!r}")
    return args


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
        settings.peering.lifetime = args.peering_lifetime
        # The served resources are fixed: no runtime observation of CRDs (or of namespaces, so
        # --namespace takes exact names), which keeps the chart's RBAC free of CRD/namespace reads.
        settings.scanning.disabled = True

    from spectrain_operator import handlers, metrics  # registers the handlers
    from spectrain_operator.reconciler import Reconciler

    kube = Kube.from_environment(os.environ.get("SPECTRAIN_KUBECONFIG") or None)
    try:
        version = check_server(kube)
    except UnsupportedServer as exc:
        log.error("not starting: %s", exc)
        return EXIT_UNSUPPORTED_SERVER
    except KubeError as exc:
        log.error("not starting: cannot read the Kubernetes API server's version: %s", exc)
        return 1
    log.info("Kubernetes API server %s", version)
    handlers.install(Reconciler(kube))

    metrics.serve(args.metrics_port)
    kopf.run(
        standalone=args.standalone,
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness or None,
        peering_name=args.peering,
        priority=args.priority,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
