#!/usr/bin/env bash
# slurm/multinode-down.sh - take down the multi-host test cluster of slurm/multinode-up.sh.
# Idempotent (nothing there: exit 0), bounded (every wait has a limit), and it only touches
# what that script created:
#   1. cancel the cluster's jobs (bounded wait)
#   2. stop every slurmd, slurmctld and munged by the pid in its pid file, each checked to be
#      ours (executable + our SLURM_CONF, or our munge socket)
#   3. stop, by pid, whatever still runs inside the namespaces the cluster created (left-over
#      slurmstepd, MPI ranks, orted): they are ours by construction
#   4. unmount the UTS namespace files, delete the namespaces listed in $MN_DIR/netns.list,
#      and drop the root namespace's "unreachable" guard route
#   --purge: also delete $MN_DIR (only if it carries multinode-up's marker file)
# Never kills by name. Exit status non-zero if something could not be stopped or removed.
set -uo pipefail
LOG_TAG=multinode-down
# shellcheck source=slurm/multinode-lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/multinode-lib.sh"
PURGE=0; [ "${1:-}" = --purge ] && PURGE=1
[ "$(id -u)" = 0 ] || { echo "multinode-down: run as root" >&2; exit 1; }
rc=0
NSLIST=()
[ -s "$DIR/netns.list" ] && mapfile -t NSLIST <"$DIR/netns.list"
# the login node's name as the running cluster knows it (the settings may have changed since)
[ -s "$DIR/env.sh" ] && CTL=$(sed -n 's/.* MN_LOGIN=\([^ ]*\).*/\1/p' "$DIR/env.sh" | head -n1)

# 1. jobs
if [ -x "$DIR/bin/mn-exec" ] && our_pid slurmctld "$DIR/run/slurmctld.pid" >/dev/null; then
    jobs=$(on_node "$CTL" squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
        log "cancelling jobs: ${jobs//$'\n'/ }"
        # shellcheck disable=SC2086
        on_node "$CTL" scancel $jobs 2>/dev/null || true
        for _ in $(seq 50); do
            [ -z "$(on_node "$CTL" squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
fi

# 2. daemons
for f in "$DIR"/node/*/slurmd.pid; do
    [ -e "$f" ] || continue
    if pid=$(our_pid slurmd "$f"); then stop_pid "$pid" "slurmd ${f#"$DIR"/node/}" || rc=1; fi
done
if pid=$(our_pid slurmctld "$DIR/run/slurmctld.pid"); then stop_pid "$pid" slurmctld || rc=1; fi
if pid=$(our_pid munged "$DIR/munge/munged.pid"); then stop_pid "$pid" munged || rc=1; fi

# 3. anything left inside our namespaces
for ns in "${NSLIST[@]}"; do
    [ -e "/run/netns/$ns" ] || continue
    for pid in $(timeout 10 ip netns pids "$ns" 2>/dev/null || true); do
        [ "$pid" = $$ ] && continue
        alive "$pid" || continue
        log "left over in $ns: pid $pid ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-80))"
        # (a slurmstepd whose srun vanished with a lost host ignores SIGTERM: short grace)
        stop_pid "$pid" "left-over pid $pid" 3 || rc=1
    done
done

# 4. namespaces, mounts, guard route
for f in "$DIR"/ns/*.uts; do
    [ -e "$f" ] || continue
    if findmnt -n "$f" >/dev/null 2>&1; then umount "$f" || { log "WARNING: umount $f failed"; rc=1; }; fi
    rm -f "$f"
done
for ((i = ${#NSLIST[@]} - 1; i >= 0; i--)); do   # nodes first, the switch last
    ns=${NSLIST[$i]}
    [ -e "/run/netns/$ns" ] || continue
    if ip netns del "$ns"; then log "deleted netns $ns"; else log "WARNING: ip netns del $ns failed"; rc=1; fi
done
[ -d "$DIR" ] && : >"$DIR/netns.list"
if [ -s "$DIR/topology" ]; then
    net=$(sed -n 's/.*subnet=\([0-9.]*\).*/\1/p' "$DIR/topology")
    if [ -n "$net" ] && ip -4 route show root "$net.0/24" | sed 's/ *$//' | grep -qxF "unreachable $net.0/24"; then
        ip route del unreachable "$net.0/24" && log "removed guard route unreachable $net.0/24"
    fi
    rm -f "$DIR/topology"
fi

if [ $PURGE = 1 ] && [ -d "$DIR" ]; then
    if [ -e "$DIR/.multinode-cluster" ]; then
        rm -rf "$DIR" && log "purged $DIR"
    else
        log "not removing $DIR (no .multinode-cluster marker)"
    fi
fi
exit $rc
