"""e2e fixtures: the cluster in KUBECONFIG (e.g. kind), the CRD, a fresh namespace, an operator.

Opt-in: these tests only run with `pytest --e2e` (`make test-e2e`); without the flag
tests/conftest.py skips them with that reason. Needs:

- KUBECONFIG (or ~/.kube/config) pointing at a cluster with a real kubelet and a pod network,
  e.g. `kind create cluster`; the current user may create CRDs, namespaces, RBAC objects and pods;
- nodes able to pull SPECTRAIN_E2E_IMAGE (default `busybox:1.36`, a small public image: the tests
  override the workload command, so no spectrain image is needed; the drafter is disabled);
- the operator: by default the tests run `python -m spectrain_operator` from this checkout as a
  local process (with the KUBECONFIG credentials), watching only the test namespace; set
  SPECTRAIN_E2E_OPERATOR=external when an operator already runs in the cluster (the Helm chart),
  which must then watch the test namespace (install the chart with `--set clusterWide=true`, or list the
  test namespace in `watchNamespaces`; its default watches only the release namespace).

The CRD from crds/ is applied (created or replaced) before the tests; the namespace is deleted
afterwards (its jobs first, while the operator still runs).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.operator_harness import CRD, Env, Operator
from tests.waiting import wait_for

IMAGE = os.environ.get("SPECTRAIN_E2E_IMAGE", "busybox:1.36")
EXTERNAL_OPERATOR = os.environ.get("SPECTRAIN_E2E_OPERATOR", "") == "external"
TIMEOUT = float(os.environ.get("SPECTRAIN_E2E_TIMEOUT", "300"))  # per outcome: image pulls, scheduling


class Cluster:
    """The cluster in KUBECONFIG, shaped like tests.integration.kubeapi.KubeAPI for `Env`."""

    def __init__(self) -> None:
        path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
        self.kubeconfig = Path(path)
        if not self.kubeconfig.exists():
            pytest.fail(f"--e2e needs a cluster: no kubeconfig at {self.kubeconfig} (set KUBECONFIG, "
                        "e.g. after `kind create cluster`)", pytrace=False)

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def apply_crd(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        crd = yaml.safe_load(CRD.read_text())
        ext = client.ApiextensionsV1Api(self.api_client())
        try:
            ext.create_custom_resource_definition(crd)
        except ApiException as exc:
            if exc.status != 409:
                raise
            crd["metadata"]["resourceVersion"] = ext.read_custom_resource_definition(
                crd["metadata"]["name"]).metadata.resource_version
            ext.replace_custom_resource_definition(crd["metadata"]["name"], crd)

        def established() -> bool:
            conds = ext.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conds)
        wait_for(established, 60, interval=0.5, what="the SpecTrainJob CRD Established")


class E2EEnv(Env):
    """`Env` against a real cluster: manifests run a tiny command in a public image, no drafter."""

    def manifest(self, name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        spec = dict(spec or {})
        command = spec.pop("command", ["sh", "-c", "exit 0"])
        base = super().manifest(name, spec)
        base["spec"]["target"] = {**base["spec"]["target"], "image": IMAGE, "command": command,
                                  "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}
        base["spec"]["drafter"] = {"enabled": False}
        return base

    def wait_phase(self, name: str, phase: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        return super().wait_phase(name, phase, timeout)

    def wait_pods(self, name: str, count: int, generation: int | None = None,
                  timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        return super().wait_pods(name, count, generation, timeout)


class _ExternalOperator:
    """Stands in for `Operator` when the operator runs in the cluster: nothing to start or check."""

    alive = True

    def check_alive(self) -> None:
        pass

    def log_tail(self, n: int = 40) -> str:
        return "(operator runs in the cluster: see its pod's logs)"

    def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EEnv]:
    from kubernetes import client

    cluster = Cluster()
    cluster.apply_crd()
    ns = f"stj-e2e-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    op: Any = _ExternalOperator() if EXTERNAL_OPERATOR else Operator(
        cluster.kubeconfig, ns, tmp_path_factory.mktemp("operator") / "operator.log").start()
    env = E2EEnv(cluster, ns, op)  # type: ignore[arg-type]
    try:
        yield env
    finally:
        try:
            for job in env.custom.list_namespaced_custom_object("spectrain.io", "v1alpha1", ns,
                                                                "spectrainjobs")["items"]:
                env.custom.delete_namespaced_custom_object("spectrain.io", "v1alpha1", ns, "spectrainjobs",
                                                           job["metadata"]["name"])
            wait_for(lambda: not env.custom.list_namespaced_custom_object(
                "spectrain.io", "v1alpha1", ns, "spectrainjobs")["items"], 60, interval=0.5,
                what="the test jobs deleted")
        finally:
            op.stop()
            core.delete_namespace(ns)
