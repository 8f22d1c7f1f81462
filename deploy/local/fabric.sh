#!/usr/bin/env bash
# Simulated InfiniBand fabric for gpupool: ibsim (Debian ibsim-utils) + OpenSM under libumad2sim.
#
#   deploy/local/fabric.sh start | stop | status | console '<ibsim command>' | reap
#
# start   generate a 2-level fat tree (deploy/local/fabric/gen_topology.py), start ibsim on it,
#         start OpenSM attached to the simulator, wait until the SM is MASTER and every link is
#         Active with a LID on every node, then write $STATE/fabric.json (env, paths, nodes → GUIDs
#         and LIDs). Idempotent: a running fabric is left alone (exit 0), even if the topology
#         variables changed — stop it first to get another topology.
# stop    stop OpenSM, the client reaper and ibsim (TERM, then KILL after 5 s). Idempotent.
# status  exit 0 and a one-line summary when running, exit 3 when stopped.
# console run one ibsim console command and print its answer, e.g.
#           fabric.sh console 'PerformanceSet "leaf-2"[3] PortCountersExtended.PortXmitData=5'
#           fabric.sh console 'Unlink "node016"[1]'      fabric.sh console 'ReLink "node016"[1]'
# reap    disconnect ibsim clients whose process died (see "client slots" below).
#
# Environment (defaults):
#   GPUPOOL_STATE (<repo>/.state), GPUPOOL_FABRIC_DIR ($GPUPOOL_STATE/fabric): state directory
#   GPUPOOL_FABRIC_SPINES (2) _LEAVES (4) _HCAS_PER_LEAF (4) _UPLINKS (1) _SPEED (EDR)
#   GPUPOOL_FABRIC_SWITCH_PORTS (smallest of 36/40/64/80/128/255 that fits)
#   GPUPOOL_FABRIC_TIMEOUT (120): seconds to wait for OpenSM's sweep
#   GPUPOOL_FABRIC_SWEEP_INTERVAL (10): OpenSM sweep_interval, seconds
#   PYTHON (python3): any Python >= 3.9, standard library only
#
# State directory: net (ibsim net file), topology.json (generated fat tree), meta.json, fabric.json,
# console.fifo, ibsim.out/.err, opensm.conf, partitions.conf, qos-policy.conf, opensm/ (log, cache,
# OpenSM's cwd), work/ (cwd for diag commands), *.pid.
# partitions.conf and qos-policy.conf are written only when absent: the fabric manager owns them
# and makes OpenSM re-read them with SIGHUP (`kill -HUP $(cat $STATE/opensm.pid)`).
#
# Gotchas found on this machine (ibsim 0.10, OpenSM 3.3.23, infiniband-diags 44):
# * ibsim reads its console on stdin; at EOF its select() loop spins at 100 % CPU. We give it the
#   console FIFO opened read-write (`<>fifo`): ibsim itself then holds a writer, never sees EOF, and
#   anyone can `echo CMD > console.fifo`. (DESIGN.md's `tail -f fifo | ibsim` works too.)
# * Sockets are abstract unix sockets named by IBSIM_SOCKNAME (default "sim"), machine-wide per
#   network namespace: two fabrics with the same name collide. We derive a name from the state
#   directory, and every client (OpenSM, perfquery, ...) needs the same IBSIM_SOCKNAME.
# * Clients run with LD_PRELOAD=libumad2sim.so. /usr/bin/ibsim-run has a typo
#   (`LD_PRELOAD="$LD_PRELOAD:sim_so"`): when LD_PRELOAD is already set it preloads a file named
#   "sim_so" and the client talks to real hardware. Set LD_PRELOAD yourself (fabric.json "env").
#   ibsim itself must not run with it (we unset it).
# * libumad2sim writes a fake sysfs tree ./sys-<pid>/ in the client's CWD and removes it in an
#   atexit handler: the CWD must be writable, and a killed client leaves its tree behind.
# * Client slots: ibsim serves at most 10 clients at once (IBSIM_MAX_CLIENTS); OpenSM takes one.
#   An 11th gets "sim_init: connect failed" (exit 255). A client killed by a signal never
#   detaches and keeps its slot until `X <n>` on the console; the reaper started here
#   (fabric/console.py reap-loop) does that every 2 s for clients whose pid is gone.
# * Counters: ibsim counts its own MAD traffic (perfquery's ClassPortInfo response adds 72 words
#   of PortXmitData on the queried port). OpenSM's light sweeps touch switch-to-switch links
#   only; HCA-facing switch ports stay exactly at a PerformanceSet value until a heavy sweep
#   (trap, SIGHUP) or a query of the HCA behind them. ibsim's PMA has no additional extended
#   counters: `perfquery -x` gives the 8 data/packet counters only; PortXmitWait and the error
#   counters come from legacy `perfquery` (PortCounters).
# * `perfquery -x LID 1,2,3` reads several ports in one process (6-10 ms of CPU per process on
#   an idle core, several times that on a loaded one); `-l` does not loop over a switch's ports. An unreachable LID fails at once
#   ("_do_madrpc failed"), it does not wait for the MAD timeout. Every client prints
#   "ibwarn: ... sim_connect: attached as client N" on stderr: parse stdout only.
# * After `Unlink`, `ibnetdiscover -p` still lists the switch port but without a peer, and the
#   HCA behind it disappears; ibsim sends trap 128 and OpenSM re-sweeps.
# * OpenSM exits on SIGTERM only while ibsim is alive: stop OpenSM first. Processes started here
#   are re-parented to PID 1, which does not reap them here: `kill -0` succeeds on zombies, so
#   liveness is read from /proc/<pid>/stat.
# Everything is local: abstract unix sockets, no TCP.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
STATE=${GPUPOOL_FABRIC_DIR:-${GPUPOOL_STATE:-$REPO/.state}/fabric}
PY=${PYTHON:-python3}
TIMEOUT=${GPUPOOL_FABRIC_TIMEOUT:-120}
SOCK=gpupool-$(printf %s "$STATE" | cksum | cut -d' ' -f1)

die() { echo "fabric: $*" >&2; exit 1; }

# alive PID NAME: PID runs (not a zombie) and its command line mentions NAME.
alive() {
    local pid=$1 name=$2 stat
    [[ -n $pid && -r /proc/$pid/stat ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z && ${stat:0:1} != X ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$name"
}

pidof_file() { cat "$STATE/$1.pid" 2>/dev/null || true; }

running() {
    alive "$(pidof_file ibsim)" ibsim && alive "$(pidof_file opensm)" opensm && [[ -f $STATE/fabric.json ]]
}

# stop_one NAME: TERM the process in NAME.pid, KILL it after 5 s.
stop_one() {
    local name=$1 pid _
    pid=$(pidof_file "$name")
    if alive "$pid" "${2:-$name}"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do alive "$pid" "${2:-$name}" || break; sleep 0.1; done
        if alive "$pid" "${2:-$name}"; then kill -KILL "$pid" 2>/dev/null || true; fi
    fi
    rm -f "$STATE/$name.pid"
}

stop_all() {
    [[ -d $STATE ]] || return 0
    stop_one reaper console.py
    stop_one opensm
    stop_one ibsim
    rm -f "$STATE/fabric.json" "$STATE/console.fifo"
    rm -rf "$STATE"/opensm/sys-* "$STATE"/work/sys-*
}

diagnose() {
    local f
    for f in ibsim.err opensm/opensm.out opensm/opensm.log reaper.log; do
        [[ -s $STATE/$f ]] || continue
        echo "---- $STATE/$f (last 15 lines)" >&2
        tail -n 15 "$STATE/$f" >&2
    done
}

start() {
    if running; then
        echo "fabric: already running ($STATE/fabric.json)"
        return 0
    fi
    stop_all
    local tool
    for tool in ibsim opensm sminfo iblinkinfo ibnetdiscover perfquery "$PY"; do
        command -v "$tool" >/dev/null || die "$tool not found (bash deploy/local/install-system.sh)"
    done
    local sim_so=${GPUPOOL_UMAD2SIM:-}
    if [[ -z $sim_so ]]; then
        local cand
        for cand in /usr/lib/*/umad2sim/libumad2sim.so /usr/lib/umad2sim/libumad2sim.so; do
            [[ -f $cand ]] && { sim_so=$cand; break; }
        done
    fi
    [[ -f $sim_so ]] || die "libumad2sim.so not found (Debian package libumad2sim0)"
    mkdir -p "$STATE/opensm" "$STATE/work"

    local gen=(--out "$STATE/net" --json "$STATE/topology.json"
        --spines "${GPUPOOL_FABRIC_SPINES:-2}" --leaves "${GPUPOOL_FABRIC_LEAVES:-4}"
        --hcas-per-leaf "${GPUPOOL_FABRIC_HCAS_PER_LEAF:-4}" --uplinks "${GPUPOOL_FABRIC_UPLINKS:-1}"
        --speed "${GPUPOOL_FABRIC_SPEED:-EDR}")
    [[ -n ${GPUPOOL_FABRIC_SWITCH_PORTS:-} ]] && gen+=(--switch-ports "$GPUPOOL_FABRIC_SWITCH_PORTS")
    "$PY" "$HERE/fabric/gen_topology.py" "${gen[@]}" || die "topology generation failed"
    local limits
    limits=$("$PY" -c 'import json,sys; l=json.load(open(sys.argv[1]))["ibsim_limits"]; print(l["nodes"], l["switches"], l["ports"])' "$STATE/topology.json")
    read -r lim_nodes lim_switches lim_ports <<<"$limits"

    rm -f "$STATE/console.fifo"
    mkfifo "$STATE/console.fifo"
    : >"$STATE/ibsim.out"
    : >"$STATE/ibsim.err"
    # ibsim: console on the FIFO opened read-write (never EOF), own session, no LD_PRELOAD.
    (cd "$STATE/work" && exec setsid env -u LD_PRELOAD IBSIM_SOCKNAME="$SOCK" \
        ibsim -s -N "$lim_nodes" -S "$lim_switches" -P "$lim_ports" "$STATE/net" \
        <>"$STATE/console.fifo" >"$STATE/ibsim.out" 2>"$STATE/ibsim.err" 9>&-) &
    echo $! >"$STATE/ibsim.pid"
    local _
    for _ in $(seq 100); do
        grep -q 'sim> ' "$STATE/ibsim.out" 2>/dev/null && break
        alive "$(pidof_file ibsim)" ibsim || { diagnose; stop_all; die "ibsim exited while starting"; }
        sleep 0.1
    done
    grep -q 'sim> ' "$STATE/ibsim.out" || { diagnose; stop_all; die "ibsim did not show its prompt in 10 s"; }

    if [[ ! -f $STATE/partitions.conf ]]; then
        cat >"$STATE/partitions.conf" <<'EOF'
# gpupool simulated fabric: the default partition, every port a full member.
# The fabric manager adds one partition per lease and sends OpenSM a SIGHUP.
Default=0x7fff, ipoib : ALL=full, ALL_SWITCHES=full, SELF=full ;
EOF
    fi
    if [[ ! -f $STATE/qos-policy.conf ]]; then
        cat >"$STATE/qos-policy.conf" <<'EOF'
# gpupool simulated fabric: everything on SL 0 until the fabric manager maps lease partitions.
qos-ulps
    default : 0
end-qos-ulps
EOF
    fi
    opensm -c "$STATE/opensm.conf.default" >/dev/null 2>&1 || die "opensm -c failed"
    sed -e "s#^partition_config_file .*#partition_config_file $STATE/partitions.conf#" \
        -e "s#^qos_policy_file .*#qos_policy_file $STATE/qos-policy.conf#" \
        -e "s#^qos .*#qos TRUE#" \
        -e "s#^log_file .*#log_file $STATE/opensm/opensm.log#" \
        -e "s#^dump_files_dir .*#dump_files_dir $STATE/opensm/#" \
        -e "s#^sweep_interval .*#sweep_interval ${GPUPOOL_FABRIC_SWEEP_INTERVAL:-10}#" \
        -e "s#^daemon .*#daemon FALSE#" \
        -e "s#^console .*#console off#" \
        "$STATE/opensm.conf.default" >"$STATE/opensm.conf"
    : >"$STATE/opensm/opensm.log"

    STATE=$STATE SOCK=$SOCK SIM_SO=$sim_so "$PY" - <<'EOF'
import json, os
s = os.environ["STATE"]
meta = {
    "state_dir": s,
    "sockname": os.environ["SOCK"],
    "env": {"IBSIM_SOCKNAME": os.environ["SOCK"], "LD_PRELOAD": os.environ["SIM_SO"]},
    "workdir": f"{s}/work",
    "net_file": f"{s}/net",
    "console_fifo": f"{s}/console.fifo",
    "ibsim_out": f"{s}/ibsim.out",
    "opensm_conf": f"{s}/opensm.conf",
    "opensm_log": f"{s}/opensm/opensm.log",
    "opensm_pid_file": f"{s}/opensm.pid",
    "partitions_conf": f"{s}/partitions.conf",
    "qos_policy_conf": f"{s}/qos-policy.conf",
}
with open(f"{s}/meta.json", "w") as fh:
    json.dump(meta, fh, indent=1)
EOF

    (cd "$STATE/opensm" && exec setsid env OSM_CACHE_DIR="$STATE/opensm" OSM_TMP_DIR="$STATE/opensm" \
        IBSIM_SOCKNAME="$SOCK" LD_PRELOAD="$sim_so" opensm -F "$STATE/opensm.conf" \
        </dev/null >"$STATE/opensm/opensm.out" 2>&1 9>&-) &
    echo $! >"$STATE/opensm.pid"
    (exec setsid "$PY" "$HERE/fabric/console.py" --dir "$STATE" reap-loop --interval 2 \
        </dev/null >"$STATE/reaper.log" 2>&1 9>&-) &
    echo $! >"$STATE/reaper.pid"

    if ! "$PY" "$HERE/fabric/fabric_state.py" --dir "$STATE" wait --timeout "$TIMEOUT"; then
        diagnose
        stop_all
        die "OpenSM did not bring the fabric up within ${TIMEOUT}s"
    fi
    alive "$(pidof_file opensm)" opensm || { diagnose; stop_all; die "opensm exited"; }
    echo "fabric: up ($("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(len(d["nodes"]), "nodes,", d["links"], "links, ready in", d["ready_seconds"], "s")' "$STATE/fabric.json")); $STATE/fabric.json"
}

status() {
    if running; then
        echo "fabric: running (ibsim pid $(pidof_file ibsim), opensm pid $(pidof_file opensm)); $STATE/fabric.json"
        return 0
    fi
    echo "fabric: stopped"
    return 3
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
start | stop)
    mkdir -p "$STATE"
    exec 9>"$STATE/fabric.lock"
    flock 9
    if [[ $cmd == start ]]; then start; else stop_all; echo "fabric: stopped"; fi
    ;;
status) status ;;
console) exec "$PY" "$HERE/fabric/console.py" --dir "$STATE" send "$*" ;;
reap) exec "$PY" "$HERE/fabric/console.py" --dir "$STATE" reap ;;
*)
    echo "usage: $0 {start|stop|status|console '<ibsim command>'|reap}" >&2
    exit 2
    ;;
esac
