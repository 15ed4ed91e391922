"""The local backend's layout: `spectrain run FILE` as processes instead of pods.

`plan` validates the manifest, asks the builders for the children (the single source of the pod
layout), and gives each pod's containers the same env, command and volumes: memory-backed
emptyDirs become directories on a tmpfs (/dev/shm), other emptyDirs a directory of their pod
(`<run-dir>/pods/<pod>/<volume>`: private, as a kubelet makes them), claims one directory every pod
that mounts them shares (`<run-dir>/pvc/<claim>`),
the ConfigMap becomes files, the rendezvous and the drafters' ports go to loopback (free ports, a
block per pod). A subPath mount is its directory inside the volume's; `readOnly` is not enforced
(no mount namespaces: the drafter's read-only view of the run volume exists only in a cluster).
The drafters' fleet key is one per run dir (`fleet/key`, mode 0600, kept for `--resume`), and so
is the job's identity (`fleet/job-uid`, a uuid4: the pods' ENV_JOB_UID). Each pod's fleet identity
(spectrain_api.fleet_identity) is minted afresh for every invocation (`fleet/identity/<pod>/`: its
private key, mode 0600, and every pod's public key), as the operator mints them per restart
generation; the processes share one user, so unlike pods they could read each other's files.
`local.execute` runs what it plans.

Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spectrain_api import fleet_identity
from spectrain_api.fsio import atomic_write_text
from spectrain_api.names import (
    ENV_DEVICE,
    ENV_DRAFTER_BIND,
    ENV_DRAFTER_PEERS,
    ENV_DRAFTER_STORE,
    ENV_METRICS_PORT,
    ENV_RUN_DIR,
    ENV_TERMINATION_LOG,
    KIND,
)
from spectrain_operator import access, builders, objects, spec

# The local pods' address: every listener of a local run binds it (the pods' status.podIP), and
# free ports are probed on it, where they will be bound.
LOOPBACK = "127.0.0.1"
SHM_ROOT = Path(os.environ.get("SPECTRAIN_SHM_ROOT", "/dev/shm"))
GRACE_S = 30.0


@dataclass(kw_only=True)
class LocalContainer:
    pod: str
    name: str
    argv: list[str]
    env: dict[str, str]
    sidecar: bool
    log: Path
    termination_log: Path | None = None   # SPECTRAIN_TERMINATION_LOG: the kubelet's termination message file
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    failures: int = 0          # sidecar exits counted toward drafter.maxFailures
    peer_failures: int = 0     # drafter exits with EXIT_PEER_FRAME: counted apart
    starts_after_off: int = 0  # starts since the drafter was disabled in place (at most one)
    exit_code: int | None = None


@dataclass(kw_only=True)
class LocalRun:
    """One run of a job: processes, directories, outcome."""

    run_dir: Path
    shm_dir: Path
    containers: list[LocalContainer] = field(default_factory=list)
    max_sidecar_restarts: int = 3
    job: dict[str, Any] = field(default_factory=dict)   # the defaulted SpecTrainJob (its failurePolicy)
    outcome: dict[str, Any] | None = None                 # status.json: phase, reason, message, exitCode
    drafter_off: dict[str, str] | None = None             # disabled in place: {reason, message}

    @property
    def targets(self) -> list[LocalContainer]:
        return [c for c in self.containers if not c.sidecar]

    @property
    def sidecars(self) -> list[LocalContainer]:
        return [c for c in self.containers if c.sidecar]


def free_port(exclude: Collection[int] = ()) -> int:
    """A port for a listener that a local process binds later (master / metrics ports), not one of
    `exclude` (the ports already handed out to this run's processes, not bound yet).

    Chosen below the kernel's ephemeral range, not with bind(port 0): a port from that range can be
    taken before the listener binds it, as the source port of any outgoing connection (a gloo mesh
    opens dozens per rank), and a metrics server bound after the mesh then failed with EADDRINUSE."""
    low = _ephemeral_low()
    top = min(low, 30000)
    if top - 10000 >= 1000:
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(10000, top)
            if port in exclude:
                continue
            with socket.socket() as s:
                try:
                    s.bind((LOOPBACK, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:      # no room below the ephemeral range: the kernel's choice
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def free_port_block(n: int, exclude: Collection[int] = ()) -> int:
    """The first of `n` consecutive free ports (local rank i of a pod's drafter listens on base + i)."""
    while True:
        base = free_port(exclude)
        block = range(base, base + n)
        if any(p in exclude for p in block):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for p in block[1:]:
                    s = stack.enter_context(socket.socket())
                    s.bind((LOOPBACK, p))
            except OSError:
                continue
        return base


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768        # Linux's default


def load_manifest(path: str | Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SystemExit(f"{path}: expected exactly one SpecTrainJob, found {len(jobs)}")
    return jobs[0]


def _resolve_command(argv: list[str]) -> list[str]:
    """Console scripts live next to this interpreter (the venv); use them even when PATH lacks it."""
    if not argv:
        return argv
    local = Path(sys.executable).parent / argv[0]
    if "/" not in argv[0] and local.exists():
        return [str(local), *argv[1:]]
    return argv


FLEET_DIR = "fleet"            # under the run dir: the run's fleet key and job identity
JOB_UID_FILE = "job-uid"


def run_identity(run_dir: Path) -> str:
    """The run's job uid (a uuid4) and fleet key (`fleet/key`: 64 hex chars, mode 0600), made on
    the first run of `run_dir` and kept for `--resume` (a Secret lives as long as its job)."""
    fleet = run_dir / FLEET_DIR
    fleet.mkdir(parents=True, exist_ok=True)
    key = fleet / access.FLEET_KEY_ITEM
    if not key.exists():
        text = access.fleet_key_text(secrets.token_bytes(access.FLEET_KEY_BYTES))
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    uid_file = fleet / JOB_UID_FILE
    if not uid_file.exists():
        uid_file.write_text(str(uuid.uuid4()))
    return uid_file.read_text().strip()


def run_volume(run_dir: Path) -> Path:
    """The host directory of a local run's run volume (its claim's, or its only pod's emptyDir), from
    the layout `plan` recorded. A job whose pods each have their own emptyDir has several: refused,
    naming them."""
    dirs = json.loads((run_dir / "layout.json").read_text())["data_dirs"]
    if len(dirs) != 1:
        raise SystemExit(f"{run_dir}: {len(dirs)} run volumes (each pod has an emptyDir of its own: "
                         f"{', '.join(dirs)}); set spec.target.checkpoint.claimName for one shared volume")
    return Path(dirs[0])


def write_control_file(path: Path, annotations: dict[str, str]) -> None:
    """A pod's annotations as the kubelet's downward API writes them (one `key="value"` line each,
    sorted, Go-quoted), replaced atomically so a reader never sees half a file."""
    atomic_write_text(path, "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(annotations.items())),
                      durable=False)


def mint_identities(job: dict[str, Any], pods: list[dict[str, Any]], run_dir: Path) -> dict[str, Path]:
    """Each drafter pod's fleet identity, fresh (`fleet/identity/<pod>/`): Secret name -> its directory."""
    names = {}
    for pod in pods:
        for vol in pod["spec"].get("volumes", []):
            secret = (vol.get("secret") or {}).get("secretName")
            if secret and secret != objects.fleet_key_name(job):
                names[pod["metadata"]["name"]] = secret
    if not names:
        return {}
    pairs = fleet_identity.mint(len(pods))
    local_world = int(job["spec"]["target"]["procsPerNode"])
    peers = fleet_identity.peers_document(job["metadata"]["uid"], 0, local_world, [pub for _, pub in pairs])
    dirs = {}
    for pod, (private, _) in zip(pods, pairs, strict=True):
        name = pod["metadata"]["name"]
        if name not in names:
            continue
        d = run_dir / FLEET_DIR / "identity" / name
        d.mkdir(parents=True, exist_ok=True)
        key = d / fleet_identity.IDENTITY_ITEM
        key.unlink(missing_ok=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(private.hex())
        (d / fleet_identity.PEERS_ITEM).write_text(peers)
        dirs[names[name]] = d
    return dirs


def _volume_dirs(pod: dict[str, Any], configmaps: dict[str, dict[str, Any]], run_dir: Path,
                 shm_dir: Path, secrets_: dict[str, Path]) -> dict[str, Path]:
    """Host directory for every pod volume."""
    name = pod["metadata"]["name"]
    dirs: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes", []):
        vname = vol["name"]
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory":
                d = shm_dir / name / vname      # tmpfs, private to the pod (the ring lives here)
            else:
                # Private to the pod, as a kubelet makes it: only a claim is shared between pods.
                d = run_dir / "pods" / name / vname
        elif "persistentVolumeClaim" in vol:
            # A claim is shared by every pod that mounts it, as on a cluster.
            d = run_dir / "pvc" / vol["persistentVolumeClaim"]["claimName"]
        elif "configMap" in vol:
            d = run_dir / "pods" / name / vname
            cm = configmaps.get(vol["configMap"]["name"])
            if cm is None:
                raise SystemExit(f"pod {name}: volume {vname} names ConfigMap {vol['configMap']['name']} "
                                 "that the builders did not produce")
            d.mkdir(parents=True, exist_ok=True)
            for key, text in (cm.get("data") or {}).items():
                (d / key).write_text(text)
        elif "secret" in vol:
            d_ = secrets_.get(vol["secret"].get("secretName"))
            if d_ is None:
                raise SystemExit(f"pod {name}: volume {vname} names Secret {vol['secret'].get('secretName')} "
                                 "that the local backend does not make")
            d = d_                                  # the run's key (shared), or this pod's identity
        elif "downwardAPI" in vol:
            d = run_dir / "pods" / name / vname
            d.mkdir(parents=True, exist_ok=True)
            for item in vol["downwardAPI"].get("items", []):   # a fresh pod: no annotations yet
                write_control_file(d / item["path"], {})
        else:
            d = run_dir / "pods" / name / vname
        d.mkdir(parents=True, exist_ok=True)
        dirs[vname] = d
    return dirs


def _mount_dir(volume_dir: Path, mount: dict[str, Any]) -> Path:
    """The host directory behind a mount: its volume's, or a subPath's directory inside it (made,
    as the kubelet makes it). `readOnly` is not enforced: the processes share the host's mount
    namespace, so a local drafter could still write the whole run volume (docs/contracts.md)."""
    sub = mount.get("subPath")
    if not sub:
        return volume_dir
    d = volume_dir / sub
    d.mkdir(parents=True, exist_ok=True)
    return d


def _container_env(c: dict[str, Any], pod: dict[str, Any], mounts: dict[str, Path], master_port: int,
                   overrides: dict[str, str], pod_ports: dict[str, int], peer_ports: list[int],
                   store_port: int = 0) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECTRAIN_", "CUDA_MPS_"))}
    meta = pod["metadata"]
    for item in c.get("env", []):
        if "value" in item:
            value = str(item["value"])
        else:
            ref = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "")
            value = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace", "default"),
                     "status.podIP": LOOPBACK, "status.podIPs": LOOPBACK,
                     "spec.nodeName": socket.gethostname()}.get(ref, "")
        # Paths under a mountPath point at the host directory behind that mount.
        for mount_path, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                value = str(host) + value[len(mount_path.rstrip("/")):]
                break
        env[item["name"]] = value
    if ENV_DRAFTER_PEERS in env:
        # Pods share one network namespace locally: each pod's drafters get their own block of ports.
        env[ENV_DRAFTER_PEERS] = ",".join(f"{LOOPBACK}:{p}" for p in peer_ports)
        env[ENV_DRAFTER_BIND] = LOOPBACK
        # engine AllReduce's store: its default port (after the exporting pod's block) may be another pod's here
        env[ENV_DRAFTER_STORE] = f"{LOOPBACK}:{store_port}"
    if env.get(ENV_METRICS_PORT, "0") != "0":
        # Pods share one network namespace locally: each container (target, drafter) of each pod
        # gets its own metrics port.
        key = f"{meta['name']}/{c['name']}"
        if key not in pod_ports:
            pod_ports[key] = free_port(exclude={master_port, store_port, *pod_ports.values(), *peer_ports})
        env[ENV_METRICS_PORT] = str(pod_ports[key])
    env["MASTER_ADDR"] = LOOPBACK
    env["MASTER_PORT"] = str(master_port)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault(ENV_DEVICE, "auto")
    env.update(overrides)
    return env


def plan(manifest: dict[str, Any], run_dir: Path, *, shm_dir: Path | None = None,
         env_overrides: dict[str, str] | None = None, drafter: bool = True) -> LocalRun:
    """Turn the builders' children into local containers (no process started yet)."""
    job = spec.defaulted(manifest)
    errors = spec.validate(job)
    if errors:
        raise SystemExit("invalid SpecTrainJob:\n" + "\n".join(f"  {e}" for e in errors))
    run_dir.mkdir(parents=True, exist_ok=True)
    job["metadata"]["uid"] = run_identity(run_dir)   # the pods' ENV_JOB_UID, stable across --resume
    # --baseline: the same pods with the drafter off, exactly as RestartWithoutDrafter builds them.
    children = builders.build_children(job, drafter_disabled=not drafter)
    pods = [o for o in children if o["kind"] == "Pod"]
    configmaps = {o["metadata"]["name"]: o for o in children if o["kind"] == "ConfigMap"}
    shm = shm_dir or SHM_ROOT / f"spectrain-{os.getpid()}-{job['metadata']['name']}"
    run = LocalRun(run_dir=run_dir, shm_dir=shm, job=job,
                   max_sidecar_restarts=int(job["spec"]["drafter"].get("maxFailures", 3)))
    master_port = free_port()
    pod_ports: dict[str, int] = {}
    procs = int(job["spec"]["target"]["procsPerNode"])
    peer_ports: list[int] = []
    for _ in pods:
        peer_ports.append(free_port_block(procs, exclude={master_port, *(p + i for p in peer_ports for i in range(procs))}))
    store_port = free_port(exclude={master_port, *(p + i for p in peer_ports for i in range(procs))})
    (run_dir / "logs").mkdir(exist_ok=True)
    secret_dirs = {objects.fleet_key_name(job): run_dir / FLEET_DIR, **mint_identities(job, pods, run_dir)}
    for pod in pods:
        vols = _volume_dirs(pod, configmaps, run_dir, shm, secret_dirs)
        pspec = pod["spec"]
        entries = [(c, c.get("restartPolicy") == "Always") for c in pspec.get("initContainers", [])]
        entries += [(c, False) for c in pspec["containers"]]
        for c, sidecar in entries:
            mounts = {m["mountPath"]: _mount_dir(vols[m["name"]], m) for m in c.get("volumeMounts", [])
                      if m["name"] in vols}
            argv = _resolve_command([*c.get("command", []), *c.get("args", [])])
            if not argv:
                raise SystemExit(f"pod {pod['metadata']['name']} container {c['name']} has no command: "
                                 "the local backend cannot run an image's default entrypoint; set target.command")
            env = _container_env(c, pod, mounts, master_port, env_overrides or {}, pod_ports, peer_ports,
                                 store_port)
            # The container's /dev/termination-log: a file per container in the run dir.
            term = run_dir / "logs" / f"{pod['metadata']['name']}.{c['name']}.termination-log"
            env.setdefault(ENV_TERMINATION_LOG, str(term))
            run.containers.append(LocalContainer(
                pod=pod["metadata"]["name"], name=c["name"], argv=argv, sidecar=sidecar, env=env,
                log=run_dir / "logs" / f"{pod['metadata']['name']}.{c['name']}.log",
                termination_log=Path(env[ENV_TERMINATION_LOG]),
            ))
    (run_dir / "job.json").write_text(json.dumps(job, indent=2))
    data_dirs = sorted({c.env[ENV_RUN_DIR] for c in run.containers if ENV_RUN_DIR in c.env})
    # Where each container's processes serve /metrics on 127.0.0.1 (its ENV_METRICS_PORT + local
    # rank): what a scrape config of a local run needs, as a cluster's reads the pods' ports.
    metrics = [{"pod": c.pod, "container": c.name,
                "ports": [int(c.env[ENV_METRICS_PORT]) + i for i in range(procs)]}
               for c in run.containers if c.env.get(ENV_METRICS_PORT, "0") != "0"]
    # whole or absent: a scraper of the run waits for this file
    tmp = run_dir / "layout.json.tmp"
    tmp.write_text(json.dumps({"data_dirs": data_dirs, "metrics": metrics}, indent=2))
    tmp.replace(run_dir / "layout.json")
    return run
