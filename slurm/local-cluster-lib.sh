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
