#!/usr/bin/env bash
# Build and cache what the real two-node cluster (scripts/cluster/cluster.sh) runs on top of the
# control plane of scripts/build-kube-current.sh:
#   kubelet, kube-proxy   k8s.io/kubernetes cmd/kubelet, cmd/kube-proxy, build module
#                         scripts/node/kube (its own module, so the control plane's module and stamp
#                         stay untouched; its k8s.io/kubernetes version must equal
#                         scripts/kube/go.mod's: checked here, `--regen` rewrites it from that one)
#   containerd 2.x        github.com/containerd/containerd/v2: containerd, containerd-shim-runc-v2,
#                         ctr (CGO_ENABLED=0), build module scripts/node/containerd
#   CoreDNS               github.com/coredns/coredns with the plugins the Corefile uses
#                         (scripts/node/coredns/main.go), build module scripts/node/coredns
#   kube-router           github.com/cloudnativelabs/kube-router/v2 (NetworkPolicy enforcement,
#                         firewall-only), build module scripts/node/kube-router
#   pause                 a static pause (scripts/cluster/pause.c, Debian's gcc) and its image
#                         archive (registry.k8s.io/pause:$PAUSE_TAG, docker-archive, for ctr import)
# and apt-installs (idempotently) the Debian packages the nodes need: runc, the CNI plugins, iptables,
# conntrack, socat, ipset, mmdebstrap, busybox-static, gcc/libc6-dev.
# Versions live in the go.mod files (and PAUSE_TAG below for the pause image name), nowhere else.
# Each part lands in its own $KUBE_CURRENT_CACHE/<name>-<version>/bin (default ~/.cache/spectrain)
# with a .stamp (versions + build modules' checksum + BUILD_LEVEL); a stamped part is not rebuilt.
#
#   scripts/cluster/build.sh              build what is missing (or report the cached parts)
#   scripts/cluster/build.sh --print-bin  print the bin directories, one per line (kubelet's first,
#                                         then containerd's, coredns', pause's, kube-router's) and exit
#   scripts/cluster/build.sh --regen      rewrite scripts/node/kube/go.mod from scripts/kube/go.mod
#                                         (same k8s.io/kubernetes + replaces), go mod tidy, build
# Needs Go >= the go lines of the modules (1.26.6) on PATH or in /usr/local/go/bin.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KMOD="$ROOT/scripts/kube"
NMOD="$ROOT/scripts/node/kube"
CMOD="$ROOT/scripts/node/containerd"
DMOD="$ROOT/scripts/node/coredns"
RMOD="$ROOT/scripts/node/kube-router"
CACHE="${KUBE_CURRENT_CACHE:-$HOME/.cache/spectrain}"
PAUSE_TAG=3.10
# Bump when the way the binaries are built changes: cached parts are rebuilt.
BUILD_LEVEL=1
APT_PACKAGES=(runc containernetworking-plugins iptables conntrack socat ipset ebtables iproute2
              util-linux mmdebstrap busybox-static gcc libc6-dev openssl curl)

log() { printf '[cluster-build] %s\n' "$*" >&2; }
die() { printf '[cluster-build] ERROR: %s\n' "$*" >&2; exit 1; }

modver() {  # modver FILE MODULE -> the version FILE requires of MODULE
  awk -v m="$2" '$1 == "require" && $2 == m && $3 ~ /^v/ { print $3; exit }
                  $1 == m && $2 ~ /^v/ { print $2; exit }' "$1"
}
modsum() { cat "$@" | sha256sum | cut -c1-16; }

mode=build
case "${1:-}" in
  "") ;;
  --print-bin) mode=print ;;
  --regen) mode=regen ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) die "unknown argument $1 (see --help)" ;;
esac

KUBE_VERSION=$(modver "$KMOD/go.mod" k8s.io/kubernetes)
NODE_KUBE_VERSION=$(modver "$NMOD/go.mod" k8s.io/kubernetes)
CONTAINERD_VERSION=$(modver "$CMOD/go.mod" github.com/containerd/containerd/v2)
COREDNS_VERSION=$(modver "$DMOD/go.mod" github.com/coredns/coredns)
KUBE_ROUTER_VERSION=$(modver "$RMOD/go.mod" github.com/cloudnativelabs/kube-router/v2)
[[ -n "$KUBE_VERSION" && -n "$CONTAINERD_VERSION" && -n "$COREDNS_VERSION" ]] \
  || die "a version is missing from scripts/kube/go.mod or scripts/node/*/go.mod"

KBIN="$CACHE/node-kube-$KUBE_VERSION/bin"
CBIN="$CACHE/containerd-$CONTAINERD_VERSION/bin"
DBIN="$CACHE/coredns-$COREDNS_VERSION/bin"
PAUSE_SUM=$(modsum "$ROOT/scripts/cluster/pause.c" <(echo "$PAUSE_TAG level=$BUILD_LEVEL"))
PBIN="$CACHE/pause-$PAUSE_SUM/bin"
RBIN="$CACHE/kube-router-$KUBE_ROUTER_VERSION/bin"
if [[ $mode == print ]]; then
  printf '%s\n' "$KBIN" "$CBIN" "$DBIN" "$PBIN" "$RBIN"
  exit 0
fi

# --- Debian packages (idempotent: only what is missing) -----------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  [[ $(id -u) == 0 ]] || die "need root to apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update >&2 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2; } \
    || die "apt-get install ${missing[*]} failed (see above): is the Debian mirror reachable, or dpkg locked by another apt?"
fi

# --- Go ---------------------------------------------------------------------------------------
source "$ROOT/scripts/go-env.sh"
go_setup "$(awk '$1 == "go" { print $2; exit }' "$CMOD/go.mod")"
proxy_error() {
  die "$1 failed: the Go module proxy ($("$GO" env GOPROXY)) could not be reached or refused a module (see above).
  Modules are fetched once into $("$GO" env GOMODCACHE); later builds need no network."
}

if [[ $mode == regen ]]; then
  log "rewriting $NMOD/go.mod from $KMOD/go.mod ($KUBE_VERSION)"
  {
    sed -n '1,/^module /p' "$NMOD/go.mod" | sed '$d'
    echo "module spectrain.local/nodebuild"
    sed -n '/^module /,$p' "$KMOD/go.mod" | sed '1d' \
      | awk '/^tool \(/ { print "tool (\n\tk8s.io/kubernetes/cmd/kube-proxy\n\tk8s.io/kubernetes/cmd/kubelet\n)"; skip=1; next }
             skip && /^\)/ { skip=0; next } !skip'
  } > "$NMOD/go.mod.tmp"
  mv -f "$NMOD/go.mod.tmp" "$NMOD/go.mod"
  cp "$KMOD/go.sum" "$NMOD/go.sum"
  (cd "$NMOD" && GOWORK=off GOFLAGS=-mod=mod "$GO" mod tidy) || proxy_error "go mod tidy in scripts/node/kube"
  NODE_KUBE_VERSION=$(modver "$NMOD/go.mod" k8s.io/kubernetes)
  log "scripts/node/kube/go.mod now builds $NODE_KUBE_VERSION; commit go.mod and go.sum"
fi
[[ "$NODE_KUBE_VERSION" == "$KUBE_VERSION" ]] || die "scripts/node/kube/go.mod builds k8s.io/kubernetes $NODE_KUBE_VERSION
  but scripts/kube/go.mod (the control plane) pins $KUBE_VERSION: run scripts/cluster/build.sh --regen"

stamped() { [[ "$(cat "$1/.stamp" 2>/dev/null)" == "$2" ]]; }
write_stamp() { echo "$2" > "$1/.stamp.tmp" && mv -f "$1/.stamp.tmp" "$1/.stamp"; }

# build_part NAME BIN STAMP MODDIR LDFLAGS "out=pkg ..." CHECKCMD
build_part() {
  local name=$1 bin=$2 stamp=$3 mod=$4 ldflags=$5 targets=$6 check=$7 t0 out tp o p
  if stamped "$bin" "$stamp"; then
    log "cached: $bin ($stamp)"
    return 0
  fi
  t0=$(date +%s)
  log "building $name ($stamp) with $("$GO" env GOVERSION) into $bin"
  go_download "$mod" || proxy_error "go mod download in ${mod#"$ROOT"/}"
  out="$bin/.build.$$"
  rm -rf "$out"; mkdir -p "$out"
  trap 'rm -rf "${out:-}"' EXIT
  for tp in $targets; do
    o=${tp%%=*}; p=${tp#*=}
    log "go build $p -> $o"
    GO_NICE=10 go_in "$mod" build -trimpath -ldflags "$ldflags" -o "$out/$o" "$p" \
      || die "go build $p in ${mod#"$ROOT"/} failed (see above)"
  done
  (cd "$out" && eval "$check") >/dev/null 2>&1 || die "the built $name does not run ($check)"
  for tp in $targets; do mv -f "$out/${tp%%=*}" "$bin/"; done
  rm -rf "$out"; trap - EXIT
  write_stamp "$bin" "$stamp"
  log "$name done in $(( $(date +%s) - t0 )) s"
}

# --- containerd 2.x -------------------------------------------------------------------------------
CPKG=github.com/containerd/containerd/v2
build_part "containerd $CONTAINERD_VERSION" "$CBIN" \
  "containerd=$CONTAINERD_VERSION modules=$(go_workspace_sum) level=$BUILD_LEVEL" "$CMOD" \
  "-s -w -X $CPKG/version.Version=$CONTAINERD_VERSION -X $CPKG/version.Package=$CPKG" \
  "containerd=$CPKG/cmd/containerd containerd-shim-runc-v2=$CPKG/cmd/containerd-shim-runc-v2 ctr=$CPKG/cmd/ctr" \
  "./containerd --version | grep -q ' $CONTAINERD_VERSION' && ./ctr --version"

# --- CoreDNS --------------------------------------------------------------------------------------
build_part "coredns $COREDNS_VERSION" "$DBIN" \
  "coredns=$COREDNS_VERSION modules=$(go_workspace_sum)-$(modsum "$DMOD/main.go") level=$BUILD_LEVEL" "$DMOD" \
  "-s -w" "coredns=." "./coredns -version | grep -q 'CoreDNS-${COREDNS_VERSION#v}'"

# --- kubelet + kube-proxy -------------------------------------------------------------------------
minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
KLDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  KLDFLAGS+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
build_part "kubelet+kube-proxy $KUBE_VERSION" "$KBIN" \
  "kubernetes=$KUBE_VERSION modules=$(go_workspace_sum) level=$BUILD_LEVEL" "$NMOD" "$KLDFLAGS" \
  "kubelet=k8s.io/kubernetes/cmd/kubelet kube-proxy=k8s.io/kubernetes/cmd/kube-proxy" \
  "./kubelet --version | grep -qx 'Kubernetes $KUBE_VERSION' && ./kube-proxy --version | grep -qx 'Kubernetes $KUBE_VERSION'"

# --- pause + its image archive --------------------------------------------------------------------
PSTAMP="pause=$PAUSE_TAG source=$PAUSE_SUM level=$BUILD_LEVEL"
if stamped "$PBIN" "$PSTAMP"; then
  log "cached: $PBIN ($PSTAMP)"
else
  log "building the static pause and registry.k8s.io/pause:$PAUSE_TAG into $PBIN"
  mkdir -p "$PBIN"
  gcc -Os -static -Wall -o "$PBIN/pause.tmp" "$ROOT/scripts/cluster/pause.c" \
    || die "gcc -static pause.c failed: apt-get install gcc libc6-dev"
  strip "$PBIN/pause.tmp"; mv -f "$PBIN/pause.tmp" "$PBIN/pause"
  rootfs=$(mktemp -d); trap 'rm -rf "$rootfs"' EXIT
  install -m 0755 "$PBIN/pause" "$rootfs/pause"
  python3 "$ROOT/scripts/cluster/image.py" --rootfs "$rootfs" --name "registry.k8s.io/pause:$PAUSE_TAG" \
    --entrypoint /pause --user 65535:65535 --out "$PBIN/pause.tar" || die "writing the pause image archive failed"
  rm -rf "$rootfs"; trap - EXIT
  echo "registry.k8s.io/pause:$PAUSE_TAG" > "$PBIN/pause.image"
  write_stamp "$PBIN" "$PSTAMP"
fi
# --- kube-router (NetworkPolicy) ----------------------------------------------------------------
KRPKG=github.com/cloudnativelabs/kube-router/v2
build_part "kube-router $KUBE_ROUTER_VERSION" "$RBIN" \
  "kube-router=$KUBE_ROUTER_VERSION modules=$(modsum "$RMOD/go.mod" "$RMOD/go.sum") level=$BUILD_LEVEL" "$RMOD" \
  "-s -w -X $KRPKG/pkg/version.Version=$KUBE_ROUTER_VERSION" "kube-router=$KRPKG/cmd/kube-router" "./kube-router --version"

log "ready: $KBIN $CBIN $DBIN $PBIN $RBIN"
