"""The supported Kubernetes range, enforced: the operator reads the API server's version at start
and refuses to run below kube.MIN_SERVER_VERSION; a DRA job on a server without resource.k8s.io/v1
fails with SpecInvalid. (Against real servers: tests/integration/test_operator_server_version.py.)"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from spectrain_operator import __main__ as opmain
from spectrain_operator import kube as kubemod
from spectrain_operator.kube import (
    EXIT_UNSUPPORTED_SERVER,
    MIN_SERVER_VERSION,
    TransientError,
    UnsupportedServer,
    check_server_version,
    server_version,
)
from spectrain_operator.reconciler import Reconciler
from tests.unit.operator.test_reconciler import FakeKube, job

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("info", "expected"), [
    ({"major": "1", "minor": "37", "gitVersion": "v1.37.2"}, (1, 37)),
    ({"major": "1", "minor": "29+", "gitVersion": "v1.29.3-eks-adc7111"}, (1, 29)),
    ({"major": "1", "minor": "20", "gitVersion": "v1.20.2"}, (1, 20)),
    ({"major": "1", "minor": "31+", "gitVersion": ""}, (1, 31)),  # no gitVersion: major/minor
    ({"major": "", "minor": "", "gitVersion": "v0.0.0-master+$Format:%H$"}, (0, 0)),  # an unstamped build
    ({}, None),
])
def test_server_version_parses_what_servers_report(info: dict[str, str], expected: tuple[int, int] | None) -> None:
    assert server_version(info) == expected


def test_the_supported_range_starts_at_1_29() -> None:
    assert MIN_SERVER_VERSION == (1, 29)
    assert check_server_version({"gitVersion": "v1.29.0"}) == "v1.29.0"
    assert check_server_version({"gitVersion": "v1.37.2"}) == "v1.37.2"
    assert check_server_version({"major": "2", "minor": "0"}) == "2.0"
    for old in ({"gitVersion": "v1.28.15"}, {"gitVersion": "v1.20.2"}, {"major": "1", "minor": "25+"}):
        with pytest.raises(UnsupportedServer) as exc:
            check_server_version(old)
        assert "older than 1.29" in str(exc.value) and "native sidecars" in str(exc.value)
    with pytest.raises(UnsupportedServer, match="no version"):
        check_server_version({"platform": "linux/amd64"})


class _VersionKube:
    def __init__(self, answers: list[Any]):
        self.answers = answers
        self.calls = 0

    def server_info(self) -> dict[str, str]:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)


def test_check_server_retries_while_the_server_is_unreachable() -> None:
    k = _VersionKube([TransientError("GET /version: connection refused"), {"gitVersion": "v1.34.1"}])
    assert opmain.check_server(k, timeout=5, pause=0) == "v1.34.1"  # type: ignore[arg-type]
    assert k.calls == 2
    k = _VersionKube([TransientError("down")] * 3)
    with pytest.raises(TransientError):
        opmain.check_server(k, timeout=0, pause=0)  # type: ignore[arg-type]


def test_main_exits_3_with_the_reason_on_an_unsupported_server(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    fake = _VersionKube([{"major": "1", "minor": "20", "gitVersion": "v1.20.2"}])
    monkeypatch.setattr(kubemod.Kube, "from_environment", classmethod(lambda cls, kubeconfig=None, **limits: fake))
    ran: list[Any] = []
    monkeypatch.setattr(opmain.kopf, "run", lambda **kw: ran.append(kw))
    monkeypatch.setattr(opmain.kopf, "configure", lambda **kw: None)
    with caplog.at_level(logging.ERROR, logger="spectrain.operator"):
        assert opmain.main(["--standalone", "--metrics-port=0"]) == EXIT_UNSUPPORTED_SERVER == 3
    assert ran == [], "kopf (and its liveness endpoint) must not start"
    assert "Kubernetes v1.20.2 is older than 1.29" in caplog.text


class _DraKube(FakeKube):
    def __init__(self, job: dict[str, Any], served: bool):
        super().__init__(job)
        self.served, self.asked = served, 0

    def serves(self, api_version: str) -> bool:
        assert api_version == "resource.k8s.io/v1"
        self.asked += 1
        return self.served


def _dra_job() -> dict[str, Any]:
    j = job(gpuSharing={"mode": "DRA", "gpusPerNode": 1})
    return j


@pytest.mark.parametrize("served", [False, True])
def test_a_dra_job_fails_spec_invalid_where_resource_k8s_io_v1_is_not_served(served: bool) -> None:
    kube = _DraKube(_dra_job(), served)
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        r.reconcile_once("team", "k")
        r.reconcile_once("team", "k")
    finally:
        r.close()
    st = kube.job["status"]
    conds = {c["type"]: c for c in st.get("conditions") or []}
    if served:
        assert "SpecInvalid" not in conds, conds
        assert ("ResourceClaimTemplate", "k-gpu") in kube.creates
    else:
        assert st["phase"] == "Failed"
        msg = conds["SpecInvalid"]["message"]
        assert msg.startswith("spec.gpuSharing.mode: DRA needs the resource.k8s.io/v1 API (Kubernetes >= 1.34)"), msg
        assert kube.creates == []
    assert kube.asked == 1, "the answer is cached"


def test_jobs_of_other_modes_never_ask_about_dra() -> None:
    kube = _DraKube(copy.deepcopy(job()), served=False)
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        r.reconcile_once("team", "k")
    finally:
        r.close()
    assert kube.asked == 0 and kube.job["status"]["phase"] != "Failed"
