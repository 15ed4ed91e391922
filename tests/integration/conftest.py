"""Integration fixtures: `kube`, a real etcd + kube-apiserver for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.kubeapi import KubeAPI, KubeBinariesMissing


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """etcd + kube-apiserver 1.20 on free loopback ports, RBAC on, admin kubeconfig at `.kubeconfig`.

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
