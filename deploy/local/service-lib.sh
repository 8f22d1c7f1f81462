# Shared by deploy/local/kafka.sh, mosquitto.sh, slurm.sh and kubernetes.sh (sourced, not run).
#
# Each script sets `here` (its folder) and sources this first, which sets:
#   repo                            the repository root
#   py                              the Python to run helpers with (GPUPOOL_PYTHON, else the repo's .venv)
#   state_root                      ${GPUPOOL_STATE:-<repo>/.state}: each service keeps its state below it
# It then sets `svc` (its name, for messages), `state` (its state dir) and `pidfile`, and uses:
#   _die MESSAGE...                 print "<svc>: MESSAGE" on stderr and exit 1
#   _log_tail FILE...               print the last 30 lines of each non-empty FILE on stderr
#   _pid_matching PATTERN           print the pid in $pidfile if that process runs and its command
#                                   line contains PATTERN (a stale or reused pid is not ours)
#   _lock SECONDS                   serialise start/stop of one state dir (flock on fd 9)
#   _stop SECONDS                   SIGTERM the pid from _pid, SIGKILL after SECONDS, remove $pidfile
#   _status SECONDS                 exit-code status (0 answering, 1 not running, 2 not answering)
#   _pid_matching PATTERN PIDFILE   the same for another pid file (a service of several daemons)
#   _wait_or_kill SECONDS PID...    wait until every PID has exited, SIGKILL those left after SECONDS
#   _kill_marked NAME=VALUE         SIGKILL every process with NAME=VALUE in its environment (a
#                                   marker a script exports before starting its daemons) and
#                                   every process below them
#   _await_start PID EXITED TIMED_OUT
#                                   record PID in $pidfile and wait $start_timeout s for _ready; on
#                                   failure print why and the log tails (_log_tails), kill PID,
#                                   remove $pidfile and _die with EXITED (PID exited) or TIMED_OUT
#   _wait_ready SCRIPT TARGET TIMEOUT [PID]
#                                   run deploy/local/SCRIPT TARGET --timeout TIMEOUT [--pid PID]
#                                   (kafka_ready.py, mqtt_ready.py: exit 0 ready, 1 not in time,
#                                   3 PID exited)
#   _main ARG                       run cmd_start, cmd_stop or cmd_status for start/stop/status,
#                                   else print the usage and exit 2
# Scripts define `_pid`, `_ready TIMEOUT PID`, `_address`, `_log_tails` and the cmd_* functions
# themselves.

repo="$(cd "$here/../.." && pwd)"
py="${GPUPOOL_PYTHON:-$repo/.venv/bin/python}"
state_root="${GPUPOOL_STATE:-$repo/.state}"

_die() {
    echo "$svc: $*" >&2
    exit 1
}

_log_tail() {
    local f
    for f in "$@"; do
        if [ -s "$f" ]; then
            echo "---- tail of $f" >&2
            tail -n 30 "$f" >&2
        fi
    done
}

_pid_matching() {
    local pid file="${2:-$pidfile}"
    [ -f "$file" ] || return 1
    pid="$(cat "$file")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$1" || return 1
    echo "$pid"
}

_descendants() {
    # _descendants PID...: the PIDs given and every process below them (from /proc/*/stat).
    local all
    all="$(awk '{print $4, $1}' /proc/[0-9]*/stat 2>/dev/null)"
    local queue=("$@") out=() pid child
    while ((${#queue[@]})); do
        pid="${queue[0]}"
        queue=("${queue[@]:1}")
        out+=("$pid")
        for child in $(awk -v p="$pid" '$1 == p {print $2}' <<<"$all"); do queue+=("$child"); done
    done
    echo "${out[@]}"
}

_wait_or_kill() {
    local timeout="$1" i pid left
    shift
    for ((i = 0; i < timeout * 10; i++)); do
        left=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left=1; done
        ((left)) || return 0
        sleep 0.1
    done
    for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; done
}

_kill_marked() {
    local marked=() p pid
    for p in /proc/[0-9]*; do
        pid="${p#/proc/}"
        [ "$pid" = "$$" ] && continue
        if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "$1"; then
            marked+=("$pid")
        fi
    done
    if ((${#marked[@]})); then
        # shellcheck disable=SC2046
        kill -KILL $(_descendants "${marked[@]}") 2>/dev/null || true
    fi
}

_lock() {
    mkdir -p "$state"
    exec 9>"$state/.lock"
    flock -w "$1" 9 || _die "another $svc script holds $state/.lock"
}

_stop() {
    local timeout="$1" pid i
    if ! pid="$(_pid)"; then
        rm -f "$pidfile"
        echo "$svc: not running" >&2
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < timeout * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "$svc: pid $pid still running after ${timeout} s; SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    rm -f "$pidfile"
    echo "$svc: stopped" >&2
}

_status() {
    # _status SECONDS: print the address (from the script's _address) and return 0 if the service
    # runs and answers _ready within SECONDS; 1 if it does not run; 2 if it runs but does not answer.
    local pid
    if ! pid="$(_pid)"; then
        echo "$svc: not running" >&2
        return 1
    fi
    if _ready "$1" "$pid" >/dev/null 2>&1; then
        _address
        return 0
    fi
    echo "$svc: running (pid $pid) but not answering on $(_address)" >&2
    return 2
}

_await_start() {
    local pid="$1" rc=0
    echo "$pid" >"$pidfile"
    _ready "$start_timeout" "$pid" 2>"$state/ready.err" || rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$state/ready.err" >&2
        _log_tails
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$pidfile"
        [ "$rc" -eq 3 ] && _die "$2"
        _die "$3"
    fi
}

_wait_ready() {
    local args=("$2" --timeout "$3")
    [ -n "${4:-}" ] && args+=(--pid "$4")
    "$py" "$here/$1" "${args[@]}"
}

# Stop a service whose script defines cmd_stop_locked, under the lock (waiting up to $1 s for it);
# nothing to do when its state dir does not exist.
_stop_if_running() {
    [ -d "$state" ] || { echo "$svc: not running" >&2; return 0; }
    _lock "$1"
    cmd_stop_locked
}

_main() {
    case "${1:-}" in
        start) cmd_start ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        *)
            echo "usage: $0 {start|stop|status}" >&2
            exit 2
            ;;
    esac
}
