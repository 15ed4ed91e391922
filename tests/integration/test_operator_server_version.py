"""The supported Kubernetes range against real servers (unit side: tests/unit/operator/test_server_version.py).

- The operator reads the server version at start: on the session's server (>= 1.29) it runs and
  serves liveness; on a 1.20 kube-apiserver (the old tier's binaries, `make kube-binaries-legacy`) it
  logs why and exits 3 without ever serving liveness.
- A DRA job where resource.k8s.io/v1 is served gets its ResourceClaimTemplate; on a current server
  started with that API turned off (--runtime-config=resource.k8s.io/v1=false) it fails SpecInvalid.
"""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spectrain_operator.kube import EXIT_UNSUPPORTED_SERVER, MIN_SERVER_VERSION
from tests.integration.kubeapi import KubeAPI, KubeBinariesMissing, find_binaries
from tests.integration.operator_harness import Env, Operator, apply_crd, env_fixture  # noqa: F401  (the env fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def _healthz(op: Operator) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{op.port}/healthz", timeout=1) as r:
            return r.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def _namespace(kube: KubeAPI) -> str:
    ns = f"ver-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    return ns


def _expect_refusal(kube: KubeAPI, log: Path) -> None:
    op = Operator(kube.kubeconfig, "default", log).start()
    try:
        assert op.proc is not None
        rc = op.proc.wait(60)
        text = log.read_text(errors="replace")
        assert rc == EXIT_UNSUPPORTED_SERVER == 3, text
        assert f"not starting: Kubernetes {kube.version_info['gitVersion']} is older than 1.29" in text, text
        assert not _healthz(op)
    finally:
        op.stop()


def test_the_operator_runs_on_the_session_server_or_refuses_it(kube: KubeAPI, tmp_path: Path) -> None:
    if kube.version < MIN_SERVER_VERSION:
        _expect_refusal(kube, tmp_path / "operator.log")
        return
    op = Operator(kube.kubeconfig, _namespace(kube), tmp_path / "operator.log").start()
    try:
        wait_for(lambda: op.check_alive() or _healthz(op), 60, interval=0.2, what="operator liveness")
        assert f"Kubernetes API server {kube.version_info['gitVersion']}" in op.log_tail(200)
    finally:
        op.stop()


def test_the_operator_refuses_a_1_20_server(kube: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> None:
    if kube.flavor == "1.20":
        pytest.skip("the session server is 1.20: test_the_operator_runs_on_the_session_server_or_refuses_it covers it")
    try:
        find_binaries("1.20")
    except KubeBinariesMissing as exc:
        pytest.skip(f"no 1.20 binaries to refuse ({exc}); `make kube-binaries-legacy` builds them")
    old = KubeAPI(tmp_path_factory.mktemp("kube120"), flavor="1.20").start()
    try:
        assert old.version == (1, 20)
        _expect_refusal(old, tmp_path_factory.mktemp("op120") / "operator.log")
    finally:
        old.cleanup()


def _dra_job(env: Env, name: str) -> dict:
    return env.manifest(name, {"gpuSharing": {"mode": "DRA", "gpusPerNode": 1}})


@pytest.fixture(scope="module")
def no_dra_env(kube: KubeAPI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A second current server with resource.k8s.io/v1 turned off, the CRD and an operator."""
    if kube.version < MIN_SERVER_VERSION:
        pytest.skip(f"the operator does not run on {kube.version_info['gitVersion']}")
    api = KubeAPI(tmp_path_factory.mktemp("kube-nodra"), flavor=kube.flavor,
                  apiserver_args=["--runtime-config=resource.k8s.io/v1=false"]).start()
    try:
        apply_crd(api)
        ns = _namespace(api)
        op = Operator(api.kubeconfig, ns, tmp_path_factory.mktemp("op-nodra") / "operator.log").start()
        try:
            yield Env(api, ns, op)
        finally:
            op.stop()
    finally:
        api.cleanup()


def test_a_dra_job_fails_spec_invalid_where_resource_k8s_io_v1_is_off(no_dra_env: Env) -> None:
    env = no_dra_env
    assert env.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", "spectrainjobs.spectrain.io")
    env.create(_dra_job(env, "dra"))
    st = env.wait_phase("dra", "Failed")
    cond = env.condition("dra", "SpecInvalid")
    assert cond is not None and cond["status"] == "True", st
    assert cond["message"].startswith("spec.gpuSharing.mode: DRA needs the resource.k8s.io/v1 API"), cond
    assert env.pods("dra") == []
    # a job of another mode runs on the same server
    env.create(env.manifest("plain"))
    env.wait_pods("plain", 2)


def test_a_dra_job_gets_its_resource_claim_template_where_resource_k8s_io_v1_is_served(
        kube: KubeAPI, request: pytest.FixtureRequest) -> None:
    if kube.version < (1, 34):
        pytest.skip(f"resource.k8s.io/v1 is GA from 1.34; the session server is {kube.version_info['gitVersion']}")
    env: Env = request.getfixturevalue("env")
    env.create(_dra_job(env, "dra-ok"))
    pods = env.wait_pods("dra-ok", 2)
    rct = env.kube.get("resource.k8s.io/v1", "ResourceClaimTemplate", "dra-ok-gpu", env.ns)
    assert rct is not None and rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
    for p in pods:
        assert p["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "dra-ok-gpu"}], p["spec"]
    assert env.condition("dra-ok", "SpecInvalid") is None
