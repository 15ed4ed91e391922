#!/usr/bin/env bash
# The real-node cluster's smoke-test image: a minbase Debian bookworm rootfs (mmdebstrap) with
# python3 (stdlib: sockets, DNS through glibc, HTTPS with the ServiceAccount CA) and busybox-static,
# wrapped by scripts/cluster/image.py as a docker-archive under the fixed name $TEST_IMAGE.
# Cached by a hash of its inputs (this script, image.py, mmdebstrap's version) under
# ~/.cache/spectrain/cluster-images/<hash>/ (KUBE_CURRENT_CACHE overrides ~/.cache/spectrain).
#
#   scripts/cluster/test-image.sh             build if missing; print the archive's path
#   scripts/cluster/test-image.sh --name      print the image name and exit
# Load it with: scripts/cluster/cluster.sh load-image "$(scripts/cluster/test-image.sh)"
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE="${KUBE_CURRENT_CACHE:-$HOME/.cache/spectrain}/cluster-images"
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
PACKAGES=python3,busybox-static,ca-certificates
TEST_IMAGE=spectrain.local/cluster-smoke:1
log() { printf '[test-image] %s\n' "$*" >&2; }
die() { printf '[test-image] ERROR: %s\n' "$*" >&2; exit 1; }

[[ "${1:-}" == --name ]] && { echo "$TEST_IMAGE"; exit 0; }
command -v mmdebstrap >/dev/null || die "mmdebstrap missing: run scripts/cluster/build.sh (it apt-installs it)"
key=$( { cat "$0" "$HERE/image.py"; dpkg-query -W -f='${Version}' mmdebstrap; } | sha256sum | cut -c1-16)
dir=$CACHE/$key
if [[ -s "$dir/image.tar" && "$(cat "$dir/.stamp" 2>/dev/null)" == "$TEST_IMAGE $key" ]]; then
  echo "$dir/image.tar"; exit 0
fi
t0=$SECONDS
rm -rf "$dir"; mkdir -p "$dir"
log "mmdebstrap $SUITE minbase + $PACKAGES (about 90 s)"
nice -n 10 mmdebstrap --variant=minbase --quiet --include="$PACKAGES" \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --aptopt='APT::Install-Recommends "false"' \
  "$SUITE" "$dir/rootfs.tar" "deb $MIRROR $SUITE main" >&2 \
  || die "mmdebstrap failed (see above): is $MIRROR reachable (apt-get update)?"
python3 "$HERE/image.py" --rootfs-tar "$dir/rootfs.tar" --name "$TEST_IMAGE" --cmd /bin/sh \
  --out "$dir/image.tar" || die "image.py failed"
rm -f "$dir/rootfs.tar"
echo "$TEST_IMAGE $key" > "$dir/.stamp"
log "built $TEST_IMAGE in $((SECONDS - t0)) s: $dir/image.tar ($(du -m "$dir/image.tar" | cut -f1) MB)"
echo "$dir/image.tar"
