# slurm/multinode-lib.sh - shared by multinode-up.sh and multinode-down.sh (sourced, not run):
# settings, names and the "is this process ours?" checks.
# shellcheck shell=bash disable=SC2034  # (the settings are used by the scripts that source this)
#
# Processes are found by the pid files our daemons write (or by `ip netns pids` of namespaces
# this cluster created) and are checked before being signalled: right executable, and our
# SLURM_CONF (slurm daemons) or our munge socket (munged). Never by name.
export PATH="$PATH:/usr/sbin:/sbin"

DIR=${MN_DIR:-/tmp/workbook-multinode}   # state, config, logs, wrappers (bin/), env.sh
NNODES=${MN_NODES:-2}                     # compute nodes ${P}1 .. ${P}N
P=${MN_PREFIX:-wbn}                       # names: ${P}sw (switch) ${P}ctl (login) ${P}1 ...
NET=${MN_SUBNET:-10.213.8}                # a private /24, first three octets
TIMEOUT=${MN_TIMEOUT:-60}                 # seconds for each wait
SW=${P}sw
CTL=${P}ctl
NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("$P$i"); done
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket.2
export SLURM_CONF=$CONF

LOG_TAG=${LOG_TAG:-multinode}
# shellcheck source=slurm/daemon-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemon-lib.sh"

# run a command "on" a node (its network + UTS namespace, the cluster's /etc/hosts), bounded
on_node() { local h=$1; shift; timeout "${ON_NODE_TIMEOUT:-10}" "$DIR/bin/mn-exec" "$h" "$@"; }
