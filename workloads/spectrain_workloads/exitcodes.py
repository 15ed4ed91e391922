"""Exit-code conventions shared by the target, the drafter and the SingleContainer supervisor.

The operator (spectrain_operator.faults) reads them back from pod status; the two copies are kept
equal by tests/unit/test_faults.py. No torch import.

| code | meaning |
|---|---|
| 0 | success |
| 1 | uncaught error |
| 2 | configuration error (ConfigError): the spec cannot run |
| 86 | GPU fault: a CUDA / MPS error was caught (use `exit_code_for`) |
| 128+N | killed by signal N (134 SIGABRT and 139 SIGSEGV also count as GPU faults) |
"""

from __future__ import annotations

import re

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_GPU_FAULT = 86
GPU_FAULT_EXIT_CODES = frozenset({EXIT_GPU_FAULT, 134, 139})

_GPU_FAULT_TEXT = re.compile(
    r"CUDA error|CUDA_ERROR|cudaError|CUBLAS_STATUS|illegal memory access|MPS (server|client)|MpsClient",
    re.IGNORECASE)


def is_gpu_fault(exc: BaseException) -> bool:
    """True for exceptions that mean the GPU context is gone (CUDA errors, MPS client termination)."""
    text = f"{type(exc).__name__}: {exc}"
    return bool(_GPU_FAULT_TEXT.search(text)) or type(exc).__name__ in {"AcceleratorError", "CudaError"}


def exit_code_for(exc: BaseException) -> int:
    """The process exit code for an exception that ends a workload (entrypoints: `sys.exit(exit_code_for(e))`)."""
    from spectrain_workloads.errors import ConfigError

    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if is_gpu_fault(exc):
        return EXIT_GPU_FAULT
    return EXIT_ERROR


def returncode_to_exit(returncode: int) -> int:
    """subprocess returncode (negative = killed by signal) as a shell-style exit status (128+N)."""
    return 128 - returncode if returncode < 0 else returncode
