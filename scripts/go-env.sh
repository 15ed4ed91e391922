# shellcheck shell=bash
# Sourced by the Go build scripts (build-kube-current.sh, build-prometheus.sh, build-helm.sh,
# cluster/build.sh), with ROOT (the repository) and die() set: which Go builds, with which
# environment, and the workspace scripts/go.work.
#
# The workspace: the build modules listed there resolve their dependencies together (one version of
# each module across all of them), so a package common to two programs is compiled once and found
# in Go's build cache by the next build: a cold build of the control plane, kwok, the nodes' kubelet,
# kube-proxy, containerd and CoreDNS, Prometheus and helm compiles the shared Kubernetes libraries
# once instead of once per module. A module not listed builds alone (GOWORK=off), with the versions
# of its own go.mod. Everything a workspace member's build depends on is in go_workspace_sum.

GO_WORK="$ROOT/scripts/go.work"

# go_setup NEED: GO := a Go >= NEED and >= go.work's (PATH's go, else /usr/local/go/bin/go); the
# build environment.
go_setup() {
  local need
  need=$(printf '%s\n%s\n' "$1" "$(awk '$1 == "go" { print $2; exit }' "$GO_WORK")" | sort -V | tail -n1)
  go_ok() { [[ -x "$1" ]] && [[ "$(printf '%s\n%s\n' "$need" "$("$1" env GOVERSION | sed 's/^go//')" | sort -V | head -n1)" == "$need" ]]; }
  # (build-kube.sh installs Debian's Go 1.19 under /usr/lib/go: never take that one.)
  GO=$(command -v go || true)
  if [[ -z "$GO" ]] || ! go_ok "$GO"; then
    if go_ok /usr/local/go/bin/go; then GO=/usr/local/go/bin/go
    else die "Go >= $need not found (have: ${GO:-none}${GO:+ $("$GO" env GOVERSION)}); install Go $need or newer into /usr/local/go"
    fi
  fi
  export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
}

# go_members: the workspace's module directories (absolute), one per line.
go_members() {
  awk '/^use \(/ { on=1; next } on && /^\)/ { on=0 } on && NF { print $1 }' "$GO_WORK" \
    | sed "s|^\./|$ROOT/scripts/|"
}

# go_workspace_sum: what every member's build list depends on (go.work and every member's go.mod
# and go.sum): part of each member's cache stamp. Not go.work.sum: it holds only checksums of what
# those select, and the go command appends to it while it builds.
go_workspace_sum() {
  local m
  { cat "$GO_WORK"
    while read -r m; do cat "$m/go.mod" "$m/go.sum"; done < <(go_members)
  } | sha256sum | cut -c1-16
}

# go_mod_env MODDIR: the GOWORK a go command in MODDIR runs with (the workspace for a member, off for
# any other module: a module under scripts/ that is not listed would otherwise meet go.work and fail).
go_mod_env() {
  if go_members | grep -qxF "$1"; then echo "GOWORK=$GO_WORK"; else echo "GOWORK=off"; fi
}

# go_in MODDIR ARGS...: run `go ARGS...` in MODDIR, in the workspace where MODDIR is a member
# (GO_NICE=N: at that niceness, for builds that run beside the tests).
go_in() {
  local dir=$1; shift
  (cd "$dir" && env "$(go_mod_env "$dir")" ${GO_NICE:+nice -n "$GO_NICE"} "$GO" "$@")
}

# go_download MODDIR: fetch a module's dependencies ahead of its build (the one network step). In
# the workspace `go build` fetches what the packages it builds need: downloading the whole build
# list would ask for modules no build here uses (some of which the checksum database cannot serve).
go_download() {
  go_members | grep -qxF "$1" && return 0
  go_in "$1" mod download
}
