"""No side doors in a local run: every TCP listener of `spectrain run`'s processes (the target's
rendezvous store, the drafters' exchange and AllReduce store, gloo, the metrics endpoints) is on
127.0.0.1, none on every interface (0.0.0.0 / ::). Read from /proc: the run's process tree, each
process's socket inodes, and the kernel's LISTEN sockets (/proc/net/tcp, tcp6)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_local_backend import ROOT, SPECTRAIN, short_demo
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp's st column


def _tree(root: int) -> set[int]:
    """`root` and every live descendant."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue                      # gone meanwhile
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in (Path("/proc") / str(pid) / "fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _addr(hex_addr: str) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    # the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listeners(root: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN held by `root`'s process tree."""
    inodes = set().union(*(_socket_inodes(p) for p in _tree(root)))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == LISTEN and f[9] in inodes:
                out.add(_addr(f[1]))
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_a_local_run_listens_on_loopback_only(tmp_path: Path) -> None:
    manifest = short_demo(tmp_path, steps=400, every=100)
    job = yaml.safe_load(manifest.read_text())
    job["spec"]["drafter"]["exchange"] = {"engine": "AllReduce", "combineEverySeconds": 1}
    manifest.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*SPECTRAIN, "run", str(manifest), "--run-dir", str(run_dir), "-q"], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (run_dir / "layout.json").exists() or proc.poll() is not None, 60, interval=0.1,
                 what="the run's layout.json")
        metrics = {p for m in json.loads((run_dir / "layout.json").read_text())["metrics"] for p in m["ports"]}
        assert len(metrics) == 4, metrics          # 2 pods x (target, drafter)
        seen: set[tuple[str, int]] = set()

        def all_up() -> bool:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            tree = _tree(proc.pid)
            seen.update(listeners(proc.pid))
            envs = [_env_of(p) for p in tree]
            master = {int(e["MASTER_PORT"]) for e in envs if "MASTER_PORT" in e}
            store = {int(e["SPECTRAIN_DRAFTER_STORE"].rpartition(":")[2]) for e in envs
                     if "SPECTRAIN_DRAFTER_STORE" in e}
            return bool(master and store) and master | store | metrics <= {port for _, port in seen}

        # every listener of the run at once: the rendezvous store (rank 0's, from the start), the
        # metrics endpoints, the AllReduce store (the exporting rank's drafter, once it started)
        wait_for(all_up, 240, interval=0.2, what=f"the rendezvous store, the AllReduce store and the metrics ports {sorted(metrics)} listening")
        wildcard = sorted((a, p) for a, p in seen if ipaddress.ip_address(a).is_unspecified)
        assert not wildcard, f"listening on every interface: {wildcard} (all: {sorted(seen)})"
        assert {a for a, _ in seen} == {"127.0.0.1"}, sorted(seen)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)


if __name__ == "__main__":      # the listeners of a running process tree: python -m ... PID
    print(sorted(listeners(int(sys.argv[1]))))
