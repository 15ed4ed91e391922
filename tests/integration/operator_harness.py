"""A namespace with the SpecTrainJob CRD and the operator running against the real apiserver
(`python -m spectrain_operator --standalone --namespace NS`, admin credentials), plus helpers that
play the kubelet by patching pods/status. Used by tests/integration/test_operator_*.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from spectrain_api.names import GROUP, KIND, PLURAL, VERSION
from tests.integration.kubeapi import KubeAPI, free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "spectrain.io_spectrainjobs.yaml"

LABEL_JOB = "spectrain.io/job-name"
STEP = 30.0  # deadline per expected outcome


class Operator:
    """`python -m spectrain_operator` as a child process; logs go to a file."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, resync_s: float = 1.0,
                 metrics_port: int = 0, extra_args: tuple[str, ...] = ()):
        self.kubeconfig, self.namespace, self.log_path, self.resync_s = kubeconfig, namespace, log_path, resync_s
        self.metrics_port = metrics_port    # 0: no /metrics server
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> Operator:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KOPF_"))}
        env.update(KUBECONFIG=str(self.kubeconfig), SPECTRAIN_RESYNC_SECONDS=str(self.resync_s),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "operator"), str(ROOT / "workloads")]))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spectrain_operator", "--standalone", "--namespace", self.namespace,
                 f"--liveness=http://127.0.0.1:{self.port}/healthz", f"--metrics-port={self.metrics_port}",
                 *self.extra_args],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def check_alive(self) -> None:
        if not self.alive:
            raise AssertionError(f"operator exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}")

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class Env:
    """One namespace, the CRD, an operator; helpers for jobs and pods."""

    def __init__(self, kube: KubeAPI, namespace: str, operator: Operator):
        self.kube, self.ns, self.operator = kube, namespace, operator
        api = kube.api_client()
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)

    # ------------------------------------------------------------ jobs
    def manifest(self, name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        base: dict[str, Any] = {"target": {"image": "img:1", "nodes": 2, "steps": 10,
                                           "parallelism": {"data": 2, "pipeline": 1, "microbatches": 2}},
                                "runPolicy": {"backoffSeconds": 1}}
        for key, value in (spec or {}).items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                "metadata": {"name": name, "namespace": self.ns}, "spec": base}

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, manifest)
        return out

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
            return out
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status(name).get("conditions") or [] if c.get("type") == type_), None)

    def wait_phase(self, name: str, phase: str, timeout: float = STEP) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            self.operator.check_alive()
            st = self.status(name)
            return st if st.get("phase") == phase else None
        try:
            return wait_for(reached, timeout, interval=0.1, what=f"{name} phase {phase}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; status: {json.dumps(self.status(name))[:1500]}\n"
                                 f"operator log:\n{self.operator.log_tail()}") from None

    # ------------------------------------------------------------ pods (playing the kubelet)
    def pods(self, name: str) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_pod(self.ns, label_selector=f"{LABEL_JOB}={name}",
                                              _preload_content=False)
        pods = json.loads(items.data)["items"]
        return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")),
                      key=lambda p: p["metadata"]["name"])

    def wait_pods(self, name: str, count: int, generation: int | None = None, timeout: float = STEP) -> list[dict[str, Any]]:
        def ready() -> tuple[list[dict[str, Any]]] | None:
            self.operator.check_alive()
            pods = self.pods(name)
            if generation is not None:
                pods = [p for p in pods if p["metadata"]["labels"].get("spectrain.io/restart-generation")
                        == str(generation)]
            return (pods,) if len(pods) == count else None  # a tuple: truthy even for zero pods
        try:
            return wait_for(ready, timeout, interval=0.1, what=f"{count} pods of {name} (generation {generation})")[0]
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; have {[p['metadata']['name'] for p in self.pods(name)]}; "
                                 f"status {json.dumps(self.status(name))[:1200]}\n{self.operator.log_tail()}") from None

    def set_pod(self, pod: str, phase: str, target: dict[str, Any], drafter: dict[str, Any] | None = None,
                ready: bool = False) -> None:
        def cs(name: str, state: dict[str, Any], restarts: int = 0, last: dict[str, Any] | None = None) -> dict[str, Any]:
            out = {"name": name, "ready": ready, "restartCount": restarts, "image": "img:1", "imageID": "",
                   "state": state}
            if last:
                out["lastState"] = last
            return out
        status: dict[str, Any] = {"phase": phase, "containerStatuses": [cs("target", target)],
                                  "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if drafter is not None:
            status["initContainerStatuses"] = [cs("drafter", drafter.get("state", {"running": {}}),
                                                  drafter.get("restartCount", 0), drafter.get("lastState"))]
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def run_pods(self, name: str, pods: list[dict[str, Any]]) -> None:
        for p in pods:
            self.set_pod(p["metadata"]["name"], "Running", {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                         ready=True)

    def exit_pod(self, pod: str, code: int, message: str = "") -> None:
        """The target terminated with `code`; `message`: its termination message (what the
        workload wrote to /dev/termination-log)."""
        term: dict[str, Any] = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                               "startedAt": "2026-01-01T00:00:00Z",
                                               "finishedAt": "2026-01-01T00:01:00Z"}}
        if message:
            term["terminated"]["message"] = message
        self.set_pod(pod, "Succeeded" if code == 0 else "Failed", term)

    def annotate_pod(self, pod: str, annotations: dict[str, str]) -> None:
        self.core.patch_namespaced_pod(pod, self.ns, {"metadata": {"annotations": annotations}})

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}",
                                                _preload_content=False)
        return list(json.loads(items.data)["items"])


def apply_crd(kube: KubeAPI) -> None:
    kube.apply(yaml.safe_load(CRD.read_text()))


def start_env(kube: KubeAPI, log_dir: Path, namespace_labels: dict[str, str] | None = None,
              metrics_port: int = 0) -> Env:
    """The CRD, a fresh namespace (with `namespace_labels`) and an operator watching it, serving
    /metrics on `metrics_port` if not 0; stop it with `env.operator.stop()`."""
    apply_crd(kube)
    ns = f"stj-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "labels": dict(namespace_labels or {})}})
    op = Operator(kube.kubeconfig, ns, log_dir / "operator.log", metrics_port=metrics_port).start()
    return Env(kube, ns, op)


@pytest.fixture(scope="module", name="env")
def env_fixture(kube: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    env = start_env(kube, tmp_path_factory.mktemp("operator"))
    try:
        yield env
    finally:
        env.operator.stop()
