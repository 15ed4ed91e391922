"""Integration fixtures: `kube`, a real etcd + kube-apiserver for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.kubeapi import KubeAPI, KubeBinariesMissing


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """etcd + kube-apiserver on free loopback ports, RBAC on, admin kubeconfig at `.kubeconfig`: the
    release of scripts/kube/go.mod, or 1.20 with SPECTRAIN_KUBE=1.20 (tests/integration/kubeapi.py).

    Fails (never skips) when the binaries are missing: run `make kube-binaries`.
    """
    try:
        api = KubeAPI(tmp_path_factory.mktemp("kube"))
    except KubeBinariesMissing as e:
        pytest.fail(str(e), pytrace=False)
    api.start()
    try:
        yield api
    finally:
        api.cleanup()
