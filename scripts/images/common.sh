# shellcheck shell=bash
# Helpers shared by scripts/images/*.sh (sourced, not run): logging, tool checks, buildah with the
# images' own storage.
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/images/versions.sh
. "$_here/versions.sh"
SCRIPT_NAME=${SCRIPT_NAME:-$(basename "$0")}
IMG_STORAGE_DRIVER=${SPECTRAIN_STORAGE_DRIVER:-overlay}

log() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() { printf '%s: error: %s\n' "$SCRIPT_NAME" "$*" >&2; exit 1; }

require_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap and buildah's chroot isolation need it): run it with sudo"
}

# Installs the Debian packages of IMG_TOOLS_APT when one of the given commands is missing (root: the
# image scripts need it anyway); nothing is installed by hand.
require_tools() {
  local t missing=()
  for t in "$@"; do command -v "$t" >/dev/null || missing+=("$t"); done
  [ ${#missing[@]} = 0 ] && return 0
  log "missing ${missing[*]}: apt-get install $IMG_TOOLS_APT"
  # shellcheck disable=SC2086  # a list of package names
  { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $IMG_TOOLS_APT >&2 \
      || { DEBIAN_FRONTEND=noninteractive apt-get update >&2 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $IMG_TOOLS_APT >&2; }; } \
    || die "apt-get install $IMG_TOOLS_APT failed (see above): is the Debian mirror reachable, or dpkg locked by another apt?"
  for t in "$@"; do command -v "$t" >/dev/null || die "$t still missing after apt-get install $IMG_TOOLS_APT"; done
}

# sha256 of the given files' names (relative to the repository, so that another checkout of the same
# files hits the same cache) and contents, plus any extra strings (in order).
IMG_REPO_ROOT=$(cd "$_here/../.." && pwd)
inputs_sha256() {
  { for f in "$@"; do
      if [ -f "$f" ]; then printf 'file %s\n' "${f#"$IMG_REPO_ROOT"/}"; sha256sum <"$f"; else printf 'str %s\n' "$f"; fi
    done; } | sha256sum | cut -c1-64
}

BUILDAH_STORE=(--root "$IMG_STORAGE_ROOT" --runroot "$IMG_STORAGE_RUNROOT" --storage-driver "$IMG_STORAGE_DRIVER")
bah() { buildah "${BUILDAH_STORE[@]}" "$@"; }
storage_ref() { printf 'containers-storage:[%s@%s+%s]%s' "$IMG_STORAGE_DRIVER" "$IMG_STORAGE_ROOT" "$IMG_STORAGE_RUNROOT" "$1"; }
