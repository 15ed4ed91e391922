"""spectrain on the real two-node cluster as a platform team installs it: the images built from the
project's Dockerfiles (scripts/images/build.sh) loaded into both nodes, the chart installed by the
real helm (scripts/build-helm.sh), a namespace under Pod Security `restricted` for the jobs, and a
ReadWriteMany run volume (a static hostPath PersistentVolume: both nodes share this machine's
disk, as a cluster shares an NFS export).

`Stack` is what the job tests use: `apply(manifest)`, `wait_phase`, `status`, `condition`, `events`,
`pods`, `run_volume` (the host directory behind the job's claim) and `kubectl`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from spectrain_api.names import API_VERSION, KIND
from tests.cluster.realcluster import RealCluster
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
IMAGES_SH = ROOT / "scripts" / "images" / "build.sh"
HELM_SH = ROOT / "scripts" / "build-helm.sh"
CHART = ROOT / "helm" / "spectrain-operator"
GROUP, VERSION = API_VERSION.split("/")
PLURAL = "spectrainjobs"
OPERATOR_NS = "spectrain-system"
RELEASE = "spectrain"
LEASE = "spectrain-operator"       # the chart's leaderElection.leaseName
LEASE_DURATION_S = 15              # its leaderElection.leaseDurationSeconds
IMAGE_UID = 1000           # the workloads image's user (spectrain_api.names.IMAGE_UID)


def _run(*args: str, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def build_images() -> dict[str, Path]:
    """The operator and workloads archives (cached by their inputs' hash: seconds when warm)."""
    _run("bash", str(IMAGES_SH), "all", timeout=3600)
    cache = Path(os.environ.get("SPECTRAIN_IMAGES_CACHE", Path.home() / ".cache" / "spectrain" / "images"))
    return {"operator": cache / "spectrain-operator.tar", "workloads": cache / "spectrain-workloads-cpu.tar"}


def helm_bin() -> str:
    _run("bash", str(HELM_SH), timeout=1800)
    return str(Path(_run("bash", str(HELM_SH), "--print-bin", timeout=30).strip()) / "helm")


@dataclass
class Stack:
    cluster: RealCluster
    ns: str
    helm: str
    volumes: Path
    workloads_image: str = "docker.io/spectrain/workloads:dev-cpu"
    operator_image: str = "docker.io/spectrain/operator:dev"
    _api: Any = field(default=None, repr=False)

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = self.cluster.api_client()
        return self._api

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        return _run("kubectl", "--kubeconfig", str(self.cluster.kubeconfig), *args, timeout=timeout)

    # ------------------------------------------------------------------ volumes
    def claim(self, name: str) -> Path:
        """A ReadWriteMany claim `name` in the jobs' namespace bound to a hostPath PersistentVolume of
        its own; returns the host directory behind it (owned by the image's user)."""
        d = self.volumes / f"{self.ns}-{name}"
        d.mkdir(parents=True, exist_ok=True)
        # What a volume whose driver applies fsGroup looks like (docs/operations.md, "The run
        # claim"): group-writable and setgid, so the directories the kubelet creates for the
        # drafter's subPath mounts are the pods' group's too.
        os.chown(d, 0, IMAGE_UID)
        d.chmod(0o2775)
        pv = f"{self.ns}-{name}"
        self.core.create_persistent_volume(client.V1PersistentVolume(
            metadata=client.V1ObjectMeta(name=pv, labels={"spectrain-test": self.ns}),
            spec=client.V1PersistentVolumeSpec(
                capacity={"storage": "5Gi"}, access_modes=["ReadWriteMany"], storage_class_name="",
                persistent_volume_reclaim_policy="Retain", host_path=client.V1HostPathVolumeSource(path=str(d)),
                claim_ref=client.V1ObjectReference(namespace=self.ns, name=name))))
        self.core.create_namespaced_persistent_volume_claim(self.ns, client.V1PersistentVolumeClaim(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PersistentVolumeClaimSpec(access_modes=["ReadWriteMany"], storage_class_name="",
                                                    volume_name=pv,
                                                    resources=client.V1VolumeResourceRequirements(
                                                        requests={"storage": "5Gi"}))))
        wait_for(lambda: self.core.read_namespaced_persistent_volume_claim(name, self.ns).status.phase == "Bound",
                 60, 0.2, f"claim {name} bound")
        return d

    # ------------------------------------------------------------------ the operator
    def operator_pods(self) -> list[Any]:
        return list(self.core.list_namespaced_pod(
            OPERATOR_NS, label_selector="app.kubernetes.io/name=spectrain-operator").items)

    def lease_holder(self) -> str:
        """The Lease's holderIdentity; "" while nobody holds it (or no replica has created it yet)."""
        try:
            lease = client.CoordinationV1Api(self.api).read_namespaced_lease(LEASE, OPERATOR_NS)
        except ApiException as exc:
            if exc.status == 404:
                return ""
            raise
        return str(lease.spec.holder_identity or "")

    def leader_pod(self) -> Any:
        """The operator pod holding the Lease (holderIdentity is <pod name>_<per-process suffix>),
        once one of this install does (a Lease left by an earlier install expires first)."""
        def find() -> Any:
            holder = self.lease_holder()
            return next((p for p in self.operator_pods() if holder.startswith(p.metadata.name + "_")), None)
        return wait_for(find, LEASE_DURATION_S + 30, 0.2, "a replica of this install leading")

    def kill_leader(self) -> tuple[str, float]:
        """SIGKILL the leading replica's container (no graceful release of the Lease); wait until
        another replica holds it. Returns (the old holder, seconds from the kill to the handover)."""
        victim = self.leader_pod()
        leader = self.lease_holder()
        (status,) = victim.status.container_statuses
        t0 = time.monotonic()
        self.cluster.kill_container(victim.spec.node_name, status.container_id)
        wait_for(lambda: self.lease_holder() not in ("", leader), LEASE_DURATION_S + 30, 0.2,
                 "another replica holding the Lease")
        return leader, time.monotonic() - t0

    # ------------------------------------------------------------------ jobs
    def example(self, path: str) -> dict[str, Any]:
        """examples/<path> unchanged but for the image (the one built here) and the namespace."""
        m: dict[str, Any] = yaml.safe_load((ROOT / "examples" / path).read_text())
        m["metadata"]["namespace"] = self.ns
        m["spec"]["target"]["image"] = self.workloads_image
        return m

    def apply(self, manifest: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, manifest)

    def delete(self, name: str) -> None:
        """Delete a job if it is there (its children go with it: ownerReferences)."""
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
            return out
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == type_), None)

    def wait_phase(self, name: str, phase: str, timeout: float) -> dict[str, Any]:
        def reached() -> bool:
            st = self.status(name)
            if st.get("phase") == "Failed" and phase != "Failed":
                raise AssertionError(f"job {name} Failed: {json.dumps(st, indent=1)[:3000]}\n{self.describe(name)}")
            return st.get("phase") == phase
        try:
            wait_for(reached, timeout, 1.0, f"job {name} {phase}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {json.dumps(self.status(name), indent=1)[:3000]}\n{self.describe(name)}") from None
        return self.status(name)

    def pods(self, name: str) -> list[Any]:
        return list(self.core.list_namespaced_pod(self.ns, label_selector=f"spectrain.io/job-name={name}").items)

    def events(self, name: str) -> list[Any]:
        return [e for e in self.core.list_namespaced_event(self.ns).items
                if e.involved_object.kind == KIND and e.involved_object.name == name]

    def logs(self, pod: str, container: str) -> str:
        try:
            return str(self.core.read_namespaced_pod_log(pod, self.ns, container=container))
        except ApiException as exc:
            return f"<no log: {exc.status}>"

    def describe(self, name: str) -> str:
        """What a person would look at when a job goes wrong (for assertion messages)."""
        out = [self.kubectl("-n", self.ns, "describe", "stj", name)]
        pods = self.pods(name)
        if pods:
            out.append(self.kubectl("-n", self.ns, "describe", "pod", *(p.metadata.name for p in pods))[-6000:])
        for p in pods:
            for c in ("target", "drafter"):
                out.append(f"--- {p.metadata.name}/{c}\n{self.logs(p.metadata.name, c)[-3000:]}")
        try:
            out.append(self.kubectl("-n", OPERATOR_NS, "logs", "--tail=80", "-l",
                                    "app.kubernetes.io/name=spectrain-operator", "--prefix"))
        except RuntimeError as exc:   # a replica on a stopped node has no log to give
            out.append(f"operator logs: {exc}"[:2000])
        return "\n".join(out)


@contextmanager
def installed(cluster: RealCluster, tmp: Path) -> Iterator[Stack]:
    """Images loaded, the chart installed (2 replicas, watching a fresh restricted namespace), and
    everything removed afterwards."""
    archives = build_images()
    for a in archives.values():
        cluster.load_image(a)
    helm = helm_bin()
    ns = f"jobs-{uuid.uuid4().hex[:6]}"
    stack = Stack(cluster=cluster, ns=ns, helm=helm, volumes=tmp / "volumes")
    core = stack.core
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, labels={"pod-security.kubernetes.io/enforce": "restricted",
                         "pod-security.kubernetes.io/enforce-version": "latest"})))
    henv = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HELM_CACHE_HOME": str(tmp / "helm-cache"),
            "HELM_CONFIG_HOME": str(tmp / "helm-config"), "HELM_DATA_HOME": str(tmp / "helm-data")}
    repo, tag = stack.operator_image.rsplit(":", 1)
    try:
        _run(helm, "install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
             "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "replicaCount=2",
             "--set", f"watchNamespaces={{{ns}}}", "--wait", "--timeout", "5m", timeout=400, env=henv)
        yield stack
    finally:
        for job in stack.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL).get("items", []):
            stack.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job["metadata"]["name"])
        _run(helm, "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", "--timeout", "2m", timeout=200, env=henv)
        core.delete_namespace(ns)
        for pv in core.list_persistent_volume(label_selector=f"spectrain-test={ns}").items:
            core.delete_persistent_volume(pv.metadata.name)
