"""GPU telemetry through NVML (pynvml from nvidia-ml-py): MPS / compute-mode detection, utilisation,
memory, a secondary idle signal and the drafter's memory guard.

Every entry point works without NVML (no driver, no GPU, CPU runs): nothing here raises because
NVML is missing; the results say ``available: False`` with the reason (e.g.
``NVMLError_LibraryNotFound``). No torch import: the drafter passes its own memory counter
(``torch.cuda.memory_reserved``) to `MemoryGuard`.

- `report()` -> `GpuReport`: driver, per-GPU name / uuid / compute mode / memory / utilisation,
  and `MpsInfo` (is this process an MPS client, and under which caps). `GpuReport.to_dict()` is
  JSON-ready for metrics and the drafter summary.
- `UtilizationSignal`: a pollable, lower-confidence idle hint. NVML utilisation is the fraction
  of the last sample period (1/6 s to 1 s, driver-dependent) in which any kernel ran, device-wide:
  it includes the drafter's own kernels, lags window boundaries and cannot say how long an idle
  stretch will last. The ring's published windows stay the primary signal; this one only
  corroborates (confidence <= `MAX_CONFIDENCE`).
- `MemoryGuard`: before the drafter grows (a bigger batch, a new cache) it asks whether the
  request fits under its MPS pinned-memory cap (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) and whether
  the device keeps at least `min_free_bytes` free for the target.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"
MAX_CONFIDENCE = 0.5

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
    mode = env.get("SPECTRAIN_GPU_SHARING", "")
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


# ------------------------------------------------------------------------------ idle signal


@dataclass(frozen=True)
class IdleHint:
    idle: bool
    confidence: float  # 0..MAX_CONFIDENCE; 0 when the signal is unavailable
    utilization_pct: int | None
    reason: str


class UtilizationSignal:
    """Secondary idle signal from NVML utilisation (see the module docstring for its limits).

    `poll()` samples once; the GPU reads idle after `min_samples` consecutive samples at or below
    `threshold_pct`. Confidence grows with the streak and never exceeds MAX_CONFIDENCE. Without
    NVML every poll answers `IdleHint(False, 0.0, None, reason)`.
    """

    def __init__(self, device_index: int = 0, *, threshold_pct: int = 10, min_samples: int = 3,
                 lib: Any = None):
        if not 0 <= threshold_pct <= 100:
            raise ValueError(f"threshold_pct: {threshold_pct} is outside 0..100")
        if min_samples < 1:
            raise ValueError(f"min_samples: {min_samples}; use at least 1")
        self.device_index = device_index
        self.threshold_pct = threshold_pct
        self.min_samples = min_samples
        self._nvml = Nvml(lib).open()
        self._handle: Any = self._nvml.device_handle(device_index)
        self._streak = 0

    @property
    def available(self) -> bool:
        return self._handle is not None

    @property
    def reason(self) -> str:
        return "" if self.available else (self._nvml.reason or "nvml unavailable")

    def poll(self) -> IdleHint:
        if self._handle is None:
            return IdleHint(False, 0.0, None, f"nvml unavailable: {self.reason}")
        try:
            util = int(self._nvml.lib.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception as e:
            self._streak = 0
            return IdleHint(False, 0.0, None, f"utilisation query failed: {_err_name(e)}")
        if util <= self.threshold_pct:
            self._streak += 1
        else:
            self._streak = 0
        idle = self._streak >= self.min_samples
        confidence = MAX_CONFIDENCE * min(1.0, self._streak / self.min_samples)
        why = (f"utilisation {util}% <= {self.threshold_pct}% for {self._streak} samples" if self._streak
               else f"utilisation {util}% > {self.threshold_pct}%")
        return IdleHint(idle, confidence, util, why)

    def close(self) -> None:
        self._nvml.close()
        self._handle = None


# ------------------------------------------------------------------------------ memory guard

_LIMIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _limit_bytes(text: str, env_name: str) -> int:
    m = _LIMIT.match(text)
    if not m:
        raise ValueError(f"{env_name}: {text!r} is not a memory size; write e.g. 0=8192M or 8G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_pinned_limit(value: str | None, device_ordinal: int = 0) -> int | None:
    """Bytes of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for `device_ordinal` (None: no limit for it).

    Accepts the CUDA form ``"0=8192M,1=8G"`` and a bare size applying to every device; sizes in
    binary units (K, M, G, T; an optional B / iB suffix).
    """
    name = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
    if not value or not value.strip():
        return None
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if len(parts) == 1 and "=" not in parts[0]:
        return _limit_bytes(parts[0], name)
    for part in parts:
        dev, sep, size = part.partition("=")
        if not sep or not dev.strip().isdigit():
            raise ValueError(f"{name}: {part!r} is not <device ordinal>=<size>; write e.g. 0=8192M")
        if int(dev) == device_ordinal:
            return _limit_bytes(size, name)
    return None


@dataclass(frozen=True)
class MemoryVerdict:
    ok: bool
    reason: str
    requested_bytes: int
    own_bytes: int | None
    limit_bytes: int | None
    device_free_bytes: int | None


class MemoryGuard:
    """Decides whether the drafter may allocate `requested_bytes` more on its GPU.

    Refuses when (a) its own usage (`own_bytes_fn`, e.g. torch.cuda.memory_reserved) plus the
    request would pass `limit_fraction` of its pinned-memory cap (from
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT unless `limit_bytes` is given), or (b) the device would have
    less than `min_free_bytes` free afterwards (NVML; leaves room for the target's next peak).
    Without NVML check (b) is skipped and the verdict says so; without a limit check (a) is skipped.
    """

    def __init__(self, device_index: int = 0, *, limit_bytes: int | None = None,
                 own_bytes_fn: Callable[[], int] | None = None, min_free_bytes: int = 1 << 30,
                 limit_fraction: float = 0.9, env: Mapping[str, str] | None = None, lib: Any = None):
        env = os.environ if env is None else env
        if not 0 < limit_fraction <= 1:
            raise ValueError(f"limit_fraction: {limit_fraction} is outside (0, 1]")
        self.device_index = device_index
        self.limit_bytes = limit_bytes if limit_bytes is not None else parse_pinned_limit(
            env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), device_index)
        self.own_bytes_fn = own_bytes_fn
        self.min_free_bytes = min_free_bytes
        self.limit_fraction = limit_fraction
        self._nvml = Nvml(lib).open()
        self._handle: Any = self._nvml.device_handle(device_index)

    def device_free_bytes(self) -> int | None:
        if self._handle is None:
            return None
        try:
            return int(self._nvml.lib.nvmlDeviceGetMemoryInfo(self._handle).free)
        except Exception:
            return None

    def check(self, requested_bytes: int = 0) -> MemoryVerdict:
        own = int(self.own_bytes_fn()) if self.own_bytes_fn is not None else None
        free = self.device_free_bytes()
        notes: list[str] = []
        if self.limit_bytes is not None and own is not None:
            budget = int(self.limit_bytes * self.limit_fraction)
            if own + requested_bytes > budget:
                return MemoryVerdict(False, f"own {own} + requested {requested_bytes} bytes exceeds "
                                     f"{self.limit_fraction:.0%} of the pinned limit {self.limit_bytes}",
                                     requested_bytes, own, self.limit_bytes, free)
        elif self.limit_bytes is None:
            notes.append("no pinned-memory limit")
        else:
            notes.append("own usage unknown")
        if free is not None:
            if free - requested_bytes < self.min_free_bytes:
                return MemoryVerdict(False, f"device would keep {free - requested_bytes} bytes free, below "
                                     f"the {self.min_free_bytes} reserved for the target",
                                     requested_bytes, own, self.limit_bytes, free)
        else:
            notes.append(f"device free memory unknown ({self._nvml.reason or 'nvml unavailable'})")
        return MemoryVerdict(True, "; ".join(notes) or "fits", requested_bytes, own, self.limit_bytes, free)

    def close(self) -> None:
        self._nvml.close()
        self._handle = None


def wait_until_fits(guard: MemoryGuard, requested_bytes: int, *, timeout_s: float,
                    poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> MemoryVerdict:
    """Re-check until the request fits or `timeout_s` passes (the last verdict is returned)."""
    deadline = clock() + timeout_s
    while True:
        v = guard.check(requested_bytes)
        if v.ok or clock() >= deadline:
            return v
        sleep(min(poll_s, max(0.0, deadline - clock())))
