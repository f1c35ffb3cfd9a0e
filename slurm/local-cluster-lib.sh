# slurm/local-cluster-lib.sh - shared by local-cluster-up.sh and local-cluster-down.sh
# shellcheck shell=bash
# (sourced, not run). Settings and the "is this daemon ours?" checks.
#
# Processes are found by the pid files our daemons write and are checked before
# being signalled: right executable, and our SLURM_CONF (slurm daemons) or our
# munge socket (munged) - never by name, so a system Slurm on the same machine
# is left alone.
export PATH="$PATH:/usr/sbin:/sbin"
DIR=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket.2
export SLURM_CONF=$CONF

LOG_TAG=${LOG_TAG:-local-cluster}
# shellcheck source=slurm/daemon-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemon-lib.sh"
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

# stop_pid PID LABEL: SIGTERM, wait up to 10 s, then SIGKILL
stop_pid() {
    local pid=$1
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do alive "$pid" || { log "stopped $2 (pid $pid)"; return 0; }; sleep 0.1; done
    log "$2 (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
    log "WARNING: $2 (pid $pid) is still alive"
    return 1
}

# stop_daemons: cancel our jobs, then stop slurmd, its leftover slurmstepds,
# slurmctld and munged (in that order). Returns non-zero if one survived.
stop_daemons() {
    local pid rc=0 jobs
    if our_pid slurmctld "$DIR/run/slurmctld.pid" >/dev/null; then
        jobs=$(timeout 5 squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            log "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            timeout 5 scancel $jobs 2>/dev/null || true
            for _ in $(seq 50); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
        fi
    fi
    if pid=$(our_pid slurmd "$DIR/run/slurmd.pid"); then stop_pid "$pid" slurmd || rc=1; fi
    # job step daemons re-parented to pid 1: ours carry our SLURM_CONF
    for pid in $(pgrep -x slurmstepd 2>/dev/null || true); do
        if alive "$pid" && has_our_conf "$pid"; then stop_pid "$pid" slurmstepd || rc=1; fi
    done
    if pid=$(our_pid slurmctld "$DIR/run/slurmctld.pid"); then stop_pid "$pid" slurmctld || rc=1; fi
    if pid=$(our_pid munged "$DIR/munge/munged.pid"); then stop_pid "$pid" munged || rc=1; fi
    return $rc
}
