"""Helpers for drafter integration tests: a drafter sidecar process next to a synthetic target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spectrain_api import rundir
from spectrain_workloads.drafter.synthetic import SyntheticSpec, SyntheticTarget
from spectrain_workloads.model import ModelConfig, model_config

REPO = Path(__file__).resolve().parents[2]
TARGET_CFG: ModelConfig = model_config("debug", {"n_layers": 2, "max_seq_len": 64})


class Pod:
    """The run/ring/config directories of one pod, and its drafter process."""

    def __init__(self, root: Path, drafter: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, target: dict[str, Any] | None = None) -> None:
        self.root = root
        self.run_dir, self.ring_dir = root / "run", root / "ring"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ring_dir.mkdir(parents=True, exist_ok=True)
        self.config = root / "config.json"
        self.config.write_text(json.dumps({"metadata": {"name": "t"},
                                           "spec": {"drafter": drafter or {}, "target": target or {}}}))
        self.settings = settings or {}
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        pythonpath = os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")])
        return {**os.environ, "PYTHONPATH": pythonpath, "SPECTRAIN_CONFIG": str(self.config),
                "SPECTRAIN_RING_DIR": str(self.ring_dir), "SPECTRAIN_RUN_DIR": str(self.run_dir),
                "SPECTRAIN_DEVICE": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "SPECTRAIN_DRAFTER_SETTINGS": json.dumps(self.settings), **self.extra_env}

    def start_drafter(self) -> subprocess.Popen[bytes]:
        log = open(self.root / "drafter.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "spectrain_workloads.drafter.sidecar"], env=self.env(),
                                     stdout=log, stderr=subprocess.STDOUT)
        return self.proc

    def stop_drafter(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def events(self, rank: int = 0) -> list[dict[str, Any]]:
        return read_jsonl(rundir.drafter_metrics(self.run_dir, rank))

    def of(self, event: str) -> list[dict[str, Any]]:
        return self.of_rank(event, 0)

    def of_rank(self, event: str, rank: int) -> list[dict[str, Any]]:
        return [e for e in self.events(rank) if e["event"] == event]

    def summary(self, rank: int = 0) -> dict[str, Any]:
        return json.loads(rundir.drafter_summary(self.run_dir, rank).read_text())

    def windows(self, rank: int = 0) -> dict[int, dict[str, Any]]:
        return {w["window_id"]: w for w in read_jsonl(self.run_dir / "metrics" / f"windows-rank-{rank}.jsonl")}

    def log_text(self) -> str:
        p = self.root / "drafter.log"
        return p.read_text(errors="replace") if p.exists() else ""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


def synthetic_target(pod: Pod, spec: SyntheticSpec) -> SyntheticTarget:
    return SyntheticTarget(run_dir=pod.run_dir, ring_path=pod.ring_dir / "ring-0", spec=spec, cfg=TARGET_CFG)


def drive(target: SyntheticTarget, until: Callable[[], Any], timeout: float, what: str,
          proc: subprocess.Popen[bytes] | None = None) -> Any:
    """Run target steps until `until()` is truthy; TimeoutError naming `what` (and the drafter's fate)."""
    deadline = time.monotonic() + timeout
    while True:
        value = until()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the drafter exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        target.run_step()
