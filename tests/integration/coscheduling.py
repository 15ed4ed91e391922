"""The scheduler-plugins kube-scheduler, as `make kube-binaries` builds it
(scripts/build-kube-current.sh, cached in ~/.cache/spectrain/scheduler-plugins-<version>/:
bin/kube-scheduler, and podgroups.yaml, the PodGroup CRD of the same module), run against a test
control plane (tests/integration/kubeapi.py) as a second scheduler for gang scheduling.

How it is wired, and why:
- the PodGroup CRD (`scheduling.x-k8s.io/v1alpha1`) is installed from podgroups.yaml as it is,
  before the scheduler starts (the Coscheduling plugin reads PodGroups through a cache of its own);
- one profile, SCHEDULER_NAME: the cluster's kube-scheduler keeps `default-scheduler`, and only
  pods with `schedulerName: SCHEDULER_NAME` are this scheduler's. The profile is the one the
  Coscheduling README and manifests/coscheduling/scheduler-config.yaml of the release give:
  Coscheduling enabled at multiPoint (its queueSort, preFilter, postFilter, permit, reserve /
  unreserve extension points) and as the only queueSort plugin (a profile has exactly one);
  `permitWaitingTimeSeconds` as in those manifests (10 s: how long bound-to-be pods wait at Permit
  for the rest of their group);
- leader election off, no serving port (`--secure-port=0`), the admin kubeconfig;
- `--pod-max-in-unschedulable-pods-duration=UNSCHEDULABLE_FLUSH_S` (default 5 min): Coscheduling
  (v0.34.7) registers only Pod/Add and PodGroup Add/Update as the events that may make a pod it
  turned away schedulable, so a gang whose pods were all last turned away by Coscheduling itself
  (sent back from Permit when a sibling did not fit) is not retried when a Node is added: it waits
  in the unschedulable pool until this flush (seen here: a third GPU node, no scheduling attempt
  for 90 s). Whether a new node wakes the gang at once or the flush does depends on which plugin
  turned each pod away last; with 20 s both come within a test's deadline;
- the PodGroup controller of scheduler-plugins (cmd/controller, which only writes PodGroup status)
  is not run: the scheduler's decisions are read from the pods and their scheduling events.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.integration.kubeapi import ROOT, KubeAPI, KubeBinariesMissing, _tail, stop_group
from tests.waiting import wait_for

SP_MODULE = ROOT / "scripts" / "kube" / "scheduler-plugins" / "go.mod"
SCHEDULER_NAME = "scheduler-plugins-scheduler"
PLUGIN = "Coscheduling"
API = "scheduling.x-k8s.io/v1alpha1"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
CRD_NAME = "podgroups.scheduling.x-k8s.io"
PERMIT_WAITING_TIME_S = 10
UNSCHEDULABLE_FLUSH_S = 20


def scheduler_plugins_version() -> str:
    """The sigs.k8s.io/scheduler-plugins release scripts/kube/scheduler-plugins/go.mod builds."""
    m = re.search(r"^\s*(?:require\s+)?sigs\.k8s\.io/scheduler-plugins\s+(v\S+)", SP_MODULE.read_text(), re.M)
    if not m:
        raise RuntimeError(f"no sigs.k8s.io/scheduler-plugins requirement in {SP_MODULE}")
    return m.group(1)


def scheduler_plugins_dir() -> Path:
    """As scripts/build-kube-current.sh --print-scheduler-plugins."""
    root = Path(os.environ.get("KUBE_CURRENT_CACHE", Path.home() / ".cache" / "spectrain"))
    return root / f"scheduler-plugins-{scheduler_plugins_version()}"


def configuration(kubeconfig: Path, scheduler_name: str = SCHEDULER_NAME,
                  permit_waiting_time_s: int = PERMIT_WAITING_TIME_S) -> dict[str, Any]:
    """A KubeSchedulerConfiguration with one Coscheduling profile named `scheduler_name`."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "profiles": [{
            "schedulerName": scheduler_name,
            "plugins": {
                "multiPoint": {"enabled": [{"name": PLUGIN}]},
                "queueSort": {"enabled": [{"name": PLUGIN}], "disabled": [{"name": "*"}]},
            },
            "pluginConfig": [{"name": PLUGIN, "args": {"permitWaitingTimeSeconds": permit_waiting_time_s}}],
        }],
    }


class Coscheduling:
    """One scheduler-plugins kube-scheduler for a KubeAPI. `start()` / `stop()`."""

    def __init__(self, kube: KubeAPI, root: Path, scheduler_name: str = SCHEDULER_NAME):
        self.kube = kube
        self.dir = scheduler_plugins_dir()
        self.binary = self.dir / "bin" / "kube-scheduler"
        self.crd = self.dir / "podgroups.yaml"
        for p in (self.binary, self.crd):
            if not p.exists():
                raise KubeBinariesMissing(f"missing {p}: run `make kube-binaries`")
        self.root = Path(root)
        self.name = scheduler_name
        self.log = self.root / "scheduler-plugins.log"
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 90.0) -> Coscheduling:
        self.root.mkdir(parents=True, exist_ok=True)
        for doc in yaml.safe_load_all(self.crd.read_text()):
            if doc:
                self.kube.apply(doc)  # waits until Established
        config = self.root / "scheduler-config.yaml"
        config.write_text(yaml.safe_dump(configuration(self.kube.kubeconfig, self.name)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--config={config}", "--secure-port=0", "--v=2",
                 f"--pod-max-in-unschedulable-pods-duration={UNSCHEDULABLE_FLUSH_S}s"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                start_new_session=True)
        try:
            # the plugins are built (Coscheduling's PodGroup cache synced) before the informers start
            wait_for(self._synced, timeout, interval=0.1, what="scheduler-plugins kube-scheduler informers synced")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_group(self.proc)

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log, n)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"scheduler-plugins kube-scheduler exited ({self.proc and self.proc.returncode}):\n"
                                 f"{self.log_tail()}")

    def _synced(self) -> bool:
        self.check_alive()
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return all(f'"Caches populated" type="*v1.{kind}"' in text for kind in ("Node", "Pod"))


def pod_group(namespace: str, name: str, kube: KubeAPI) -> dict[str, Any] | None:
    return kube.get(API, "PodGroup", name, namespace)
