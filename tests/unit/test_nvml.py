"""spectrain_workloads.nvml: every path with NVML absent (this machine) and with a stand-in pynvml."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from spectrain_workloads import exitcodes, nvml
from spectrain_workloads.errors import ConfigError

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
    sig = nvml.UtilizationSignal(lib=lib)
    hint = sig.poll()
    assert not sig.available and not hint.idle and hint.confidence == 0.0 and hint.utilization_pct is None
    guard = nvml.MemoryGuard(own_bytes_fn=lambda: 5 * GiB, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"},
                             lib=lib)
    ok = guard.check(GiB)
    assert ok.ok and ok.device_free_bytes is None and "unknown" in ok.reason
    assert not guard.check(3 * GiB).ok, "the pinned-limit check still works without NVML"


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


def test_utilization_signal_needs_a_streak_and_caps_confidence() -> None:
    lib = FakeNvml()
    sig = nvml.UtilizationSignal(threshold_pct=10, min_samples=3, lib=lib)
    lib.util[0] = 90
    busy = sig.poll()
    assert not busy.idle and busy.confidence == 0.0 and busy.utilization_pct == 90
    lib.util[0] = 5
    hints = [sig.poll() for _ in range(4)]
    assert [h.idle for h in hints] == [False, False, True, True]
    assert all(h.confidence <= nvml.MAX_CONFIDENCE for h in hints)
    assert hints[0].confidence < hints[2].confidence == nvml.MAX_CONFIDENCE
    lib.util[0] = 50
    assert not sig.poll().idle, "one busy sample resets the streak"
    sig.close()
    assert lib.shutdowns == 1


def test_utilization_signal_bad_device() -> None:
    sig = nvml.UtilizationSignal(device_index=7, lib=FakeNvml())
    assert not sig.available and "Invalid Argument" in sig.poll().reason


@pytest.mark.parametrize(("bad", "field"), [({"threshold_pct": 101}, "threshold_pct"),
                                            ({"min_samples": 0}, "min_samples")])
def test_utilization_signal_arguments(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        nvml.UtilizationSignal(lib=FakeNvml(), **bad)


def test_memory_guard_with_nvml() -> None:
    lib = FakeNvml()
    own = {"bytes": 2 * GiB}
    guard = nvml.MemoryGuard(own_bytes_fn=lambda: own["bytes"], min_free_bytes=4 * GiB,
                             env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10G"}, lib=lib)
    assert guard.limit_bytes == 10 * GiB
    assert guard.check(GiB).ok
    over_cap = guard.check(8 * GiB)
    assert not over_cap.ok and "pinned limit" in over_cap.reason
    lib.free[0] = 5 * GiB
    tight = guard.check(2 * GiB)
    assert not tight.ok and "reserved for the target" in tight.reason
    assert tight.device_free_bytes == 5 * GiB


def test_wait_until_fits_uses_the_injected_clock() -> None:
    lib = FakeNvml()
    lib.free[0] = GiB
    guard = nvml.MemoryGuard(min_free_bytes=2 * GiB, env={}, lib=lib)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s
        if now[0] >= 1.0:
            lib.free[0] = 10 * GiB

    v = nvml.wait_until_fits(guard, GiB, timeout_s=5, poll_s=0.5, clock=lambda: now[0], sleep=sleep)
    assert v.ok and now[0] == 1.0
    lib.free[0] = GiB
    v = nvml.wait_until_fits(guard, GiB, timeout_s=2, poll_s=0.5, clock=lambda: now[0],
                             sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert not v.ok


@pytest.mark.parametrize(("value", "device", "expected"), [
    ("0=8192M,1=4G", 0, 8 * GiB), ("0=8192M,1=4G", 1, 4 * GiB), ("0=8192M", 1, None), ("8G", 3, 8 * GiB),
    ("0=512MB", 0, 512 << 20), (None, 0, None), ("", 0, None),
])
def test_parse_pinned_limit(value: str | None, device: int, expected: int | None) -> None:
    assert nvml.parse_pinned_limit(value, device) == expected


@pytest.mark.parametrize("bad", ["x=1G", "0=lots", "0:1G,1=2G"])
def test_parse_pinned_limit_errors_name_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        nvml.parse_pinned_limit(bad, 0)


def test_operator_pinned_limit_format_round_trips() -> None:
    from spectrain_operator import gpu_sharing

    text = gpu_sharing.pinned_mem_limit_env("6Gi", 2)
    assert nvml.parse_pinned_limit(text, 1) == 6 * GiB


@pytest.mark.parametrize(("exc", "code"), [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), exitcodes.EXIT_GPU_FAULT),
    (RuntimeError("cudaErrorMpsClientTerminated"), exitcodes.EXIT_GPU_FAULT),
    (ConfigError("spec.target.model.preset: unknown"), exitcodes.EXIT_CONFIG),
    (ValueError("bad"), exitcodes.EXIT_ERROR),
])
def test_exit_code_for(exc: BaseException, code: int) -> None:
    assert exitcodes.exit_code_for(exc) == code


def test_returncode_to_exit() -> None:
    assert exitcodes.returncode_to_exit(-9) == 137
    assert exitcodes.returncode_to_exit(3) == 3
