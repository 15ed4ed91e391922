"""bench-operator: the operator against a real kube-apiserver + etcd (BENCHMARKS.md keys).

The control plane is the integration tier's (tests/integration/kubeapi.py, binaries from
`make kube-binaries`: the release of scripts/kube/go.mod; results before 2026-12-01 were measured on
1.20, which the operator now refuses); the operator is `python -m spectrain_operator --standalone` as a child
process, authenticated as its own user (`spectrain-operator`, group system:masters), so that the
apiserver's audit log tells its requests apart from the bench's. The bench plays the kubelet.

create_to_children_s_<N>  N jobs (2 nodes each) created at once (8 client threads) in a fresh
                          namespace: seconds from the first create until every child of every
                          job exists (2 pods, ConfigMap, Service, ServiceAccount/Role/RoleBinding);
                          the pods are seen through one watch, the other kinds listed once the
                          pods are all there (the operator creates them before the pods)
jobs100_to_running_s      100 jobs created at once; the bench watches their pods and patches each
                          new pod Running (as a kubelet would); seconds until all 100 jobs report
                          status.phase Running
operator_rss_mb           peak RSS (VmHWM) of the operator process over the whole run
api_calls_per_reconcile   every request of the operator's user in the audit log (kopf's watches
                          and patches included) / reconcile passes (spectrain_reconciles_total);
                          also own_api_calls_per_reconcile: the reconciler's own requests only
                          (spectrain_api_calls_total)
duplicate_creates         creates of the operator answered 409 AlreadyExists (audit log) plus
                          objects it created more than once (the same namespace/kind/name
                          answered 201 twice); must be 0

--quick: the same measurements with N = 1, 8, 32 and 30 jobs (the keys keep their names; the
sizes used are in `sizes`).

Run: python -m bench.operator [--quick]   (make bench-operator [QUICK=1])
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench.common import parse_args, print_table, write_results
from tests.integration.kubeapi import KubeAPI, free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "spectrain.io_spectrainjobs.yaml"
GROUP, VERSION, PLURAL = "spectrain.io", "v1alpha1", "spectrainjobs"
LABEL_JOB = "spectrain.io/job-name"
OPERATOR_USER = "spectrain-operator"
CREATE_THREADS = 8
KUBELET_THREADS = 4


def manifest(ns: str, name: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SpecTrainJob", "metadata": {"name": name, "namespace": ns},
            "spec": {"target": {"image": "img:1", "nodes": 2, "steps": 10,
                                "parallelism": {"data": 1, "pipeline": 2, "microbatches": 2}}}}


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path):
        self.metrics_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KOPF_"))}
        env.update(KUBECONFIG=str(kubeconfig),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "operator"), str(ROOT / "workloads")]))
        self.log = open(log_path, "ab")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spectrain_operator", "--standalone", "--liveness=",
             f"--metrics-port={self.metrics_port}"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            start_new_session=True)
        self.peak_rss_kb = 0

    def sample_rss(self) -> None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss_kb = max(self.peak_rss_kb, int(line.split()[1]))
        except OSError:
            pass

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited with {self.proc.returncode}")

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, _, value = line.rpartition(" ")
            name = key.split("{", 1)[0]
            out[name] += float(value)
            out[key] += float(value)
        return dict(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.sample_rss()
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class Bench:
    def __init__(self, kube: KubeAPI):
        from kubernetes import client

        self.kube = kube
        api = kube.api_client()
        api.configuration.connection_pool_maxsize = 16
        api.rest_client.pool_manager.connection_pool_kw["maxsize"] = 16
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        return name

    def create_jobs(self, ns: str, names: list[str],
                    make: Callable[[str, str], dict[str, Any]] = manifest) -> None:
        """Create the jobs `make(ns, name)` at once (CREATE_THREADS client threads)."""
        with ThreadPoolExecutor(CREATE_THREADS) as pool:
            list(pool.map(lambda n: self.custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, make(ns, n), _preload_content=False), names))

    def _names(self, items_call: Any, ns: str, **kw: Any) -> set[str]:
        data = json.loads(items_call(ns, _preload_content=False, **kw).data)
        return {i["metadata"]["name"] for i in data["items"]}

    def children_complete(self, ns: str, names: list[str], pods: set[str] | None = None) -> bool:
        """`pods`: the pod names a PodWatch has seen (no request); None: list them."""
        pods = self._names(self.core.list_namespaced_pod, ns) if pods is None else pods
        if not all(f"{n}-{i}" in pods for n in names for i in (0, 1)):
            return False  # pods are created last: check the rest only once they are there
        want = set(names)
        return (want <= self._names(self.core.list_namespaced_service, ns)
                and {f"{n}-config" for n in names} <= self._names(self.core.list_namespaced_config_map, ns)
                and {f"{n}-status" for n in names} <= self._names(self.core.list_namespaced_service_account, ns)
                and {f"{n}-status" for n in names} <= self._names(self.rbac.list_namespaced_role, ns)
                and {f"{n}-status" for n in names} <= self._names(self.rbac.list_namespaced_role_binding, ns))

    def phases(self, ns: str) -> Counter[str]:
        data = json.loads(self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL,
                                                                    _preload_content=False).data)
        return Counter((i.get("status") or {}).get("phase", "") for i in data["items"])


class PodWatch:
    """The pods created in a namespace, from one watch: `names`, and `on_added(name)` once per new
    pod. Waiting for the children of a burst this way costs the apiserver no repeated pod lists
    (which it serves from etcd, decoding every pod of the namespace each time, and which would
    compete with the operator being measured)."""

    def __init__(self, bench: Bench, ns: str, on_added: Callable[[str], None] | None = None):
        self.names: set[str] = set()
        self._on_added = on_added
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bench, self._ns = bench, ns
        threading.Thread(target=self._run, daemon=True).start()
        if not self._ready.wait(30):
            raise RuntimeError("pod watch did not start")

    def _run(self) -> None:
        from kubernetes import watch

        rv = json.loads(self._bench.core.list_namespaced_pod(self._ns, _preload_content=False).data)["metadata"][
            "resourceVersion"]
        self._ready.set()
        w = watch.Watch()
        while not self._stop.is_set():
            for ev in w.stream(self._bench.core.list_namespaced_pod, self._ns, resource_version=rv,
                               timeout_seconds=5, _preload_content=False):
                obj = ev["raw_object"] if "raw_object" in ev else ev["object"]
                rv = obj["metadata"]["resourceVersion"]
                name = obj["metadata"]["name"]
                if ev["type"] == "ADDED" and name not in self.names:
                    self.names.add(name)
                    if self._on_added is not None:
                        self._on_added(name)
                if self._stop.is_set():
                    w.stop()
                    break

    def stop(self) -> None:
        self._stop.set()


class Kubelet:
    """Watches the pods of a namespace and patches each new one Running, like a kubelet would."""

    def __init__(self, bench: Bench, ns: str):
        self.bench, self.ns = bench, ns
        self.todo: queue.Queue[str | None] = queue.Queue()
        self.patched = 0
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(KUBELET_THREADS)]
        self.watch: PodWatch | None = None

    def start(self) -> Kubelet:
        for t in self.threads:
            t.start()
        self.watch = PodWatch(self.bench, self.ns, on_added=self.todo.put)
        return self

    def _work(self) -> None:
        started = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        while True:
            name = self.todo.get()
            if name is None:
                return
            status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                      "containerStatuses": [{"name": "target", "ready": True, "restartCount": 0, "image": "img:1",
                                             "imageID": "", "state": started}]}
            self.bench.core.patch_namespaced_pod_status(name, self.ns, {"status": status}, _preload_content=False)
            self.patched += 1

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        for _ in range(KUBELET_THREADS):
            self.todo.put(None)


def audit_counts(kube: KubeAPI, since: int) -> tuple[int, int, int]:
    """(requests, creates answered 409, objects created more than once) of the operator's user."""
    events = kube.audit_events(since, user=OPERATOR_USER)
    conflicts = 0
    created: Counter[tuple[str, str, str]] = Counter()
    for ev in events:
        code = (ev.get("responseStatus") or {}).get("code")
        if ev.get("verb") != "create":
            continue
        ref = ev.get("objectRef") or {}
        if code == 409:
            conflicts += 1
        elif code == 201 and ref.get("resource") != "events":
            created[(ref.get("namespace", ""), ref.get("resource", ""), ref.get("name", ""))] += 1
    twice = sum(c - 1 for c in created.values() if c > 1)
    return len(events), conflicts, twice


def run(quick: bool) -> dict[str, Any]:
    sizes = [1, 8, 32] if quick else [1, 16, 64]
    many = 30 if quick else 100
    results: dict[str, Any] = {"sizes": {"create": sizes, "running": many}}
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        kube = KubeAPI(Path(tmp) / "kube")
        kube.start()
        op: OperatorProcess | None = None
        try:
            kube.apply(yaml.safe_load(CRD.read_text()))
            bench = Bench(kube)
            op_kubeconfig = kube.kubeconfig_for(OPERATOR_USER, ["system:masters"])
            audit_start = kube.audit_offset()
            op = OperatorProcess(op_kubeconfig, Path(tmp) / "operator.log")
            sampler_stop = threading.Event()

            def sample() -> None:
                while not sampler_stop.wait(0.2):
                    op.sample_rss()
            threading.Thread(target=sample, daemon=True).start()

            # warm-up: the operator is up, watching, and has validated one job
            ns = bench.namespace("warmup")
            bench.create_jobs(ns, ["w"])
            wait_for(lambda: (op.check(), bench.children_complete(ns, ["w"]))[1], 120, interval=0.1,
                     what="the warm-up job's children")

            for n in sizes:
                ns = bench.namespace(f"create-{n}")
                names = [f"j{i}" for i in range(n)]
                pods = PodWatch(bench, ns)
                t0 = time.perf_counter()
                bench.create_jobs(ns, names)
                wait_for(lambda ns=ns, names=names, pods=pods: (
                    op.check(), bench.children_complete(ns, names, set(pods.names)))[1],
                         300, interval=0.02, what=f"children of {n} jobs")
                pods.stop()
                results[f"create_to_children_s_{n if not quick else {1: 1, 8: 16, 32: 64}[n]}"] = \
                    time.perf_counter() - t0

            ns = bench.namespace("running")
            kubelet = Kubelet(bench, ns).start()
            names = [f"r{i}" for i in range(many)]
            t0 = time.perf_counter()
            bench.create_jobs(ns, names)
            wait_for(lambda: (op.check(), bench.phases(ns).get("Running", 0) == many)[1], 600, interval=0.1,
                     what=f"{many} jobs Running")
            results["jobs100_to_running_s"] = time.perf_counter() - t0
            kubelet.stop()

            m = op.metrics()
            sampler_stop.set()
            op.sample_rss()
            reconciles = m.get("spectrain_reconciles_total", 0.0)
            requests, conflicts, twice = audit_counts(kube, audit_start)
            results["reconcile_passes"] = int(reconciles)
            results["api_calls_per_reconcile"] = requests / max(reconciles, 1.0)
            results["own_api_calls_per_reconcile"] = m.get("spectrain_api_calls_total", 0.0) / max(reconciles, 1.0)
            results["operator_requests"] = requests
            results["duplicate_creates"] = conflicts + twice
            results["operator_rss_mb"] = op.peak_rss_kb / 1024.0
            results["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        finally:
            if op is not None:
                op.stop()
            kube.cleanup()
    return results


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    results = run(args.quick)
    path = write_results("operator", results, args.quick)
    print_table("bench-operator" + (" (quick)" if args.quick else ""),
                {k: v for k, v in results.items() if not isinstance(v, (dict, list))})
    print(f"sizes: {results['sizes']}  loadavg: {results.get('loadavg')}\nwrote {path}")
    goals = {"create_to_children_s_64 <= 2": results["create_to_children_s_64"] <= 2,
             "jobs100_to_running_s <= 30": results["jobs100_to_running_s"] <= 30,
             "operator_rss_mb <= 200": results["operator_rss_mb"] <= 200,
             "duplicate_creates == 0": results["duplicate_creates"] == 0}
    print("goals: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in goals.items()))


if __name__ == "__main__":
    main()
