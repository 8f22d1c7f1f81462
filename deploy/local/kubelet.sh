#!/usr/bin/env bash
# One real node for the local Kubernetes control plane (deploy/local/kubernetes.sh): a kubelet and
# containerd + runc, so that pods on it run real containers (kwok's nodes run none). gpupool's
# broker runs a lease's workload there (broker/lending_kubernetes.py).
#
#   deploy/local/kubelet.sh start    start (or find running) containerd and the kubelet against the
#                                    running control plane, import the local images, advertise the
#                                    node's GPUs, wait until the node is Ready; prints the node name
#   deploy/local/kubelet.sh stop     SIGTERM the kubelet, every container of this containerd and
#                                    containerd (SIGKILL after 10 s); delete the Node object
#   deploy/local/kubelet.sh status   exit 0 and print the node name if the node is Ready in the
#                                    running control plane; 1 if not running; 2 if not ready
#
# Environment (defaults):
#   GPUPOOL_STATE (<repo>/.state), GPUPOOL_KUBELET_DIR ($GPUPOOL_STATE/kubelet): state directory
#   GPUPOOL_K8S_DIR ($GPUPOOL_STATE/kubernetes): the control plane whose kubeconfig the kubelet uses
#   GPUPOOL_KUBELET_NODE (gpu-node-run)   the node's name
#   GPUPOOL_K8S_GPUS (8)                  nvidia.com/gpu advertised on it
#   GPUPOOL_K8S_START_TIMEOUT (180)       seconds for each wait of a start
#   GPUPOOL_RUNC (runc on PATH)           the OCI runtime containerd's runc shim runs
#
# The node: kubelet v1.31.14 (deploy/local/kubernetes-build.sh) listening on 127.0.0.1 only (its
# own ports, from deploy/local/ports.py), cgroupfs driver under the cgroup /gpupool-<hash of the
# state dir> (cgroup v1 here: failCgroupV1 false; swap allowed), no kube-proxy, labels
# gpupool.io/workloads=true and nvidia.com/gpu.present=true (Kueue's `gpu` flavor). Its node
# address is the host's (the kubelet refuses a loopback node IP); nothing listens on it. Pods get
# a host-only CNI bridge network (containernetworking-plugins' bridge gpupool-cni0 + host-local,
# subnet 10.244.250.0/24, no masquerade, no port mapping): the host reaches a pod at its pod IP,
# nothing outside the host does. GPUs: the node
# has no GPU and no device plugin; ${GPUPOOL_K8S_GPUS} nvidia.com/gpu are advertised the way
# Kubernetes documents for extended resources (a PATCH of the Node's status capacity), so
# kube-scheduler counts them and nothing is handed to a container.
#
# Images (nothing can be pulled here): built from local files by deploy/local/oci_image.py and
# imported with `ctr images import`, pull policy IfNotPresent:
#   registry.k8s.io/pause:3.10       the sandbox image and gpupool's placeholders: Kubernetes' own
#                                    pause.c (build/pause/linux in the k8s.io/kubernetes module),
#                                    built static by kubernetes-build.sh
#   gpupool.local/workload:1         an empty root (bin, lib, lib64 -> usr/...; /etc/passwd) for a
#                                    workload that mounts the host's /usr and its program read-only
#                                    (hostPath): the local stand-in for a site's image
#
# containerd 1.6 and runc come from Debian (deploy/local/install-system.sh); containerd runs with
# its own root, state, socket and runc root under the state directory. State directory:
# containerd/ (config.toml, root, state, runc), cni/, kubelet/ (config.yaml, root dir, pod logs),
# images/, log/{containerd,kubelet}.log, pid/{containerd,kubelet}.pid, ports.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/service-lib.sh
. "$here/service-lib.sh"
svc=kubelet
state="${GPUPOOL_KUBELET_DIR:-$state_root/kubelet}"
k8s_state="${GPUPOOL_K8S_DIR:-$state_root/kubernetes}"
kubeconfig="$k8s_state/kubeconfig"
[ -x "$py" ] || py=python3
node="${GPUPOOL_KUBELET_NODE:-gpu-node-run}"
gpus="${GPUPOOL_K8S_GPUS:-8}"
start_timeout="${GPUPOOL_K8S_START_TIMEOUT:-180}"
runc="${GPUPOOL_RUNC:-$(command -v runc || echo /usr/sbin/runc)}"
bin="${GPUPOOL_K8S_CACHE:-${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/kubernetes-v1.31.14}/bin"
pidfile="$state/pid/kubelet.pid"
sock="$state/containerd/containerd.sock"
# One cgroup per state dir: two worktrees' kubelets never share kubepods.
cgroup_root="/gpupool-$(printf '%s' "$state" | sha256sum | cut -c1-10)"
PAUSE_IMAGE=registry.k8s.io/pause:3.10
WORKLOAD_IMAGE=gpupool.local/workload:1

_pid() {
    _pid_matching "$bin/kubelet"
}

_containerd_pid() {
    _pid_matching "containerd --config $state/containerd/config.toml" "$state/pid/containerd.pid"
}

_node() {
    # _node COMMAND [ARGS...]: kubernetes_setup.py COMMAND for this node.
    "$py" "$here/kubernetes_setup.py" "$1" --kubeconfig "$kubeconfig" --gpus "$gpus" --node "$node" "${@:2}"
}

_ready() {
    _containerd_pid >/dev/null || return 1
    _node local-node --timeout "$1" --check-only
}

_address() {
    echo "$node"
}

_log_tails() {
    _log_tail "$state/log/containerd.log" "$state/log/kubelet.log"
}

_fail() {
    _log_tails
    _die "$*"
}

_ctr() {
    ctr --address "$sock" --namespace k8s.io "$@"
}

_check_tools() {
    local t
    for t in containerd containerd-shim-runc-v2 runc ctr; do
        command -v "$t" >/dev/null 2>&1 || _die "$t not found (deploy/local/install-system.sh installs containerd and runc)"
    done
    [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
        || _die "CNI plugins not found in /usr/lib/cni (install-system.sh: containernetworking-plugins)"
    [ -x "$bin/kubelet" ] && [ -x "$bin/pause" ] || _die "no kubelet or pause in $bin (deploy/local/kubernetes-build.sh)"
    [ -s "$kubeconfig" ] || _die "no control plane: $kubeconfig missing (deploy/local/kubernetes.sh start first)"
}

_cgroups() {
    # The kubelet's cgroup root must exist: in the unified hierarchy (cgroup v2), or in every
    # cgroup v1 hierarchy (a hybrid host's cgroup2 at /sys/fs/cgroup/unified is not the kubelet's).
    local d
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        mkdir -p "/sys/fs/cgroup${cgroup_root}"
        return
    fi
    for d in /sys/fs/cgroup/*/; do
        case "$d" in */unified/) continue ;; esac
        [ -f "${d}cgroup.procs" ] && mkdir -p "$d${cgroup_root#/}"
    done
}

_write_configs() {
    mkdir -p "$state/containerd" "$state/cni" "$state/kubelet/root" "$state/kubelet/pods-log" "$state/images"
    cat >"$state/containerd/config.toml" <<EOF
# Generated by deploy/local/kubelet.sh at each start: do not edit (edit the script).
version = 2
root = "$state/containerd/root"
state = "$state/containerd/state"
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$state/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # No OOM score below containerd's own: lowering one needs CAP_SYS_RESOURCE, which a container
  # or VM running these services may lack (runc then fails "failed to update /proc/self/oom_score_adj").
  restrict_oom_score_adj = true
  # Pods' network namespaces under the state dir (not /run/netns): the stop unmounts what is left.
  netns_mounts_under_state_dir = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$state/containerd/runc"
        BinaryName = "$runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$state/cni"
EOF
    cat >"$state/cni/10-gpupool.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "gpupool-local",
  "plugins": [
    {"type": "bridge", "bridge": "gpupool-cni0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.250.0/24"}]],
              "dataDir": "$state/cni/ipam"}}
  ]
}
EOF
    cat >"$state/kubelet/config.yaml" <<EOF
# Generated by deploy/local/kubelet.sh at each start: do not edit (edit the script).
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $kubelet_port
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://$sock
cgroupDriver: cgroupfs
cgroupRoot: $cgroup_root
failCgroupV1: false
failSwapOn: false
makeIPTablesUtilChains: false
podLogsDir: $state/kubelet/pods-log
volumePluginDir: $state/kubelet/volume-plugins
resolvConf: /etc/resolv.conf
registerNode: true
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
fileCheckFrequency: 0s
maxPods: 110
oomScoreAdj: 0
EOF
}

_images() {
    # Build both images (once per state dir, or when an input changed) and import them.
    local pause_tar="$state/images/pause.tar" work_tar="$state/images/workload.tar"
    "$py" "$here/oci_image.py" "$pause_tar" "$PAUSE_IMAGE" --entrypoint /pause --file "$bin/pause:pause" >/dev/null \
        || _die "building the pause image failed"
    "$py" "$here/oci_image.py" "$work_tar" "$WORKLOAD_IMAGE" --entrypoint /bin/sh \
        --dir usr --dir etc --dir tmp:1777 --dir proc --dir sys --dir dev --dir run --dir var \
        --symlink bin:usr/bin --symlink sbin:usr/sbin --symlink lib:usr/lib --symlink lib64:usr/lib64 \
        --file "$here/kubernetes/passwd:etc/passwd:0644" --file "$here/kubernetes/group:etc/group:0644" >/dev/null \
        || _die "building the workload image failed"
    _ctr images import "$pause_tar" >>"$state/log/images.log" 2>&1 \
        || { _log_tail "$state/log/images.log"; _die "ctr images import of $PAUSE_IMAGE failed"; }
    _ctr images import "$work_tar" >>"$state/log/images.log" 2>&1 \
        || { _log_tail "$state/log/images.log"; _die "ctr images import of $WORKLOAD_IMAGE failed"; }
}

_ports() {
    local previous=()
    [ -s "$state/ports" ] && read -r -a previous <"$state/ports"
    [ "${#previous[@]}" -eq 2 ] || previous=(0)
    "$py" "$here/ports.py" 2 "${previous[@]}" >"$state/ports.new" || _die "could not pick free ports"
    mv "$state/ports.new" "$state/ports"
    read -r kubelet_port healthz_port <"$state/ports"
}

cmd_start() {
    _check_tools
    _lock 120
    if _ready 5 >/dev/null 2>&1; then
        _address
        return 0
    fi
    cmd_stop_locked >/dev/null 2>&1 || true
    rm -rf "$state/cni/ipam"  # every pod is gone: no address is taken
    mkdir -p "$state/log" "$state/pid"
    : >"$state/log/containerd.log"
    : >"$state/log/kubelet.log"
    : >"$state/log/images.log"
    local t0=$SECONDS
    _ports
    _cgroups
    _write_configs
    export GPUPOOL_KUBELET_NODE_DIR="$state"  # the marker `stop` finds what is left with
    containerd --config "$state/containerd/config.toml" </dev/null 9>&- >>"$state/log/containerd.log" 2>&1 &
    echo $! >"$state/pid/containerd.pid"
    local i
    for ((i = 0; i < start_timeout * 10; i++)); do
        ctr --address "$sock" version >/dev/null 2>&1 && break
        _containerd_pid >/dev/null || _fail "containerd exited"
        sleep 0.1
    done
    ctr --address "$sock" version >/dev/null 2>&1 || _fail "containerd not answering within ${start_timeout} s"
    _images
    "$bin/kubelet" --config="$state/kubelet/config.yaml" --kubeconfig="$kubeconfig" \
        --root-dir="$state/kubelet/root" --cert-dir="$state/kubelet/pki" --hostname-override="$node" \
        --node-labels=gpupool.io/workloads=true,nvidia.com/gpu.present=true --v=1 \
        </dev/null 9>&- >>"$state/log/kubelet.log" 2>&1 &
    echo $! >"$pidfile"
    _node local-node --timeout "$start_timeout" --pid "$(cat "$pidfile")" \
        || _fail "node $node not Ready with $gpus nvidia.com/gpu within ${start_timeout} s"
    echo "$svc: $(date -u +%H:%M:%S) node $node ready after $((SECONDS - t0)) s" >&2
    _address
}

cmd_stop_locked() {
    local pids=() pid
    if pid="$(_pid)"; then
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid")
    fi
    _wait_or_kill 10 "${pids[@]}"
    rm -f "$pidfile"
    # Containers of this node go with their shims (the runc shims are in the marker's env).
    if _containerd_pid >/dev/null; then
        local ids
        ids="$(_ctr tasks ls -q 2>/dev/null || true)"
        for pid in $ids; do _ctr tasks kill -s KILL "$pid" >/dev/null 2>&1 || true; done
        pid="$(_containerd_pid)"
        kill -TERM "$pid" 2>/dev/null || true
        _wait_or_kill 10 "$pid"
    fi
    rm -f "$state/pid/containerd.pid"
    _kill_marked "GPUPOOL_KUBELET_NODE_DIR=$state"
    # Mounts the kubelet and containerd left (pod volumes, rootfs) under this state dir.
    grep -F " $state/" /proc/mounts | cut -d' ' -f2 | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    [ -s "$kubeconfig" ] && _node delete-local-node --timeout 10 >/dev/null 2>&1 || true
    echo "$svc: stopped" >&2
}

cmd_stop() {
    _stop_if_running 120
}

cmd_status() {
    _status 5
}

_main "${1:-}"
