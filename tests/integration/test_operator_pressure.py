"""The operator under API pressure, through a fault-injecting proxy in front of the real apiserver
(tests/integration/faultproxy.py): it converges while 429s (with Retry-After), 500s and bogus 409s
are injected, waits at least the Retry-After it is given, keeps its request rate under its QPS
limit, recovers from dropped watches, watches only the job pods (a server-side label selector),
and refuses to adopt an object of a job's name that another owner holds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.faultproxy import FaultPolicy, FaultProxy, Seen, per_second
from tests.integration.kubeapi import KubeAPI
from tests.integration.operator_harness import Env, Operator, apply_crd
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

QPS, BURST = 40, 20
JOBS = 100
RETRY_AFTER_S = 1.0
FAULT_RATE = 0.2       # of the operator's non-watch requests: 429 and 500, half each
CONFLICT_RATE = 0.05   # of its creates: a 409 although nothing exists


def _start(kube: KubeAPI, tmp: Path, proxy: FaultProxy, name: str, *args: str) -> Env:
    apply_crd(kube)
    ns = f"{name}-{random.randbytes(3).hex()}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    op = Operator(proxy.kubeconfig(), ns, tmp / "operator.log", resync_s=30.0,
                  extra_args=(f"--qps={QPS}", f"--burst={BURST}", *args)).start()
    return Env(kube, ns, op)


@pytest.fixture(name="proxy")
def proxy_fixture(kube: KubeAPI, tmp_path: Path) -> Iterator[FaultProxy]:
    proxy = FaultProxy(kube, tmp_path).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def _manifest(env: Env, name: str) -> dict[str, Any]:
    return env.manifest(name, {"target": {"nodes": 1, "parallelism": {"data": 1, "pipeline": 1, "microbatches": 1}}})


def _honoured(seen: list[Seen]) -> tuple[int, list[str]]:
    """(429s followed by a retry of the same request, those retried sooner than Retry-After)."""
    later: dict[tuple[str, str, str, str], list[Seen]] = {}
    for s in seen:
        later.setdefault((s.method, s.path, s.query, s.name), []).append(s)
    checked, early = 0, []
    for reqs in later.values():
        for a, b in zip(reqs, reqs[1:], strict=False):
            if a.fault == 429:
                checked += 1
                if b.at - a.at < RETRY_AFTER_S - 0.01:
                    early.append(f"{a.method} {a.path} {a.name}: retried after {b.at - a.at:.3f}s")
    return checked, early


def test_converges_under_injected_429_500_409_within_its_qps(kube: KubeAPI, tmp_path: Path, proxy: FaultProxy) -> None:
    # Not on Secrets: the operator may not read them, so a 409 on the fleet key with nothing there
    # is, to it, a Secret someone else planted (the owner-mismatch test below).
    faults = FaultPolicy(seed=7, fault_rate=FAULT_RATE, retry_after_s=RETRY_AFTER_S, conflict_rate=CONFLICT_RATE,
                         no_conflict_suffixes=("/events", "/secrets"))
    env = _start(kube, tmp_path, proxy, "pressure")
    try:
        wait_for(lambda: any(s.watch and "pods" in s.path for s in proxy.requests()), 30, what="the pod watch")
        proxy.set_policy(faults)
        t0 = time.monotonic()
        for i in range(JOBS):
            env.create(_manifest(env, f"j{i:03d}"))

        def converged() -> bool:
            env.operator.check_alive()
            pods = env.core.list_namespaced_pod(env.ns, label_selector="spectrain.io/job-name").items
            return len(pods) >= JOBS
        wait_for(converged, 240, interval=1.0, what=f"a pod for each of {JOBS} jobs")
        for i in range(JOBS):
            wait_for(lambda i=i: env.status(f"j{i:03d}").get("phase"), 60, interval=0.2, what=f"j{i:03d} status")
        took = time.monotonic() - t0
        seen = proxy.requests(t0)
        proxy.set_policy(FaultPolicy())

        pods = env.core.list_namespaced_pod(env.ns, label_selector="spectrain.io/job-name").items
        per_job: dict[str, int] = {}
        for p in pods:
            per_job[p.metadata.labels["spectrain.io/job-name"]] = per_job.get(p.metadata.labels["spectrain.io/job-name"], 0) + 1
        assert len(per_job) == JOBS and set(per_job.values()) == {1}, "duplicate or missing pods"
        maps = env.core.list_namespaced_config_map(env.ns, label_selector="spectrain.io/job-name").items
        assert len(maps) == JOBS, f"{len(maps)} ConfigMaps for {JOBS} jobs"

        injected = {code: sum(1 for s in seen if s.fault == code) for code in (429, 500, 409)}
        assert all(injected.values()), f"every fault kind injected: {injected}"
        checked, early = _honoured(seen)
        assert checked >= 10 and not early, f"Retry-After not honoured ({checked} checked): {early[:5]}"

        rates = per_second(seen)
        busy = [s.at for s in seen]
        mean = len(seen) / max(busy[-1] - busy[0], 1e-9)
        print(f"{JOBS} jobs converged in {took:.1f}s through {len(seen)} requests; injected {injected}; "
              f"{checked} retries after 429 all waited >= {RETRY_AFTER_S}s; requests/s: mean {mean:.1f}, "
              f"densest 1-s window {max(rates)} (limit: qps {QPS}, burst {BURST})")
        # The token bucket's bound: at most burst + qps * T in any T seconds (kopf's own few watch
        # requests bypass it, hence the small allowance).
        assert max(rates) <= QPS + BURST + 4
        assert mean <= QPS * 1.05
    finally:
        env.operator.stop()


def test_recovers_from_dropped_watches_and_watches_only_job_pods(kube: KubeAPI, tmp_path: Path,
                                                                  proxy: FaultProxy) -> None:
    proxy.set_policy(FaultPolicy(drop_watches_after_s=2.0))
    env = _start(kube, tmp_path, proxy, "drops")
    try:
        env.create(_manifest(env, "w1"))
        (pod,) = env.wait_pods("w1", 1)
        wait_for(lambda: proxy.watches_dropped >= 2, 30, what="watches dropped")
        # The pod's changes arrive only through a watch the proxy keeps cutting.
        env.run_pods("w1", [pod])
        env.wait_phase("w1", "Running")
        wait_for(lambda: proxy.watches_dropped >= 4, 30, what="more watches dropped")
        env.exit_pod(pod["metadata"]["name"], 0)
        env.wait_phase("w1", "Succeeded")
        pod_watches = [s for s in proxy.requests() if s.watch and s.path.endswith("/pods")]
        assert pod_watches and all("labelSelector=spectrain.io%2Fjob-name" in s.query
                                   or "labelSelector=spectrain.io/job-name" in s.query for s in pod_watches)
        watches = [s for s in proxy.requests() if s.watch]
        span = watches[-1].at - watches[0].at
        print(f"{proxy.watches_dropped} watches dropped; {len(watches)} watch requests in {span:.1f}s")
        # kopf reconnects after handlers.WATCH_RECONNECT_S, not in a tight loop (2 streams: jobs, pods).
        assert len(watches) <= 2 * (span / 2.0 + 2) + 2
    finally:
        env.operator.stop()


def test_a_409_on_an_object_of_another_owner_is_an_error_on_the_job(kube: KubeAPI, tmp_path: Path,
                                                                    proxy: FaultProxy) -> None:
    env = _start(kube, tmp_path, proxy, "owner")
    try:
        foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c1-config", "namespace": env.ns},
                   "data": {"owner": "someone else"}}
        env.core.create_namespaced_config_map(env.ns, foreign)
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s1-fleet-key", "namespace": env.ns},
                  "stringData": {"key": "0" * 64}}
        env.core.create_namespaced_secret(env.ns, secret)
        env.create(_manifest(env, "c1"))
        env.create(_manifest(env, "s1"))
        for name, kind, obj in (("c1", "ConfigMap", "c1-config"), ("s1", "Secret", "s1-fleet-key")):
            env.wait_phase(name, "Failed")
            messages = " ".join(c.get("message", "") for c in env.status(name).get("conditions") or [])
            assert f"{kind} {env.ns}/{obj} already exists and is not owned by this job" in messages, messages
            assert f"kubectl -n {env.ns} delete {kind.lower()} {obj}" in messages
            assert any(f"{obj} already exists" in e["message"] for e in env.events(name))
            assert env.pods(name) == []
        # the foreign objects are untouched
        assert env.core.read_namespaced_config_map("c1-config", env.ns).data == {"owner": "someone else"}
        # a job whose objects are all its own runs normally alongside
        env.create(_manifest(env, "ok"))
        env.wait_pods("ok", 1)
    finally:
        env.operator.stop()
