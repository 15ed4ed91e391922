"""Kueue's manager, as `make kube-binaries` builds it (scripts/build-kube-current.sh, cached in
~/.cache/spectrain/kueue-<version>/: bin/kueue, and crds.yaml + webhooks.yaml taken from the same
module's config/components), run against a test control plane (tests/integration/kubeapi.py).

How it is wired, and why:
- its CRDs are installed from crds.yaml as they are;
- its webhooks are served by the manager on 127.0.0.1 with a serving certificate signed by a CA
  made here (Kueue's internal cert management is off in its Configuration): the webhook
  configurations of webhooks.yaml get `url: https://127.0.0.1:PORT/<path>` + `caBundle` instead of
  their in-cluster Service. Only the webhooks for pods and Kueue's own kinds are installed: the
  other frameworks are not enabled. The pod webhooks only see namespaces labelled NAMESPACE_LABEL
  (and pods with a queue name), so the rest of the suite shares the control plane undisturbed;
  `stop` removes the webhook configurations again;
- integrations: the `pod` framework only (plain pods and pod groups, what the operator's pods use),
  managedJobsNamespaceSelector = NAMESPACE_LABEL; no leader election, no metrics, no visibility
  server;
- with internal cert management off, Kueue reads a metrics serving certificate from the fixed path
  /etc/kueue/metrics/certs even when metrics are off; the manager runs in a private mount namespace
  (`unshare --mount`) whose /etc is an overlay holding that certificate, so the host's /etc is
  never written.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.integration.kubeapi import (
    ROOT,
    KubeAPI,
    KubeBinariesMissing,
    _openssl,
    _tail,
    free_port,
    stop_group,
)
from tests.waiting import wait_for

KUEUE_MODULE = ROOT / "scripts" / "kube" / "kueue" / "go.mod"
NAMESPACE_LABEL = ("spectrain.io/kueue-test", "true")
SYSTEM_NAMESPACE = "kueue-system"
API = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
FINALIZER = "kueue.x-k8s.io/managed"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"  # hard-wired in cmd/kueue when internal certs are off


def kueue_version() -> str:
    """The sigs.k8s.io/kueue release scripts/kube/kueue/go.mod builds (e.g. v0.17.0)."""
    m = re.search(r"^\s*(?:require\s+)?sigs\.k8s\.io/kueue\s+(v\S+)", KUEUE_MODULE.read_text(), re.M)
    if not m:
        raise RuntimeError(f"no sigs.k8s.io/kueue requirement in {KUEUE_MODULE}")
    return m.group(1)


def kueue_dir() -> Path:
    """As scripts/build-kube-current.sh --print-kueue."""
    root = Path(os.environ.get("KUBE_CURRENT_CACHE", Path.home() / ".cache" / "spectrain"))
    return root / f"kueue-{kueue_version()}"


def _webhook_wanted(hook: dict[str, Any]) -> bool:
    """Webhooks for pods and for Kueue's own kinds; the other frameworks' are left out."""
    for rule in hook.get("rules") or []:
        groups = rule.get("apiGroups") or []
        if "kueue.x-k8s.io" in groups or ("" in groups and "pods" in (rule.get("resources") or [])):
            return True
    return False


def webhook_configurations(manifests: list[dict[str, Any]], port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations pointed at https://127.0.0.1:`port`.

    Names get a `kueue-` prefix as Kueue's release manifests do; the pod webhooks are scoped to
    namespaces with NAMESPACE_LABEL and to pods with a queue name.
    """
    out = []
    for doc in manifests:
        if not doc or doc.get("kind") not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        cfg = copy.deepcopy(doc)
        cfg["metadata"] = {"name": "kueue-" + doc["metadata"]["name"]}
        hooks = []
        for hook in cfg.get("webhooks") or []:
            if not _webhook_wanted(hook):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            if any("pods" in (r.get("resources") or []) for r in hook.get("rules") or []):
                hook["namespaceSelector"] = {"matchLabels": dict([NAMESPACE_LABEL])}
                hook["objectSelector"] = {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
            hooks.append(hook)
        cfg["webhooks"] = hooks
        out.append(cfg)
    return out


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for the test control plane."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": SYSTEM_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": dict([NAMESPACE_LABEL])},
        "integrations": {"frameworks": ["pod"]},
        # the visibility API server wants its own certificates and an APIService: not needed
        "featureGates": {"VisibilityOnDemand": False},
    }


class Kueue:
    """One Kueue manager for a KubeAPI. `start()` / `stop()`."""

    def __init__(self, kube: KubeAPI, root: Path):
        self.kube = kube
        self.dir = kueue_dir()
        self.binary = self.dir / "bin" / "kueue"
        for p in (self.binary, self.dir / "crds.yaml", self.dir / "webhooks.yaml"):
            if not p.exists():
                raise KubeBinariesMissing(f"missing {p}: run `make kube-binaries`")
        self.root = Path(root)
        self.pki = self.root / "pki"
        self.log = self.root / "kueue.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.webhook_port = 0
        self.health_port = 0
        self._webhooks: list[dict[str, Any]] = []

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120.0) -> Kueue:
        self.root.mkdir(parents=True, exist_ok=True)
        self.pki.mkdir(exist_ok=True)
        self._make_pki()
        for crd in yaml.safe_load_all((self.dir / "crds.yaml").read_text()):
            if crd:
                self.kube.apply(crd)
        self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM_NAMESPACE}})
        self.webhook_port, self.health_port = free_port(), free_port()
        config = self.root / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(self.webhook_port, self.health_port, self.pki / "webhook")))
        self._spawn(config)
        try:
            wait_for(self._ready, timeout, interval=0.2, what="kueue /readyz (webhook server listening)")
            ca = base64.b64encode((self.pki / "ca.crt").read_bytes()).decode()
            manifests = list(yaml.safe_load_all((self.dir / "webhooks.yaml").read_text()))
            self._webhooks = webhook_configurations(manifests, self.webhook_port, ca)
            for cfg in self._webhooks:
                self.kube.apply(cfg)
            # the API server calls the webhooks from now on: a ResourceFlavor dry-run goes through
            # the mutating and the validating one (TLS, CA and paths all right)
            wait_for(self._webhooks_answer, 30, interval=0.2, what="Kueue's webhooks to answer the API server")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for cfg in self._webhooks:
            self.kube.delete(cfg)
        self._webhooks = []
        stop_group(self.proc)

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log, n)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"kueue exited ({self.proc and self.proc.returncode}):\n{self.log_tail()}")

    # ------------------------------------------------------------ internals
    def _make_pki(self) -> None:
        d = self.pki
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "2", "-subj", "/CN=spectrain-kueue-test-ca", cwd=d)
        (d / "serving.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
        for name in ("webhook", "metrics"):
            (d / name).mkdir(exist_ok=True)
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}/tls.key", "-out", f"{name}.csr",
                     "-subj", f"/CN=kueue-{name}", cwd=d)
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", f"{name}/tls.crt", "-days", "2", "-extfile", "serving.ext", cwd=d)

    def _spawn(self, config: Path) -> None:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise RuntimeError("unshare (util-linux) not found: Kueue needs a private /etc/kueue (see module doc)")
        overlay = self.root / "etc-overlay"
        for sub in ("upper", "work"):
            (overlay / sub).mkdir(parents=True, exist_ok=True)
        script = (
            "set -e; "
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={overlay}/upper,workdir={overlay}/work /etc; "
            f"mkdir -p {METRICS_CERT_DIR}; cp {self.pki}/metrics/tls.crt {self.pki}/metrics/tls.key {METRICS_CERT_DIR}/; "
            f'exec "$0" --config={config} --zap-log-level=2'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(self.kube.kubeconfig)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [unshare, "--mount", "--propagation", "private", "sh", "-c", script, str(self.binary)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                start_new_session=True)

    def _ready(self) -> bool:
        self.check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def _webhooks_answer(self) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        self.check_alive()
        custom = client.CustomObjectsApi(self.kube.api_client())
        try:
            custom.create_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "resourceflavors",
                                                {"apiVersion": API, "kind": "ResourceFlavor",
                                                 "metadata": {"name": "webhook-probe"}}, dry_run="All")
        except ApiException as exc:
            if exc.status in (500, 502, 503, 504) or "failed calling webhook" in str(exc.body):
                return False
            raise
        return True


# ---------------------------------------------------------------- Kueue's objects (pure)

def resource_flavor(name: str, node_labels: dict[str, str]) -> dict[str, Any]:
    """A ResourceFlavor: Kueue adds `node_labels` to the nodeSelector of every pod it admits on it."""
    return {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": {"nodeLabels": dict(node_labels)}}


def cluster_queue(name: str, flavor: str, quotas: dict[str, str]) -> dict[str, Any]:
    """A ClusterQueue for every namespace with one flavor and `quotas` (resource -> nominal quota);
    a workload may preempt lower-priority ones admitted in the same queue."""
    return {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {},
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": [{"coveredResources": list(quotas),
                                         "flavors": [{"name": flavor, "resources": [
                                             {"name": r, "nominalQuota": q} for r, q in quotas.items()]}]}]}}


def local_queue(namespace: str, name: str, cluster_queue_name: str) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue_name}}


def workload_priority_class(name: str, value: int) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
            "value": value, "description": f"spectrain tests: {name}"}
