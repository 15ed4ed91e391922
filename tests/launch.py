"""Run a target job as local processes with the environment a pod would get (tests, benches, drafters).

    procs = launch_local(cfg_path, world=2, run_dir=run, ring_dir=ring)
    codes = wait_all(procs, timeout_s=120)

`nodes` processes ("pods") are started, each with LOCAL_WORLD_SIZE = world / nodes (the target
entrypoint spawns its local ranks when that is > 1). A pod's ring files live in
`ring_dir` (one node) or `ring_dir/node-<n>` (several): `ring_file(ring_dir, rank, ...)` gives the
path of any rank's ring. Logs go to `<run_dir>/logs/node-<n>.log`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_WORKLOADS = str(Path(__file__).resolve().parents[1] / "workloads")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def node_ring_dir(ring_dir: str | os.PathLike[str], node: int, nodes: int) -> Path:
    return Path(ring_dir) if nodes == 1 else Path(ring_dir) / f"node-{node}"


def ring_file(ring_dir: str | os.PathLike[str], rank: int, *, world: int, nodes: int | None = None) -> Path:
    """The ring file of global `rank` under launch_local's layout."""
    nodes = world if nodes is None else nodes
    per = world // nodes
    return node_ring_dir(ring_dir, rank // per, nodes) / f"ring-{rank % per}"


def rank_env(*, cfg_path: str | os.PathLike[str], world: int, node: int, nodes: int, run_dir: Path,
             ring_dir: Path, master_port: int, device: str = "cpu",
             extra: Mapping[str, str] | None = None) -> dict[str, str]:
    per = world // nodes
    env = {
        **os.environ,
        "SPECTRAIN_CONFIG": str(cfg_path), "SPECTRAIN_RUN_DIR": str(run_dir),
        "SPECTRAIN_RING_DIR": str(node_ring_dir(ring_dir, node, nodes)), "SPECTRAIN_DEVICE": device,
        "SPECTRAIN_JOB_NAME": os.environ.get("SPECTRAIN_JOB_NAME", "local"),
        "RANK": str(node * per), "NODE_RANK": str(node), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(per), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": "lo", "SPECTRAIN_TORCH_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (_WORKLOADS, os.environ.get("PYTHONPATH", "")) if p),
    }
    if per == 1:
        env["LOCAL_RANK"] = "0"     # the process is the rank itself; no spawning
    else:
        env.pop("LOCAL_RANK", None)
    env.update(extra or {})   # callers may override anything above, e.g. SPECTRAIN_TORCH_THREADS
    return env


def launch_local(cfg_path: str | os.PathLike[str], world: int, run_dir: str | os.PathLike[str],
                 ring_dir: str | os.PathLike[str], *, nodes: int | None = None,
                 env: Mapping[str, str] | None = None, master_port: int | None = None,
                 device: str = "cpu", python: str = sys.executable) -> list[subprocess.Popen[Any]]:
    """Start the target job; returns one Popen per node (default: one per rank)."""
    nodes = world if nodes is None else nodes
    if nodes < 1 or world % nodes:
        raise ValueError(f"world ({world}) must be a multiple of nodes ({nodes})")
    run, ring = Path(run_dir), Path(ring_dir)
    (run / "logs").mkdir(parents=True, exist_ok=True)
    port = master_port or free_port()
    procs = []
    for n in range(nodes):
        node_ring_dir(ring, n, nodes).mkdir(parents=True, exist_ok=True)
        e = rank_env(cfg_path=cfg_path, world=world, node=n, nodes=nodes, run_dir=run, ring_dir=ring,
                     master_port=port, device=device, extra=env)
        log = open(run / "logs" / f"node-{n}.log", "ab")
        try:
            procs.append(subprocess.Popen([python, "-m", "spectrain_workloads.target"], env=e,
                                          stdout=log, stderr=subprocess.STDOUT))
        finally:
            log.close()     # the child holds its own descriptor
    return procs


def wait_all(procs: list[subprocess.Popen[Any]], timeout_s: float) -> list[int]:
    """Wait for every process; on timeout kill them all and raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop(procs, grace_s=0)
        raise TimeoutError(f"target processes still running after {timeout_s}s") from None
    return [p.returncode for p in procs]


def stop(procs: list[subprocess.Popen[Any]], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after grace_s, for the processes still running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
