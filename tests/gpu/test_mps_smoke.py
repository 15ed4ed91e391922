"""CUDA smoke test: target + drafter as two MPS clients of one private MPS daemon on one GPU.

Checks the drafter's caps as spectrain sets them (gpu_sharing.drafter_mps_env):
- thread cap: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 makes the drafter's compute-bound matmul at
  least 2x slower than the uncapped target's (ideal 4x), measured one client at a time;
- memory cap: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M lets the drafter allocate 1 GiB but not 3 GiB;
- both clients then run together and finish, and spectrain_workloads.nvml sees MPS.
Also runs spectrain-supervisor (SingleContainer mode) with the real `nvidia-cuda-mps-control -f`.

Skipped without CUDA (tests/conftest.py) and without the nvidia-cuda-mps-control binary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from spectrain_operator import gpu_sharing
from tests.waiting import wait_for

pytestmark = pytest.mark.gpu

TIMEOUT = 240
THREAD_PCT = 25
PINNED_MIB = 2048

CLIENT = textwrap.dedent("""\
    import json, os, sys, time
    from pathlib import Path
    import torch
    role, d = sys.argv[1], Path(sys.argv[2])
    def wait_file(name, timeout=200):
        deadline = time.monotonic() + timeout
        while not (d / name).exists():
            if time.monotonic() > deadline:
                sys.exit(98)
            time.sleep(0.01)
    def matmul_seconds(n=8192, reps=40):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    out = {"role": role, "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    from spectrain_workloads import nvml
    out["mps"] = nvml.report().to_dict()["mps"]
    if role == "target":
        out["seconds"] = matmul_seconds()
        (d / "target.json").write_text(json.dumps(out))
        wait_file("drafter.json")
        out["together_seconds"] = matmul_seconds(reps=20)
        (d / "target-together.json").write_text(json.dumps(out))
    else:
        wait_file("target.json")
        out["seconds"] = matmul_seconds()
        gib = 1 << 30
        small = torch.empty(gib, dtype=torch.uint8, device="cuda")
        out["alloc_1gib"] = True
        del small
        torch.cuda.empty_cache()
        try:
            big = torch.empty(3 * gib, dtype=torch.uint8, device="cuda")
            big.fill_(1)
            torch.cuda.synchronize()
            out["alloc_3gib"] = True
        except torch.OutOfMemoryError:
            out["alloc_3gib"] = False
        (d / "drafter.json").write_text(json.dumps(out))
        out["together_seconds"] = matmul_seconds(reps=20)
        (d / "drafter-together.json").write_text(json.dumps(out))
""")


def _mps_binary() -> str:
    path = shutil.which("nvidia-cuda-mps-control")
    if path is None:
        pytest.skip("nvidia-cuda-mps-control not on PATH: install the NVIDIA compute utils")
    return path


@pytest.fixture
def mps_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private MPS control daemon (pipe/log dirs under tmp_path); quit at the end."""
    binary = _mps_binary()
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    log.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    subprocess.run([binary, "-d"], env=env, check=True, timeout=30)

    def ready() -> bool:
        return subprocess.run([binary], input=b"get_server_list\n", env=env, capture_output=True,
                              timeout=10).returncode == 0

    try:
        wait_for(ready, 30, interval=0.1, what="the MPS control daemon")
        yield env
    finally:
        subprocess.run([binary], input=b"quit\n", env=env, capture_output=True, timeout=30)


def test_target_and_drafter_share_a_gpu_under_mps_with_caps(tmp_path: Path, mps_env: dict[str, str]) -> None:
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    job = {"metadata": {"name": "smoke"}, "spec": {
        "gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 1},
        "drafter": {"gpuShare": {"activeThreadPercentage": THREAD_PCT, "pinnedMemoryLimit": f"{PINNED_MIB}Mi"}}}}
    drafter_env = {**mps_env, **gpu_sharing.drafter_mps_env(job), "CUDA_VISIBLE_DEVICES": "0"}
    assert drafter_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={PINNED_MIB}M"
    target_env = {**mps_env, "CUDA_VISIBLE_DEVICES": "0"}
    target = subprocess.Popen([sys.executable, str(client), "target", str(tmp_path)], env=target_env)
    drafter = subprocess.Popen([sys.executable, str(client), "drafter", str(tmp_path)], env=drafter_env)
    try:
        assert drafter.wait(TIMEOUT) == 0
        assert target.wait(TIMEOUT) == 0
    finally:
        for p in (target, drafter):
            if p.poll() is None:
                p.kill()
                p.wait()
    t = json.loads((tmp_path / "target.json").read_text())
    d = json.loads((tmp_path / "drafter.json").read_text())
    print(json.dumps({"target": t, "drafter": d}, indent=1))
    assert t["mps"]["active"] and d["mps"]["active"], "both processes must be MPS clients"
    ratio = d["seconds"] / t["seconds"]
    assert ratio >= 2.0, f"drafter at {THREAD_PCT}% threads only {ratio:.2f}x slower than the target"
    assert d["alloc_1gib"] is True
    assert d["alloc_3gib"] is False, f"the {PINNED_MIB}M pinned limit did not stop a 3 GiB allocation"
    assert (tmp_path / "target-together.json").exists() and (tmp_path / "drafter-together.json").exists()


def test_supervisor_runs_mps_drafter_and_target_in_one_container(tmp_path: Path) -> None:
    binary = _mps_binary()
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    log.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log),
           "CUDA_VISIBLE_DEVICES": "0"}
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    drafter_env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(THREAD_PCT),
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={PINNED_MIB}M"}
    argv = [sys.executable, "-m", "spectrain_workloads.supervisor",
            "--mps-command", json.dumps([binary, "-f"]),
            "--mps-ready-command", json.dumps(["sh", "-c", f"echo get_server_list | {binary}"]),
            "--drafter-command", json.dumps([sys.executable, str(client), "drafter", str(tmp_path)]),
            "--drafter-env", json.dumps(drafter_env),
            "--termination-log", str(tmp_path / "termination-log"),
            "--", sys.executable, str(client), "target", str(tmp_path)]
    proc = subprocess.run(argv, env=env, timeout=TIMEOUT)
    verdict = json.loads((tmp_path / "termination-log").read_text())["spectrainSupervisor"]
    assert proc.returncode == 0, verdict
    assert verdict["cause"] == "success"
    d = json.loads((tmp_path / "drafter.json").read_text())
    assert d["mps"]["active"] and d["alloc_3gib"] is False
