"""Fixtures of the real-node tier: `real_cluster`, a real two-node cluster for the tests of this package
(tests/cluster/realcluster.py; needs root; SPECTRAIN_CLUSTER_KEEP=1 leaves it up afterwards), and
`stack`, spectrain installed on it as a platform team installs it (tests/cluster/stack.py).

    def test_x(real_cluster):
        real_cluster.load_image("/path/image.tar")      # into both nodes' containerd
        api = real_cluster.api_client()                 # kubernetes.client.ApiClient (admin)
        # or: kubectl --kubeconfig real_cluster.kubeconfig ...
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster.realcluster import RealCluster
from tests.cluster.realcluster import real_cluster as _real_cluster
from tests.cluster.stack import Stack, installed


# Package scope: the cluster goes down when tests/cluster is done, not at the end of the whole
# suite, so its control loops do not load the 2 cores under the later tiers.
@pytest.fixture(scope="package")
def real_cluster() -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        pytest.skip("the real-node cluster needs root (network namespaces, cgroups, mounts)")
    with _real_cluster() as cluster:
        yield cluster


# The chart installed once for every job test of the package (images built and loaded, helm
# install with 2 replicas, a fresh restricted namespace): each job test names its own job.
@pytest.fixture(scope="package")
def stack(real_cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with installed(real_cluster, tmp_path_factory.mktemp("stack")) as s:
        yield s
