#!/usr/bin/env bash
# scripts/images/base.sh: the images' base, built here from Debian packages (no registry needed).
#
# mmdebstrap builds a minbase $IMG_SUITE rootfs with $IMG_BASE_PACKAGES (versions.sh), oci_layout.py
# wraps it as a one-layer OCI image (uncompressed layer, fixed dates), and skopeo copies it into
# buildah's storage under $IMG_CACHE as $IMG_BASE_NAME:$IMG_BASE_TAG. The result is cached by a hash
# of its inputs (versions.sh's values, this script, oci_layout.py, mmdebstrap's version) with a stamp holding
# the digest: a warm run only checks the stamp and the storage. Prints the manifest digest
# (sha256:...), which build.sh passes as PYTHON_IMAGE_DIGEST / BASE_IMAGE_DIGEST.
# Usage: sudo scripts/images/base.sh        (SPECTRAIN_IMAGES_CACHE overrides ~/.cache/spectrain/images)
set -euo pipefail
export SCRIPT_NAME=base.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/images/common.sh
. "$here/common.sh"

require_root
require_tools mmdebstrap skopeo buildah python3

# The values from versions.sh, not the file: a comment there rebuilds nothing.
key=$(inputs_sha256 "$here/base.sh" "$here/oci_layout.py" \
      "suite=$IMG_SUITE mirrors=$IMG_MIRROR,$IMG_SECURITY_MIRROR packages=$IMG_BASE_PACKAGES" \
      "epoch=$IMG_SOURCE_DATE_EPOCH ref=$IMG_BASE_NAME:$IMG_BASE_TAG" \
      "mmdebstrap $(dpkg-query -W -f='${Version}' mmdebstrap)")
dir=$IMG_CACHE/base/$key
stamp=$dir/stamp
ref=$IMG_BASE_NAME:$IMG_BASE_TAG

in_storage() {  # the storage holds $ref with digest $1
  [ "$(skopeo inspect --format '{{.Digest}}' "$(storage_ref "$ref")" 2>/dev/null || true)" = "$1" ]
}

if [ -f "$stamp" ]; then
  digest=$(cat "$stamp")
  if ! in_storage "$digest"; then
    log "stamp found, image missing from $IMG_STORAGE_ROOT: loading $dir/oci again"
    skopeo copy --quiet "oci:$dir/oci:$IMG_BASE_TAG" "$(storage_ref "$ref")"
    in_storage "$digest" || die "$ref in storage does not have digest $digest: remove $dir and rerun"
  fi
  log "cached: $ref@$digest ($dir)"
  echo "$digest"
  exit 0
fi

log "building $ref from Debian $IMG_SUITE ($IMG_BASE_PACKAGES) into $dir"
rm -rf "$dir.tmp"
mkdir -p "$dir.tmp"
start=$SECONDS
# Slim like python:*-slim: no docs (but their copyright files), man pages or translations.
SOURCE_DATE_EPOCH=$IMG_SOURCE_DATE_EPOCH mmdebstrap --variant=minbase --quiet \
  --include="$IMG_BASE_PACKAGES" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --aptopt='APT::Install-Recommends "false"' \
  "$IMG_SUITE" "$dir.tmp/rootfs.tar" \
  "deb $IMG_MIRROR $IMG_SUITE main" \
  "deb $IMG_MIRROR $IMG_SUITE-updates main" \
  "deb $IMG_SECURITY_MIRROR $IMG_SUITE-security main" \
  || die "mmdebstrap failed (see above): check that $IMG_MIRROR is reachable (apt-get update)"
log "rootfs: $(du -m "$dir.tmp/rootfs.tar" | cut -f1) MB in $((SECONDS - start)) s"
digest=$(python3 "$here/oci_layout.py" "$dir.tmp/rootfs.tar" "$dir.tmp/oci" "$IMG_BASE_TAG" "$IMG_SOURCE_DATE_EPOCH")
rm "$dir.tmp/rootfs.tar"   # its bytes are the layer blob in oci/
skopeo copy --quiet "oci:$dir.tmp/oci:$IMG_BASE_TAG" "$(storage_ref "$ref")"
in_storage "$digest" || die "skopeo stored $ref with another digest than $digest: report a bug in base.sh"
echo "$digest" >"$dir.tmp/stamp"
rm -rf "$dir"
mv "$dir.tmp" "$dir"
log "built $ref@$digest in $((SECONDS - start)) s"
echo "$digest"
