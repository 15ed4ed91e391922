"""A small cluster on the current server for the tests that schedule pods for real: kube-scheduler,
the node-lifecycle and resourceclaim controllers, kwok's fake kubelets, and fake GPU nodes
(nvidia.com/gpu capacity, and DRA ResourceSlices for their GPUs so the scheduler allocates claims).

The fake nodes carry a NoSchedule taint that only pods with TOLERATION tolerate: every other pod
of the suite stays unscheduled, so the tests that play the kubelet (exit codes, restarts) are
undisturbed. Used as the module-scoped `cluster` fixture (import it into the test module).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.kubeapi import KubeAPI
from tests.waiting import wait_for

NODES = ("gpu-node-0", "gpu-node-1")
GPUS_PER_NODE = 4
DRA_DRIVER = "gpu.nvidia.com"
TOLERATION = {"key": KubeAPI.FAKE_NODE_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}


def _resource_slice(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRA_DRIVER}"},
        "spec": {
            "driver": DRA_DRIVER, "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}",
                         "attributes": {"type": {"string": "gpu"}, "index": {"int": i},
                                        "productName": {"string": "Fake H100"}},
                         "capacity": {"memory": {"value": "80Gi"}}} for i in range(GPUS_PER_NODE)],
        },
    }


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture(kube: KubeAPI) -> KubeAPI:
    """kube-scheduler, the node-lifecycle and resourceclaim controllers, kwok and two fake GPU nodes
    (with DRA slices)."""
    if kube.flavor != "current":
        pytest.skip("kube-scheduler and kwok are built with the current server only (SPECTRAIN_KUBE=current)")
    kube.start_kwok()
    kube.start_node_controllers()
    for node in NODES:
        kube.add_fake_node(node, gpus=GPUS_PER_NODE)
    kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRA_DRIVER},
                "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRA_DRIVER}'"}}]}})
    for node in NODES:
        kube.apply(_resource_slice(node))

    def ready(node: str) -> bool:
        n = kube.get("v1", "Node", node) or {}
        conds = (n.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def schedulable(node: str) -> bool:  # the node-lifecycle controller lifts the not-ready taint
        taints = ((kube.get("v1", "Node", node) or {}).get("spec") or {}).get("taints") or []
        return ready(node) and all(t["key"] == KubeAPI.FAKE_NODE_TAINT["key"] for t in taints)

    for node in NODES:
        wait_for(lambda node=node: schedulable(node), 90, interval=0.2, what=f"{node} Ready and untainted")
    kube.start_scheduler()
    return kube
