"""bench-operator_scale: the operator at scale, on a cluster of kwok nodes with the real kube-scheduler.

The control plane of bench-operator (tests/integration/kubeapi.py: kube-apiserver with the blocking
audit log on, etcd; the release of scripts/kube/go.mod) plus what the integration tier's `cluster`
fixture adds (tests/integration/fake_cluster.py): kube-scheduler (its default client rate limit:
50 requests/s, burst 100), the node-lifecycle controller and kwok's fake kubelets. NODES fake nodes
of GPUS_PER_NODE nvidia.com/gpu each, enough for every pod of the bench at once. The operator is
`python -m spectrain_operator --standalone` as its own process and user (bench.operator). Nothing
here plays the kubelet: the scheduler binds the pods, kwok runs them.

Every job: `nodes` pods of one rank each (data parallel), gpuSharing SingleContainer with 1 GPU per
pod (so the scheduler fits GPUS_PER_NODE pods per node), drafter on, tolerating the fake nodes'
taint (spec.scheduling.tolerations).

jobs100x8_to_running_s    100 jobs of 8 pods created at once (8 client threads) in a fresh
                          namespace: seconds from the first create until every one of the 800
                          pods is Running AND every job reports status.phase Running (the later
                          of the two; both are followed through watches, timed at the event)
pods512_to_running_s      the same for one job of 512 pods
operator_rss_mb_800pods   peak RSS (VmHWM) of the operator process once the 800-pod run is done
                          (the process ran only the warm-up before it)
api_calls_per_pod         requests of the operator's user in the apiserver audit log from the
                          first create of the 800-pod run until the operator is quiet after it
                          (no new spectrain_api_calls_total for QUIET_S), / 800 pods; the same for
                          the 512-pod run: api_calls_per_pod_512. *_api_calls_by_verb: the breakdown
                          (verb resource[/subresource]); *_reconcile_passes: the operator's passes

Also recorded per run (seconds from the first create): *_created_s (last pod ADDED), *_bound_s (last
pod given a node), *_pods_running_s (last pod Running), *_jobs_running_s (last job Running): where
the time goes (operator creating, scheduler binding, kwok starting, operator reporting).

--quick: 20 jobs of 8 pods and one job of 128 pods (the keys keep their names; the sizes used are
in `sizes`), under 2 minutes.

Run: python -m bench.operator_scale [--quick]   (make bench-operator_scale [QUICK=1])
"""

from __future__ import annotations

import json
import math
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.common import parse_args, print_table, write_results
from bench.operator import CRD, GROUP, OPERATOR_USER, PLURAL, VERSION, Bench, OperatorProcess
from tests.integration.kubeapi import KubeAPI
from tests.waiting import wait_for

GPUS_PER_NODE = 8
TOLERATION = {"key": KubeAPI.FAKE_NODE_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}
QUIET_S = 2.0
FULL = {"jobs": 100, "pods_per_job": 8, "big": 512}
QUICK = {"jobs": 20, "pods_per_job": 8, "big": 128}


def manifest(ns: str, name: str, pods: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SpecTrainJob", "metadata": {"name": name, "namespace": ns},
            "spec": {"target": {"image": "img:1", "nodes": pods, "procsPerNode": 1, "steps": 10,
                                "parallelism": {"data": pods, "pipeline": 1}},
                     "gpuSharing": {"mode": "SingleContainer", "gpusPerNode": 1},
                     "scheduling": {"tolerations": [TOLERATION]}}}


class PhaseWatch:
    """Every object of one kind in a namespace, from one watch (no repeated lists): when each was
    first seen, first had a node (pods), and first reached `phase` (monotonic clock, at the event)."""

    def __init__(self, list_call: Callable[..., Any], phase: str = "Running"):
        self.added: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.reached: dict[str, float] = {}
        self._list, self._phase = list_call, phase
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, daemon=True).start()
        if not self._ready.wait(30):
            raise RuntimeError("watch did not start")

    def _seen(self, obj: dict[str, Any]) -> None:
        now = time.monotonic()
        name = obj["metadata"]["name"]
        self.added.setdefault(name, now)
        if (obj.get("spec") or {}).get("nodeName"):
            self.bound.setdefault(name, now)
        if (obj.get("status") or {}).get("phase") == self._phase:
            self.reached.setdefault(name, now)

    def _run(self) -> None:
        from kubernetes import watch

        try:
            data = json.loads(self._list(_preload_content=False).data)
            for obj in data["items"]:
                self._seen(obj)
            rv = data["metadata"]["resourceVersion"]
            self._ready.set()
            while not self._stop.is_set():
                w = watch.Watch()
                for ev in w.stream(self._list, resource_version=rv, timeout_seconds=5, deserialize=False):
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        raise RuntimeError(f"watch: {obj.get('message')}")
                    rv = obj["metadata"]["resourceVersion"]
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._seen(obj)
                    if self._stop.is_set():
                        w.stop()
                        break
        except BaseException as exc:  # surfaced by check()
            self.error = exc
            self._ready.set()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"watch failed: {self.error!r}")

    def last(self, times: dict[str, float], n: int) -> float | None:
        """When the n-th object got there (None: fewer than n have)."""
        return max(times.values()) if len(times) >= n else None

    def stop(self) -> None:
        self._stop.set()


def verbs(events: list[dict[str, Any]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for ev in events:
        ref = ev.get("objectRef") or {}
        res = "/".join(x for x in (ref.get("resource", ""), ref.get("subresource", "")) if x)
        out[f"{ev.get('verb')} {res or ev.get('requestURI', '')}"] += 1
    return dict(out.most_common())


def metrics_up(op: OperatorProcess) -> bool:
    try:
        op.metrics()
    except OSError:
        return False
    return True


def wait_quiet(op: OperatorProcess, timeout: float = 120.0) -> None:
    """Until the operator has made no request for QUIET_S (its own counter, from /metrics)."""
    last = {"calls": -1.0, "since": time.monotonic()}

    def quiet() -> bool:
        op.check()
        calls = op.metrics().get("spectrain_api_calls_total", 0.0)
        now = time.monotonic()
        if calls != last["calls"]:
            last.update(calls=calls, since=now)
        return now - last["since"] >= QUIET_S

    wait_for(quiet, timeout, interval=0.25, what="the operator quiet")


def run_burst(kube: KubeAPI, bench: Bench, op: OperatorProcess, ns: str, jobs: dict[str, int],
              timeout: float) -> dict[str, Any]:
    """Create `jobs` (name -> pods) at once; time them to Running; count the operator's requests."""
    bench.namespace(ns)
    n_pods = sum(jobs.values())
    pods = PhaseWatch(lambda **kw: bench.core.list_namespaced_pod(ns, **kw))
    stjs = PhaseWatch(lambda **kw: bench.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, **kw))
    audit_from = kube.audit_offset()
    passes_before = op.metrics().get("spectrain_reconciles_total", 0.0)
    t0 = time.monotonic()
    try:
        bench.create_jobs(ns, list(jobs), make=lambda ns_, name: manifest(ns_, name, jobs[name]))
        wait_for(lambda: (op.check(), pods.check(), stjs.check(),
                          len(pods.reached) >= n_pods and len(stjs.reached) >= len(jobs))[3],
                 timeout, interval=0.05, what=f"{n_pods} pods of {len(jobs)} job(s) Running")
    except TimeoutError:
        raise TimeoutError(f"{len(pods.added)} pods created, {len(pods.bound)} bound, {len(pods.reached)} Running, "
                           f"{len(stjs.reached)}/{len(jobs)} jobs Running; operator log:\n"
                           + "\n".join(Path(op.log.name).read_text(errors="replace").splitlines()[-20:])) from None
    finally:
        pods.stop()
        stjs.stop()
    out: dict[str, Any] = {
        "created_s": (pods.last(pods.added, n_pods) or t0) - t0,
        "bound_s": (pods.last(pods.bound, n_pods) or t0) - t0,
        "pods_running_s": (pods.last(pods.reached, n_pods) or t0) - t0,
        "jobs_running_s": (stjs.last(stjs.reached, len(jobs)) or t0) - t0,
    }
    out["to_running_s"] = max(out["pods_running_s"], out["jobs_running_s"])
    op.sample_rss()
    out["rss_mb"] = op.peak_rss_kb / 1024.0
    wait_quiet(op)
    events = kube.audit_events(audit_from, user=OPERATOR_USER)
    out["api_calls"] = len(events)
    out["api_calls_per_pod"] = len(events) / n_pods
    out["api_calls_by_verb"] = verbs(events)
    out["reconcile_passes"] = int(op.metrics().get("spectrain_reconciles_total", 0.0) - passes_before)
    out["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    return out


def run(quick: bool) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    total = 1 + sizes["jobs"] * sizes["pods_per_job"] + sizes["big"]   # 1: the warm-up job's pod
    n_nodes = math.ceil(total / GPUS_PER_NODE) + 1  # every pod of every run fits at once, and a spare node
    timeout = 180 if quick else 600
    results: dict[str, Any] = {"sizes": {**sizes, "nodes": n_nodes, "gpus_per_node": GPUS_PER_NODE}}
    with tempfile.TemporaryDirectory(prefix="bench-operator-scale-") as tmp:
        kube = KubeAPI(Path(tmp) / "kube")
        kube.start()
        op: OperatorProcess | None = None
        try:
            t = time.monotonic()
            kube.apply(yaml.safe_load(CRD.read_text()))
            kube.start_kwok()
            kube.start_node_controllers()
            names = [f"kwok-node-{i}" for i in range(n_nodes)]
            kube.add_fake_nodes(names, gpus=GPUS_PER_NODE)
            wait_for(lambda: kube.fake_nodes_schedulable(names), 180, interval=0.5,
                     what=f"{n_nodes} fake nodes Ready and untainted")
            kube.start_scheduler()
            results["cluster_setup_s"] = time.monotonic() - t
            bench = Bench(kube)
            op = OperatorProcess(kube.kubeconfig_for(OPERATOR_USER, ["system:masters"]), Path(tmp) / "operator.log")
            wait_for(lambda: (op.check(), metrics_up(op))[1], 60, interval=0.1, what="the operator's /metrics")
            # warm-up: the operator is up, watching, and has run one (1-pod) job
            run_burst(kube, bench, op, "warmup", {"w": 1}, 120)

            many = run_burst(kube, bench, op, "jobs", {f"j{i}": sizes["pods_per_job"] for i in range(sizes["jobs"])},
                             timeout)
            results["jobs100x8_to_running_s"] = many["to_running_s"]
            results["operator_rss_mb_800pods"] = many["rss_mb"]
            results["api_calls_per_pod"] = many["api_calls_per_pod"]
            results["jobs100x8"] = many

            big = run_burst(kube, bench, op, "big", {"big": sizes["big"]}, timeout)
            results["pods512_to_running_s"] = big["to_running_s"]
            results["api_calls_per_pod_512"] = big["api_calls_per_pod"]
            results["operator_rss_mb_peak"] = big["rss_mb"]
            results["pods512"] = big
        finally:
            if op is not None:
                op.stop()
            kube.cleanup()
    return results


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    results = run(args.quick)
    path = write_results("operator_scale", results, args.quick)
    print_table("bench-operator_scale" + (" (quick)" if args.quick else ""),
                {k: v for k, v in results.items() if not isinstance(v, (dict, list))})
    for run_name in ("jobs100x8", "pods512"):
        r = results[run_name]
        print(f"{run_name}: created {r['created_s']:.2f} s, bound {r['bound_s']:.2f} s, pods Running "
              f"{r['pods_running_s']:.2f} s, jobs Running {r['jobs_running_s']:.2f} s; {r['reconcile_passes']} passes, "
              f"{r['api_calls']} requests: "
              + ", ".join(f"{k} {v}" for k, v in list(r["api_calls_by_verb"].items())[:8]))
    print(f"sizes: {results['sizes']}\nwrote {path}")
    goals = {"jobs100x8_to_running_s <= 60": results["jobs100x8_to_running_s"] <= 60,
             "pods512_to_running_s <= 30": results["pods512_to_running_s"] <= 30,
             "operator_rss_mb_800pods <= 300": results["operator_rss_mb_800pods"] <= 300}
    print("goals: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in goals.items()))


if __name__ == "__main__":
    main()
