#!/usr/bin/env bash
# PID 1 of one member (control plane or node) of the real-node cluster: scripts/cluster/cluster.sh
# starts it as
#   nsenter --net=/run/netns/NS unshare --mount --propagation private --pid --fork --mount-proc \
#     --kill-child=TERM supervise.sh MEMBER_DIR
# so everything it starts (and every shim and container those start) lives in this PID namespace:
# when this script ends, the kernel kills them all, and the private mount namespace (tmpfs /run,
# the bind mounts below, kubelet's volume mounts) goes with them. Nothing here touches the host.
#
# MEMBER_DIR holds:
#   binds          lines "SOURCE TARGET": bind mounts made first (SOURCE created if missing)
#   run.d/NN-x.sh  started in name order, output to log/x.log; a NN-x.sh that ends in .once.sh is
#                  run to completion (must succeed); NN-x.ready, if present, is polled (deadline
#                  READY_TIMEOUT s) before the next one starts
# It writes supervisor.pid (its PID as the host sees it is the caller's business), pids (name pid,
# PIDs of this namespace) and ready (once all are started), and on SIGTERM stops the children
# (TERM, then KILL after STOP_TIMEOUT s) and exits.
set -euo pipefail
dir=$1
READY_TIMEOUT=${READY_TIMEOUT:-90}
STOP_TIMEOUT=${STOP_TIMEOUT:-3}
me="supervise[$(basename "$dir")]"
log() { printf '%s [%s] %s\n' "$(date +%H:%M:%S.%N | cut -c1-12)" "$me" "$*"; }

pids=()
stop() {
  trap - TERM INT
  log "stopping ${#pids[@]} processes"
  ((${#pids[@]})) && kill -TERM "${pids[@]}" 2>/dev/null || true
  local end=$((SECONDS + STOP_TIMEOUT)) p alive
  while ((SECONDS < end)); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  log "exiting (the kernel kills what is left in this PID namespace)"
  exit 0
}
trap stop TERM INT

# a private /run (containerd's and runc's state, pod netns mounts, xtables.lock) and the binds
mount -t tmpfs -o mode=0755,size=64m tmpfs /run
mount --make-rshared /
if [[ -f "$dir/binds" ]]; then
  while read -r src dst; do
    [[ -n "$src" ]] || continue
    mkdir -p "$src"
    mount --bind "$src" "$dst"
  done < "$dir/binds"
fi
mkdir -p "$dir/log"
: > "$dir/pids"

for run in "$dir"/run.d/*.sh; do
  name=$(basename "$run" .sh); name=${name#*-}; name=${name%.once}
  if [[ $run == *.once.sh ]]; then
    log "running $name"
    "$run" >> "$dir/log/$name.log" 2>&1 || { log "$name failed: see $dir/log/$name.log"; stop; }
    continue
  fi
  log "starting $name"
  "$run" >> "$dir/log/$name.log" 2>&1 &
  pids+=($!)
  echo "$name $!" >> "$dir/pids"
  ready=${run%.sh}.ready
  if [[ -f $ready ]]; then
    end=$((SECONDS + READY_TIMEOUT))
    until bash "$ready" >/dev/null 2>&1; do
      kill -0 "${pids[-1]}" 2>/dev/null || { log "$name exited: see $dir/log/$name.log"; stop; }
      ((SECONDS < end)) || { log "$name not ready after ${READY_TIMEOUT}s: see $dir/log/$name.log"; stop; }
      sleep 0.2
    done
    log "$name ready"
  fi
done
echo ok > "$dir/ready"
log "all started"
# Idle as PID 1 (bash reaps orphans) until every child is gone or SIGTERM arrives.
wait || true
log "all children exited"
