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
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
state="${GPUPOOL_STATE:-$repo/.state}/mosquitto"
py="${GPUPOOL_PYTHON:-$repo/.venv/bin/python}"
sites="${GPUPOOL_SITES:-edge-a,edge-b,edge-c}"
root="${GPUPOOL_MQTT_ROOT:-gpupool/v1}"
start_timeout="${MOSQUITTO_START_TIMEOUT:-20}"

conf="$state/mosquitto.conf"
creds="$state/credentials.json"
pidfile="$state/mosquitto.pid"
portfile="$state/port"

svc=mosquitto
# shellcheck source=deploy/local/service-lib.sh
. "$here/service-lib.sh"

_log_tails() {
    _log_tail "$state/mosquitto.log" "$state/stdout.log"
}

_pid() {
    # The pid of *this state dir's* mosquitto, if it runs.
    _pid_matching "-c $conf"
}

_ready() {
    # _ready TIMEOUT [PID]: wait until gpupool-broker can log in.
    local args=("$creds" --timeout "$1")
    [ -n "${2:-}" ] && args+=(--pid "$2")
    "$py" "$here/mqtt_ready.py" "${args[@]}"
}

_address() {
    echo "127.0.0.1:$(cat "$portfile")"
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

    # shellcheck disable=SC2046  # the previous port, or nothing
    port="$("$py" "$here/ports.py" 1 $(cat "$portfile" 2>/dev/null || true))" || _die "could not pick a free port"
    echo "$port" >"$portfile"
    (cd "$repo" && "$py" -m broker.acl --dir "$state" --port "$port" --root "$root" --sites "$sites" >/dev/null) \
        || _die "could not write the Mosquitto files (python -m broker.acl)"

    echo "=== start $(date -u +%Y-%m-%dT%H:%M:%SZ) on 127.0.0.1:$port" >>"$state/stdout.log"
    setsid mosquitto -c "$conf" </dev/null >>"$state/stdout.log" 2>&1 9>&- &
    pid=$!
    echo "$pid" >"$pidfile"
    local rc=0
    _ready "$start_timeout" "$pid" 2>"$state/ready.err" || rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$state/ready.err" >&2
        _log_tails
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$pidfile"
        [ "$rc" -eq 3 ] && _die "mosquitto exited during start (see the logs above)"
        _die "no MQTT login on 127.0.0.1:$port within ${start_timeout} s"
    fi
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

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 {start|stop|status}" >&2
        exit 2
        ;;
esac
