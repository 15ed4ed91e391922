"""The images `make images` builds (scripts/images/build.sh), run without Docker.

Each fixture builds its image through the script (a no-op when its inputs are unchanged: the
archive under ~/.cache/spectrain/images is reused), loads the docker-archive into buildah's storage
of scripts/images and runs commands in it with `buildah run --isolation chroot`, as the image's own
USER and ENV. Part of `make test` (the real-cluster tier runs these images): needs root (the
scripts install Debian's buildah/skopeo/mmdebstrap); a cold build needs PyPI and takes ~15 min on
2 busy cores (the CPU workloads image is ~5 GB), a warm one returns at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mmdebstrap and buildah's chroot isolation)"),
]

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "scripts" / "images"
Run = Callable[..., subprocess.CompletedProcess]


def bah(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """buildah with scripts/images' own storage (common.sh's `bah`)."""
    return subprocess.run(["bash", "-c", f'. "{IMAGES}/common.sh"; bah "$@"', "bah", *args],
                          check=check, capture_output=True, text=True)


def _container(image_ref: str) -> Iterator[Run]:
    name = f"spectrain-test-{uuid.uuid4().hex[:8]}"
    bah("from", "--pull=never", "--name", name, image_ref)

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return bah("run", "--isolation", "chroot", name, "--", *cmd, check=False)

    try:
        yield run
    finally:
        bah("rm", name, check=False)


def _archive(image: str) -> Path:
    built = subprocess.run([str(IMAGES / "build.sh"), image], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"})
    assert built.returncode == 0, f"build.sh {image} failed:\n{built.stderr[-4000:]}"
    return Path(built.stdout.split()[-1])


@pytest.fixture(scope="module")
def operator_image() -> Iterator[Run]:
    yield from _container(f"docker-archive:{_archive('operator')}")


@pytest.fixture(scope="module")
def workloads_image() -> Iterator[Run]:
    yield from _container(f"docker-archive:{_archive('workloads')}")


@pytest.fixture(scope="module")
def base_image() -> Iterator[Run]:
    digest = subprocess.run([str(IMAGES / "base.sh")], check=True, capture_output=True, text=True).stdout.split()[-1]
    yield from _container(f"localhost/spectrain/base@{digest}")


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_operator_runs_as_65532_without_torch(operator_image: Run) -> None:
    assert ok(operator_image("id", "-u")).strip() == "65532"
    assert ok(operator_image("id", "-g")).strip() == "65532"
    assert ok(operator_image("python", "-c", "import importlib.util; print(importlib.util.find_spec('torch'))")
              ).strip() == "None"


def test_operator_pip_check(operator_image: Run) -> None:
    ok(operator_image("pip", "check"))


def test_operator_imports_celpy_and_handlers(operator_image: Run) -> None:
    # spec.py validates specs with the CRD's CEL rules through celpy (cel-python, the operator extra).
    ok(operator_image("python", "-c", "import celpy, spectrain_operator.handlers"))


def test_workloads_runs_as_uid_1000(workloads_image: Run) -> None:
    assert ok(workloads_image("id", "-u")).strip() == "1000"
    assert ok(workloads_image("id", "-g")).strip() == "1000"
    assert ok(workloads_image("sh", "-c", "echo $HOME; pwd")).split() == ["/home/spectrain", "/home/spectrain"]


def test_workloads_pip_check(workloads_image: Run) -> None:
    ok(workloads_image("pip", "check"))


def test_workloads_imports_torch_and_workloads(workloads_image: Run) -> None:
    out = ok(workloads_image("python", "-c", "import sys, torch, spectrain_workloads; "
                             "print(sys.version_info[:2], torch.__version__)"))
    assert "(3, 11)" in out and "2.13.0" in out, out


@pytest.mark.parametrize("image", ["operator_image", "workloads_image"])
def test_no_host_ca_or_pip_settings_baked_in(image: str, base_image: Run, request: pytest.FixtureRequest) -> None:
    """The build's pip used the host's CA bundle through a read-only bind mount: no layer keeps it."""
    run: Run = request.getfixturevalue(image)
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    assert ok(run("sha256sum", bundle)).split()[0] == ok(base_image("sha256sum", bundle)).split()[0]
    host = hashlib.sha256(Path(bundle).read_bytes()).hexdigest()
    if host != ok(base_image("sha256sum", bundle)).split()[0]:   # the host has its proxy's CA
        assert ok(run("sha256sum", bundle)).split()[0] != host
    env = ok(run("env"))
    assert "PIP_FIND_LINKS" not in env and "PIP_CERT" not in env, env
