#!/usr/bin/env bash
# A real two-node Kubernetes cluster on this one machine, up and down with one command.
#
#   scripts/cluster/cluster.sh up                 build what is missing, start, wait until usable
#   scripts/cluster/cluster.sh down [--purge]     stop everything, leave the host clean (idempotent);
#                                                 --purge also drops the nodes' image stores
#   scripts/cluster/cluster.sh status             print what runs; exit 0 when the cluster is up
#   scripts/cluster/cluster.sh env                print `export KUBECONFIG=...` (host kubectl/python)
#   scripts/cluster/cluster.sh load-image ARCHIVE import a docker/OCI archive into both nodes
#   scripts/cluster/cluster.sh kill-container NODE ID  SIGKILL a container (a crash, for fault tests)
#   scripts/cluster/cluster.sh stop-node NODE     SIGKILL a node's kubelet, containerd and every
#                                                 container at once (a node lost, for fault tests)
#   scripts/cluster/cluster.sh start-node NODE    start a stopped node again, wait until Ready
#
# Layout (each member in its own network namespace, its own PID + private mount namespace with
# scripts/cluster/supervise.sh as PID 1):
#   spc-cp   etcd, kube-apiserver v1.37.2 (Node+RBAC, ServiceAccount tokens, default admission incl.
#            PodSecurity), kube-controller-manager (default controllers), kube-scheduler, CoreDNS
#            (cluster DNS; Service kube-system/kube-dns ClusterIP $DNS_IP, endpoint = this process);
#            a bridge joining the nodes: $CP_IP/24
#   spc-n1/2 containerd 2.x (own root/state, restrict_oom_score_adj, sandbox = a static pause),
#            kubelet (cgroupfs, failCgroupV1: false, cgroupRoot /spectrain-nN), kube-proxy (iptables),
#            CNI bridge + host-local on the node's pod CIDR; node IPs $NODE_NET.11/.12, routes to the
#            other node's pod CIDR
# The host gets ONE veth pair (spc-h0, $HOST_IP/30) to reach the apiserver at $CP_HOST_IP:6443;
# nothing else touches the host's network. Binaries: scripts/build-kube-current.sh (control plane)
# and scripts/cluster/build.sh (node parts), both cached under ~/.cache/spectrain.
# State: $SPECTRAIN_CLUSTER_DIR (default ~/.cache/spectrain/cluster-run), removed by `down`, which
# keeps the processes' logs of that run in $SPECTRAIN_CLUSTER_DIR.last-logs/. Node images:
# $SPECTRAIN_CLUSTER_IMAGES (default ~/.cache/spectrain/cluster-containerd), kept until `down --purge`.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/scripts/cluster"
STATE=${SPECTRAIN_CLUSTER_DIR:-${KUBE_CURRENT_CACHE:-$HOME/.cache/spectrain}/cluster-run}
# Addresses: private ranges, used only inside this cluster's namespaces (+ the host end of the link).
NODE_NET=10.213.0          # cp bridge .1, nodes .11 .12
CP_IP=$NODE_NET.1
HOST_IP=10.213.1.1         # host end of the one veth pair
CP_HOST_IP=10.213.1.2      # the apiserver as the host sees it
POD_NET=10.214             # cluster CIDR $POD_NET.0.0/16, node N: $POD_NET.N.0/24
SERVICE_CIDR=10.215.0.0/16
KUBE_SVC_IP=10.215.0.1
DNS_IP=10.215.0.10
DOMAIN=cluster.local
NODES=(1 2)
# A node whose kubelet stops renewing its Lease is NotReady (and tainted unreachable) after
# NODE_GRACE_S; the kubelet renews every quarter of NODE_LEASE_S. Kubernetes' defaults are 50 s and
# 40 s: shorter here so the node-loss test does not wait a minute for the taint.
NODE_GRACE_S=30
NODE_LEASE_S=20
UP_TIMEOUT=${UP_TIMEOUT:-120}
# Each node's containerd root (its images) outlives `down`, so loaded images (GBs) need neither a
# re-import at the next `up` nor a slow delete at `down`; a node restarts on it like after a reboot
# (kubelet removes the previous run's containers). `down --purge` removes it too.
IMAGE_STORE=${SPECTRAIN_CLUSTER_IMAGES:-${KUBE_CURRENT_CACHE:-$HOME/.cache/spectrain}/cluster-containerd}

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] ERROR: %s\n' "$*" >&2; exit 1; }
now_ms() { date +%s%3N; }

# wait_for DESC TIMEOUT_S CMD...: poll CMD (0.2 s apart) until it succeeds or the deadline passes
wait_for() {
  local desc=$1 t=$2 end; shift 2
  end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) < end )) || { log "timed out after ${t}s waiting for $desc"; return 1; }
    sleep 0.2
  done
}

node_name() { echo "spectrain-n$1"; }
ns_of() { case $1 in cp) echo spc-cp ;; *) echo "spc-n$1" ;; esac; }
member_dir() { case $1 in cp) echo "$STATE/cp" ;; *) echo "$STATE/n$1" ;; esac; }

bins() {
  KBIN=$(bash "$ROOT/scripts/build-kube-current.sh" --print-bin)
  mapfile -t NB < <(bash "$HERE/build.sh" --print-bin)
  NKBIN=${NB[0]} CBIN=${NB[1]} DBIN=${NB[2]} PBIN=${NB[3]} RBIN=${NB[4]}
}

have_bins() {
  local f
  for f in "$KBIN"/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler} "$NKBIN"/{kubelet,kube-proxy} \
           "$CBIN"/{containerd,containerd-shim-runc-v2,ctr} "$DBIN/coredns" "$PBIN/pause.tar"; do
    [[ -x $f || -f $f ]] || return 1
  done
  [[ -f "$KBIN/.stamp" && -f "$NKBIN/.stamp" && -f "$CBIN/.stamp" && -f "$DBIN/.stamp" && -f "$PBIN/.stamp" ]]
}

ctr_in() {  # ctr_in N ARGS...: ctr against node N's containerd, inside its namespaces
  local n=$1 sup; shift
  sup=$(cat "$(member_dir "$n")/supervisor.hostpid")
  nsenter -t "$sup" -n -m -p -- "$CBIN/ctr" --address /run/containerd/containerd.sock "$@"
}

kc() { kubectl --kubeconfig "$STATE/admin.kubeconfig" "$@"; }

# ---------------------------------------------------------------------------------------------
# down: stop every member (TERM to its supervisor, KILL after a deadline), then remove netns,
# the host veth, the node cgroups and the state directory. Safe with nothing running.
# ---------------------------------------------------------------------------------------------
cgroup_roots() {
  local n h
  for n in "${NODES[@]}"; do
    for h in /sys/fs/cgroup/*/; do
      [[ -d "$h/spectrain-n$n" ]] && echo "${h%/}/spectrain-n$n"
    done
  done
  return 0
}

down() {
  local t0 m sup ns pid end d
  t0=$(now_ms)
  for m in "${NODES[@]}" cp; do
    d=$(member_dir "$m")
    sup=$(cat "$d/supervisor.hostpid" 2>/dev/null || true)
    if [[ -n "$sup" ]] && kill -0 "$sup" 2>/dev/null && grep -q supervise "/proc/$sup/cmdline" 2>/dev/null; then
      kill -TERM "$sup" 2>/dev/null || true
    fi
  done
  for m in "${NODES[@]}" cp; do
    d=$(member_dir "$m")
    sup=$(cat "$d/supervisor.hostpid" 2>/dev/null || true)
    [[ -n "$sup" ]] || continue
    if ! wait_for "supervisor $m" 15 bash -c "! kill -0 $sup"; then
      log "supervisor of $m (pid $sup) ignored TERM: KILL"
      kill -KILL "$sup" 2>/dev/null || true
    fi
  done
  log "supervisors stopped at $(( $(now_ms) - t0 )) ms"
  # anything else still inside our network namespaces (a leftover of a crash): KILL it
  for m in "${NODES[@]}" cp; do
    ns=$(ns_of "$m")
    [[ -e /run/netns/$ns ]] || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    wait_for "processes of $ns" 15 bash -c "[[ -z \"\$(ip netns pids $ns 2>/dev/null)\" ]]" \
      || log "WARNING: processes still in $ns: $(ip netns pids "$ns" | tr '\n' ' ')"
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del spc-h0 2>/dev/null || true
  log "namespaces removed at $(( $(now_ms) - t0 )) ms"
  # node cgroups, deepest first, once their tasks have gone
  local roots
  roots=$(cgroup_roots)
  if [[ -n "$roots" ]]; then
    if ! wait_for "node cgroups removed" 20 bash -c '
        for r in '"$(echo $roots)"'; do
          [[ -d $r ]] || continue
          find "$r" -depth -type d -exec rmdir {} + 2>/dev/null
          [[ -d $r ]] && exit 1
        done; exit 0'; then
      log "WARNING: cgroups left: $(cgroup_roots | tr '\n' ' ')"
    fi
  fi
  log "cgroups removed at $(( $(now_ms) - t0 )) ms"
  if [[ -d "$STATE" ]]; then  # keep the logs of the last run next to the state (debugging a failed test)
    rm -rf "$STATE.last-logs"; mkdir -p "$STATE.last-logs"
    for d in "$STATE"/cp "$STATE"/n*; do
      [[ -d "$d" ]] || continue
      mkdir -p "$STATE.last-logs/${d##*/}"
      cp -r "$d"/log "$d"/supervisor.log "$STATE.last-logs/${d##*/}/" 2>/dev/null || true
    done
  fi
  rm -rf "$STATE"
  if [[ ${1:-} == --purge ]]; then rm -rf "$IMAGE_STORE"; log "removed the image stores $IMAGE_STORE"; fi
  log "down in $(( $(now_ms) - t0 )) ms"
}

# ---------------------------------------------------------------------------------------------
# up
# ---------------------------------------------------------------------------------------------
certs() {  # CA, apiserver serving, apiserver->kubelet client, kubelet serving per node, SA keys
  local p=$STATE/pki n
  mkdir -p "$p"
  openssl_quiet() { openssl "$@" 2>/dev/null; }
  openssl_quiet ecparam -name prime256v1 -genkey -noout -out "$p/ca.key"
  openssl_quiet req -x509 -new -key "$p/ca.key" -subj /CN=spectrain-cluster-ca -days 30 -out "$p/ca.crt"
  issue() {  # issue NAME SUBJECT [SAN]
    openssl_quiet ecparam -name prime256v1 -genkey -noout -out "$p/$1.key"
    openssl_quiet req -new -key "$p/$1.key" -subj "$2" -out "$p/$1.csr"
    if [[ -n "${3:-}" ]]; then printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$p/$1.ext"
    else printf 'extendedKeyUsage=clientAuth\n' > "$p/$1.ext"; fi
    openssl_quiet x509 -req -in "$p/$1.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial -days 30 \
      -extfile "$p/$1.ext" -out "$p/$1.crt"
  }
  issue apiserver /CN=kube-apiserver \
    "IP:$CP_IP,IP:$CP_HOST_IP,IP:$KUBE_SVC_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.$DOMAIN,DNS:localhost"
  issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  for n in "${NODES[@]}"; do issue "kubelet-n$n" "/CN=$(node_name "$n")" "IP:$NODE_NET.1$n,DNS:$(node_name "$n")"; done
  openssl_quiet genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$p/sa.key"
  openssl_quiet pkey -in "$p/sa.key" -pubout -out "$p/sa.pub"
  [[ -s "$p/sa.pub" && -s "$p/kubelet-n2.crt" ]] || die "openssl failed to write the cluster certificates into $p"
}

kubeconfig() {  # kubeconfig FILE SERVER TOKEN
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: spectrain
  cluster: {server: "$2", certificate-authority: "$STATE/pki/ca.crt"}
users:
- name: u
  user: {token: "$3"}
contexts:
- name: spectrain
  context: {cluster: spectrain, user: u}
current-context: spectrain
EOF
}

write_cp() {
  local d=$STATE/cp r
  mkdir -p "$d/run.d" "$d/etcd"
  r=$d/run.d
  cat > "$r/10-etcd.sh" <<EOF
#!/bin/sh
exec "$KBIN/etcd" --name default --data-dir "$d/etcd" --listen-client-urls http://127.0.0.1:2379 \\
  --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \\
  --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster default=http://127.0.0.1:2380 \\
  --unsafe-no-fsync --log-level warn
EOF
  echo "curl -fsS http://127.0.0.1:2379/health" > "$r/10-etcd.ready"
  cat > "$r/20-kube-apiserver.sh" <<EOF
#!/bin/sh
exec "$KBIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \\
  --bind-address=0.0.0.0 --advertise-address=$CP_IP --secure-port=6443 \\
  --tls-cert-file=$STATE/pki/apiserver.crt --tls-private-key-file=$STATE/pki/apiserver.key \\
  --client-ca-file=$STATE/pki/ca.crt --token-auth-file=$STATE/tokens.csv \\
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \\
  --service-cluster-ip-range=$SERVICE_CIDR \\
  --service-account-issuer=https://kubernetes.default.svc.$DOMAIN \\
  --service-account-key-file=$STATE/pki/sa.pub --service-account-signing-key-file=$STATE/pki/sa.key \\
  --kubelet-client-certificate=$STATE/pki/apiserver-kubelet-client.crt \\
  --kubelet-client-key=$STATE/pki/apiserver-kubelet-client.key \\
  --kubelet-certificate-authority=$STATE/pki/ca.crt --kubelet-preferred-address-types=InternalIP \\
  --allow-privileged=true --profiling=false --cert-dir=$d/apiserver-certs --v=1
EOF
  echo "curl -fsS --cacert $STATE/pki/ca.crt -H 'Authorization: Bearer $ADMIN_TOKEN' https://127.0.0.1:6443/readyz" \
    > "$r/20-kube-apiserver.ready"
  cat > "$r/30-kube-controller-manager.sh" <<EOF
#!/bin/sh
exec "$KBIN/kube-controller-manager" --kubeconfig=$d/controller-manager.kubeconfig \\
  --use-service-account-credentials=true --service-account-private-key-file=$STATE/pki/sa.key \\
  --root-ca-file=$STATE/pki/ca.crt --leader-elect=false --secure-port=0 \\
  --node-monitor-grace-period=${NODE_GRACE_S}s --v=1
EOF
  cat > "$r/40-kube-scheduler.sh" <<EOF
#!/bin/sh
exec "$KBIN/kube-scheduler" --kubeconfig=$d/scheduler.kubeconfig --leader-elect=false --secure-port=0 --v=1
EOF
  cat > "$r/50-bootstrap.once.sh" <<EOF
#!/bin/sh
set -e
"$(command -v kubectl)" --kubeconfig=$d/admin-local.kubeconfig apply -f $d/bootstrap.yaml
EOF
  cat > "$r/60-coredns.sh" <<EOF
#!/bin/sh
exec "$DBIN/coredns" -conf $d/Corefile
EOF
  echo "curl -fsS http://127.0.0.1:8181/ready" > "$r/60-coredns.ready"
  cat > "$d/Corefile" <<EOF
$DOMAIN:53 in-addr.arpa:53 ip6.arpa:53 {
    bind $CP_IP
    errors
    ready 127.0.0.1:8181
    kubernetes $DOMAIN in-addr.arpa ip6.arpa {
        kubeconfig $d/coredns.kubeconfig spectrain
        pods insecure
        ttl 5
    }
    cache 5
}
.:53 {
    bind $CP_IP
    errors
    # nothing leaves the cluster: every other name is NXDOMAIN (so resolvers go on with their
    # search list instead of stopping at REFUSED)
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF
  cat > "$d/bootstrap.yaml" <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "spectrain:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "spectrain:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "spectrain:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "spectrain:kube-router"}
rules:
- apiGroups: [""]
  resources: [namespaces, pods, services, nodes, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "spectrain:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "spectrain:kube-router"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-router"}]
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  clusterIP: $DNS_IP
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-coredns
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: spectrain-cluster}
addressType: IPv4
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
endpoints:
- addresses: ["$CP_IP"]
  conditions: {ready: true}
EOF
  kubeconfig "$d/admin-local.kubeconfig" https://127.0.0.1:6443 "$ADMIN_TOKEN"
  kubeconfig "$d/controller-manager.kubeconfig" https://127.0.0.1:6443 "$CM_TOKEN"
  kubeconfig "$d/scheduler.kubeconfig" https://127.0.0.1:6443 "$SCHED_TOKEN"
  kubeconfig "$d/coredns.kubeconfig" https://127.0.0.1:6443 "$DNS_TOKEN"
  chmod +x "$r"/*.sh
}

write_node() {
  local n=$1 d r name ip cidr
  d=$(member_dir "$n"); r=$d/run.d; name=$(node_name "$n"); ip=$NODE_NET.1$n; cidr=$POD_NET.$n.0/24
  mkdir -p "$r" "$d/cni/net.d" "$d/containerd" "$d/kubelet" "$d/varlib/cni" "$d/varlog"
  printf '%s /var/lib\n%s /var/log\n' "$d/varlib" "$d/varlog" > "$d/binds"
  cat > "$d/containerd/config.toml" <<EOF
version = 3
root = "$IMAGE_STORE/n$n"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$d/cni/net.d"
[plugins.'io.containerd.snapshotter.v1.overlayfs']
  # throwaway containers: no syncfs of the host filesystem when a container's rootfs is unmounted
  mount_options = ["volatile"]
[plugins.'io.containerd.cri.v1.images']
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$(cat "$PBIN/pause.image")"
EOF
  cat > "$d/cni/net.d/10-spectrain.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "spectrain",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$d/cni/ipam",
              "ranges": [[{"subnet": "$cidr", "gateway": "$POD_NET.$n.1"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  cat > "$d/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /spectrain-n$n
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $STATE/pki/kubelet-n$n.crt
tlsPrivateKeyFile: $STATE/pki/kubelet-n$n.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: Webhook}
clusterDNS: [$DNS_IP]
clusterDomain: $DOMAIN
resolvConf: ""
podCIDR: $cidr
podLogsDir: $d/pod-logs
volumePluginDir: $d/volume-plugins
failSwapOn: false
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: 100Mi, nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
serializeImagePulls: false
nodeStatusUpdateFrequency: 4s
nodeLeaseDurationSeconds: $NODE_LEASE_S
syncFrequency: 10s
fileCheckFrequency: 60s
maxPods: 60
EOF
  cat > "$d/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $d/kube-proxy.kubeconfig}
mode: iptables
hostnameOverride: $name
clusterCIDR: $POD_NET.0.0/16
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
iptables: {masqueradeAll: true, syncPeriod: 30s, minSyncPeriod: 0s}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  kubeconfig "$d/kubelet.kubeconfig" "https://$CP_IP:6443" "$(node_token "$n")"
  kubeconfig "$d/kube-proxy.kubeconfig" "https://$CP_IP:6443" "$PROXY_TOKEN"
  kubeconfig "$d/kube-router.kubeconfig" "https://$CP_IP:6443" "$ROUTER_TOKEN"
  cat > "$r/10-containerd.sh" <<EOF
#!/bin/sh
export PATH="$CBIN:\$PATH"
exec "$CBIN/containerd" --config "$d/containerd/config.toml" --log-level warn
EOF
  echo "\"$CBIN/ctr\" --address /run/containerd/containerd.sock version" > "$r/10-containerd.ready"
  cat > "$r/20-pause-image.once.sh" <<EOF
#!/bin/sh
set -e
"$CBIN/ctr" --address /run/containerd/containerd.sock -n k8s.io images import "$PBIN/pause.tar"
EOF
  cat > "$r/30-kubelet.sh" <<EOF
#!/bin/sh
exec "$NKBIN/kubelet" --config=$d/kubelet/config.yaml --kubeconfig=$d/kubelet.kubeconfig \\
  --root-dir=$d/kubelet/root --cert-dir=$d/kubelet/pki --hostname-override=$name --node-ip=$ip --v=1
EOF
  cat > "$r/40-kube-proxy.sh" <<EOF
#!/bin/sh
exec "$NKBIN/kube-proxy" --config=$d/kube-proxy.yaml --v=1
EOF
  if [[ $NETPOL == 1 ]]; then  # NetworkPolicy enforcement, firewall only (no routing, no proxy)
    cat > "$r/50-kube-router.sh" <<EOF
#!/bin/sh
exec "$RBIN/kube-router" --kubeconfig=$d/kube-router.kubeconfig --hostname-override=$name \\
  --run-firewall=true --run-router=false --run-service-proxy=false --run-loadbalancer=false \\
  --enable-cni=false --service-cluster-ip-range=$SERVICE_CIDR --metrics-port=0 --health-port=20244 --v=1
EOF
    echo "curl -fsS http://127.0.0.1:20244/healthz" > "$r/50-kube-router.ready"
  fi
  chmod +x "$r"/*.sh
}

node_token() { local v="N${1}_TOKEN"; echo "${!v}"; }

network() {  # namespaces, the cp bridge, node links, the host link, routes
  local n ns peer
  ip netns add spc-cp
  ip -n spc-cp link set lo up
  ip -n spc-cp link add spcbr0 type bridge
  ip -n spc-cp addr add "$CP_IP/24" dev spcbr0
  ip -n spc-cp link set spcbr0 up
  ip link add spc-h0 type veth peer name spc-host
  ip link set spc-host netns spc-cp
  ip addr add "$HOST_IP/30" dev spc-h0
  ip link set spc-h0 up
  ip -n spc-cp addr add "$CP_HOST_IP/30" dev spc-host
  ip -n spc-cp link set spc-host up
  for n in "${NODES[@]}"; do
    ns=$(ns_of "$n")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n spc-cp link add "vn$n" type veth peer name eth0 netns "$ns"
    ip -n spc-cp link set "vn$n" master spcbr0 up
    ip -n "$ns" addr add "$NODE_NET.1$n/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n spc-cp route add "$POD_NET.$n.0/24" via "$NODE_NET.1$n"
    # Service VIPs: routable in the node (DNAT happens before delivery), never leave it
    ip -n "$ns" route add "$SERVICE_CIDR" dev eth0
    ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.route_localnet=1
    ip netns exec "$ns" sh -c 'for f in /proc/sys/net/bridge/bridge-nf-call-iptables; do [ -w $f ] && echo 1 > $f; done; true'
  done
  for n in "${NODES[@]}"; do
    for peer in "${NODES[@]}"; do
      [[ $peer == "$n" ]] || ip -n "$(ns_of "$n")" route add "$POD_NET.$peer.0/24" via "$NODE_NET.1$peer"
    done
  done
}

cgroups() {  # a cgroupRoot per node in every v1 hierarchy, cpuset filled
  local n h
  for n in "${NODES[@]}"; do
    for h in /sys/fs/cgroup/*/; do
      h=${h%/}
      [[ -f "$h/cgroup.procs" && ! -f "$h/cgroup.controllers" ]] || continue  # v1 hierarchies only
      mkdir -p "$h/spectrain-n$n"
      if [[ -f "$h/cpuset.cpus" ]]; then
        cat "$h/cpuset.cpus" > "$h/spectrain-n$n/cpuset.cpus"
        cat "$h/cpuset.mems" > "$h/spectrain-n$n/cpuset.mems"
      fi
    done
  done
}

start_member() {  # start_member M: its supervisor, detached; records the host PID
  local m=$1 d ns pid
  d=$(member_dir "$m"); ns=$(ns_of "$m")
  setsid nsenter --net="/run/netns/$ns" unshare --mount --propagation private --pid --fork --mount-proc \
    --kill-child=TERM bash "$HERE/supervise.sh" "$d" > "$d/supervisor.log" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > "$d/unshare.hostpid"
  # the supervisor is unshare's only child
  wait_for "supervisor of $m" 10 pgrep -P "$pid" || true
  local sup; sup=$(pgrep -P "$pid" | head -n1)
  [[ -n "$sup" ]] || die "the supervisor of $m did not start: see $d/supervisor.log"
  echo "$sup" > "$d/supervisor.hostpid"
}

wait_member() {  # wait_member M TIMEOUT: until it wrote `ready`, failing fast if it died
  local m=$1 t=$2 d sup end
  d=$(member_dir "$m"); sup=$(cat "$d/supervisor.hostpid")
  end=$(( $(date +%s) + t ))
  until [[ -f "$d/ready" ]]; do
    kill -0 "$sup" 2>/dev/null || { tail -n 20 "$d/supervisor.log" >&2; die "$m stopped while starting: see $d/supervisor.log and $d/log/"; }
    (( $(date +%s) < end )) || die "$m not ready after ${t}s: see $d/supervisor.log and $d/log/"
    sleep 0.2
  done
}

nodes_ready() {
  local out
  out=$(kc get nodes -o jsonpath='{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}') || return 1
  local n
  for n in "${NODES[@]}"; do grep -qx "$(node_name "$n")=True" <<<"$out" || return 1; done
}

is_up() {
  local m sup
  [[ -f "$STATE/admin.kubeconfig" ]] || return 1
  for m in cp "${NODES[@]}"; do
    sup=$(cat "$(member_dir "$m")/supervisor.hostpid" 2>/dev/null) || return 1
    kill -0 "$sup" 2>/dev/null || return 1
  done
  kc get --raw /readyz >/dev/null 2>&1 && nodes_ready
}

up() {
  local t0 m n
  t0=$(now_ms)
  [[ $(id -u) == 0 ]] || die "needs root (network namespaces, cgroups, mounts)"
  bins
  if ! have_bins; then
    log "building what is missing (first time: ~20 min on 2 cores)"
    [[ -f "$KBIN/.stamp" ]] || nice -n 10 bash "$ROOT/scripts/build-kube-current.sh" >&2
    nice -n 10 bash "$HERE/build.sh" >&2
    bins
    have_bins || die "binaries still missing after the builds (see above)"
  fi
  command -v kubectl >/dev/null || die "kubectl not found on PATH (Debian: apt-get install kubectl, or the Google Cloud SDK's)"
  for c in nsenter unshare ip iptables /usr/sbin/runc /usr/lib/cni/bridge openssl curl; do
    command -v "$c" >/dev/null || die "$c missing: run scripts/cluster/build.sh (it apt-installs runc, containernetworking-plugins, iptables, ...)"
  done
  if is_up; then log "already up ($STATE)"; print_env; return 0; fi
  if [[ -d "$STATE" || -e /run/netns/spc-cp ]]; then log "stale state: down first"; down; fi
  mkdir -p "$STATE"
  trap 'rc=$?; if ((rc)); then log "up failed (rc=$rc): logs in $STATE/*/log; run: $0 down"; fi' EXIT

  tok() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
  ADMIN_TOKEN=$(tok) CM_TOKEN=$(tok) SCHED_TOKEN=$(tok) PROXY_TOKEN=$(tok) DNS_TOKEN=$(tok)
  # shellcheck disable=SC2034  # N<n>_TOKEN are read through node_token
  N1_TOKEN=$(tok) N2_TOKEN=$(tok) ROUTER_TOKEN=$(tok)
  # NetworkPolicy engine: on when kube-router is built, unless SPECTRAIN_CLUSTER_NETPOL=0
  NETPOL=0
  [[ -x "$RBIN/kube-router" && ${SPECTRAIN_CLUSTER_NETPOL:-1} != 0 ]] && NETPOL=1
  {
    echo "$ADMIN_TOKEN,spectrain-admin,uid-admin,\"system:masters\""
    echo "$CM_TOKEN,system:kube-controller-manager,uid-cm"
    echo "$SCHED_TOKEN,system:kube-scheduler,uid-sched"
    echo "$PROXY_TOKEN,system:kube-proxy,uid-proxy"
    echo "$DNS_TOKEN,system:coredns,uid-coredns"
    echo "$ROUTER_TOKEN,system:kube-router,uid-router"
    for n in "${NODES[@]}"; do echo "$(node_token "$n"),system:node:$(node_name "$n"),uid-n$n,\"system:nodes\""; done
  } > "$STATE/tokens.csv"
  chmod 600 "$STATE/tokens.csv"
  certs
  kubeconfig "$STATE/admin.kubeconfig" "https://$CP_HOST_IP:6443" "$ADMIN_TOKEN"
  chmod 600 "$STATE/admin.kubeconfig"
  write_cp
  for n in "${NODES[@]}"; do write_node "$n"; done
  network
  cgroups
  log "network + config in $(( $(now_ms) - t0 )) ms; starting the control plane"
  start_member cp
  for n in "${NODES[@]}"; do start_member "$n"; done
  wait_member cp "$UP_TIMEOUT"
  log "control plane ready at $(( $(now_ms) - t0 )) ms"
  for n in "${NODES[@]}"; do wait_member "$n" "$UP_TIMEOUT"; done
  wait_for "nodes Ready" "$UP_TIMEOUT" nodes_ready || die "nodes not Ready after ${UP_TIMEOUT}s: see $STATE/n*/log/kubelet.log"
  for n in "${NODES[@]}"; do  # the node's pod CIDR, as IPAM would have set it (NetworkPolicy engines read it)
    kc patch node "$(node_name "$n")" --type merge \
      -p "{\"spec\":{\"podCIDR\":\"$POD_NET.$n.0/24\",\"podCIDRs\":[\"$POD_NET.$n.0/24\"]}}" >/dev/null \
      || die "could not set the pod CIDR of $(node_name "$n")"
  done
  wait_for "default ServiceAccount" "$UP_TIMEOUT" kc -n default get serviceaccount default \
    || die "no default ServiceAccount after ${UP_TIMEOUT}s: see $STATE/cp/log/kube-controller-manager.log"
  trap - EXIT
  log "up in $(( $(now_ms) - t0 )) ms: $(kc get nodes --no-headers | awk '{print $1 "=" $2}' | tr '\n' ' ')"
  print_env
}

print_env() { echo "export KUBECONFIG=$STATE/admin.kubeconfig"; }

status() {
  local m sup d
  for m in cp "${NODES[@]}"; do
    d=$(member_dir "$m")
    sup=$(cat "$d/supervisor.hostpid" 2>/dev/null || true)
    if [[ -n "$sup" ]] && kill -0 "$sup" 2>/dev/null; then
      echo "$m: supervisor pid $sup, $(ip netns pids "$(ns_of "$m")" 2>/dev/null | wc -l) processes"
    else
      echo "$m: not running"
    fi
  done
  if is_up; then kc get nodes -o wide; echo "up"; else echo "down (or not healthy)"; return 1; fi
}

# The image names a docker-archive carries (manifest.json RepoTags), as containerd names them
# (docker.io/ and library/ added to short names).
archive_names() {
  tar -xOf "$1" manifest.json 2>/dev/null | python3 -c '
import json, sys
for m in json.load(sys.stdin):
    for t in m.get("RepoTags") or []:
        first = t.split("/")[0]
        if "/" not in t:
            t = "docker.io/library/" + t
        elif "." not in first and ":" not in first and first != "localhost":
            t = "docker.io/" + t
        print(t)' || true
}

load_image() {
  local archive=$1 n t0
  [[ -f "$archive" ]] || die "no such archive: $archive"
  bins
  is_up || die "the cluster is not up: run $0 up"
  t0=$(now_ms)
  # The node image stores outlive `down`: an archive imported before (same path, size and mtime:
  # the image scripts rewrite an archive only when they rebuild it) is not read again, as long as
  # the node still has its images (a kubelet under disk pressure garbage-collects unused images).
  # Layers are unpacked, then dropped from the content store: a node holds an image once.
  local key stamp pids=() rc=0 todo=() names have name
  key="$(readlink -f "$archive") $(stat -c '%s %Y' "$archive")"
  names=$(archive_names "$archive")
  for n in "${NODES[@]}"; do
    stamp="$IMAGE_STORE/n$n/imported.$(basename "$archive").stamp"
    have=$(ctr_in "$n" -n k8s.io images ls -q 2>/dev/null || true)
    for name in $names; do
      grep -qxF "$name" <<<"$have" || { rm -f "$stamp"; break; }
    done
    [[ "$(cat "$stamp" 2>/dev/null)" == "$key" ]] || todo+=("$n")
  done
  for n in "${todo[@]}"; do  # the nodes that need it, at once
    ( ctr_in "$n" -n k8s.io images import --local --discard-unpacked-layers "$(readlink -f "$archive")" >&2 \
        && echo "$key" > "$IMAGE_STORE/n$n/imported.$(basename "$archive").stamp" ) &
    pids+=($!)
  done
  for n in "${!pids[@]}"; do wait "${pids[$n]}" || rc=1; done
  ((rc == 0)) || die "ctr images import failed on a node (see above): is $archive a docker or OCI archive?"
  log "imported $archive into ${#todo[@]} of ${#NODES[@]} nodes (the others had it) in $(( $(now_ms) - t0 )) ms"
}

kill_container() {  # kill_container NODE CONTAINER_ID: SIGKILL a container's task, as a crash would
  local node=$1 id=${2#containerd://} n
  n=${node#spectrain-n}
  [[ " ${NODES[*]} " == *" $n "* ]] || die "no node $node (spectrain-n1 or spectrain-n2)"
  is_up || die "the cluster is not up: run $0 up"
  bins
  ctr_in "$n" -n k8s.io tasks kill -s SIGKILL "$id" >&2 || die "ctr tasks kill $id on $node failed (see above)"
}

node_index() {  # node_index NODE: N of spectrain-nN, or die
  local n=${1#spectrain-n}
  [[ " ${NODES[*]} " == *" $n "* ]] || die "no node $1 (spectrain-n1 or spectrain-n2)"
  echo "$n"
}

stop_node() {  # stop_node NODE: KILL its PID 1: the kernel kills kubelet, containerd and every container
  local n sup d
  n=$(node_index "$1"); d=$(member_dir "$n")
  is_up || die "the cluster is not up: run $0 up"
  sup=$(cat "$d/supervisor.hostpid")
  kill -KILL "$sup"
  wait_for "node $1's processes gone" 30 bash -c "! kill -0 $(cat "$d/unshare.hostpid") 2>/dev/null" \
    || die "node $1's namespace did not end after its PID 1 was killed"
  rm -f "$d/ready"
  log "stopped $1 (its Node object turns NotReady after ${NODE_GRACE_S}s)"
}

start_node() {  # start_node NODE: a stopped node again, on its state and image store, until Ready
  local n d
  n=$(node_index "$1"); d=$(member_dir "$n")
  [[ -f "$STATE/admin.kubeconfig" ]] || die "the cluster is not up: run $0 up"
  if [[ -f "$d/ready" ]] && kill -0 "$(cat "$d/supervisor.hostpid")" 2>/dev/null; then log "$1 runs"; return 0; fi
  bins
  start_member "$n"
  wait_member "$n" "$UP_TIMEOUT"
  wait_for "$1 Ready" "$UP_TIMEOUT" nodes_ready || die "$1 not Ready after ${UP_TIMEOUT}s: see $d/log/kubelet.log"
  log "started $1"
}

case "${1:-}" in
  up) up ;;
  down) down "${2:-}" ;;
  status) status ;;
  env) [[ -f "$STATE/admin.kubeconfig" ]] || die "the cluster is not up: run $0 up"; print_env ;;
  load-image) [[ $# == 2 ]] || die "usage: $0 load-image ARCHIVE"; load_image "$2" ;;
  kill-container) [[ $# == 3 ]] || die "usage: $0 kill-container NODE CONTAINER_ID"; kill_container "$2" "$3" ;;
  stop-node) [[ $# == 2 ]] || die "usage: $0 stop-node NODE"; stop_node "$2" ;;
  start-node) [[ $# == 2 ]] || die "usage: $0 start-node NODE"; start_node "$2" ;;
  -h|--help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
  *) die "unknown command $1 (up|down|status|env|load-image ARCHIVE|kill-container NODE ID|stop-node NODE|start-node NODE)" ;;
esac
