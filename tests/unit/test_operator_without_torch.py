"""The operator image installs no torch: every operator module, the CLI's validate/render/run paths
and the workload modules the operator uses must import with torch absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

OPERATOR_DIR = Path(__file__).resolve().parents[2] / "operator" / "spectrain_operator"


def test_every_operator_module_imports_with_torch_absent() -> None:
    modules = sorted(f"spectrain_operator.{p.stem}" for p in OPERATOR_DIR.glob("*.py")
                     if p.stem not in ("__init__", "__main__"))
    assert "spectrain_operator.handlers" in modules and "spectrain_operator.local" in modules
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # `import torch` now raises ImportError, as in the operator image\n"
        "sys.modules['numpy'] = None\n"
        f"for m in {modules!r}:\n"
        "    __import__(m)\n"
        "import spectrain_workloads.podstatus, spectrain_workloads.contract, spectrain_workloads.config\n"
        "from spectrain_operator import cli\n"
        "assert cli.main(['validate', '-q', 'examples/demo.yaml', 'examples/demo-rl.yaml']) == 0\n"
        "assert cli.main(['validate', '-q', 'examples/invalid/layers-not-divisible.yaml']) == 1\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=OPERATOR_DIR.parents[1])
    assert res.returncode == 0, res.stderr
