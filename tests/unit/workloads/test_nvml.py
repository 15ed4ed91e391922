"""spectrain_workloads.nvml: every path with NVML absent (this machine) and with a stand-in pynvml."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from spectrain_workloads import nvml

pytestmark = pytest.mark.unit

GiB = 1 << 30


class NVMLError(Exception):
    pass


class FakeNvml:
    """A stand-in for the pynvml module: one or more GPUs with settable telemetry."""

    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3

    def __init__(self, gpus: int = 1, *, init_error: Exception | None = None, mps_server: bool = False):
        self.init_error = init_error
        self.util = [0] * gpus
        self.free = [60 * GiB] * gpus
        self.mode = [3] * gpus
        self.mps_server = mps_server
        self.inits = 0
        self.shutdowns = 0
        self.fail_util = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.util)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < len(self.util):
            raise NVMLError("Invalid Argument")
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000-{h}"

    def nvmlDeviceGetComputeMode(self, h: int) -> int:
        return self.mode[h]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        total = 141 * GiB
        return types.SimpleNamespace(total=total, free=self.free[h], used=total - self.free[h])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        if self.fail_util:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=self.util[h], memory=self.util[h] // 2)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.65.06"

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [types.SimpleNamespace(pid=4242)] if self.mps_server else [types.SimpleNamespace(pid=1)]

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        return b"nvidia-cuda-mps-server" if pid == 4242 else b"python"


# ------------------------------------------------------------------------- NVML really absent here


def _real_nvml_works() -> bool:
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_real_pynvml_report_agrees_with_pynvml() -> None:
    r = nvml.report(env={})
    assert r.available == _real_nvml_works()
    if not r.available:
        assert r.reason, "an unavailable report says why"
        assert r.gpus == ()
    assert isinstance(r.to_dict(), dict)


def test_no_pynvml_module_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: None)
    r = nvml.report(env={})
    assert not r.available and "nvidia-ml-py" in r.reason


def test_library_not_found_everywhere() -> None:
    lib = FakeNvml(init_error=NVMLError("NVML Shared Library Not Found"))
    r = nvml.report(lib=lib, env={"SPECTRAIN_GPU_SHARING": "DRA"})
    assert not r.available and "NVML Shared Library Not Found" in r.reason
    assert r.sharing_mode == "DRA"


# ------------------------------------------------------------------------- with a stand-in NVML


def test_report_with_gpus(tmp_path: Path) -> None:
    lib = FakeNvml(gpus=2)
    lib.util = [55, 3]
    r = nvml.report(lib=lib, env={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert r.available and r.driver_version == "580.65.06"
    assert [g.index for g in r.gpus] == [0, 1]
    g0 = r.gpus[0]
    assert (g0.name, g0.compute_mode, g0.utilization_gpu_pct) == ("NVIDIA H200", "ExclusiveProcess", 55)
    assert g0.memory_free_bytes == 60 * GiB and g0.memory_total_bytes == 141 * GiB
    assert not r.mps.active
    assert lib.inits == lib.shutdowns == 1, "the NVML session is closed"
    d = r.to_dict()
    assert d["gpus"][1]["utilization_gpu_pct"] == 3


def test_unsupported_query_is_reported_as_unknown() -> None:
    lib = FakeNvml()
    lib.fail_util = True
    r = nvml.report(lib=lib, env={})
    assert r.available and r.gpus[0].utilization_gpu_pct is None


def test_mps_detected_from_control_pipe(tmp_path: Path) -> None:
    (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
           "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}
    m = nvml.detect_mps(env)
    assert (m.active, m.source, m.active_thread_percentage, m.pinned_device_mem_limit) == \
        (True, "pipe", 30, "0=8192M")


def test_mps_detected_from_server_process(tmp_path: Path) -> None:
    r = nvml.report(lib=FakeNvml(mps_server=True), env={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")})
    assert r.mps.active and r.mps.source == "mps-server-process"


def test_operator_pinned_limit_format_round_trips() -> None:
    from spectrain_operator import gpu_sharing
    from spectrain_workloads.drafter.sidecar import parse_memory

    text = gpu_sharing.pinned_mem_limit_env("6Gi", 2)
    assert parse_memory(text, 1) == 6 * GiB
