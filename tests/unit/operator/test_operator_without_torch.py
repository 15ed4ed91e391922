"""The operator image ships the operator and the API package only: no torch and no workloads.
Every operator module and the CLI's validate/render paths import and run with both absent, and the
operator's code imports nothing from the workloads but the user commands that need them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
OPERATOR_DIR = ROOT / "operator" / "spectrain_operator"
# `spectrain report`, `spectrain generate` and the end of `spectrain run` (its report) are workload
# commands the one CLI dispatches to; they import the workloads inside the function that runs them.
WORKLOAD_COMMANDS = {("cli.py", "spectrain_workloads.report"), ("cli.py", "spectrain_workloads.generate"),
                     ("local.py", "spectrain_workloads")}


def _modules(package: Path) -> list[str]:
    out = []
    for p in sorted(package.rglob("*.py")):
        parts = p.relative_to(package.parent).with_suffix("").parts
        if parts[-1] != "__main__":
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_every_operator_module_imports_with_torch_and_the_workloads_absent() -> None:
    modules = _modules(OPERATOR_DIR) + _modules(ROOT / "operator" / "spectrain_api")
    assert {"spectrain_operator.handlers", "spectrain_operator.policy.drafter", "spectrain_api.rules"} <= set(modules)
    code = (
        "import sys\n"
        "for blocked in ('torch', 'numpy', 'spectrain_workloads'):\n"
        "    sys.modules[blocked] = None  # `import` now raises ImportError, as in the operator image\n"
        f"for m in {modules!r}:\n"
        "    __import__(m)\n"
        "from spectrain_operator import cli\n"
        "assert cli.main(['validate', '-q', 'examples/demo.yaml', 'examples/demo-rl.yaml']) == 0\n"
        "assert cli.main(['validate', '-q', 'examples/invalid/layers-not-divisible.yaml']) == 1\n"
        "assert cli.main(['render', 'examples/demo.yaml']) == 0\n"
        "for argv in (['report', 'runs/x'], ['generate', '--model', 'm', '--drafter', 'd', '--prompt', 'p']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert f'spectrain {argv[0]} runs the workloads' in str(exc.code), exc.code\n"
        "        assert \"pip install 'spectrain[workloads]'\" in str(exc.code), exc.code\n"
        "    else:\n"
        "        raise AssertionError(f'{argv[0]} ran without the workloads')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def _workload_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, inside a function) of every import of spectrain_workloads in `path`."""
    tree = ast.parse(path.read_text())
    local: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(fn))
    out = []
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        out += [(n, node.lineno, id(node) in local) for n in names if n.split(".")[0] == "spectrain_workloads"]
    return out


def test_the_operator_imports_only_the_api_package_from_the_workloads_side() -> None:
    found = {(p.name, mod): (line, lazy) for p in OPERATOR_DIR.rglob("*.py") for mod, line, lazy in _workload_imports(p)}
    for (name, mod), (line, lazy) in found.items():
        assert (name, mod) in WORKLOAD_COMMANDS and lazy, (
            f"operator/spectrain_operator/{name}:{line} imports {mod}; the operator image has no workloads: "
            "import the name from spectrain_api")
    assert (ROOT / "operator/spectrain_api").is_dir()
    api = [mod for p in (ROOT / "operator/spectrain_api").rglob("*.py") for mod, _, _ in _workload_imports(p)]
    assert not api, f"spectrain_api imports the workloads: {api}"


def test_the_operator_image_copies_no_workloads() -> None:
    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    copies = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line]
    assert "operator/spectrain_api/" in copies and "operator/spectrain_operator/" in copies
    assert not [c for c in copies if c.startswith("workloads")], copies


def test_what_the_operator_dockerfile_copies_builds_a_wheel_of_operator_and_api(tmp_path: Path) -> None:
    """The image's build step (`pip install --no-deps --no-build-isolation .` over the COPY'd files)
    run here as `pip wheel` on exactly those files: it builds, and ships no workloads package."""
    import shutil
    import zipfile

    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from" not in line and "requirements.lock" not in line:
            *sources, dest = line.split()[1:]
            for src in sources:
                for path in ROOT.glob(src.rstrip("*").rstrip("/")) if "*" in src else [ROOT / src.rstrip("/")]:
                    target = tmp_path / dest.rstrip("/") if path.is_dir() else tmp_path / path.name
                    (shutil.copytree if path.is_dir() else shutil.copy)(path, target)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    packages = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if ".dist-info" not in name}
    assert packages == {"spectrain_api", "spectrain_operator"}
