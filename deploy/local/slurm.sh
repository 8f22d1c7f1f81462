#!/usr/bin/env bash
# A real Slurm cluster for gpupool on loopback, without Docker: Debian's Slurm 22.05 and munge.
#
#   deploy/local/slurm.sh start    start (or find running) munged, slurmctld and one slurmd per node,
#                                  wait until every node is idle; prints the path of slurm.conf
#   deploy/local/slurm.sh stop     SIGTERM every daemon of this state dir, SIGKILL after 10 s
#   deploy/local/slurm.sh status   exit 0 and print the path of slurm.conf if slurmctld answers and
#                                  every node is up; 1 if not running; 2 if running but not ready
#
# Clients (sbatch, squeue, scontrol, sinfo, scancel) reach this cluster with SLURM_CONF set to the
# printed path; nothing else is needed (munge's socket is named in slurm.conf's AuthInfo).
#
# Environment (defaults):
#   GPUPOOL_STATE (<repo>/.state), GPUPOOL_SLURM_DIR ($GPUPOOL_STATE/slurm): state directory
#   GPUPOOL_SLURM_NODES (4)        nodes gpu-node-001 ... (the simulator's host names)
#   GPUPOOL_SLURM_GPUS (8)         GPUs per node: GRES gpu:h100, on character devices nvidia0..
#   GPUPOOL_SLURM_CPUS (32)        CPUs per node as Slurm sees them (SlurmdParameters=config_overrides)
#   GPUPOOL_SLURM_GRACE (30)       GraceTime of the lent partition, seconds: a lease's notice
#   GPUPOOL_SLURM_EXEMPT (0)       PreemptExemptTime, seconds: no job is preempted before it ran
#                                  this long (a lease's minimum guaranteed duration)
#   GPUPOOL_SLURM_START_TIMEOUT (60)
#
# Partitions: `training` (default; PriorityTier=10, PreemptMode=OFF) and `lent` (PriorityTier=1,
# PreemptMode=CANCEL, GraceTime=GPUPOOL_SLURM_GRACE): a pending training job that needs GPUs held
# by jobs in `lent` preempts them by itself (PreemptType=preempt/partition_prio); the preempted job
# gets SIGTERM (preempt_send_user_signal; a lease job asks for it with sbatch --signal=B:TERM@N)
# and is cancelled when its grace time ends. Both partitions hold every node.
#
# State directory: slurm.conf, gres.conf, munge.key, munge.socket*, dev/nvidia* (the
# GPUs' character devices, major 195 like NVIDIA's), ctld/ (StateSaveLocation), spool/<node>/,
# log/ (slurmctld.log, slurmd-<node>.log, munged.log), pid/, ports (slurmctld port, then one port
# per node; kept across restarts when free).
#
# Facts this rests on (Debian 12, Slurm 22.05, no Docker; see ../shared/DESIGN.md):
# * several slurmd on one host: one `slurmd -N <node>` each, with its own Port= on its NodeName line
#   and %n in the spool, pid and log paths; CommunicationParameters=NoInAddrAny,NoCtldInAddrAny keeps
#   every daemon on 127.0.0.1.
# * GRES must be backed by character devices (`mknod ... c 195 N`): with plain files the node comes
#   up but jobs see no CUDA_VISIBLE_DEVICES; `Count=` without `File=` makes the node INVALID.
# * Reservations cannot hold GRES in 22.05: lent GPUs are held by a job in the `lent` partition.
# * batch_sched_delay=0,bf_interval=2: submit -> RUNNING in about a second instead of about 3.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/local/service-lib.sh
. "$here/service-lib.sh"
svc=slurm
state="${GPUPOOL_SLURM_DIR:-$state_root/slurm}"
[ -x "$py" ] || py=python3
nodes="${GPUPOOL_SLURM_NODES:-4}"
gpus="${GPUPOOL_SLURM_GPUS:-8}"
cpus="${GPUPOOL_SLURM_CPUS:-32}"
grace="${GPUPOOL_SLURM_GRACE:-30}"
exempt="${GPUPOOL_SLURM_EXEMPT:-0}"
start_timeout="${GPUPOOL_SLURM_START_TIMEOUT:-60}"

conf="$state/slurm.conf"
pidfile="$state/pid/slurmctld.pid"
munge_pid="$state/pid/munged.pid"
socket="$state/munge.socket"
export SLURM_CONF="$conf"

_node_names() {
    local i
    for ((i = 1; i <= nodes; i++)); do printf 'gpu-node-%03d\n' "$i"; done
}

_pid() {
    _pid_matching "slurmctld"
}

_alive() {
    # _alive PIDFILE PATTERN: print the pid in PIDFILE if it runs and its command line has PATTERN.
    local pid
    [ -f "$1" ] || return 1
    pid="$(cat "$1")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 1
    echo "$pid"
}

_ready() {
    # _ready TIMEOUT: wait until slurmctld answers and every node is idle (or allocated/mixed: a
    # running cluster with jobs is ready too); 0 when ready, 1 on timeout.
    local deadline=$((SECONDS + $1)) out
    while ((SECONDS < deadline)); do
        if out="$(sinfo -h -N -o '%N %t' 2>/dev/null)" && [ -n "$out" ]; then
            if [ "$(awk '$2 ~ /^(idle|alloc|mix|comp)$/' <<<"$out" | sort -u -k1,1 | wc -l)" -eq "$nodes" ]; then
                return 0
            fi
        fi
        sleep 0.3
    done
    return 1
}

_address() {
    echo "$conf"
}

_log_tails() {
    _log_tail "$state/log/slurmctld.log" "$state/log/munged.log"
    local n
    for n in $(_node_names); do _log_tail "$state/log/slurmd-$n.log"; done
}

_ports() {
    # slurmctld's port then one per node; those of the last start are kept when still free.
    local count=$((nodes + 1)) previous=()
    [ -s "$state/ports" ] && read -r -a previous <"$state/ports"
    if [ "${#previous[@]}" -ne "$count" ]; then previous=(0); fi
    "$py" "$here/ports.py" "$count" "${previous[@]}" >"$state/ports.new" || _die "could not pick free ports"
    mv "$state/ports.new" "$state/ports"
}

_write_config() {
    local ports n i=0 last
    read -r -a ports <"$state/ports"
    last="$(printf 'gpu-node-%03d' "$nodes")"
    mkdir -p "$state/dev" "$state/ctld" "$state/log" "$state/pid"
    for n in $(_node_names); do mkdir -p "$state/spool/$n"; done
    for ((g = 0; g < gpus; g++)); do
        [ -c "$state/dev/nvidia$g" ] || { rm -f "$state/dev/nvidia$g"; mknod "$state/dev/nvidia$g" c 195 "$g"; }
    done
    cat >"$conf.new" <<EOF
# Generated by deploy/local/slurm.sh at each start: do not edit (edit the script).
ClusterName=gpupool
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation=$state/ctld
SlurmctldPidFile=$state/pid/slurmctld.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdSpoolDir=$state/spool/%n
SlurmdPidFile=$state/pid/slurmd-%n.pid
SlurmdLogFile=$state/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=2,sched_min_interval=100000
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PreemptExemptTime=$(printf '%02d:%02d:%02d' $((exempt / 3600)) $((exempt % 3600 / 60)) $((exempt % 60)))
SlurmctldParameters=preempt_send_user_signal
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
EOF
    for n in $(_node_names); do
        i=$((i + 1))
        echo "NodeName=$n NodeAddr=127.0.0.1 NodeHostname=localhost Port=${ports[$i]} CPUs=$cpus RealMemory=65536 Gres=gpu:h100:$gpus State=UNKNOWN" >>"$conf.new"
    done
    cat >>"$conf.new" <<EOF
PartitionName=training Nodes=gpu-node-[001-${last#gpu-node-}] Default=YES PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
PartitionName=lent Nodes=gpu-node-[001-${last#gpu-node-}] Default=NO PriorityTier=1 PreemptMode=CANCEL GraceTime=$grace MaxTime=INFINITE State=UP
EOF
    mv "$conf.new" "$conf"
    cat >"$state/gres.conf" <<EOF
AutoDetect=off
NodeName=gpu-node-[001-${last#gpu-node-}] Name=gpu Type=h100 File=$state/dev/nvidia[0-$((gpus - 1))]
EOF
}

_start_munge() {
    if _alive "$munge_pid" munged >/dev/null; then return 0; fi
    if [ ! -s "$state/munge.key" ]; then
        (umask 077; head -c 1024 /dev/urandom >"$state/munge.key")
    fi
    chmod 0400 "$state/munge.key"
    rm -f "$socket" "$socket.lock"
    munged --force --socket="$socket" --key-file="$state/munge.key" --pid-file="$munge_pid" \
        --log-file="$state/log/munged.log" --seed-file="$state/munge.seed" 9>&- \
        || { _log_tails; _die "munged did not start"; }
    local i
    for ((i = 0; i < 50; i++)); do [ -S "$socket" ] && return 0; sleep 0.1; done
    _log_tails
    _die "munged did not create $socket"
}

cmd_start() {
    command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && command -v tini >/dev/null 2>&1 \
        || _die "slurmctld/slurmd/munge/tini not installed (bash deploy/local/install-system.sh)"
    _lock 60
    if _pid >/dev/null && _ready 5; then
        _address
        return 0
    fi
    cmd_stop_locked >/dev/null 2>&1 || true
    mkdir -p "$state"
    chmod 755 "$state"  # munged wants its socket's folders searchable by all
    _ports
    _write_config
    _start_munge
    # A marker in the daemons' environment (slurmstepd inherits it): `stop` finds what is left.
    export GPUPOOL_SLURM_CLUSTER="$state"
    # -c: a fresh cluster at each start (no jobs of an earlier run, whose processes are gone).
    slurmctld -c -f "$conf" 9>&- >>"$state/log/slurmctld.out" 2>&1 || { _log_tails; _die "slurmctld did not start"; }
    local n
    # Each slurmd runs in the foreground under `tini -s`, a child subreaper: job processes whose
    # parent died are reaped by it, as a node's init does. Where PID 1 does not reap (containers,
    # this sandbox), an orphan would stay a zombie in the job's process group and Slurm would
    # wait KillWait for it at every job end.
    for n in $(_node_names); do
        tini -s -- slurmd -D -N "$n" -f "$conf" </dev/null 9>&- >>"$state/log/slurmd.out" 2>&1 &
    done
    if ! _ready "$start_timeout"; then
        sinfo -N >&2 2>&1 || true
        _log_tails
        _die "nodes not idle within ${start_timeout} s"
    fi
    _address
}

cmd_stop_locked() {
    local f pid pids=() i
    # Jobs first: slurmd leaves running jobs alone when it stops (they survive a restart), so
    # cancel them while the controller still answers and give them KillWait to end.
    if _pid >/dev/null; then
        local jobs
        jobs="$(squeue -h -o %A 2>/dev/null || true)"
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 100; i++)); do
                [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
                sleep 0.1
            done
        fi
    fi
    for f in "$state"/pid/slurmd-*.pid "$state/pid/slurmctld.pid" "$munge_pid"; do
        [ -f "$f" ] || continue
        if pid="$(_alive "$f" slurm)" || pid="$(_alive "$f" munged)"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$f"
    done
    _wait_or_kill 10 "${pids[@]}"
    # What is left of this cluster: processes started with its marker in their environment
    # (the daemons, and slurmstepd, which slurmd forks) and everything below them.
    _kill_marked "GPUPOOL_SLURM_CLUSTER=$state"
    echo "$svc: stopped" >&2
}

cmd_stop() {
    _stop_if_running 60
}

cmd_status() {
    if ! _pid >/dev/null; then
        echo "$svc: not running" >&2
        return 1
    fi
    if _ready 2; then
        _address
        return 0
    fi
    echo "$svc: slurmctld runs but not every node is up" >&2
    return 2
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 64
        ;;
esac
