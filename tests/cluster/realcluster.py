"""A real two-node Kubernetes cluster for tests: scripts/cluster/cluster.sh (etcd, kube-apiserver,
controller-manager, scheduler, CoreDNS; per node containerd 2.x + runc, kubelet, kube-proxy, CNI
bridge, each member in its own network/PID/mount namespace).

`real_cluster()` brings it up (building what is missing: ~20 min the first time on 2 cores, seconds
warm), yields a `RealCluster` and brings it down afterwards, unless it was already up when the
session started (then it is left running) or SPECTRAIN_CLUSTER_KEEP=1. Needs root.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "scripts" / "cluster" / "cluster.sh"
TEST_IMAGE_SH = ROOT / "scripts" / "cluster" / "test-image.sh"
NODES = ("spectrain-n1", "spectrain-n2")


def _run(*args: str, timeout: float) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


@dataclass
class RealCluster:
    kubeconfig: Path
    nodes: tuple[str, ...] = NODES

    @property
    def netpol(self) -> bool:
        """NetworkPolicy is enforced (kube-router, firewall only, runs on every node)."""
        return (self.kubeconfig.parent / "n1" / "run.d" / "50-kube-router.sh").exists()

    def load_image(self, archive: str | Path) -> None:
        """Import a docker/OCI archive into every node's containerd (pods: imagePullPolicy Never)."""
        _run("bash", str(CLUSTER_SH), "load-image", str(archive), timeout=900)

    def kill_container(self, node: str, container_id: str) -> None:
        """SIGKILL a container's process on `node` (containerStatuses[].containerID), as a crash
        would: no SIGTERM, no cleanup; the kubelet sees it exit 137."""
        _run("bash", str(CLUSTER_SH), "kill-container", node, container_id, timeout=60)

    def stop_node(self, node: str) -> None:
        """SIGKILL `node`'s kubelet, containerd and every container at once, as a node crash would."""
        _run("bash", str(CLUSTER_SH), "stop-node", node, timeout=120)

    def start_node(self, node: str) -> None:
        """Start a stopped `node` again (its state and images kept), until it is Ready."""
        _run("bash", str(CLUSTER_SH), "start-node", node, timeout=600)

    def test_image(self) -> str:
        """Build (cached) and load the small smoke-test image; return its name."""
        archive = _run("bash", str(TEST_IMAGE_SH), timeout=900).strip().splitlines()[-1]
        self.load_image(archive)
        return _run("bash", str(TEST_IMAGE_SH), "--name", timeout=30).strip()

    def api_client(self):  # -> kubernetes.client.ApiClient
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))


def _is_up() -> bool:
    return subprocess.run(["bash", str(CLUSTER_SH), "status"], capture_output=True).returncode == 0


@contextmanager
def real_cluster() -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        raise PermissionError("the real-node cluster needs root (network namespaces, cgroups, mounts)")
    was_up = _is_up()
    try:
        _run("bash", str(CLUSTER_SH), "up", timeout=3600)
        env = _run("bash", str(CLUSTER_SH), "env", timeout=30).strip()
        kubeconfig = Path(env.removeprefix("export KUBECONFIG="))
        yield RealCluster(kubeconfig=kubeconfig)
    finally:
        if not was_up and os.environ.get("SPECTRAIN_CLUSTER_KEEP") != "1":
            _run("bash", str(CLUSTER_SH), "down", timeout=600)
