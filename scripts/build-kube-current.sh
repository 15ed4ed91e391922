#!/usr/bin/env bash
# Build a current Kubernetes control plane from the Go module proxy and cache it:
# kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes), etcd
# (go.etcd.io/etcd/server/v3, the version that Kubernetes release requires) and kwok
# (sigs.k8s.io/kwok, fake nodes and pod lifecycles); Kueue's manager (sigs.k8s.io/kueue cmd/kueue)
# with the CRDs and webhook manifests of the same module; the scheduler-plugins kube-scheduler
# (sigs.k8s.io/scheduler-plugins cmd/scheduler: the Coscheduling plugin, run as a second scheduler
# for gang scheduling) with the PodGroup CRD of the same module. Idempotent: exits at once when the
# binaries of the pinned versions are cached.
#
# The versions live in the build modules, nowhere else:
#   scripts/kube/go.mod       k8s.io/kubernetes (each staging module replaced by its published
#                             v0.Y.Z) and go.etcd.io/etcd/server/v3; go.sum committed
#   scripts/kube/kwok/go.mod  sigs.k8s.io/kwok, in its own module: kwok is built with the k8s.io
#                             library versions of its own release
#   scripts/kube/kueue/go.mod sigs.k8s.io/kueue, in its own module for the same reason
#   scripts/kube/scheduler-plugins/go.mod
#                             sigs.k8s.io/scheduler-plugins, in its own module (its k8s.io v0.34
#                             libraries; its replace block repeated, as replaces do not carry over)
# Binaries land in $KUBE_CURRENT_CACHE/kube-<kubernetes version>/bin (default
# ~/.cache/spectrain/kube-vX.Y.Z/bin) with a stamp naming the versions and the build modules'
# checksum: a change to either module rebuilds. Kueue lands in $KUBE_CURRENT_CACHE/kueue-<version>/
# (bin/kueue, crds.yaml, webhooks.yaml) with a stamp of its own: a Kueue bump rebuilds only Kueue;
# scheduler-plugins likewise in $KUBE_CURRENT_CACHE/scheduler-plugins-<version>/ (bin/kube-scheduler,
# podgroups.yaml). The Go module and build caches are Go's own (go env GOMODCACHE / GOCACHE).
#
#   scripts/build-kube-current.sh                 build (or report the cached binaries)
#   scripts/build-kube-current.sh --print-bin     print the bin directory and exit (tests use it)
#   scripts/build-kube-current.sh --print-kueue   print Kueue's directory and exit
#   scripts/build-kube-current.sh --print-scheduler-plugins
#                                                 print scheduler-plugins' directory and exit
#   scripts/build-kube-current.sh --regen vX.Y.Z  rewrite scripts/kube/go.mod for another
#                                                 k8s.io/kubernetes release, go mod tidy, then build
#
# Needs Go >= the `go` line of scripts/kube/go.mod (1.26) on PATH or in /usr/local/go/bin.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOD="$ROOT/scripts/kube"
KWOK_MOD="$MOD/kwok"
KUEUE_MOD="$MOD/kueue"
SP_MOD="$MOD/scheduler-plugins"
CACHE="${KUBE_CURRENT_CACHE:-$HOME/.cache/spectrain}"
# Bump when the way the binaries are built changes (flags, ldflags): cached binaries are rebuilt.
BUILD_LEVEL=1

log() { printf '[build-kube-current] %s\n' "$*" >&2; }
die() { printf '[build-kube-current] ERROR: %s\n' "$*" >&2; exit 1; }

modver() {  # modver FILE MODULE -> the version FILE requires of MODULE
  awk -v m="$2" '$1 == "require" && $2 == m && $3 ~ /^v/ { print $3; exit }
                  $1 == m && $2 ~ /^v/ { print $2; exit }' "$1"
}

mode=build
case "${1:-}" in
  "") ;;
  --print-bin) mode=print ;;
  --print-kueue) mode=print-kueue ;;
  --print-scheduler-plugins) mode=print-sp ;;
  --regen) mode=regen; REGEN_VERSION="${2:-}"; [[ "$REGEN_VERSION" =~ ^v1\.[0-9]+\.[0-9]+$ ]] \
             || die "--regen needs a release version like v1.37.2" ;;
  -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
  *) die "unknown argument $1 (see --help)" ;;
esac

KUBE_VERSION=$(modver "$MOD/go.mod" k8s.io/kubernetes)
[[ -n "$KUBE_VERSION" ]] || die "no k8s.io/kubernetes requirement in $MOD/go.mod"
KUEUE_VERSION=$(modver "$KUEUE_MOD/go.mod" sigs.k8s.io/kueue)
[[ -n "$KUEUE_VERSION" ]] || die "no sigs.k8s.io/kueue requirement in $KUEUE_MOD/go.mod"
KUEUE_DIR="$CACHE/kueue-$KUEUE_VERSION"
SP_VERSION=$(modver "$SP_MOD/go.mod" sigs.k8s.io/scheduler-plugins)
[[ -n "$SP_VERSION" ]] || die "no sigs.k8s.io/scheduler-plugins requirement in $SP_MOD/go.mod"
SP_DIR="$CACHE/scheduler-plugins-$SP_VERSION"
if [[ $mode == print ]]; then
  echo "$CACHE/kube-$KUBE_VERSION/bin"
  exit 0
elif [[ $mode == print-kueue ]]; then
  echo "$KUEUE_DIR"
  exit 0
elif [[ $mode == print-sp ]]; then
  echo "$SP_DIR"
  exit 0
fi

# --- Go -----------------------------------------------------------------------------------------
source "$ROOT/scripts/go-env.sh"
go_setup "$(awk '$1 == "go" { print $2; exit }' "$MOD/go.mod")"

proxy_error() {
  die "$1 failed: the Go module proxy ($("$GO" env GOPROXY)) could not be reached or refused a module;
  see the go output above. The modules are fetched once into $("$GO" env GOMODCACHE); later builds need no network."
}

# --- --regen: point the build module at another release ---------------------------------------
if [[ $mode == regen ]]; then
  log "fetching k8s.io/kubernetes@$REGEN_VERSION"
  json=$(cd "$MOD" && GOWORK=off "$GO" mod download -json "k8s.io/kubernetes@$REGEN_VERSION") || proxy_error "go mod download k8s.io/kubernetes@$REGEN_VERSION"
  kdir=$(printf '%s' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -f "$kdir/go.mod" ]] || die "no go.mod in $kdir"
  staging_version="v0.${REGEN_VERSION#v1.}"
  tmp="$MOD/go.mod.tmp"
  {
    sed -n '1,/^module /p' "$MOD/go.mod"
    printf '\ngo %s\n\n' "$(awk '$1 == "go" { print $2; exit }' "$kdir/go.mod")"
    printf 'tool (\n\tgo.etcd.io/etcd/server/v3\n\tk8s.io/kubernetes/cmd/kube-apiserver\n'
    printf '\tk8s.io/kubernetes/cmd/kube-controller-manager\n\tk8s.io/kubernetes/cmd/kube-scheduler\n)\n\n'
    printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$REGEN_VERSION"
    grep -oE '^[[:space:]]+k8s\.io/[a-z0-9-]+ => \./staging' "$kdir/go.mod" \
      | awk -v v="$staging_version" '{ print "\t" $1 " => " $1 " " v }'
    printf ')\n'
  } > "$tmp"
  mv -f "$tmp" "$MOD/go.mod"
  rm -f "$MOD/go.sum"
  (cd "$MOD" && GOWORK=off GOFLAGS=-mod=mod "$GO" mod tidy) || proxy_error "go mod tidy in $MOD"
  KUBE_VERSION=$REGEN_VERSION
  log "scripts/kube/go.mod now builds $KUBE_VERSION (etcd $(modver "$MOD/go.mod" go.etcd.io/etcd/server/v3)); commit go.mod and go.sum"
fi

ETCD_VERSION=$(modver "$MOD/go.mod" go.etcd.io/etcd/server/v3)
KWOK_VERSION=$(modver "$KWOK_MOD/go.mod" sigs.k8s.io/kwok)
[[ -n "$ETCD_VERSION" && -n "$KWOK_VERSION" ]] || die "etcd or kwok version missing from the build modules"
BIN="$CACHE/kube-$KUBE_VERSION/bin"
TARGETS=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)
sum=$(go_workspace_sum)
STAMP="kubernetes=$KUBE_VERSION etcd=$ETCD_VERSION kwok=$KWOK_VERSION modules=$sum level=$BUILD_LEVEL"

stamped() {      # stamped DIR STAMP: DIR was built for exactly STAMP
  [[ "$(cat "$1/.stamp" 2>/dev/null)" == "$2" ]]
}

write_stamp() {  # write_stamp DIR STAMP, atomically, once DIR is complete
  echo "$2" > "$1/.stamp.tmp" && mv -f "$1/.stamp.tmp" "$1/.stamp"
}

have_all() {
  local t
  for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
  stamped "$BIN" "$STAMP"
}

# kwok's stages (what its fake kubelets do to nodes and pods), from its release: nodes become
# Ready and keep heartbeating; pods are marked Running (native sidecars running, plain init
# containers completed) and, once deleted, removed; pods owned by a Job complete.
STAGES=(node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml
        pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml)
write_stages() {
  local dir f
  dir=$(go_in "$KWOK_MOD" list -m -f '{{.Dir}}' sigs.k8s.io/kwok) || proxy_error "go list -m sigs.k8s.io/kwok"
  {
    echo "# kwok $KWOK_VERSION stages (scripts/build-kube-current.sh): ${STAGES[*]}"
    for f in "${STAGES[@]}"; do
      [[ -f "$dir/kustomize/stage/$f" ]] || die "kwok $KWOK_VERSION has no kustomize/stage/$f"
      echo "---"; cat "$dir/kustomize/stage/$f"
    done
  } > "$BIN/kwok-stages.yaml.tmp" && mv -f "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
}

build_kube() {
if have_all; then
  if [[ ! -s "$BIN/kwok-stages.yaml" ]]; then
    go_in "$KWOK_MOD" mod download sigs.k8s.io/kwok || proxy_error "go mod download sigs.k8s.io/kwok"
    write_stages
  fi
  log "cached: $BIN ($STAMP; delete $BIN/.stamp to rebuild)"
  return 0
fi

local t0 got etcd_says t
t0=$(date +%s)
log "building $STAMP with $("$GO" env GOVERSION) into $BIN"

# --- 1. build (go build fetches the modules it needs: the only network step) ---------------------
minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  # what hack/lib/version.sh stamps: `--version` and /version report the release, and the
  # binary version (feature gates, emulation) is the release's
  LDFLAGS+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
OUT="$BIN/.build.$$"
rm -rf "$OUT"; mkdir -p "$OUT"
trap 'rm -rf "${OUT:-}"' EXIT
log "go build kube-apiserver kube-controller-manager kube-scheduler etcd (about 9 min on 2 cores with an empty Go build cache, the workspace's shared libraries included; 30 s warm)"
go_in "$MOD" build -trimpath -ldflags "$LDFLAGS" -o "$OUT/" \
   k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
   k8s.io/kubernetes/cmd/kube-scheduler go.etcd.io/etcd/server/v3 || die "go build in scripts/kube failed (see above)"
# go names the etcd server module's main package (go.etcd.io/etcd/server/v3) "server"
mv -f "$OUT/server" "$OUT/etcd"
log "go build kwok"
go_in "$KWOK_MOD" build -trimpath -ldflags "-s -w" -o "$OUT/kwok" sigs.k8s.io/kwok/cmd/kwok \
  || die "go build in scripts/kube/kwok failed (see above)"

# --- 2. check and install atomically ------------------------------------------------------------
got=$("$OUT/kube-apiserver" --version) || die "the built kube-apiserver does not run"
[[ "$got" == "Kubernetes $KUBE_VERSION" ]] || die "kube-apiserver --version says '$got', expected 'Kubernetes $KUBE_VERSION'"
etcd_says=$("$OUT/etcd" --version) || die "the built etcd does not run"
[[ "$etcd_says" == *"etcd Version: ${ETCD_VERSION#v}"* ]] || die "etcd --version says '$etcd_says', expected ${ETCD_VERSION#v}"
for t in "${TARGETS[@]}"; do mv -f "$OUT/$t" "$BIN/$t"; done
write_stages
write_stamp "$BIN" "$STAMP"
log "done in $(( $(date +%s) - t0 )) s: $BIN ($got, etcd $ETCD_VERSION, kwok $KWOK_VERSION)"
}

# --- Kueue ----------------------------------------------------------------------------------------
# The manager (cmd/kueue) and, from the same module, what a cluster installs with it: the CRDs
# (config/components/crd/bases) and the webhook configurations (config/components/webhook/
# manifests.yaml; the tests point them at the manager on 127.0.0.1). Its own stamp and directory:
# a Kueue bump rebuilds Kueue only.
KUEUE_SUM=$(cat "$KUEUE_MOD/go.mod" "$KUEUE_MOD/go.sum" | sha256sum | cut -c1-16)
KUEUE_STAMP="kueue=$KUEUE_VERSION modules=$KUEUE_SUM level=$BUILD_LEVEL"

build_kueue() {
  if [[ -x "$KUEUE_DIR/bin/kueue" && -s "$KUEUE_DIR/crds.yaml" && -s "$KUEUE_DIR/webhooks.yaml" \
        ]] && stamped "$KUEUE_DIR" "$KUEUE_STAMP"; then
    log "cached: $KUEUE_DIR ($KUEUE_STAMP; delete $KUEUE_DIR/.stamp to rebuild)"
    return 0
  fi
  local t0 src f
  t0=$(date +%s)
  log "building $KUEUE_STAMP with $("$GO" env GOVERSION) into $KUEUE_DIR"
  go_download "$KUEUE_MOD" || proxy_error "go mod download in scripts/kube/kueue"
  src=$(go_in "$KUEUE_MOD" list -m -f '{{.Dir}}' sigs.k8s.io/kueue) || proxy_error "go list -m sigs.k8s.io/kueue"
  OUT="$KUEUE_DIR/.build.$$"
  rm -rf "$OUT"; mkdir -p "$OUT/bin"
  log "go build kueue (about 4 min cold on 2 cores, seconds with a warm Go build cache)"
  go_in "$KUEUE_MOD" build -trimpath \
     -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
     -o "$OUT/bin/kueue" sigs.k8s.io/kueue/cmd/kueue || die "go build in scripts/kube/kueue failed (see above)"
  "$OUT/bin/kueue" --help >/dev/null 2>&1 || die "the built kueue does not run"
  for f in "$src"/config/components/crd/bases/*.yaml; do
    printf -- '---\n# %s\n' "${f##*/}"; grep -v '^---$' "$f"
  done > "$OUT/crds.yaml"
  grep -q 'kind: CustomResourceDefinition' "$OUT/crds.yaml" || die "no CRDs under $src/config/components/crd/bases"
  cp "$src/config/components/webhook/manifests.yaml" "$OUT/webhooks.yaml" \
    || die "Kueue $KUEUE_VERSION has no config/components/webhook/manifests.yaml"
  chmod -R u+w "$OUT"  # files copied out of the module cache are read-only
  mkdir -p "$KUEUE_DIR"
  rm -rf "$KUEUE_DIR/bin"
  mv -f "$OUT/bin" "$OUT/crds.yaml" "$OUT/webhooks.yaml" "$KUEUE_DIR/"
  rm -rf "$OUT"
  write_stamp "$KUEUE_DIR" "$KUEUE_STAMP"
  log "done in $(( $(date +%s) - t0 )) s: $KUEUE_DIR (kueue $KUEUE_VERSION)"
}

# --- scheduler-plugins ----------------------------------------------------------------------------
# kube-scheduler with the out-of-tree plugins (cmd/scheduler; the tests run it as a second scheduler
# with a Coscheduling profile) and, from the same module, the PodGroup CRD it reads
# (config/crd/bases/scheduling.x-k8s.io_podgroups.yaml). Its own stamp and directory.
SP_SUM=$(cat "$SP_MOD/go.mod" "$SP_MOD/go.sum" | sha256sum | cut -c1-16)
SP_STAMP="scheduler-plugins=$SP_VERSION modules=$SP_SUM level=$BUILD_LEVEL"

build_scheduler_plugins() {
  if [[ -x "$SP_DIR/bin/kube-scheduler" && -s "$SP_DIR/podgroups.yaml" \
        ]] && stamped "$SP_DIR" "$SP_STAMP"; then
    log "cached: $SP_DIR ($SP_STAMP; delete $SP_DIR/.stamp to rebuild)"
    return 0
  fi
  local t0 src crd
  t0=$(date +%s)
  log "building $SP_STAMP with $("$GO" env GOVERSION) into $SP_DIR"
  go_download "$SP_MOD" || proxy_error "go mod download in scripts/kube/scheduler-plugins"
  src=$(go_in "$SP_MOD" list -m -f '{{.Dir}}' sigs.k8s.io/scheduler-plugins) \
    || proxy_error "go list -m sigs.k8s.io/scheduler-plugins"
  crd="$src/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml"
  [[ -f "$crd" ]] || die "scheduler-plugins $SP_VERSION has no config/crd/bases/scheduling.x-k8s.io_podgroups.yaml"
  OUT="$SP_DIR/.build.$$"
  rm -rf "$OUT"; mkdir -p "$OUT/bin"
  trap 'rm -rf "${OUT:-}"' EXIT
  log "go build scheduler-plugins kube-scheduler (about 4 min cold on 2 cores, seconds with a warm Go build cache)"
  # stamped with the Kubernetes release it is built from, as hack/lib/version.sh does: the binary
  # version decides the emulation version, and one below 1.31 (scheduler-plugins' own tag, v0.34.Z)
  # is refused at start ("emulation version 0.34 is not between [1.31, 0.34.0]")
  local kver kminor ldflags pkg got
  kver=$(modver "$SP_MOD/go.mod" k8s.io/kubernetes)
  [[ "$kver" =~ ^v1\.[0-9]+\. ]] || die "no k8s.io/kubernetes v1.Y.Z in $SP_MOD/go.mod"
  kminor=${kver#v1.}; kminor=${kminor%%.*}
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$kver -X $pkg.gitMajor=1 -X $pkg.gitMinor=$kminor -X $pkg.gitTreeState=clean"
  done
  go_in "$SP_MOD" build -trimpath -ldflags "$ldflags" \
     -o "$OUT/bin/kube-scheduler" sigs.k8s.io/scheduler-plugins/cmd/scheduler \
    || die "go build in scripts/kube/scheduler-plugins failed (see above)"
  got=$("$OUT/bin/kube-scheduler" --version) || die "the built scheduler-plugins kube-scheduler does not run"
  [[ "$got" == "Kubernetes $kver" ]] || die "scheduler-plugins kube-scheduler --version says '$got', expected 'Kubernetes $kver'"
  cp "$crd" "$OUT/podgroups.yaml"
  chmod -R u+w "$OUT"  # files copied out of the module cache are read-only
  mkdir -p "$SP_DIR"
  rm -rf "$SP_DIR/bin"
  mv -f "$OUT/bin" "$OUT/podgroups.yaml" "$SP_DIR/"
  rm -rf "$OUT"
  write_stamp "$SP_DIR" "$SP_STAMP"
  log "done in $(( $(date +%s) - t0 )) s: $SP_DIR (scheduler-plugins $SP_VERSION)"
}

build_kube
build_kueue
build_scheduler_plugins
