#!/usr/bin/env bash
# A one-node Slurm on this machine, on loopback only, to rehearse `fedlight reproduce --launcher slurm` (and what
# tests/slurm_cluster.py starts for the real-Slurm tests). Needs root and Debian's packages (installed when missing).
#
#   tools/slurm_single_node.sh start [DIR]   # install if needed, write DIR/slurm.conf, start munged, slurmctld, slurmd
#   export SLURM_CONF=DIR/slurm.conf          # what sbatch, squeue, scontrol, scancel then talk to
#   tools/slurm_single_node.sh stop [DIR]    # cancel the jobs, stop the daemons
#
# DIR (default /tmp/fedlight-slurm) holds the config, the munge key and socket, state, spool and logs, so nothing in
# /etc is touched. FEDLIGHT_SLURM_PORT (default 6817) is slurmctld's port, slurmd takes the next one;
# FEDLIGHT_SLURM_KILLWAIT (default 30, Slurm's) the seconds between a job's SIGTERM and SIGKILL. Every wait is
# bounded: `start` gives up after FEDLIGHT_SLURM_WAIT seconds (default 60) with the log that says why.
set -euo pipefail
cmd=${1:-}
dir=$(realpath -m "${2:-/tmp/fedlight-slurm}")
port=${FEDLIGHT_SLURM_PORT:-6817}
wait_s=${FEDLIGHT_SLURM_WAIT:-60}
sbin=/usr/sbin
export SLURM_CONF=$dir/slurm.conf

die() { echo "slurm_single_node: $*" >&2; exit 1; }

install() {
    [ -x $sbin/slurmctld ] && [ -x $sbin/slurmd ] && [ -x $sbin/munged ] && command -v sbatch >/dev/null && return
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and this is not root: install slurmctld slurmd slurm-client munge"
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
    echo "slurm_single_node: installing slurmctld slurmd slurm-client munge (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -qq >&2 || die "apt-get update failed"
    timeout 600 apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2 \
        || die "apt-get install of slurmctld slurmd slurm-client munge failed"
}

write_conf() {
    local hw cpus mem
    hw=$($sbin/slurmd -C | head -1)
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    [ -n "$cpus" ] && [ -n "$mem" ] || die "slurmd -C did not report CPUs and RealMemory: $hw"
    cat >"$dir/slurm.conf" <<EOF
ClusterName=fedlight
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=600
KillWait=${FEDLIGHT_SLURM_KILLWAIT:-30}
NodeName=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$(hostname -s) Default=YES MaxTime=INFINITE State=UP
EOF
}

stop_pid() {  # stop_pid FILE: SIGTERM, up to 10 s, then SIGKILL
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

start() {
    install
    [ "$(id -u)" = 0 ] || die "the daemons run as root here; run as root (or use a cluster's Slurm)"
    [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null \
        && die "a Slurm already runs from $dir; stop it first: $0 stop $dir"
    mkdir -p "$dir/state" "$dir/spool" && chmod 700 "$dir"
    [ -f "$dir/munge.key" ] || { dd if=/dev/urandom of="$dir/munge.key" bs=1k count=1 2>/dev/null; chmod 400 "$dir/munge.key"; }
    write_conf
    $sbin/munged --force --socket="$dir/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" || die "munged did not start: $dir/munged.log"
    $sbin/slurmctld -c -i || die "slurmctld did not start: $dir/slurmctld.log"
    $sbin/slurmd -N "$(hostname -s)" || die "slurmd did not start: $dir/slurmd.log"
    local deadline=$((SECONDS + wait_s)) st=""
    until [ "$st" = idle ]; do
        [ $SECONDS -lt $deadline ] || { tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2;
                                        die "the node is not idle after ${wait_s} s (state: ${st:-none})"; }
        sleep 0.5
        st=$(timeout 10 sinfo -h -N -o %T 2>/dev/null | head -1 || true)
    done
    echo "slurm_single_node: up; export SLURM_CONF=$dir/slurm.conf"
}

stop() {
    [ -f "$dir/slurm.conf" ] || return 0
    if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        timeout 10 scancel --full --signal=KILL --quiet 2>/dev/null || true  # every job's processes, at once
        timeout 10 scancel --quiet 2>/dev/null || true
        for _ in $(seq 100); do  # bounded: 20 s
            [ -z "$(timeout 5 squeue -h -t R,CG 2>/dev/null)" ] && break; sleep 0.2
        done
    fi
    stop_pid "$dir/slurmd.pid"
    stop_pid "$dir/slurmctld.pid"
    stop_pid "$dir/munged.pid"
}

case "$cmd" in
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 start|stop [DIR]" ;;
esac
