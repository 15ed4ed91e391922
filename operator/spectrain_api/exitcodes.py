"""Exit codes of the workload processes: which code an exception ends a process with.

The codes themselves are `spectrain_api.names`'s; the operator (spectrain_operator.faults)
reads them back from pod status. No torch import.

| code | meaning |
|---|---|
| 0 | success |
| 1 | uncaught error |
| 2 | configuration error (ConfigError): the spec cannot run |
| 86 | GPU fault: a CUDA / MPS error was caught (use `exit_code_for`) |
| 128+N | killed by signal N (134 SIGABRT and 139 SIGSEGV also count as GPU faults) |

Every entrypoint (spectrain-target, spectrain-drafter, spectrain-supervisor) also writes its fatal
error as one line to the container's termination message (`write_termination_message`), which the
operator shows in the job's conditions (a target's exit 2 fails the job with reason ConfigError).
"""

from __future__ import annotations

import os
import re

from spectrain_api.errors import ConfigError
from spectrain_api.names import (
    ENV_TERMINATION_LOG,
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_GPU_FAULT,
    TERMINATION_LOG,
)

# The kubelet keeps at most 4096 bytes of a termination message.
MAX_TERMINATION_MESSAGE_BYTES = 4000

# Text of an exception or a termination message that marks a GPU / MPS fault (also under exit code 1).
GPU_FAULT_TEXT = re.compile(
    r"CUDA error|CUDA_ERROR|cudaError|CUBLAS_STATUS|illegal memory access|MPS (server|client)|MpsClient",
    re.IGNORECASE)


def is_gpu_fault(exc: BaseException) -> bool:
    """True for exceptions that mean the GPU context is gone (CUDA errors, MPS client termination)."""
    text = f"{type(exc).__name__}: {exc}"
    return bool(GPU_FAULT_TEXT.search(text)) or type(exc).__name__ in {"AcceleratorError", "CudaError"}


def exit_code_for(exc: BaseException) -> int:
    """The process exit code for an exception that ends a workload (entrypoints: `sys.exit(exit_code_for(e))`)."""
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if is_gpu_fault(exc):
        return EXIT_GPU_FAULT
    return EXIT_ERROR


def returncode_to_exit(returncode: int) -> int:
    """subprocess returncode (negative = killed by signal) as a shell-style exit status (128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def fatal_message(exc: BaseException) -> str:
    """The one-line termination message for the exception that ends an entrypoint."""
    if isinstance(exc, ConfigError):
        return f"configuration error: {exc}"
    return f"{type(exc).__name__}: {exc}"


def termination_log_path() -> str | None:
    """Where this process writes its fatal error: $SPECTRAIN_TERMINATION_LOG when set (the local
    backend, the supervisor's children), else the kubelet's /dev/termination-log when it exists and is
    writable (the kubelet mounts it, mode 0666, into every container), else None. The default path is
    never created: off a cluster /dev/termination-log does not exist and nothing is written."""
    path = os.environ.get(ENV_TERMINATION_LOG, "")
    if path:
        return path
    if os.path.isfile(TERMINATION_LOG) and os.access(TERMINATION_LOG, os.W_OK):
        return TERMINATION_LOG
    return None


def write_termination_message(text: str) -> bool:
    """Write `text` as one short line (whitespace collapsed, at most 4000 bytes) to the termination
    log (`termination_log_path`). The first fatal error of a container wins: a message already there
    (another local rank's, which failed first) is kept. Never raises; True when written."""
    try:
        path = termination_log_path()
        if path is None:
            return False
        line = " ".join(str(text).split()).encode("utf-8")[:MAX_TERMINATION_MESSAGE_BYTES]
        try:
            if os.path.getsize(path) > 0:
                return False
        except OSError:
            pass  # not there yet: create it
        with open(path, "wb") as f:
            f.write(line.decode("utf-8", errors="ignore").encode("utf-8"))
        return True
    except Exception:  # noqa: BLE001 - reporting the error must never mask it
        return False
