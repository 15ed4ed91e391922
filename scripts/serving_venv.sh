#!/usr/bin/env bash
# `make test-serving`: run tests/serving/ (speculators loads our EAGLE-3 exports) in a separate
# venv, .cache/serving-venv, built once (rebuilt when this script changes). Extra args go to pytest.
#
# Why a separate venv: speculators 0.9.0 pins transformers<=5.19.0 (the project runs 5.23.0) and
# requires torchvision/torchaudio, so it must never be installed into .venv.
#
# How torch is reused: the venv is created WITHOUT --system-site-packages; one .pth file runs
# site.addsitedir() on .venv's site-packages, which appends it to sys.path *after* this venv's own
# site-packages. So torch (the multi-GB wheel), pytest and the editable spectrain install come
# from .venv, while what is installed here (transformers 5.19.0, speculators and its extra
# dependencies) shadows .venv's copies. pip never writes to .venv: the pins that would pull
# torch/torchvision/torchaudio are installed with --no-deps, and the rest resolve against what
# .venv already provides (pip only installs the missing ones, here; it does not uninstall outside
# its own prefix). The resolver's complaint about torchvision/torchaudio is expected: speculators
# imports neither on the paths the tests use.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
SV=${SERVING_VENV:-.cache/serving-venv}
NO_DEPS=(speculators==0.9.0 hs-connectors==0.9.0 transformers==5.19.0)
WITH_DEPS=(datasets==5.1.0 openai==3.60.0 httpx==0.28.1 loguru==0.7.3 pydantic-settings==2.16.3 psutil==7.2.2 protobuf==7.36.2)
STAMP="$SV/.built-$(sha256sum "$0" | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "serving_venv.sh: $VENV/bin/python missing: run 'make install' first" >&2
  exit 2
fi

if [ ! -f "$STAMP" ]; then
  rm -rf "$SV"
  base="$("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)')/bin/python3"
  "$base" -m venv "$SV"
  main_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  here_site=$("$SV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$(realpath "$main_site")')" > "$here_site/zz_spectrain_main_venv.pth"
  "$SV/bin/pip" install -q --disable-pip-version-check --no-deps "${NO_DEPS[@]}"
  if ! log=$("$SV/bin/pip" install -q --disable-pip-version-check "${WITH_DEPS[@]}" 2>&1); then
    echo "$log" >&2
    exit 1
  fi
  grep -v -e "dependency resolver does not currently" -e "requires torchaudio" -e "requires torchvision" \
       -e "requires setuptools" <<<"$log" || true
  "$SV/bin/python" - "$VENV" <<'EOF'
import sys
from importlib.metadata import version
import torch, transformers, speculators  # noqa: F401,E401
import spectrain_workloads.drafter.eagle3  # noqa: F401
assert transformers.__version__ == "5.19.0", transformers.__version__
assert version("speculators") == "0.9.0", version("speculators")
assert torch.__file__.startswith(__import__("os").path.realpath(sys.argv[1])), torch.__file__  # .venv's torch
print(f"serving venv: torch {torch.__version__} (from {sys.argv[1]}), transformers {transformers.__version__}, "
      f"speculators {version('speculators')}")
EOF
  touch "$STAMP"
fi

SPECTRAIN_SERVING_TESTS=1 HF_HUB_OFFLINE=1 exec "$SV/bin/python" -m pytest tests/serving -p no:cacheprovider "$@"
