"""The local backend: run the pods the operator's builders produce as local processes.

`spectrain run FILE` validates the manifest, asks the builders for the children (the single
source of the pod layout), and runs each pod's containers with the same env, command and
volumes: memory-backed emptyDirs become directories on a tmpfs (/dev/shm), other volumes
directories under the run dir, the ConfigMap becomes files, the rendezvous goes to loopback.
Native sidecars (init containers with restartPolicy Always) start first and are restarted when
they exit, like the kubelet does; the job's exit code is the targets' outcome. A drafter past
drafter.maxFailures (or matched by a drafter failurePolicy rule that disables it) is disabled in
place as on a cluster: every pod's control file (the downward-API file of its annotations,
`pods/<pod>/podinfo/annotations`, in the kubelet's `key="value"` format) gets
ANNOTATION_DRAFTER_DISABLED, the sidecar is restarted once more and idles, and `status.json` says
`drafterDisabled` with a DrafterDegraded condition. Exits with EXIT_PEER_FRAME are counted apart.
The drafters' fleet key is one per run dir (`fleet/key`, mode 0600, kept for `--resume`), and so
is the job's identity (`fleet/job-uid`, a uuid4: the pods' ENV_JOB_UID). Targets are never
restarted: the first failing target stops the run, which ends Failed with the reason the
operator's failure policy gives its exit (a target's exit 2 without a matching rule: ConfigError)
and the workload's termination message (SPECTRAIN_TERMINATION_LOG, a file per container under
`logs/`), on stderr and in `status.json` of the run dir.

Torch-free: the workloads run in child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spectrain_api.exitcodes import returncode_to_exit
from spectrain_api.fsio import atomic_write_text
from spectrain_api.names import (
    ANNOTATION_DRAFTER_DISABLED,
    ENV_DEVICE,
    ENV_DRAFTER_BIND,
    ENV_DRAFTER_CONTROL,
    ENV_DRAFTER_PEERS,
    ENV_DRAFTER_STORE,
    ENV_METRICS_PORT,
    ENV_RUN_DIR,
    ENV_TERMINATION_LOG,
    EXIT_PEER_FRAME,
    KIND,
)
from spectrain_operator import builders, faults, spec
from spectrain_operator.progress import ProgressView

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
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:      # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
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
                    s.bind(("", p))
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
    key = fleet / builders.FLEET_KEY_ITEM
    if not key.exists():
        text = builders.fleet_key_text(secrets.token_bytes(builders.FLEET_KEY_BYTES))
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    uid_file = fleet / JOB_UID_FILE
    if not uid_file.exists():
        uid_file.write_text(str(uuid.uuid4()))
    return uid_file.read_text().strip()


def write_control_file(path: Path, annotations: dict[str, str]) -> None:
    """A pod's annotations as the kubelet's downward API writes them (one `key="value"` line each,
    sorted, Go-quoted), replaced atomically so a reader never sees half a file."""
    atomic_write_text(path, "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(annotations.items())),
                      durable=False)


def _volume_dirs(pod: dict[str, Any], configmaps: dict[str, dict[str, Any]], run_dir: Path,
                 shm_dir: Path, fleet_secret: str) -> dict[str, Path]:
    """Host directory for every pod volume."""
    name = pod["metadata"]["name"]
    dirs: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes", []):
        vname = vol["name"]
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory":
                d = shm_dir / name / vname      # tmpfs, private to the pod (the ring lives here)
            else:
                # One disk for all pods of a machine: the run volume is shared, like a PVC would be.
                d = run_dir / vname
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
            if vol["secret"].get("secretName") != fleet_secret:
                raise SystemExit(f"pod {name}: volume {vname} names Secret {vol['secret'].get('secretName')} "
                                 "that the local backend does not make")
            d = run_dir / FLEET_DIR                 # the run's key, shared like the job's Secret
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
                     "status.podIP": "127.0.0.1", "status.podIPs": "127.0.0.1",
                     "spec.nodeName": socket.gethostname()}.get(ref, "")
        # Paths under a mountPath point at the host directory behind that mount.
        for mount_path, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                value = str(host) + value[len(mount_path.rstrip("/")):]
                break
        env[item["name"]] = value
    if ENV_DRAFTER_PEERS in env:
        # Pods share one network namespace locally: each pod's drafters get their own block of ports.
        env[ENV_DRAFTER_PEERS] = ",".join(f"127.0.0.1:{p}" for p in peer_ports)
        env[ENV_DRAFTER_BIND] = "127.0.0.1"
        # engine AllReduce's store: its default port (after the exporting pod's block) may be another pod's here
        env[ENV_DRAFTER_STORE] = f"127.0.0.1:{store_port}"
    if env.get(ENV_METRICS_PORT, "0") != "0":
        # Pods share one network namespace locally: each container (target, drafter) of each pod
        # gets its own metrics port.
        key = f"{meta['name']}/{c['name']}"
        if key not in pod_ports:
            pod_ports[key] = free_port(exclude={master_port, store_port, *pod_ports.values(), *peer_ports})
        env[ENV_METRICS_PORT] = str(pod_ports[key])
    env["MASTER_ADDR"] = "127.0.0.1"
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
    for pod in pods:
        vols = _volume_dirs(pod, configmaps, run_dir, shm, builders.fleet_key_name(job))
        pspec = pod["spec"]
        entries = [(c, c.get("restartPolicy") == "Always") for c in pspec.get("initContainers", [])]
        entries += [(c, False) for c in pspec["containers"]]
        for c, sidecar in entries:
            mounts = {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in vols}
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


def _start(c: LocalContainer) -> None:
    if c.termination_log is not None:   # fresh for every start, like the kubelet's per container
        with contextlib.suppress(OSError):
            c.termination_log.unlink()
    with open(c.log, "ab") as log:
        c.proc = subprocess.Popen(c.argv, env=c.env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)


def _signal(c: LocalContainer, sig: int) -> None:
    if c.proc is not None and c.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, sig)


def _stop_all(cs: list[LocalContainer], grace_s: float) -> None:
    for c in cs:
        _signal(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in cs:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(c, signal.SIGKILL)
            c.proc.wait()


def _termination_message(c: LocalContainer) -> str:
    if c.termination_log is None:
        return ""
    try:
        return c.termination_log.read_text(errors="replace")[:4096]
    except OSError:
        return ""


def failure_outcome(run: LocalRun, c: LocalContainer) -> dict[str, Any]:
    """What the operator's status would say about target `c`'s exit (no restarts here): the fault
    classified from a pod status carrying its exit code and termination message, the reason from
    the failure policy (ConfigError for an exit 2 no rule matches)."""
    code = returncode_to_exit(int(c.exit_code if c.exit_code is not None else 1))
    pod = {"metadata": {"name": c.pod}, "status": {"phase": "Failed", "containerStatuses": [{
        "name": "target", "restartCount": 0,
        "state": {"terminated": {"exitCode": code, "reason": "Error", "message": _termination_message(c)}}}]}}
    fault = faults.classify_pod(pod) or faults.PodFault(faults.TARGET, code, "TargetFailed",
                                                        f"target exited with code {code}")
    try:
        action = faults.action_for(fault, run.job)
    except ValueError as exc:
        return {"phase": "Failed", "reason": "SpecInvalid", "message": str(exc), "exitCode": code}
    reason = {faults.CONFIG_ERROR: "ConfigError", faults.FAIL_JOB: "FailedByPolicy"}.get(action, fault.reason)
    return {"phase": "Failed", "reason": reason, "message": f"{c.pod}: {fault.message}", "exitCode": code}


def _sidecar_exited(run: LocalRun, c: LocalContainer) -> bool:
    """Count a sidecar's exit; whether to start it again. A drafter's exit never fails the job; the
    operator's policy (faults.action_for) decides when it is disabled in place: then every pod's
    control file says so, and each drafter is started at most once more (it reads the file and
    idles). Other sidecars are restarted up to drafter.maxFailures times, as before."""
    assert c.proc is not None
    code = returncode_to_exit(int(c.proc.returncode))
    c.proc = None
    if c.name != faults.DRAFTER:
        c.failures += 1
        return c.failures <= run.max_sidecar_restarts
    _count(c, code)
    if run.drafter_off is not None:   # disabled: one more start (it reads the control file and idles)
        c.starts_after_off += 1
        return c.starts_after_off <= 1
    fault = faults.PodFault(faults.DRAFTER, code, "DrafterFailed", f"drafter exited with code {code}",
                            restarts=c.failures)
    try:
        action = faults.action_for(fault, run.job)
        why = faults.disable_reason(fault, run.job) if action == faults.DISABLE_DRAFTER else ""
    except ValueError as exc:   # spec.validate checked the rules; keep the drafter restarting
        sys.stderr.write(f"{c.pod}/{c.name}: {exc}\n")
        return True
    if action == faults.DISABLE_DRAFTER:
        c.starts_after_off = 1
        disable_drafter(run, why, f"{c.pod}: drafter exited with code {code}, {c.failures} failure(s) "
                                  f"(maxFailures {run.max_sidecar_restarts}); disabled in place, the target "
                                  "keeps running")
    return True


def _count(c: LocalContainer, code: int) -> None:
    if code == EXIT_PEER_FRAME:
        c.peer_failures += 1
    else:
        c.failures += 1


def disable_drafter(run: LocalRun, reason: str, message: str) -> None:
    """Disable every drafter of the run in place: the annotation in each pod's control file."""
    run.drafter_off = {"reason": reason, "message": message}
    for path in sorted({c.env[ENV_DRAFTER_CONTROL] for c in run.sidecars if ENV_DRAFTER_CONTROL in c.env}):
        write_control_file(Path(path), {ANNOTATION_DRAFTER_DISABLED: reason})
    sys.stderr.write(f"drafter disabled ({reason}): {message}\n")


def _drafter_status(run: LocalRun) -> dict[str, Any]:
    """The status fields of the run's drafters (as the operator's status names them)."""
    drafters = [c for c in run.sidecars if c.name == faults.DRAFTER]
    out: dict[str, Any] = {"drafterDisabled": run.drafter_off is not None,
                           "drafterFailures": max((c.failures for c in drafters), default=0),
                           "drafterPeerFailures": sum(c.peer_failures for c in drafters)}
    if run.drafter_off is not None:
        out["conditions"] = [{"type": "DrafterDegraded", "status": "True", **run.drafter_off}]
    return out


def _finish(run: LocalRun, outcome: dict[str, Any]) -> None:
    outcome = {**outcome, **_drafter_status(run)}
    run.outcome = outcome
    with contextlib.suppress(OSError):
        (run.run_dir / "status.json").write_text(json.dumps(outcome, indent=2))


def execute(run: LocalRun, *, view: ProgressView | None = None, poll_s: float = 0.2) -> int:
    """Run to completion. Returns 0 when every target exited 0, else the first failing code.
    `run.outcome` (and status.json in the run dir) says Succeeded or Failed with the reason."""
    stopping = False
    with contextlib.suppress(OSError):
        (run.run_dir / "status.json").unlink()   # a --resume starts without the last run's outcome

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    old = signal.signal(signal.SIGINT, on_sigint)
    old_term = signal.signal(signal.SIGTERM, on_sigint)
    try:
        for c in run.sidecars:      # native sidecars start before the main containers
            _start(c)
        for c in run.targets:
            _start(c)
        while True:
            if stopping:
                # Ctrl-C: targets checkpoint on SIGTERM and exit; then the sidecars.
                _stop_all(run.targets, GRACE_S)
                _stop_all(run.sidecars, GRACE_S)
                return 130
            for c in run.targets:
                if c.exit_code is None and c.proc is not None and c.proc.poll() is not None:
                    c.exit_code = c.proc.returncode
            failed = [c for c in run.targets if c.exit_code not in (None, 0)]
            if failed:
                # One rank failed: the gang stops (the operator restarts the whole job).
                _stop_all(run.targets, GRACE_S)
                _stop_all(run.sidecars, GRACE_S)
                for c in failed:
                    sys.stderr.write(f"{c.pod}/{c.name} exited {c.exit_code}; log: {c.log}\n")
                outcome = failure_outcome(run, failed[0])
                _finish(run, outcome)
                sys.stderr.write(f"job Failed ({outcome['reason']}): {outcome['message']}\n")
                return int(failed[0].exit_code or 1)
            if all(c.exit_code == 0 for c in run.targets):
                _stop_all(run.sidecars, GRACE_S)
                _finish(run, {"phase": "Succeeded", "reason": "Completed", "exitCode": 0,
                              "message": f"all {len(run.targets)} target container(s) exited 0"})
                return 0
            for c in run.sidecars:
                if c.proc is not None and c.proc.poll() is not None and _sidecar_exited(run, c):
                    c.restarts += 1      # restart it like the kubelet would
                    _start(c)
            if view is not None:
                view.refresh()
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, old_term)
        if view is not None:
            view.close()
        shutil.rmtree(run.shm_dir, ignore_errors=True)


def run_job(path: str | Path, run_dir: Path, *, resume: bool = False, drafter: bool = True,
            live: bool = True, env_overrides: dict[str, str] | None = None) -> int:
    manifest = load_manifest(path)
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise SystemExit(f"--run-dir {run_dir} already holds a run: pass --resume to continue it, "
                         "or choose another directory")
    run = plan(manifest, run_dir, drafter=drafter, env_overrides=env_overrides)
    data_dirs = json.loads((run_dir / "layout.json").read_text())["data_dirs"]
    view = ProgressView(Path(data_dirs[0]), live=live) if data_dirs else None
    return execute(run, view=view)


def run_main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir or f"runs/{Path(args.file).stem}")
    live = sys.stdout.isatty() and not getattr(args, "quiet", False)
    t0 = time.monotonic()
    if getattr(args, "baseline", False):
        # The same job with the drafter off, so the report can compare target step times.
        base_dir = run_dir / "baseline"
        print(f"baseline run (drafter off) -> {base_dir}")
        code = run_job(args.file, base_dir, resume=args.resume, drafter=False, live=live)
        if code != 0:
            return code
    print(f"run -> {run_dir}")
    code = run_job(args.file, run_dir, resume=args.resume or getattr(args, "baseline", False),
                   live=live)
    print(f"job finished with exit code {code} in {time.monotonic() - t0:.0f} s")
    if code == 0 and getattr(args, "report", False):
        from spectrain_workloads import report  # lazy: needs matplotlib

        out = report.build_report(run_dir)
        report.print_headline(run_dir, out)
    return code
