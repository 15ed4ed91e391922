"""GPU telemetry through NVML (pynvml from nvidia-ml-py): MPS / compute-mode detection, utilisation
and memory, for the drafter's summary (its `gpu` field) and `make gpu-check`.

Every entry point works without NVML (no driver, no GPU, CPU runs): nothing here raises because
NVML is missing; the results say ``available: False`` with the reason (e.g.
``NVMLError_LibraryNotFound``). No torch import.

- `report()` -> `GpuReport`: driver, per-GPU name / uuid / compute mode / memory / utilisation,
  and `MpsInfo` (is this process an MPS client, and under which caps). `GpuReport.to_dict()` is
  JSON-ready for metrics and the drafter summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from spectrain_api.names import ENV_GPU_SHARING

DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"

COMPUTE_MODES = {0: "Default", 1: "ExclusiveThread", 2: "Prohibited", 3: "ExclusiveProcess"}


def _load_pynvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _err_name(e: BaseException) -> str:
    return type(e).__name__


class Nvml:
    """A scoped NVML session: `with Nvml() as n: ...`; `n.available`, `n.reason`, `n.lib`.

    `lib` may be injected (a fake pynvml in tests). Init failures are caught and recorded.
    """

    def __init__(self, lib: Any = None):
        self.lib: Any = lib if lib is not None else _load_pynvml()
        self.available = False
        self.reason = ""
        self._owns_init = False

    def open(self) -> Nvml:
        if self.lib is None:
            self.reason = "pynvml not installed (pip install nvidia-ml-py)"
            return self
        try:
            self.lib.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            self.reason = f"{_err_name(e)}: {e}"
            return self
        self.available = True
        self._owns_init = True
        return self

    def device_handle(self, index: int) -> Any:
        """The device's NVML handle, or None (reason recorded, session closed) when it cannot be had."""
        if not self.available:
            return None
        try:
            return self.lib.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:
            self.reason = f"{_err_name(e)}: {e}"
            self.close()
            return None

    def close(self) -> None:
        if self._owns_init:
            try:
                self.lib.nvmlShutdown()
            except Exception:
                pass
            self._owns_init = False
            self.available = False

    def __enter__(self) -> Nvml:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str = ""
    uuid: str = ""
    compute_mode: str = "Unknown"
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None


@dataclass(frozen=True)
class MpsInfo:
    """Whether this process talks to an MPS control daemon, and the caps it runs under.

    `source`: how MPS was detected: "pipe" (CUDA_MPS_PIPE_DIRECTORY, or the default
    /tmp/nvidia-mps, holds the daemon's `control` pipe), "mps-server-process" (NVML lists an
    nvidia-cuda-mps-server on the GPU) or "none".
    """

    active: bool
    source: str
    pipe_directory: str | None = None
    active_thread_percentage: int | None = None
    pinned_device_mem_limit: str | None = None


@dataclass(frozen=True)
class GpuReport:
    available: bool
    reason: str = ""
    driver_version: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    mps: MpsInfo = field(default_factory=lambda: MpsInfo(active=False, source="none"))
    sharing_mode: str = ""  # SPECTRAIN_GPU_SHARING, set by the operator

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        return d


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # a query not supported on this GPU / driver: report it as unknown
        return None


def _gpu_info(lib: Any, index: int) -> GpuInfo:
    h = lib.nvmlDeviceGetHandleByIndex(index)
    mem = _call(lambda: lib.nvmlDeviceGetMemoryInfo(h))
    util = _call(lambda: lib.nvmlDeviceGetUtilizationRates(h))
    mode = _call(lambda: lib.nvmlDeviceGetComputeMode(h))
    return GpuInfo(
        index=index,
        name=_text(_call(lambda: lib.nvmlDeviceGetName(h)) or ""),
        uuid=_text(_call(lambda: lib.nvmlDeviceGetUUID(h)) or ""),
        compute_mode=COMPUTE_MODES.get(mode, "Unknown") if mode is not None else "Unknown",
        memory_total_bytes=int(mem.total) if mem is not None else None,
        memory_used_bytes=int(mem.used) if mem is not None else None,
        memory_free_bytes=int(mem.free) if mem is not None else None,
        utilization_gpu_pct=int(util.gpu) if util is not None else None,
        utilization_memory_pct=int(util.memory) if util is not None else None,
    )


def _mps_server_running(lib: Any, count: int) -> bool:
    for i in range(count):
        try:
            h = lib.nvmlDeviceGetHandleByIndex(i)
            procs = lib.nvmlDeviceGetComputeRunningProcesses(h) or []
        except Exception:
            continue
        for p in procs:
            try:
                name = lib.nvmlSystemGetProcessName(p.pid)
            except Exception:
                continue
            if "nvidia-cuda-mps-server" in _text(name):
                return True
    return False


def detect_mps(env: Mapping[str, str] | None = None, *, lib: Any = None, gpu_count: int = 0) -> MpsInfo:
    """MPS client detection from the environment and, when given an open NVML `lib`, the GPUs."""
    env = os.environ if env is None else env
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR
    pct_text = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    pct = int(pct_text) if pct_text and pct_text.strip().isdigit() else None
    pinned = env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") or None
    if (Path(pipe) / "control").exists():
        return MpsInfo(True, "pipe", pipe, pct, pinned)
    if lib is not None and gpu_count and _mps_server_running(lib, gpu_count):
        return MpsInfo(True, "mps-server-process", env.get("CUDA_MPS_PIPE_DIRECTORY"), pct, pinned)
    return MpsInfo(False, "none", env.get("CUDA_MPS_PIPE_DIRECTORY"), pct, pinned)


def report(*, lib: Any = None, env: Mapping[str, str] | None = None) -> GpuReport:
    """What this process sees of the GPUs; never raises for a missing or failing NVML."""
    env = os.environ if env is None else env
    mode = env.get(ENV_GPU_SHARING, "")
    with Nvml(lib) as n:
        if not n.available:
            return GpuReport(available=False, reason=n.reason, mps=detect_mps(env), sharing_mode=mode)
        try:
            count = int(n.lib.nvmlDeviceGetCount())
            gpus = tuple(_gpu_info(n.lib, i) for i in range(count))
        except Exception as e:
            return GpuReport(available=False, reason=f"{_err_name(e)}: {e}", mps=detect_mps(env),
                             sharing_mode=mode)
        driver = _text(_call(n.lib.nvmlSystemGetDriverVersion) or "")
        return GpuReport(available=True, driver_version=driver, gpus=gpus,
                         mps=detect_mps(env, lib=n.lib, gpu_count=count), sharing_mode=mode)
