#!/usr/bin/env bash
# Build kube-apiserver + kube-controller-manager 1.20 from Debian bookworm's `kubernetes`
# source package and cache them in $KUBE_CACHE/bin. Idempotent: exits at once when both
# binaries are cached. No registry ships a prebuilt apiserver that this machine can reach;
# see /work/shared/notes/test-infrastructure.md for the facts this script is built on.
#
#   KUBE_CACHE   cache root (default ~/.cache/spectrain/kube); binaries land in $KUBE_CACHE/bin
#   KUBE_KEEP_WORK=1  keep the extracted source and build outputs in $KUBE_CACHE/work (~2.3 GB)
set -euo pipefail

KUBE_CACHE="${KUBE_CACHE:-$HOME/.cache/spectrain/kube}"
BIN="$KUBE_CACHE/bin"
WORK="$KUBE_CACHE/work"
TARGETS=(kube-apiserver kube-controller-manager)
# Bump when the source patches below change: cached binaries of another level are rebuilt.
PATCH_LEVEL=2

log() { printf '[build-kube] %s\n' "$*" >&2; }
die() { printf '[build-kube] ERROR: %s\n' "$*" >&2; exit 1; }

have_all() {
  local t
  for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
  [[ "$(cat "$BIN/.patch-level" 2>/dev/null)" == "$PATCH_LEVEL" ]]
}

if have_all; then
  log "cached: $BIN/{kube-apiserver,kube-controller-manager} patch level $PATCH_LEVEL (delete them to rebuild)"
  exit 0
fi

trap 'rc=$?; [[ $rc -ne 0 ]] && log "FAILED (exit $rc) at line $LINENO; partial work kept in $WORK, rerun to resume"' EXIT

# --- 1. build dependencies (Debian) ---------------------------------------------------------
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || die "not root and no sudo: install as root: golang-go rsync etcd-server make openssl dpkg-dev golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev"
  SUDO=(sudo)
fi
command -v apt-get >/dev/null || die "apt-get not found: this script expects Debian bookworm"

PKGS=(golang-go rsync etcd-server make openssl dpkg-dev
      golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing: ${missing[*]}"
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
    || die "apt-get update failed"
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    || die "apt-get install ${missing[*]} failed"
fi
export PATH="/usr/lib/go/bin:$PATH"
command -v go >/dev/null || die "go not on PATH after installing golang-go"

REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
JSONITER_SRC=/usr/share/gocode/src/github.com/json-iterator/go
[[ -d $REFLECT2_SRC && -d $JSONITER_SRC ]] || die "Debian Go sources missing: $REFLECT2_SRC / $JSONITER_SRC"

# --- 2. the kubernetes source package via a private apt dir (never touches /etc/apt) ---------
mkdir -p "$WORK"
SRCDIR=$(find "$WORK" -maxdepth 1 -type d -name 'kubernetes-*' | head -n1 || true)
if [[ -z "$SRCDIR" || ! -f "$SRCDIR/.spectrain-extracted" ]]; then
  [[ -n "$SRCDIR" ]] && rm -rf "$SRCDIR"
  # The mirror the machine's apt sources already name (deb822 or one-line format).
  mirror=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
             /etc/apt/sources.list.d/*.list 2>/dev/null \
           | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ' || true)
  security=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
             /etc/apt/sources.list.d/*.list 2>/dev/null \
           | grep -oE 'https?://[^ ]+/debian-security/?( |$)' | head -n1 | tr -d ' ' || true)
  [[ -n "$mirror" ]] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
  mirror=${mirror%/}; security=${security%/}
  log "Debian mirror: $mirror${security:+ (security: $security)}"

  APTD="$WORK/apt"
  rm -rf "$APTD"; mkdir -p "$APTD/parts" "$APTD/lists/partial" "$APTD/cache/archives/partial"
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    echo "deb-src [signed-by=$keyring] $mirror bookworm main"
    echo "deb-src [signed-by=$keyring] $mirror bookworm-updates main"
    [[ -n "$security" ]] && echo "deb-src [signed-by=$keyring] $security bookworm-security main"
  } > "$APTD/sources.list"
  APT_OPTS=(-o "Dir::Etc::SourceList=$APTD/sources.list" -o "Dir::Etc::SourceParts=$APTD/parts"
            -o "Dir::State::Lists=$APTD/lists" -o "Dir::Cache=$APTD/cache" -o "APT::Sandbox::User=root")
  log "fetching the source index"
  apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update (private deb-src dir $APTD) failed"
  mkdir -p "$WORK/dl"
  log "downloading the kubernetes source package (~34 MB)"
  (cd "$WORK/dl" && apt-get "${APT_OPTS[@]}" source --download-only kubernetes) \
    || die "apt-get source kubernetes failed"
  dsc=$(ls -t "$WORK"/dl/kubernetes_*.dsc | head -n1)
  [[ -n "$dsc" ]] || die "no kubernetes_*.dsc downloaded"
  log "extracting $(basename "$dsc")"
  (cd "$WORK" && dpkg-source --no-check -x "$dsc") || die "dpkg-source -x $dsc failed"
  SRCDIR=$(find "$WORK" -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
  [[ -d "$SRCDIR/vendor" ]] || die "extracted tree $SRCDIR has no vendor/"

  # --- 3. the reflect2 pitfall: vendored reflect2 1.0.1 SIGSEGVs on Go >= 1.18 --------------
  log "replacing vendored reflect2 + json-iterator with Debian's (1.0.2 / 1.1.12)"
  for pair in "$REFLECT2_SRC:vendor/github.com/modern-go/reflect2" "$JSONITER_SRC:vendor/github.com/json-iterator/go"; do
    src=${pair%%:*}; dst="$SRCDIR/${pair#*:}"
    rsync -a --delete --exclude '*_test.go' --exclude 'testdata/' --exclude 'go.mod' --exclude 'go.sum' \
      "$src/" "$dst/" || die "rsync $src -> $dst failed"
  done
  # --- 3b. go-openapi zero-value check: with Go >= 1.16 reflect.Zero returns shared values, so the
  # vendored validator treats "" (and 0, false) as null and rejects every empty string in a custom
  # resource ('Invalid value: "null": ... must be of type string'). Upstream fix: kube-openapi#230
  # (kubernetes#99804, 1.21): only a real nil is null.
  mapfile -t typego < <(grep -rl --include=type.go 'reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data))' \
                          "$SRCDIR/vendor" || true)
  ((${#typego[@]})) || die "go-openapi validate/type.go zero-value check not found: the patch needs updating"
  for f in "${typego[@]}"; do
    sed -i 's/if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {/if data == nil {/' "$f"
    ! grep -q 'reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data))' "$f" || die "patching $f failed"
    log "patched the zero-value check in ${f#"$SRCDIR"/}"
  done
  touch "$SRCDIR/.spectrain-extracted"
else
  log "reusing extracted source $SRCDIR"
fi

# --- 4. build -------------------------------------------------------------------------------
log "building ${TARGETS[*]} in $SRCDIR (about 11 min on 2 cores)"
(cd "$SRCDIR" && CGO_ENABLED=0 GOPROXY=off GOFLAGS=-mod=vendor \
   make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" GOLDFLAGS="-s -w") \
  || die "kube build failed (see the go output above)"

# --- 5. install atomically ------------------------------------------------------------------
mkdir -p "$BIN"
for t in "${TARGETS[@]}"; do
  built=$(find "$SRCDIR/_output" -type f -name "$t" -perm -u+x | head -n1)
  [[ -n "$built" ]] || die "built binary $t not found under $SRCDIR/_output"
  tmp="$BIN/.$t.tmp.$$"
  cp "$built" "$tmp" && chmod 0755 "$tmp" && mv -f "$tmp" "$BIN/$t"
done
"$BIN/kube-apiserver" --version >&2 || die "$BIN/kube-apiserver does not run"
echo "$PATCH_LEVEL" > "$BIN/.patch-level.tmp" && mv -f "$BIN/.patch-level.tmp" "$BIN/.patch-level"
# The source tree + build outputs take ~2.3 GB; keep them only when asked (KUBE_KEEP_WORK=1).
if [[ "${KUBE_KEEP_WORK:-0}" != 1 ]]; then rm -rf "$WORK"; fi
log "done: $BIN"
