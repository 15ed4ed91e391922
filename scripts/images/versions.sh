# shellcheck shell=bash
# shellcheck disable=SC2034  # sourced: the other scripts use these
# Every pinned input of scripts/images/*.sh, in one place (sourced, not run).
# Changing any value here changes the cache keys, so the next build starts from scratch.

# The base rootfs: Debian packages through mmdebstrap (minbase + what the Dockerfiles' RUN steps use).
IMG_SUITE=bookworm                                   # Python 3.11 (no Debian suite here has 3.12)
IMG_MIRROR=http://deb.debian.org/debian
IMG_SECURITY_MIRROR=http://deb.debian.org/debian-security
# python3-venv: `python3 -m venv` with ensurepip; passwd: groupadd/useradd/userdel; ca-certificates:
# TLS from the running containers (kubernetes client, HF downloads).
IMG_BASE_PACKAGES=python3,python3-venv,ca-certificates,passwd
# Every file mtime in the base and its image config's "created" (2025-01-01T00:00:00Z): the
# same packages give the same digest.
IMG_SOURCE_DATE_EPOCH=1735689600
IMG_BASE_NAME=localhost/spectrain/base
IMG_BASE_TAG=${IMG_SUITE}-py3.11

# The images built from operator/Dockerfile and workloads/Dockerfile (CPU variant).
IMG_OPERATOR_REF=spectrain/operator:dev
IMG_WORKLOADS_REF=spectrain/workloads:dev-cpu

# Tools (Debian bookworm packages), installed by the scripts when missing (common.sh require_tools).
# uidmap, fuse-overlayfs: what buildah's overlay storage and chroot isolation use here.
IMG_TOOLS_APT="mmdebstrap buildah skopeo uidmap fuse-overlayfs"

IMG_CACHE=${SPECTRAIN_IMAGES_CACHE:-$HOME/.cache/spectrain/images}
# buildah's own containers-storage, apart from any host storage (/var/lib/containers).
IMG_STORAGE_ROOT=$IMG_CACHE/storage
IMG_STORAGE_RUNROOT=$IMG_CACHE/run
