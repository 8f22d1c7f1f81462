#!/usr/bin/env bash
# Mosquitto 2 for gpupool on loopback, with per-site users and an ACL, without Docker.
#
#   deploy/local/mosquitto.sh start    start (or find running), wait until a login works; prints host:port
#   deploy/local/mosquitto.sh stop     SIGTERM (Mosquitto saves its persistence file), SIGKILL after 10 s
#   deploy/local/mosquitto.sh status   exit 0 and print host:port if running and accepting logins,
#                                      1 if not running, 2 if running but not accepting logins
#
# State under ${GPUPOOL_STATE:-<repo>/.state}/mosquitto (mode 0700), written by `python -m broker.acl`
# at each start:
#   mosquitto.conf, acl, passwd     config, ACL (broker/acl.py says who may do what), PBKDF2 hashes
#   credentials.json                {"host", "port", "users": {name: password}, "root"} for clients
#   data/                           persistence (retained messages, sessions; kept across restarts)
#   mosquitto.log, stdout.log, mosquitto.pid, port
#
# Users: one per site in GPUPOOL_SITES (comma separated; default edge-a,edge-b,edge-c) plus
# gpupool-broker; passwords are random once and kept across restarts. MQTT root: GPUPOOL_MQTT_ROOT
# (default gpupool/v1). The port of the previous start is reused when free.
#
# TLS: with GPUPOOL_MQTT_TLS=1 a second listener speaks MQTT over TLS (same users and ACL) on the
# port in tls_port, with a throwaway CA and a server certificate for 127.0.0.1/localhost made with
# openssl under tls/ (kept across restarts: ca.pem is what clients trust; ca.key signs client
# certificates for tests). credentials.json then has "tls": {"port", "cafile", ...}. With
# GPUPOOL_MQTT_TLS_REQUIRE_CERT=1 clients must also present a certificate of that CA.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/service-lib.sh
. "$here/service-lib.sh"
svc=mosquitto
state="$state_root/mosquitto"
sites="${GPUPOOL_SITES:-edge-a,edge-b,edge-c}"
root="${GPUPOOL_MQTT_ROOT:-gpupool/v1}"
start_timeout="${MOSQUITTO_START_TIMEOUT:-20}"

conf="$state/mosquitto.conf"
creds="$state/credentials.json"
pidfile="$state/mosquitto.pid"
portfile="$state/port"
tls_portfile="$state/tls_port"
tls_dir="$state/tls"
tls="${GPUPOOL_MQTT_TLS:-0}"

_log_tails() {
    _log_tail "$state/mosquitto.log" "$state/stdout.log"
}

_pid() {
    # The pid of *this state dir's* mosquitto, if it runs.
    _pid_matching "-c $conf"
}

_ready() {
    # _ready TIMEOUT [PID]: wait until gpupool-observer can log in.
    _wait_ready mqtt_ready.py "$creds" "$@"
}

_address() {
    echo "127.0.0.1:$(cat "$portfile")"
}

_tls_files() {
    # A throwaway CA and a server certificate signed by it (SAN IP:127.0.0.1, DNS:localhost),
    # made once; an expired or incomplete set is made again.
    mkdir -p "$tls_dir"
    chmod 700 "$tls_dir"
    if [ -s "$tls_dir/ca.pem" ] && [ -s "$tls_dir/server.pem" ] && [ -s "$tls_dir/server.key" ] \
        && openssl x509 -checkend 86400 -noout -in "$tls_dir/server.pem" >/dev/null 2>&1; then
        return 0
    fi
    command -v openssl >/dev/null 2>&1 || _die "openssl not found (needed for GPUPOOL_MQTT_TLS=1)"
    (
        cd "$tls_dir"
        umask 077
        openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 825 -subj "/CN=gpupool local test CA" \
            -keyout ca.key -out ca.pem
        openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=localhost" -keyout server.key -out server.csr
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >server.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 -sha256 \
            -extfile server.ext -out server.pem
        rm -f server.csr server.ext
    ) >"$tls_dir/openssl.log" 2>&1 || { cat "$tls_dir/openssl.log" >&2; _die "could not make the TLS files"; }
}

cmd_start() {
    _lock 60
    chmod 700 "$state"
    local pid port
    if pid="$(_pid)"; then
        _ready "$start_timeout" "$pid" >/dev/null 2>&1 || { _log_tails; _die "running (pid $pid) but refusing logins"; }
        _address
        return 0
    fi
    [ -x "$py" ] || _die "no python at $py; run 'make venv' (or set GPUPOOL_PYTHON)"
    command -v mosquitto >/dev/null 2>&1 || _die "mosquitto not found; run deploy/local/install-system.sh"

    local tls_args=()
    if [ "$tls" = "1" ]; then
        _tls_files
        local ports
        # shellcheck disable=SC2046  # the previous ports, or nothing
        ports="$("$py" "$here/ports.py" 2 $(cat "$portfile" 2>/dev/null || echo 0) $(cat "$tls_portfile" 2>/dev/null || true))" \
            || _die "could not pick free ports"
        port="${ports%% *}"
        echo "${ports##* }" >"$tls_portfile"
        tls_args=(--tls-port "${ports##* }" --cafile "$tls_dir/ca.pem" --certfile "$tls_dir/server.pem"
            --keyfile "$tls_dir/server.key")
        [ "${GPUPOOL_MQTT_TLS_REQUIRE_CERT:-0}" = "1" ] && tls_args+=(--require-certificate)
    else
        # shellcheck disable=SC2046  # the previous port, or nothing
        port="$("$py" "$here/ports.py" 1 $(cat "$portfile" 2>/dev/null || true))" || _die "could not pick a free port"
        rm -f "$tls_portfile"
    fi
    echo "$port" >"$portfile"
    (cd "$repo" && "$py" -m broker.acl --dir "$state" --port "$port" --root "$root" --sites "$sites" \
        "${tls_args[@]}" >/dev/null) || _die "could not write the Mosquitto files (python -m broker.acl)"

    echo "=== start $(date -u +%Y-%m-%dT%H:%M:%SZ) on 127.0.0.1:$port" >>"$state/stdout.log"
    setsid mosquitto -c "$conf" </dev/null >>"$state/stdout.log" 2>&1 9>&- &
    _await_start $! "mosquitto exited during start (see the logs above)" \
        "no MQTT login on 127.0.0.1:$port within ${start_timeout} s"
    _address
}

cmd_stop() {
    _lock 60
    chmod 700 "$state"
    _stop 10
}

cmd_status() {
    _status 3
}

_main "${1:-}"
