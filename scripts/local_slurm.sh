#!/usr/bin/env bash
# A one-host Slurm cluster on this machine, for the tests and for trying `srun`/`sbatch` locally.
#
#   scripts/local_slurm.sh          install (if needed), configure and start munged, slurmctld, slurmd
#   scripts/local_slurm.sh stop     stop the three daemons
#   scripts/local_slurm.sh status   show whether the controller answers and the node's state
#
# Needs root on a Debian-like system (apt-get installs `slurm-wlm` and `munge` when missing).
# Made for containers and CI machines without systemd or cgroups: the daemons are started
# directly, processes are tracked by parent pid (proctrack/linuxproc), and no task plugin binds
# CPUs (task/none). This host is both the controller and the only compute node, with the CPUs and
# memory `slurmd -C` reports, in one partition `debug`. Running it again while the cluster is up
# changes nothing. The config goes to /etc/slurm/slurm.conf (the path srun/sbatch read by default);
# one we did not write is never overwritten.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by distribuuuu scripts/local_slurm.sh"
STATE=/var/lib/distribuuuu-slurm   # controller state, slurmd spool, logs, pid files
LOGS=$STATE/log
TIMEOUT_S=${LOCAL_SLURM_TIMEOUT_S:-60}

log() { echo "[local_slurm] $*"; }
die() { echo "[local_slurm] error: $*" >&2; exit 1; }

# True if the pid file names a live process of that daemon (a stale file's pid may be reused).
pid_alive() {
    local pid
    pid=$(cat "$STATE/$1.pid" 2>/dev/null) || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}

stop_daemon() {
    local pid i
    if pid_alive "$1"; then
        pid=$(cat "$STATE/$1.pid")
        kill "$pid"
        for i in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
        [ -d "/proc/$pid" ] && kill -9 "$pid"
        log "stopped $1 (pid $pid)"
    fi
    rm -f "$STATE/$1.pid"
}

stop() {
    # slurmd first, so no step is started while the controller goes away; then munged.
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon munged
}

status() {
    if scontrol ping >/dev/null 2>&1; then
        scontrol ping
        sinfo -N -o "%N %P %T %c %m"
    else
        echo "no Slurm controller answers (start one with $0)"
        return 1
    fi
}

node_idle() {
    # "idle" or "mixed"/"allocated" (jobs left from an earlier run) all take new work.
    local st
    st=$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -1) || return 1
    case "$st" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    [ ${#missing[@]} -eq 0 ] && return
    command -v apt-get >/dev/null || die "${missing[*]} missing and no apt-get to install them"
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

start_munge() {
    # munged refuses keys or directories that others can write; the package sets them up, we check.
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
    fi
    local user=munge
    id munge >/dev/null 2>&1 || user=root
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown "$user" /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        # Already running (ours, or one the package's install script started).
        [ -f /run/munge/munged.pid ] && cp /run/munge/munged.pid "$STATE/munged.pid"
        return
    fi
    log "starting munged"
    if [ "$user" = root ]; then munged --force; else runuser -u munge -- munged; fi
    local i
    for i in $(seq 50); do
        [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n </dev/null | unmunge >/dev/null 2>&1 || die "munged does not answer (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$STATE/munged.pid"
}

write_conf() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; move it away to use the local cluster"
    fi
    # slurmd -C prints this machine's NodeName line (CPUs, sockets, cores, threads, RealMemory).
    local hw cpus boards sockets cores threads mem
    hw=$(slurmd -C | head -1)
    field() { echo "$hw" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
    cpus=$(field CPUs); boards=$(field Boards); sockets=$(field SocketsPerBoard)
    cores=$(field CoresPerSocket); threads=$(field ThreadsPerCore); mem=$(field RealMemory)
    [ -n "$cpus" ] && [ -n "$mem" ] || die "cannot read CPUs/RealMemory from 'slurmd -C': $hw"
    # Memory reported at registration must be >= RealMemory or the node is drained; leave 5% slack.
    mem=$((mem * 95 / 100))
    local new
    new=$(cat <<EOF
$MARK
# One host: controller and only compute node. Stop with: scripts/local_slurm.sh stop
ClusterName=local
SlurmctldHost=$NODE($ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
# No systemd or writable cgroups in containers: track tasks by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SchedulerType=sched/backfill
# Cores are the unit of allocation; memory is not tracked (jobs need no --mem).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Keep finished jobs visible to 'scontrol show job' for 10 minutes (no accounting database).
MinJobAge=600
# After SIGTERM a task gets KillWait seconds to exit before SIGKILL (Slurm's default is 30).
KillWait=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeAddr=$ADDR CPUs=$cpus Boards=${boards:-1} SocketsPerBoard=${sockets:-1} CoresPerSocket=${cores:-$cpus} ThreadsPerCore=${threads:-1} RealMemory=$mem State=UNKNOWN
# OverSubscribe: up to 4 jobs may share a core, so tests can start jobs on a 2-core machine.
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
)
    if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$new" ]; then
        CONF_CHANGED=0
    else
        mkdir -p "$CONF_DIR"
        echo "$new" >"$CONF"
        CONF_CHANGED=1
        log "wrote $CONF ($NODE: $cpus CPUs, ${mem} MB)"
    fi
    # Present but empty: some builds read it even with proctrack/linuxproc.
    [ -f "$CONF_DIR/cgroup.conf" ] || echo "# not used: proctrack/linuxproc, task/none" >"$CONF_DIR/cgroup.conf"
}

start() {
    [ "$(id -u)" = 0 ] || die "run me as root (the daemons and /etc/slurm need it)"
    install_packages
    NODE=$(hostname -s)
    # The master address the training processes use is this name; it must resolve to this host.
    if ! getent hosts "$NODE" >/dev/null; then
        log "adding '127.0.1.1 $NODE' to /etc/hosts (the host name did not resolve)"
        echo "127.0.1.1 $NODE" >>/etc/hosts
    fi
    ADDR=$(getent ahostsv4 "$NODE" | awk 'NR == 1 {print $1}')
    mkdir -p "$STATE/ctld" "$STATE/d" "$LOGS"
    start_munge
    write_conf
    if [ "$CONF_CHANGED" = 1 ] && { pid_alive slurmctld || pid_alive slurmd; }; then
        log "config changed: restarting slurmctld and slurmd"
        stop_daemon slurmd
        stop_daemon slurmctld
    fi
    local t0=$SECONDS
    # -i: start even if the saved state does not fit this config (e.g. another host name or CPU count).
    pid_alive slurmctld || { log "starting slurmctld"; slurmctld -i; }
    pid_alive slurmd || { log "starting slurmd"; slurmd; }
    until scontrol ping >/dev/null 2>&1 && node_idle; do
        if [ $((SECONDS - t0)) -ge "$TIMEOUT_S" ]; then
            sinfo -N -l || true
            tail -n 20 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 || true
            die "node $NODE not up after ${TIMEOUT_S}s (logs in $LOGS)"
        fi
        # A node drained by an earlier, failed registration comes back once the config is right.
        if sinfo -h -N -n "$NODE" -o %T 2>/dev/null | grep -qE 'drain|down'; then
            scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true
        fi
        sleep 0.5
    done
    log "up: node $NODE $(sinfo -h -N -n "$NODE" -o '%T, %c CPUs, partition %P')"
    log "try: srun -n 2 hostname; stop with: $0 stop (logs in $LOGS)"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) die "usage: $0 [start|stop|status]" ;;
esac
