"""spectrain_api.exitcodes: the code an exception ends a workload process with."""

from __future__ import annotations

import pytest

from spectrain_api import exitcodes, names
from spectrain_api.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("exc", "code"), [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), names.EXIT_GPU_FAULT),
    (RuntimeError("cudaErrorMpsClientTerminated"), names.EXIT_GPU_FAULT),
    (ConfigError("spec.target.model.preset: unknown"), names.EXIT_CONFIG),
    (ValueError("bad"), names.EXIT_ERROR),
])
def test_exit_code_for(exc: BaseException, code: int) -> None:
    assert exitcodes.exit_code_for(exc) == code


def test_returncode_to_exit() -> None:
    assert exitcodes.returncode_to_exit(-9) == 137
    assert exitcodes.returncode_to_exit(3) == 3
