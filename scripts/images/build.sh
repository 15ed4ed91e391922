#!/usr/bin/env bash
# scripts/images/build.sh: build the spectrain images without Docker or a registry (`make images`).
#
# Usage: sudo scripts/images/build.sh [operator|workloads|all]     (default: all)
# base.sh first builds (or finds) the base from Debian packages; then buildah (Debian bookworm's)
# builds operator/Dockerfile and workloads/Dockerfile (its CPU variant) as users' docker would
# (docker image format: OCI's has no SHELL, which workloads/Dockerfile sets), with the base's digest
# as the required build arg, chroot isolation and the storage under $IMG_CACHE. --layers keeps each
# step's layer there, as docker does: a change to the sources alone reuses the pip install steps
# (`buildah --root $IMG_STORAGE_ROOT rmi --prune` or removing $IMG_CACHE reclaims the space).
# pip inside the build reaches PyPI through this machine's TLS proxy: the host's CA bundle is
# bind-mounted read-only over the base's /etc/ssl/certs/ca-certificates.crt for the RUN steps only
# (Debian's pip reads that file), so it never lands in a layer, and no host environment (e.g.
# PIP_FIND_LINKS) reaches the RUN steps: buildah gives them only the image's ENV and build args.
# Each image is written as a docker-archive that `ctr -n k8s.io images import` (and `docker load`)
# loads as docker.io/$IMG_OPERATOR_REF and docker.io/$IMG_WORKLOADS_REF:
#   $IMG_CACHE/spectrain-operator.tar, $IMG_CACHE/spectrain-workloads-cpu.tar
# and cached by the sha256 of every input (the Dockerfile, its lock, pyproject.toml,
# .dockerignore, each source file the Dockerfile COPYs, the base digest, this script), kept in
# <archive>.inputs: a warm run with unchanged inputs returns at once. Prints the archives' paths.
set -euo pipefail
export SCRIPT_NAME=build.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/images/common.sh
. "$here/common.sh"
root=$(cd "$here/../.." && pwd)

what=${1:-all}
case $what in
  operator) images=(operator) ;;
  workloads) images=(workloads) ;;
  all) images=(operator workloads) ;;
  *) die "unknown image '$what': use operator, workloads or all" ;;
esac

require_root
require_tools buildah skopeo
ca=/etc/ssl/certs/ca-certificates.crt
[ -s "$ca" ] || die "$ca missing: the build's pip needs the host's CA bundle (apt-get install ca-certificates)"

base_digest=$("$here/base.sh")

# The source files a Dockerfile COPYs (directories expanded, what .dockerignore drops left out).
sources() {
  local p
  for p in "$@"; do
    if [ -d "$root/$p" ]; then
      (cd "$root" && find "$p" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' | LC_ALL=C sort)
    else
      echo "$p"
    fi
  done
}

build_one() {
  local name=$1 dockerfile ref archive copies=() args=()
  case $name in
    operator)
      dockerfile=operator/Dockerfile ref=$IMG_OPERATOR_REF archive=$IMG_CACHE/spectrain-operator.tar
      copies=(operator/requirements.lock pyproject.toml operator/spectrain_operator operator/spectrain_api)
      args=(--build-arg "PYTHON_IMAGE=$IMG_BASE_NAME" --build-arg "PYTHON_IMAGE_DIGEST=$base_digest") ;;
    workloads)
      dockerfile=workloads/Dockerfile ref=$IMG_WORKLOADS_REF archive=$IMG_CACHE/spectrain-workloads-cpu.tar
      copies=(workloads/requirements.lock pyproject.toml operator/spectrain_api
              operator/spectrain_operator workloads/spectrain_workloads)
      args=(--build-arg "BASE_IMAGE=$IMG_BASE_NAME" --build-arg "BASE_IMAGE_DIGEST=$base_digest") ;;
  esac
  local files key
  mapfile -t files < <(sources "$dockerfile" .dockerignore "${copies[@]}")
  key=$(cd "$root" && inputs_sha256 "${files[@]}" "base $base_digest" "ref $ref" "$here/build.sh" \
        "buildah $(buildah --version)")
  if [ -f "$archive" ] && [ "$(cat "$archive.inputs" 2>/dev/null)" = "$key" ]; then
    log "cached: $ref ($archive, inputs $key)"
    echo "$archive"
    return
  fi
  log "building $ref from $dockerfile on $IMG_BASE_NAME@$base_digest (${#files[@]} input files, inputs $key)"
  local start=$SECONDS
  # The image keeps its name in buildah's storage too (tests/images run it from the archive).
  (cd "$root" && env -u PIP_FIND_LINKS buildah "${BUILDAH_STORE[@]}" bud --isolation chroot --pull=never \
      --format docker --layers -f "$dockerfile" -t "$ref" \
      --volume "$ca:$ca:ro" "${args[@]}" .) >&2 \
    || die "buildah bud of $dockerfile failed (its output above names the step); fix it and rerun"
  log "built $ref in $((SECONDS - start)) s; writing $archive"
  rm -f "$archive.tmp" "$archive.inputs"
  skopeo copy --quiet "$(storage_ref "localhost/$ref")" "docker-archive:$archive.tmp:$ref"
  mv "$archive.tmp" "$archive"
  echo "$key" >"$archive.inputs"
  log "$ref: $(du -m "$archive" | cut -f1) MB archive in $((SECONDS - start)) s"
  echo "$archive"
}

mkdir -p "$IMG_CACHE"
for image in "${images[@]}"; do build_one "$image"; done
