#!/usr/bin/env bash
# Build Prometheus and promtool from the Go module proxy and cache them, for the integration tests
# that check the chart's alert rules (promtool check/test rules) and scrape a `spectrain run` with a
# real Prometheus (tests/integration/test_monitoring_prometheus.py). Idempotent: exits at once when
# the binaries of the pinned version are cached.
#
# The version lives in the build module, nowhere else:
#   scripts/prometheus/go.mod  github.com/prometheus/prometheus (Prometheus 3.YY.Z is the module's
#                              v0.3YY.Z) as a `tool`; go.sum committed
# Binaries land in $PROMETHEUS_CACHE/prometheus-<module version>/bin (default
# ~/.cache/spectrain/prometheus-v0.3YY.Z/bin) with a stamp naming the version and the build
# module's checksum: a change to either rebuilds. Built with the `remove_all_sd` tag: the tests use
# static scrape configs only, and leaving out the cloud service discoveries (AWS, Azure, GCE,
# Kubernetes, ...) keeps their SDKs out of the build. The Go module and build caches are Go's own.
#
#   scripts/build-prometheus.sh               build (or report the cached binaries)
#   scripts/build-prometheus.sh --print-bin   print the bin directory and exit (tests use it)
#
# Needs Go >= the `go` line of scripts/prometheus/go.mod on PATH or in /usr/local/go/bin.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD="$ROOT/scripts/prometheus"
CACHE="${PROMETHEUS_CACHE:-$HOME/.cache/spectrain}"
# Bump when the way the binaries are built changes (flags, tags, ldflags): cached binaries are rebuilt.
BUILD_LEVEL=1
TARGETS=(prometheus promtool)

log() { printf '[build-prometheus] %s\n' "$*" >&2; }
die() { printf '[build-prometheus] ERROR: %s\n' "$*" >&2; exit 1; }

mode=build
case "${1:-}" in
  "") ;;
  --print-bin) mode=print ;;
  -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
  *) die "unknown argument $1 (see --help)" ;;
esac

MODULE_VERSION=$(awk '$1 == "github.com/prometheus/prometheus" && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod")
[[ "$MODULE_VERSION" =~ ^v0\.3[0-9]{2}\.[0-9]+$ ]] \
  || die "no github.com/prometheus/prometheus v0.3YY.Z requirement in $MOD/go.mod (got '${MODULE_VERSION}')"
# v0.316.0 -> 3.16.0: what the release calls itself (`prometheus --version`, the build info metric)
minor=${MODULE_VERSION#v0.3}; minor=${minor%%.*}
RELEASE="3.$((10#$minor)).${MODULE_VERSION##*.}"
BIN="$CACHE/prometheus-$MODULE_VERSION/bin"
if [[ $mode == print ]]; then
  echo "$BIN"
  exit 0
fi

# --- Go (scripts/go-env.sh) ---------------------------------------------------------------------
source "$ROOT/scripts/go-env.sh"
go_setup "$(awk '$1 == "go" { print $2; exit }' "$MOD/go.mod")"

sum=$(go_workspace_sum)
STAMP="prometheus=$RELEASE module=$MODULE_VERSION modules=$sum level=$BUILD_LEVEL"

have_all() {
  local t
  for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
  [[ "$(cat "$BIN/.stamp" 2>/dev/null)" == "$STAMP" ]]
}

if have_all; then
  log "cached: $BIN ($STAMP; delete $BIN/.stamp to rebuild)"
  exit 0
fi

t0=$(date +%s)
log "building $STAMP with $("$GO" env GOVERSION) into $BIN"
OUT="$BIN/.build.$$"
rm -rf "$OUT"; mkdir -p "$OUT"
trap 'rm -rf "${OUT:-}"' EXIT
# go build fetches the modules it needs from the proxy into Go's module cache (go.sum pins them): the
# only network step, about 40 s here; later builds need no network.
log "go build prometheus promtool (about 2.5 min on 2 cores after the control plane: the workspace shares its libraries; seconds warm)"
LDFLAGS="-s -w -X github.com/prometheus/common/version.Version=$RELEASE"
LDFLAGS+=" -X github.com/prometheus/common/version.Branch=HEAD -X github.com/prometheus/common/version.Revision=$MODULE_VERSION"
go_in "$MOD" build -trimpath -tags remove_all_sd -ldflags "$LDFLAGS" -o "$OUT/" \
   github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool \
  || die "go build in scripts/prometheus failed (see above; a module the proxy could not serve shows there)"

for t in "${TARGETS[@]}"; do
  got=$("$OUT/$t" --version 2>&1) || die "the built $t does not run"
  [[ "$got" == "$t, version $RELEASE "* ]] || die "$t --version says '${got%%$'\n'*}', expected $t, version $RELEASE"
done
for t in "${TARGETS[@]}"; do mv -f "$OUT/$t" "$BIN/$t"; done
echo "$STAMP" > "$BIN/.stamp.tmp" && mv -f "$BIN/.stamp.tmp" "$BIN/.stamp"
log "done in $(( $(date +%s) - t0 )) s: $BIN (Prometheus $RELEASE)"
