"""Run the real operator (`python -m spectrain_operator`) as a local process the way the chart's
Deployment runs it: the same args and env (fieldRefs resolved), the ServiceAccount's credentials,
and its ports moved to free loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.integration.kubeapi import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def deployment_command(dep: dict[str, Any], *, pod_name: str, namespace: str, liveness_port: int,
                       metrics_port: int, overrides: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and env of the operator container of a rendered Deployment, as a local process."""
    c = dep["spec"]["template"]["spec"]["containers"][0]
    argv = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(c["command"])]
    for a in c.get("args", []):
        if a.startswith("--liveness="):
            a = f"--liveness=http://127.0.0.1:{liveness_port}/healthz"
        elif a.startswith("--metrics-port=") and a != "--metrics-port=0":
            a = f"--metrics-port={metrics_port}"
        argv.append(a)
    env: dict[str, str] = {}
    field = {"metadata.name": pod_name, "metadata.namespace": namespace}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
            env[e["name"]] = field[e["valueFrom"]["fieldRef"]["fieldPath"]]
    env.update(overrides or {})
    return argv, env


class OperatorProcess:
    def __init__(self, dep: dict[str, Any], kubeconfig: Path, log_path: Path, *, pod_name: str,
                 namespace: str, overrides: dict[str, str] | None = None) -> None:
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.argv, self.env = deployment_command(dep, pod_name=pod_name, namespace=namespace,
                                                 liveness_port=self.liveness_port,
                                                 metrics_port=self.metrics_port, overrides=overrides)
        self.kubeconfig, self.log_path, self.pod_name = kubeconfig, log_path, pod_name
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KOPF_"))}
        env.update(self.env)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "workloads"),
                                             env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def check_alive(self) -> None:
        if not self.alive:
            code = self.proc.returncode if self.proc else None
            raise AssertionError(f"operator {self.pod_name} exited ({code}):\n{self.log_tail()}")

    def healthy(self) -> bool:
        self.check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        wait_for(self.healthy, timeout, interval=0.05, what=f"operator {self.pod_name} /healthz")

    def kill(self) -> None:
        """SIGKILL: a crash, no graceful goodbye to the peers."""
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive:
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
