# slurm/daemon-lib.sh - what the single-node (local-cluster-*) and the multi-node (multinode-*)
# test clusters share (sourced by their -lib.sh files, not run).
# shellcheck shell=bash

log() { printf '[%s %s] %s\n' "${LOG_TAG:-cluster}" "$(date +%T)" "$*" >&2; }

# Alive = exists and is not a zombie. Where pid 1 does not reap re-parented daemons
# (containers, VMs without an init), dead daemons linger as <defunct> and `kill -0` still
# succeeds on them.
alive() {
    local pid=$1 st
    [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
    st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

# Ours = started with our SLURM_CONF ($CONF) in its environment (slurm daemons, slurmstepd)
has_our_conf() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF"; }

# our_pid NAME PIDFILE: print the pid in PIDFILE if that process is our NAME
our_pid() {
    local name=$1 pidfile=$2 pid exe want
    [ -s "$pidfile" ] || return 1
    pid=$(tr -dc '0-9' <"$pidfile")
    alive "$pid" || return 1
    # Debian: /usr/sbin/slurmd -> /etc/alternatives/slurmd -> /usr/sbin/slurmd-wlm
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null || true)
    want=$(readlink -f "$(command -v "$name" || echo "/usr/sbin/$name")")
    [ -n "$exe" ] && [ "$exe" = "$want" ] || return 1
    if [ "$name" = munged ]; then
        tr '\0' '\n' <"/proc/$pid/cmdline" | grep -qxF -- "--socket=$MUNGE_SOCKET" || return 1
    else
        has_our_conf "$pid" || return 1
    fi
    echo "$pid"
}

# stop_pid PID LABEL [GRACE]: SIGTERM, wait up to GRACE (10) s, then SIGKILL; non-zero if it survived
stop_pid() {
    local pid=$1 grace=${3:-10}
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq $((grace * 10))); do alive "$pid" || { log "stopped $2 (pid $pid)"; return 0; }; sleep 0.1; done
    log "$2 (pid $pid) ignored SIGTERM for $grace s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
    log "WARNING: $2 (pid $pid) is still alive"
    return 1
}

# write_fake_gpus <count> <NodeName expression> <gres.conf to write>: the stage scripts ask for
# --gpus-per-node, and gres/gpu needs File= entries that are character devices: clones of
# /dev/null under $DIR/fakegpu (the CPU build runs the job).
write_fake_gpus() {
    local count=$1 nodes=$2 out=$3 i
    : >"$out"
    [ "$count" -gt 0 ] || return 0
    mkdir -p "$DIR/fakegpu"
    for ((i = 0; i < count; i++)); do
        [ -c "$DIR/fakegpu/nvidia$i" ] || mknod "$DIR/fakegpu/nvidia$i" c 1 3
    done
    echo "NodeName=$nodes Name=gpu File=$DIR/fakegpu/nvidia[0-$((count - 1))]" >"$out"
}
