#!/usr/bin/env bash
# slurm/local-cluster-down.sh - stop the cluster that slurm/local-cluster-up.sh started:
# cancels its jobs, then stops slurmd, leftover slurmstepds, slurmctld and munged by the pids
# in their pid files, after checking each is ours (never by name). Nothing running: exit 0.
#   --purge   also delete $SLURM_LOCAL_DIR (only under /tmp) and our /etc/slurm/slurm.conf link
set -euo pipefail
LOG_TAG=local-cluster-down
# shellcheck source=slurm/local-cluster-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/local-cluster-lib.sh"

rc=0
stop_daemons || rc=1
if [ "${1:-}" = --purge ]; then
    [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$CONF" ] && rm -f /etc/slurm/slurm.conf
    case $DIR in /tmp/?*) rm -rf "$DIR" ;; *) log "not removing $DIR (not under /tmp)" ;; esac
fi
exit $rc
