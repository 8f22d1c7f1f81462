#!/usr/bin/env bash
# A real Kubernetes control plane for gpupool on loopback, without Docker: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kwok (fake GPU nodes) and Kueue (training queues).
#
#   deploy/local/kubernetes.sh start    build the binaries if not cached (deploy/local/kubernetes-build.sh;
#                                       minutes when cold), start (or find running) every component,
#                                       wait until the API is ready, every node is Ready and Kueue's
#                                       webhook answers; prints the path of the kubeconfig
#   deploy/local/kubernetes.sh stop     SIGTERM every component of this state dir, SIGKILL after 10 s
#                                       (the local kubelet node of deploy/local/kubelet.sh first)
#   deploy/local/kubernetes.sh status   exit 0 and print the kubeconfig path if everything answers;
#                                       1 if not running; 2 if running but not ready
#
# Clients reach the cluster with KUBECONFIG set to the printed path (a cluster-admin bearer token,
# the cluster's CA; the server is https://127.0.0.1:<port>).
#
# Environment (defaults):
#   GPUPOOL_STATE (<repo>/.state), GPUPOOL_K8S_DIR ($GPUPOOL_STATE/kubernetes): state directory
#   GPUPOOL_CACHE (~/.cache/gpupool): binaries in $GPUPOOL_CACHE/kubernetes-v1.31.14/bin
#   GPUPOOL_K8S_NODES (4)        kwok nodes gpu-node-001 ... (the Slurm nodes' and the simulator's hosts)
#   GPUPOOL_K8S_GPUS (8)         allocatable nvidia.com/gpu per node
#   GPUPOOL_K8S_CPUS (32), GPUPOOL_K8S_MEMORY (64Gi)   per node, as the Slurm nodes
#   GPUPOOL_K8S_START_TIMEOUT (180)   seconds for each wait of a start (the build not counted)
#
# What runs (versions pinned in kubernetes-build.sh): etcd 3.4.23 (Debian) on a fresh data dir at
# each start; kube-apiserver v1.31.14 (token auth from a static token file, RBAC, service-account
# keys; admission plugin ServiceAccount off: no kubelet mounts tokens here), kube-controller-manager
# and kube-scheduler (no leader election); kwok v0.8.0 with deploy/local/kubernetes/kwok.yaml
# (pods Running once bound, completion opt-in by annotation, deletion after the grace period);
# Kueue v0.17.0 (batch/v1 Jobs only; ClusterQueue `training` with nominal quota = every GPU present,
# LocalQueue `training` in namespace `training`; see kubernetes_setup.py).
#
# Kueue's webhooks: nothing routes Services here, so the webhook configurations call
# https://127.0.0.1:<port> by URL; the certificates (openssl, SANs: the webhook Service's DNS name
# and 127.0.0.1) are put in the Secret Kueue's cert rotator manages before Kueue starts, and in
# its certDir, so the rotator finds them valid and only injects the CA.
#
# State directory: pki/ (CA, apiserver, service-account and Kueue webhook keys), token.csv,
# kubeconfig, etcd/ (data), kueue.yaml, log/<component>.log, pid/<component>.pid, ports.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/service-lib.sh
. "$here/service-lib.sh"
svc=kubernetes
state="${GPUPOOL_K8S_DIR:-$state_root/kubernetes}"
[ -x "$py" ] || py=python3
nodes="${GPUPOOL_K8S_NODES:-4}"
gpus="${GPUPOOL_K8S_GPUS:-8}"
cpus="${GPUPOOL_K8S_CPUS:-32}"
memory="${GPUPOOL_K8S_MEMORY:-64Gi}"
start_timeout="${GPUPOOL_K8S_START_TIMEOUT:-180}"
bin="${GPUPOOL_K8S_CACHE:-${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/kubernetes-v1.31.14}/bin"
kueue_dir="$(dirname "$bin")/kueue"
kubeconfig="$state/kubeconfig"
pki="$state/pki"
pidfile="$state/pid/kube-apiserver.pid"
# Started in this order, stopped in the reverse one.
components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kueue)

_pid() {
    _pid_matching kube-apiserver
}

_alive() {
    # _alive COMPONENT: print the pid of COMPONENT if its pid file names a live process of it.
    _pid_matching "$bin/$1" "$state/pid/$1.pid"
}

_ports_read() {
    read -r etcd_port etcd_peer_port api_port cm_port sched_port kwok_port webhook_port kueue_health_port <"$state/ports"
}

_setup() {
    # _setup COMMAND [ARGS...]: run kubernetes_setup.py COMMAND against this cluster.
    "$py" "$here/kubernetes_setup.py" "$1" --kubeconfig "$kubeconfig" --nodes "$nodes" --gpus "$gpus" \
        --cpus "$cpus" --memory "$memory" "${@:2}"
}

_ready() {
    # _ready TIMEOUT: 0 when every component runs, the API is ready, every node is Ready and
    # Kueue's webhook server answers; checked once (TIMEOUT is the client's request bound).
    local c
    for c in "${components[@]}"; do _alive "$c" >/dev/null || return 1; done
    _ports_read
    _setup ready --kueue-health "127.0.0.1:$kueue_health_port" --timeout "$1"
}

_address() {
    echo "$kubeconfig"
}

_log_tails() {
    local c
    for c in "${components[@]}"; do _log_tail "$state/log/$c.log"; done
}

_fail() {
    # _fail MESSAGE: print every component's log tail and exit naming what failed.
    _log_tails
    _die "$*"
}

_pki() {
    # The cluster's keys, made once per state dir with openssl (kept across restarts).
    grep -q "BEGIN RSA PRIVATE KEY" "$pki/kueue-tls.key" 2>/dev/null && [ -s "$state/token.csv" ] && return 0
    command -v openssl >/dev/null 2>&1 || _die "openssl not found"
    rm -rf "$pki"
    mkdir -p "$pki"
    local log="$state/log/openssl.log"
    : >"$log"
    (
        set -e
        cd "$pki"
        umask 077
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 \
            -subj "/CN=gpupool-local-ca"
        openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.96.0.1\n' >apiserver.ext
        openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
            -extfile apiserver.ext -out apiserver.crt
        openssl genrsa -out sa.key 2048
        openssl rsa -in sa.key -pubout -out sa.pub
        # Kueue's webhook: its own CA, as Kueue's cert rotator keeps one (ca.crt/ca.key in the Secret).
        # The rotator (open-policy-agent/cert-controller) accepts a CA only if it verifies for the
        # name "kueue-ca" (a SAN), and certificates valid for more than its 90-day lookahead;
        # otherwise it makes new ones that only the Secret, not Kueue's certDir, would hold.
        openssl req -x509 -newkey rsa:2048 -nodes -keyout kueue-ca.key -out kueue-ca.crt -days 3650 \
            -subj "/O=kueue/CN=kueue-ca" -addext "subjectAltName=DNS:kueue-ca" \
            -addext "basicConstraints=critical,CA:TRUE" \
            -addext "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment"
        openssl req -newkey rsa:2048 -nodes -keyout kueue-tls.key -out kueue-tls.csr \
            -subj "/CN=kueue-webhook-service.kueue-system.svc"
        printf 'subjectAltName=DNS:kueue-webhook-service.kueue-system.svc,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n' >kueue.ext
        openssl x509 -req -in kueue-tls.csr -CA kueue-ca.crt -CAkey kueue-ca.key -CAcreateserial -days 3650 \
            -extfile kueue.ext -out kueue-tls.crt
        # The rotator parses keys as PKCS#1 ("RSA PRIVATE KEY"); OpenSSL 3 writes PKCS#8.
        openssl rsa -in kueue-ca.key -traditional -out kueue-ca.key
        openssl rsa -in kueue-tls.key -traditional -out kueue-tls.key
    ) >>"$log" 2>&1 || { _log_tail "$log"; _die "openssl: making the cluster's certificates failed"; }
    local token
    token="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    (umask 077; echo "$token,gpupool-admin,gpupool-admin,\"system:masters\"" >"$state/token.csv")
}

_kubeconfig() {
    # _kubeconfig TOKEN: the kubeconfig of this start (the API server's port changes across starts).
    (umask 077; cat >"$kubeconfig.new" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gpupool-local
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $pki/ca.crt
users:
- name: gpupool-admin
  user:
    token: $1
contexts:
- name: gpupool-local
  context: {cluster: gpupool-local, user: gpupool-admin}
current-context: gpupool-local
EOF
    )
    mv "$kubeconfig.new" "$kubeconfig"
}

_ports() {
    local count=8 previous=()
    [ -s "$state/ports" ] && read -r -a previous <"$state/ports"
    if [ "${#previous[@]}" -ne "$count" ]; then previous=(0); fi
    "$py" "$here/ports.py" "$count" "${previous[@]}" >"$state/ports.new" || _die "could not pick free ports"
    mv "$state/ports.new" "$state/ports"
}

_spawn() {
    # _spawn COMPONENT ARGS...: start $bin/COMPONENT in the background with its log and pid file.
    local c="$1"
    shift
    "$bin/$c" "$@" </dev/null 9>&- >>"$state/log/$c.log" 2>&1 &
    echo $! >"$state/pid/$c.pid"
}

_write_kueue_config() {
    mkdir -p "$state/kueue-certs"
    cp "$pki/kueue-ca.crt" "$state/kueue-certs/ca.crt"
    cp "$pki/kueue-ca.key" "$state/kueue-certs/ca.key"
    cp "$pki/kueue-tls.crt" "$state/kueue-certs/tls.crt"
    cp "$pki/kueue-tls.key" "$state/kueue-certs/tls.key"
    cat >"$state/kueue.yaml" <<EOF
# Generated by deploy/local/kubernetes.sh at each start: do not edit (edit the script).
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:$kueue_health_port
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: $webhook_port
  certDir: $state/kueue-certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: true
  webhookServiceName: kueue-webhook-service
  webhookSecretName: kueue-webhook-server-cert
integrations:
  frameworks:
  - batch/job
EOF
}

cmd_start() {
    bash "$here/kubernetes-build.sh" || _die "building the control plane's binaries failed (see above)"
    "$py" -c 'import kubernetes' 2>/dev/null \
        || _die "the Python kubernetes client is missing from $py (make venv: pyproject's test extra)"
    _lock 120
    if _ready 5 >/dev/null 2>&1; then
        _address
        return 0
    fi
    # A start that fails (a port taken between picking and binding, a component that dies) is
    # stopped and tried once more on fresh ports; a second failure stops everything and fails.
    local try
    for try in 1 2; do
        cmd_stop_locked >/dev/null 2>&1 || true
        if (_start_once); then
            _address
            return 0
        fi
        if ((try == 1)); then
            echo "$svc: start failed (above); stopping everything and trying once more on fresh ports" >&2
            rm -f "$state/ports"
        fi
    done
    cmd_stop_locked >/dev/null 2>&1 || true
    _die "did not start, twice (see above)"
}

_start_once() {
    # One start of every component (in a subshell: _fail exits it); 0 when all is ready.
    mkdir -p "$state/log" "$state/pid"
    local c
    for c in "${components[@]}"; do : >"$state/log/$c.log"; done  # tails on failure: this try only
    _ports
    _ports_read
    _pki
    _kubeconfig "$(cut -d, -f1 "$state/token.csv")"
    _write_kueue_config
    # A marker in every component's environment: `stop` finds what is left of this cluster.
    export GPUPOOL_K8S_CLUSTER="$state"
    local t0=$SECONDS
    rm -rf "$state/etcd"
    _spawn etcd --name gpupool --data-dir "$state/etcd" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
        --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
        --initial-cluster "gpupool=http://127.0.0.1:$etcd_peer_port" \
        --quota-backend-bytes 2147483648 --log-level warn
    _spawn kube-apiserver --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api_port" \
        --etcd-servers="http://127.0.0.1:$etcd_port" \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --client-ca-file="$pki/ca.crt" --token-auth-file="$state/token.csv" \
        --authorization-mode=RBAC --anonymous-auth=false \
        --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$pki/sa.pub" \
        --service-account-signing-key-file="$pki/sa.key" \
        --service-cluster-ip-range=10.96.0.0/16 --endpoint-reconciler-type=none \
        --disable-admission-plugins=ServiceAccount --profiling=false
    _setup api --timeout "$start_timeout" --pid "$(_alive kube-apiserver || echo 1)" \
        || _fail "kube-apiserver not ready within ${start_timeout} s"
    echo "$svc: $(date -u +%H:%M:%S) API ready after $((SECONDS - t0)) s" >&2
    _spawn kube-controller-manager --kubeconfig="$kubeconfig" --bind-address=127.0.0.1 --secure-port="$cm_port" \
        --leader-elect=false --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
        --use-service-account-credentials=false --authentication-kubeconfig="$kubeconfig" \
        --authorization-kubeconfig="$kubeconfig" --profiling=false
    _spawn kube-scheduler --kubeconfig="$kubeconfig" --bind-address=127.0.0.1 --secure-port="$sched_port" \
        --leader-elect=false --authentication-kubeconfig="$kubeconfig" \
        --authorization-kubeconfig="$kubeconfig" --profiling=false
    _setup bootstrap --kueue-dir "$kueue_dir" --cert-dir "$state/kueue-certs" \
        --webhook-url "https://127.0.0.1:$webhook_port" --timeout "$start_timeout" \
        || _fail "creating the nodes and Kueue's CRDs, Secret and webhook configurations failed"
    _spawn kwok --kubeconfig="$kubeconfig" --config="$here/kubernetes/kwok.yaml" \
        --server-address="127.0.0.1:$kwok_port" --node-ip=127.0.0.1 \
        --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake --v=WARN
    _spawn kueue --config="$state/kueue.yaml" --kubeconfig="$kubeconfig" \
        --feature-gates=VisibilityOnDemand=false --zap-log-level=info
    _setup nodes --timeout "$start_timeout" --pid "$(_alive kwok || echo 1)" \
        || _fail "kwok nodes not Ready within ${start_timeout} s"
    _setup queues --timeout "$start_timeout" --pid "$(_alive kueue || echo 1)" \
        || _fail "Kueue's webhook or training queues not ready within ${start_timeout} s"
    _ready 10 || _fail "a component exited during the start"
    echo "$svc: $(date -u +%H:%M:%S) ready after $((SECONDS - t0)) s ($nodes nodes x $gpus GPUs)" >&2
}

cmd_stop_locked() {
    local i c pid pids=()
    # The local node (deploy/local/kubelet.sh) runs against this control plane: it goes first.
    if [ -d "${GPUPOOL_KUBELET_DIR:-$state_root/kubelet}" ]; then
        GPUPOOL_K8S_DIR="$state" bash "$here/kubelet.sh" stop >/dev/null 2>&1 || true
    fi
    for ((i = ${#components[@]} - 1; i >= 0; i--)); do
        c="${components[$i]}"
        if pid="$(_alive "$c")"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$state/pid/$c.pid"
    done
    _wait_or_kill 10 "${pids[@]}"
    # Anything else started with this cluster's marker in its environment.
    _kill_marked "GPUPOOL_K8S_CLUSTER=$state"
    echo "$svc: stopped" >&2
}

cmd_stop() {
    _stop_if_running 120
}

cmd_status() {
    _status 5
}

_main "${1:-}"
