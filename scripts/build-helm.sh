#!/usr/bin/env bash
# Build the helm CLI from the Go module proxy and cache it, for the real-cluster tests that install
# the chart as a platform team would (`helm install`). Idempotent: exits at once when the binary of
# the pinned version is cached.
#
# The version lives in the build module, nowhere else:
#   scripts/helm/go.mod   helm.sh/helm/v4 as a `tool`; go.sum committed
# The binary lands in $HELM_CACHE/helm-<version>/bin/helm (default ~/.cache/spectrain/helm-vX.Y.Z/bin)
# with a stamp naming the version and the build module's checksum: a change to either rebuilds.
#
#   scripts/build-helm.sh               build (or report the cached binary)
#   scripts/build-helm.sh --print-bin   print the bin directory and exit (tests use it)
#
# Needs Go >= the `go` line of scripts/helm/go.mod on PATH or in /usr/local/go/bin.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD="$ROOT/scripts/helm"
CACHE="${HELM_CACHE:-$HOME/.cache/spectrain}"
# Bump when the way the binary is built changes (flags, ldflags): a cached binary is rebuilt.
BUILD_LEVEL=1

log() { printf '[build-helm] %s\n' "$*" >&2; }
die() { printf '[build-helm] ERROR: %s\n' "$*" >&2; exit 1; }

mode=build
case "${1:-}" in
  "") ;;
  --print-bin) mode=print ;;
  -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
  *) die "unknown argument $1 (see --help)" ;;
esac

VERSION=$(awk '$1 == "helm.sh/helm/v4" && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod")
[[ "$VERSION" =~ ^v4\.[0-9]+\.[0-9]+$ ]] || die "no helm.sh/helm/v4 vX.Y.Z requirement in $MOD/go.mod (got '${VERSION}')"
BIN="$CACHE/helm-$VERSION/bin"
if [[ $mode == print ]]; then
  echo "$BIN"
  exit 0
fi

# --- Go (scripts/go-env.sh) ---------------------------------------------------------------------
source "$ROOT/scripts/go-env.sh"
go_setup "$(awk '$1 == "go" { print $2; exit }' "$MOD/go.mod")"

sum=$(go_workspace_sum)
STAMP="helm=$VERSION modules=$sum level=$BUILD_LEVEL"

if [[ -x "$BIN/helm" && "$(cat "$BIN/.stamp" 2>/dev/null)" == "$STAMP" ]]; then
  log "cached: $BIN ($STAMP; delete $BIN/.stamp to rebuild)"
  exit 0
fi

t0=$(date +%s)
log "building $STAMP with $("$GO" env GOVERSION) into $BIN"
OUT="$BIN/.build.$$"
rm -rf "$OUT"; mkdir -p "$OUT"
trap 'rm -rf "${OUT:-}"' EXIT
# go build fetches the modules it needs from the proxy into Go's module cache (go.sum pins them): the
# only network step; later builds need no network.
log "go build helm"
go_in "$MOD" build -trimpath \
   -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$VERSION" -o "$OUT/helm" helm.sh/helm/v4/cmd/helm \
  || die "go build in scripts/helm failed (see above; a module the proxy could not serve shows there)"
got=$("$OUT/helm" version --template '{{.Version}}' 2>&1) || die "the built helm does not run: $got"
[[ "$got" == "$VERSION" ]] || die "helm version says '$got', expected $VERSION"
mv -f "$OUT/helm" "$BIN/helm"
echo "$STAMP" > "$BIN/.stamp.tmp" && mv -f "$BIN/.stamp.tmp" "$BIN/.stamp"
log "done in $(( $(date +%s) - t0 )) s: $BIN/helm"
