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
