"""A real, throwaway Kubernetes control plane for integration tests: etcd + kube-apiserver
(+ optionally kube-controller-manager for garbage collection and namespace deletion; on the current
server also kube-scheduler, the node-lifecycle and resourceclaim controllers, and kwok running fake
nodes: `start_scheduler`, `start_node_controllers`, `start_kwok`, `add_fake_node`).

Two servers, chosen by SPECTRAIN_KUBE:
- `current` (the default): the release pinned in scripts/kube/go.mod (kube-apiserver,
  kube-controller-manager, kube-scheduler, etcd, kwok) from `make kube-binaries`
  (scripts/build-kube-current.sh, cached in ~/.cache/spectrain/kube-<version>/bin);
- `1.20`: kube-apiserver + kube-controller-manager 1.20 from `make kube-binaries-legacy`
  (scripts/build-kube.sh, cached in $KUBE_CACHE/bin, default ~/.cache/spectrain/kube/bin) and
  Debian's etcd-server. Below the operator's supported range (it refuses to start there): kept for
  that test and for comparing what an old server silently drops.
Everything listens on free ports on 127.0.0.1 and lives in one private directory.

Authentication:
- the admin is a static token (`--token-auth-file`), user `admin` in `system:masters`;
- any other user is a client certificate signed by the cluster CA (`kubeconfig_for`), so users
  and groups can be made at any time without restarting the apiserver;
- ServiceAccounts get bound tokens through the TokenRequest API (`kubeconfig_for_service_account`),
  so an operator can run as exactly the ServiceAccount and ClusterRoleBinding a chart renders.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.waiting import wait_for

DEFAULT_CACHE = Path.home() / ".cache" / "spectrain" / "kube"
MISSING_HINT = "run `make kube-binaries-legacy`"
ROOT = Path(__file__).resolve().parents[2]
CURRENT_MODULE = ROOT / "scripts" / "kube" / "go.mod"
CURRENT_HINT = "run `make kube-binaries`"
FLAVORS = ("1.20", "current")


class KubeBinariesMissing(RuntimeError):
    pass


def kube_flavor() -> str:
    """Which server the tests run against: SPECTRAIN_KUBE=current (default) or 1.20."""
    flavor = os.environ.get("SPECTRAIN_KUBE", "current") or "current"
    if flavor not in FLAVORS:
        raise ValueError(f"SPECTRAIN_KUBE={flavor!r}: one of {', '.join(FLAVORS)}")
    return flavor


def current_version() -> str:
    """The k8s.io/kubernetes release scripts/kube/go.mod builds (e.g. v1.37.2)."""
    m = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", CURRENT_MODULE.read_text(), re.M)
    if not m:
        raise RuntimeError(f"no k8s.io/kubernetes requirement in {CURRENT_MODULE}")
    return m.group(1)


def kube_bin_dir(flavor: str | None = None) -> Path:
    if (flavor or kube_flavor()) == "current":
        # as scripts/build-kube-current.sh --print-bin
        root = Path(os.environ.get("KUBE_CURRENT_CACHE", Path.home() / ".cache" / "spectrain"))
        return root / f"kube-{current_version()}" / "bin"
    return Path(os.environ.get("KUBE_CACHE", DEFAULT_CACHE)) / "bin"


def find_binaries(flavor: str | None = None) -> dict[str, Path]:
    """Paths of the flavor's binaries; raise naming what is missing."""
    flavor = flavor or kube_flavor()
    bin_dir = kube_bin_dir(flavor)
    found: dict[str, Path] = {}
    missing: list[str] = []
    if flavor == "current":
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kwok"):
            p = bin_dir / name
            if os.access(p, os.X_OK):
                found[name] = p
            else:
                missing.append(str(p))
        if missing:
            raise KubeBinariesMissing(f"missing {', '.join(missing)}: {CURRENT_HINT}")
        return found
    for name in ("kube-apiserver", "kube-controller-manager"):
        p = bin_dir / name
        if os.access(p, os.X_OK):
            found[name] = p
        else:
            missing.append(str(p))
    etcd = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if etcd:
        found["etcd"] = Path(etcd)
    else:
        missing.append("etcd (Debian package etcd-server)")
    if missing:
        raise KubeBinariesMissing(f"missing {', '.join(missing)}: {MISSING_HINT}")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {r.stderr.strip()}")


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def stop_group(p: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM a component started in its own session, SIGKILL it after `timeout` s; no-op if gone."""
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# What a kubelet does to a pod that is deleted while it runs and that a finalizer keeps (kubelets
# since 1.27 set the terminal phase before the pod goes): its containers are stopped (SIGTERM: exit
# 143) and the pod is marked Failed. kwok's own pod-delete stage only deletes, which leaves such a
# pod Running for good; Kueue's pod integration (its finalizer, tests/integration/kueue.py) and the
# Job controller rely on the terminal phase. The weight makes kwok pick this stage over
# pod-delete whenever both match.
KWOK_TERMINATE_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-terminate-kept-by-finalizer
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '.metadata.finalizers'
      operator: 'Exists'
    - key: '.status.phase'
      operator: 'In'
      values: ['Pending', 'Running']
  weight: 1
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Failed
      conditions:
      - type: Ready
        status: "False"
        reason: PodCompleted
        lastTransitionTime: {{ $now | Quote }}
      - type: ContainersReady
        status: "False"
        reason: PodCompleted
        lastTransitionTime: {{ $now | Quote }}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: false
        restartCount: 0
        state:
          terminated:
            exitCode: 143
            reason: Error
            finishedAt: {{ $now | Quote }}
      {{ end }}
"""


class KubeAPI:
    """One etcd + kube-apiserver. Use `start()` / `stop()` (the `kube` fixture does both)."""

    ADMIN_USER = "admin"

    def __init__(self, root: Path, flavor: str | None = None, apiserver_args: list[str] | tuple[str, ...] = ()) -> None:
        self.flavor = flavor or kube_flavor()
        self.apiserver_args = list(apiserver_args)
        self.bins = find_binaries(self.flavor)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pki = self.root / "pki"
        self.logs = self.root / "logs"
        self.pki.mkdir(exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._admin_token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
        self.port = 0
        self.server = ""
        self.kubeconfig = self.root / "admin.kubeconfig"
        self.audit_log = self.root / "logs" / "audit.jsonl"
        self._user_serial = 0
        self._core: Any = None   # _core_api
        self._core_pool = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 90.0) -> KubeAPI:
        t0 = time.monotonic()
        try:
            self._make_pki()
            self._start_etcd(timeout)
            self._start_apiserver(timeout - (time.monotonic() - t0))
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for name in reversed(list(self._procs)):
            self._kill(name)
        self._procs.clear()

    def _kill(self, name: str, timeout: float = 10.0) -> None:
        stop_group(self._procs.get(name), timeout)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=self.root)
        log.close()
        self._procs[name] = p
        return p

    def _check_alive(self, name: str) -> None:
        p = self._procs[name]
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}; log tail:\n{_tail(self.logs / f'{name}.log')}")

    # ---------------------------------------------------------------- PKI
    def _make_pki(self) -> None:
        d = self.pki
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "2", "-subj", "/CN=spectrain-test-ca", cwd=d)
        (d / "serving.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                       "extendedKeyUsage=serverAuth\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "serving.key", "-out", "serving.csr",
                 "-subj", "/CN=kube-apiserver", cwd=d)
        _openssl("x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "serving.crt", "-days", "2", "-extfile", "serving.ext", cwd=d)
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
        (d / "tokens.csv").write_text(f'{self._admin_token},{self.ADMIN_USER},admin-uid,"system:masters"\n')
        (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        # Every request at Metadata level: tests read who was denied what (see `denials`).
        (d / "audit-policy.yaml").write_text(
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n"
            "rules:\n  - level: Metadata\n")

    # ---------------------------------------------------------------- etcd / apiserver
    def _start_etcd(self, timeout: float) -> None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.root
        self._etcd_dir = Path(base) / f"spectrain-etcd-{os.getpid()}-{id(self):x}"
        self.etcd_port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        self._spawn("etcd", [
            str(self.bins["etcd"]), "--name", "default", "--data-dir", str(self._etcd_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}", "--log-level", "warn",
        ])
        self.etcd_url = client_url

        def healthy() -> bool:
            self._check_alive("etcd")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1) as r:
                    return bool(json.loads(r.read()).get("health") == "true")
            except (OSError, ValueError):
                return False

        wait_for(healthy, timeout, interval=0.05, what="etcd /health")

    def _start_apiserver(self, timeout: float) -> None:
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        d = self.pki
        self._spawn("kube-apiserver", [
            str(self.bins["kube-apiserver"]),
            f"--etcd-servers={self.etcd_url}",
            "--etcd-prefix=/spectrain-test",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            # 1.20 still had an insecure port; current releases refuse a loopback advertise address
            # for the `kubernetes` Service's endpoints: no endpoint reconciler (nothing here needs it)
            *(["--insecure-port=0"] if self.flavor == "1.20" else ["--endpoint-reconciler-type=none"]),
            f"--tls-cert-file={d / 'serving.crt'}", f"--tls-private-key-file={d / 'serving.key'}",
            f"--client-ca-file={d / 'ca.crt'}",
            f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--api-audiences=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={self.root / 'certs'}",
            f"--audit-policy-file={d / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}", "--audit-log-mode=blocking",
            "--v=1",
            *self.apiserver_args,
        ])
        ctx = self.ssl_context()

        def ready() -> bool:
            self._check_alive("kube-apiserver")
            req = urllib.request.Request(f"{self.server}/readyz",
                                         headers={"Authorization": f"Bearer {self._admin_token}"})
            try:
                with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
                    return r.status == 200
            except (OSError, urllib.error.HTTPError):
                return False

        wait_for(ready, timeout, interval=0.1, what="kube-apiserver /readyz")
        self._write_kubeconfig(self.kubeconfig, self.ADMIN_USER, {"token": self._admin_token})
        req = urllib.request.Request(f"{self.server}/version",
                                     headers={"Authorization": f"Bearer {self._admin_token}"})
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            self.version_info: dict[str, Any] = json.loads(r.read())
        m = re.match(r"v(\d+)\.(\d+)", str(self.version_info.get("gitVersion", "")))
        # (major, minor) as served, e.g. (1, 20) or (1, 37): tests of what a release enforces branch on it
        self.version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    @property
    def enforces_cel(self) -> bool:
        """Whether the server evaluates CRD x-kubernetes-validations (on by default from 1.25)."""
        return self.version >= (1, 25)

    def start_controller_manager(self, timeout: float = 60.0) -> None:
        """garbagecollector + namespace controllers. Start it after the CRDs are established:
        it discovers new resources only at its 30 s resync."""
        if "kube-controller-manager" in self._procs:
            return
        self._spawn("kube-controller-manager", [
            str(self.bins["kube-controller-manager"]),
            f"--kubeconfig={self.kubeconfig}",
            "--controllers=garbagecollector,namespace",
            "--leader-elect=false", *(["--port=0"] if self.flavor == "1.20" else []), "--secure-port=0",
            "--concurrent-gc-syncs=5", "--v=1",
        ])
        # Ready once it has synced its informers: GC logs this; poll the log with a deadline.
        log = self.logs / "kube-controller-manager.log"

        def synced() -> bool:
            self._check_alive("kube-controller-manager")
            text = log.read_text(errors="replace") if log.exists() else ""
            return "all resource monitors have synced" in text or "synced garbage collector" in text

        wait_for(synced, timeout, interval=0.1, what="kube-controller-manager garbage collector sync")

    # ---------------------------------------------------------------- scheduling, fake nodes (current only)
    FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"   # = "fake": kwok manages the node
    FAKE_NODE_TAINT = {"key": "spectrain.io/fake-node", "value": "kwok", "effect": "NoSchedule"}
    # kwok leaves pods with this annotation alone: a test plays their kubelet instead
    KWOK_HANDS_OFF = "kwok.x-k8s.io/status"        # = "custom"

    def _need_current(self, what: str) -> None:
        if self.flavor != "current":
            raise RuntimeError(f"{what} needs SPECTRAIN_KUBE=current (kube-scheduler and kwok are built there)")

    def start_scheduler(self, timeout: float = 60.0) -> None:
        """The real kube-scheduler (leader election off, no serving port). Pods that tolerate
        FAKE_NODE_TAINT land on the fake nodes; every other pod of the suite stays Pending, so
        the tests that play the kubelet keep doing so undisturbed."""
        self._need_current("kube-scheduler")
        if "kube-scheduler" in self._procs:
            return
        self._spawn("kube-scheduler", [
            str(self.bins["kube-scheduler"]), f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--secure-port=0", "--v=2",  # v=2: informer syncs, each binding
        ])
        log = self.logs / "kube-scheduler.log"

        def synced() -> bool:
            self._check_alive("kube-scheduler")
            text = log.read_text(errors="replace") if log.exists() else ""
            return all(f'"Caches populated" type="*v1.{kind}"' in text for kind in ("Node", "Pod"))

        wait_for(synced, timeout, interval=0.1, what="kube-scheduler informers synced")

    def start_node_controllers(self, timeout: float = 60.0) -> None:
        """A second kube-controller-manager with the controllers a cluster of (fake) nodes needs:
        node-lifecycle (lifts the not-ready taint the apiserver puts on every new Node once kwok
        reports it Ready) and resourceclaim (each pod's ResourceClaims from its templates, DRA)."""
        self._need_current("the node controllers")
        if "kube-controller-manager-nodes" in self._procs:
            return
        self._spawn("kube-controller-manager-nodes", [
            str(self.bins["kube-controller-manager"]), f"--kubeconfig={self.kubeconfig}",
            "--controllers=node-lifecycle-controller,resourceclaim-controller",
            "--leader-elect=false", "--secure-port=0", "--v=1",
        ])
        log = self.logs / "kube-controller-manager-nodes.log"

        def started() -> bool:
            self._check_alive("kube-controller-manager-nodes")
            text = log.read_text(errors="replace") if log.exists() else ""
            return "Caches are synced" in text

        wait_for(started, timeout, interval=0.1, what="node controllers started")

    def start_kwok(self, timeout: float = 60.0) -> None:
        """kwok: fake kubelets for the nodes annotated FAKE_NODE_ANNOTATION=fake (heartbeats; pods
        go Running, Jobs' pods complete, deleted pods are removed), with the stages of its release
        (`kwok-stages.yaml` beside the binaries), and a kubelet's one kwok lacks (KWOK_TERMINATE_STAGE)."""
        self._need_current("kwok")
        if "kwok" in self._procs:
            return
        stages = self.bins["kwok"].parent / "kwok-stages.yaml"
        if not stages.is_file():
            raise KubeBinariesMissing(f"missing {stages}: {CURRENT_HINT}")
        terminate = self.root / "kwok-stage-terminate.yaml"
        terminate.write_text(KWOK_TERMINATE_STAGE)
        self._spawn("kwok", [
            str(self.bins["kwok"]), f"--kubeconfig={self.kubeconfig}", f"--config={stages}", f"--config={terminate}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={self.FAKE_NODE_ANNOTATION}=fake",
            f"--disregard-status-with-annotation-selector={self.KWOK_HANDS_OFF}=custom",
            "--cidr=10.244.0.0/16", "--node-ip=10.1.0.1", f"--server-address=127.0.0.1:{free_port()}",
        ])
        log = self.logs / "kwok.log"

        def started() -> bool:
            self._check_alive("kwok")
            text = log.read_text(errors="replace") if log.exists() else ""
            return "Starting" in text or "Watching" in text or "started" in text.lower()

        wait_for(started, timeout, interval=0.1, what="kwok started")

    def fake_node(self, name: str, *, gpus: int = 8, cpu: str = "64", memory: str = "512Gi",
                  labels: dict[str, str] | None = None) -> dict[str, Any]:
        """The manifest of a Node kwok runs, with `gpus` nvidia.com/gpu, tainted FAKE_NODE_TAINT."""
        capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
        if gpus:
            capacity["nvidia.com/gpu"] = str(gpus)
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {self.FAKE_NODE_ANNOTATION: "fake"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok", **(labels or {})}},
            "spec": {"taints": [dict(self.FAKE_NODE_TAINT)]},
            "status": {"capacity": capacity, "allocatable": dict(capacity)},
        }

    def add_fake_node(self, name: str, *, gpus: int = 8, cpu: str = "64", memory: str = "512Gi",
                      labels: dict[str, str] | None = None) -> dict[str, Any]:
        """A Node kwok runs, with `gpus` nvidia.com/gpu, tainted FAKE_NODE_TAINT."""
        return self.apply(self.fake_node(name, gpus=gpus, cpu=cpu, memory=memory, labels=labels))

    def add_fake_nodes(self, names: list[str], *, gpus: int = 8, threads: int = 8) -> None:
        """Many fake nodes at once (`fake_node`; concurrent creates, an existing node is left as it is)."""
        from concurrent.futures import ThreadPoolExecutor

        from kubernetes.client.rest import ApiException

        core = self._core_api(threads)

        def create(name: str) -> None:
            try:
                core.create_node(self.fake_node(name, gpus=gpus), _preload_content=False)
            except ApiException as exc:
                if exc.status != 409:
                    raise

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(create, names))

    def _core_api(self, pool: int = 8) -> Any:
        """One admin CoreV1Api kept for the helpers that call it often (a connection pool of `pool`)."""
        from kubernetes import client

        if self._core is None or self._core_pool < pool:
            api = self.api_client()
            api.rest_client.pool_manager.connection_pool_kw["maxsize"] = pool
            self._core, self._core_pool = client.CoreV1Api(api), pool
        return self._core

    def fake_nodes_schedulable(self, names: list[str]) -> bool:
        """Whether every named node is Ready and carries no taint but FAKE_NODE_TAINT (the
        node-lifecycle controller has lifted the not-ready one), from one list of the nodes."""
        data = json.loads(self._core_api().list_node(_preload_content=False).data)
        ok = set()
        for node in data["items"]:
            conds = (node.get("status") or {}).get("conditions") or []
            taints = (node.get("spec") or {}).get("taints") or []
            if (any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
                    and all(t["key"] == self.FAKE_NODE_TAINT["key"] for t in taints)):
                ok.add(node["metadata"]["name"])
        return set(names) <= ok

    def log_tail(self, name: str, n: int = 40) -> str:
        return _tail(self.logs / f"{name}.log", n)

    def cleanup(self) -> None:
        self.stop()
        if getattr(self, "_etcd_dir", None):
            shutil.rmtree(self._etcd_dir, ignore_errors=True)

    # ---------------------------------------------------------------- clients
    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki / "ca.crt"))

    def _write_kubeconfig(self, path: Path, user: str, creds: dict[str, str]) -> Path:
        cfg = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "spectrain-test", "cluster": {
                "server": self.server, "certificate-authority-data": _b64(self.pki / "ca.crt")}}],
            "users": [{"name": user, "user": creds}],
            "contexts": [{"name": user, "context": {"cluster": "spectrain-test", "user": user}}],
            "current-context": user,
        }
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)
        return path

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A kubernetes.client.ApiClient for the admin (or the given kubeconfig)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def dynamic(self) -> Any:
        if getattr(self, "_dyn", None) is None:
            from kubernetes.dynamic import DynamicClient

            self._dyn = DynamicClient(self.api_client(), cache_file=str(self.root / "discovery.json"))
        return self._dyn

    def kubeconfig_for(self, user: str, groups: list[str] | tuple[str, ...] = ()) -> Path:
        """A kubeconfig authenticating as `user` in `groups` (client certificate, CN=user, O=group)."""
        self._user_serial += 1
        stem = f"user-{self._user_serial}"
        subj = "/CN=" + user.replace("/", r"\/") + "".join("/O=" + g.replace("/", r"\/") for g in groups)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}.key", "-out", f"{stem}.csr",
                 "-subj", subj, cwd=self.pki)
        _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{stem}.crt", "-days", "1", "-extfile", "client.ext", cwd=self.pki)
        return self._write_kubeconfig(self.root / f"{stem}.kubeconfig", user, {
            "client-certificate-data": _b64(self.pki / f"{stem}.crt"),
            "client-key-data": _b64(self.pki / f"{stem}.key"),
        })

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600,
                              pod: dict[str, Any] | None = None) -> str:
        """A bound token (TokenRequest API) of an existing ServiceAccount; bound to `pod` (as the kubelet
        mounts it: void once that pod is gone) when given."""
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        spec: dict[str, Any] = {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        tr = core.create_namespaced_service_account_token(name, namespace, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return str(tr.status.token)

    def kubeconfig_for_service_account(self, namespace: str, name: str, seconds: int = 3600) -> Path:
        """A kubeconfig with a bound token (TokenRequest API) of an existing ServiceAccount."""
        user = f"system:serviceaccount:{namespace}:{name}"
        return self._write_kubeconfig(self.root / f"sa-{namespace}-{name}.kubeconfig", user,
                                      {"token": self.service_account_token(namespace, name, seconds)})

    def bind_cluster_role(self, cluster_role: str, *, user: str | None = None, group: str | None = None,
                          service_account: tuple[str, str] | None = None, namespace: str | None = None,
                          name: str | None = None) -> dict[str, Any]:
        """Bind `cluster_role` to a user, group or (namespace, name) ServiceAccount: cluster-wide with a
        ClusterRoleBinding, or inside `namespace` with a RoleBinding."""
        if service_account is not None:
            subject = {"kind": "ServiceAccount", "namespace": service_account[0], "name": service_account[1]}
        elif user is not None:
            subject = {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}
        elif group is not None:
            subject = {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": group}
        else:
            raise ValueError("bind_cluster_role needs user, group or service_account")
        who = subject["name"].replace(":", "-").lower()
        obj: dict[str, Any] = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding" if namespace else "ClusterRoleBinding",
            "metadata": {"name": name or f"{cluster_role}-{who}"[:253]},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [subject],
        }
        if namespace:
            obj["metadata"]["namespace"] = namespace
        return self.apply(obj)

    # ---------------------------------------------------------------- audit
    def audit_offset(self) -> int:
        """Current end of the audit log: pass it to `audit_events` to see only later requests."""
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def audit_events(self, since: int = 0, user: str | None = None) -> list[dict[str, Any]]:
        """Audit events (ResponseComplete / Panic stages) written after byte offset `since`."""
        if not self.audit_log.exists():
            return []
        with open(self.audit_log, "rb") as f:
            f.seek(since)
            data = f.read()
        out = []
        for line in data.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if ev.get("stage") not in ("ResponseComplete", "Panic"):
                continue
            if user is None or ev.get("user", {}).get("username") == user:
                out.append(ev)
        return out

    def denials(self, since: int = 0, user: str | None = None) -> list[str]:
        """Requests answered 403, as 'verb group/resource[/subresource] ns/name' strings."""
        out = []
        for ev in self.audit_events(since, user):
            if ev.get("responseStatus", {}).get("code") != 403:
                continue
            ref = ev.get("objectRef") or {}
            res = "/".join(x for x in (ref.get("apiGroup", ""), ref.get("resource", ""),
                                       ref.get("subresource", "")) if x) or ev.get("requestURI", "")
            out.append(f"{ev.get('verb')} {res} {ref.get('namespace', '')}/{ref.get('name', '')}")
        return out

    # ---------------------------------------------------------------- objects
    def _resource(self, obj: dict[str, Any]) -> Any:
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        dyn = self.dynamic()
        try:
            return dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        except ResourceNotFoundError:
            # A CRD established since the discovery cache was filled: refresh it once.
            dyn.resources.invalidate_cache()
            return dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])

    def apply(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create `obj`, or merge-patch it when it exists; return the server's object.
        CustomResourceDefinitions are waited on until Established."""
        from kubernetes.dynamic.exceptions import ConflictError

        res = self._resource(obj)
        ns = (namespace or obj.get("metadata", {}).get("namespace") or "default") if res.namespaced else None
        try:
            out = res.create(body=obj, namespace=ns)
        except ConflictError:
            out = res.patch(body=obj, name=obj["metadata"]["name"], namespace=ns,
                            content_type="application/merge-patch+json")
        result: dict[str, Any] = out.to_dict()
        if obj["kind"] == "CustomResourceDefinition":
            self.wait_crd_established(obj["metadata"]["name"])
        return result

    def apply_all(self, objs: list[dict[str, Any]], namespace: str | None = None) -> list[dict[str, Any]]:
        return [self.apply(o, namespace) for o in objs if o]

    def delete(self, obj: dict[str, Any], namespace: str | None = None) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        res = self._resource(obj)
        ns = (namespace or obj["metadata"].get("namespace") or "default") if res.namespaced else None
        try:
            res.delete(name=obj["metadata"]["name"], namespace=ns)
        except NotFoundError:
            pass

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        res = self._resource({"apiVersion": api_version, "kind": kind})
        try:
            out: dict[str, Any] = res.get(name=name, namespace=namespace).to_dict()
            return out
        except NotFoundError:
            return None

    def wait_crd_established(self, name: str, timeout: float = 30.0) -> None:
        def established() -> bool:
            crd = self.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name)
            conds = (crd or {}).get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        wait_for(established, timeout, interval=0.05, what=f"CRD {name} Established")
        self.dynamic().resources.invalidate_cache()
