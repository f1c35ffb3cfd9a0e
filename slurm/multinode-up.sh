#!/usr/bin/env bash
# slurm/multinode-up.sh - a throwaway MULTI-HOST Slurm cluster on one machine, for
# `make test-multinode` and for trying the job scripts with --nodes=2. Run as root.
#
#   bash slurm/multinode-up.sh                    # prints the env file (/tmp/workbook-multinode/env.sh)
#   /tmp/workbook-multinode/bin/mn-login          # a shell on the login node, env.sh sourced
#   ... sbatch --nodes=2 --ntasks-per-node=2 --gpus-per-node=2 slurm/stage-3.sh
#   bash slurm/multinode-down.sh [--purge]        # stops what this script started
#
# Every "host" is a network namespace (its own eth0, IP address and TCP ports) plus a UTS
# namespace (its own hostname), running its own slurmd; a bridge in a "switch" namespace joins
# them. So MPI traffic between hosts really crosses a (virtual) network, and the switch ports'
# byte counters show it. Defaults:
#
#     wbnsw: bridge br0 --+-- p-wbnctl <-> wbnctl eth0 10.213.8.1   login node + slurmctld
#                         +-- p-wbn1   <-> wbn1   eth0 10.213.8.11  slurmd, 4 CPUs, 4 fake GPUs
#                         +-- p-wbn2   <-> wbn2   eth0 10.213.8.12  slurmd, 4 CPUs, 4 fake GPUs
#
# The subnet exists only inside these namespaces: none has a default route, and the root
# namespace gets an "unreachable" route for it, so nothing can leave the machine. One munged
# runs in the root namespace; its socket is a file, which every namespace can reach.
# `bin/mn-exec NODE CMD` runs CMD on a node, `bin/mn-login CMD` on the login node with env.sh
# sourced, and `bin/mn-rsh` is an ssh stand-in for plain `mpirun --host wbn1:2,wbn2:2` (no sshd).
# Slurm and MPI commands only work inside the namespaces (mn-login / mn-exec).
#
# Idempotent: with the same settings a second run only checks (< 1 s); a changed slurm.conf
# restarts the daemons, a changed topology rebuilds everything. Every wait is bounded
# (MN_TIMEOUT). On failure it prints the daemons' logs and takes down what exists (by pid).
#
# Settings (environment): MN_DIR=/tmp/workbook-multinode MN_NODES=2 MN_PREFIX=wbn
#   MN_SUBNET=10.213.8 MN_CPUS=4 MN_MEM_MB=8192 MN_GPUS=4 (fake, per node) MN_TIMEOUT=60
#   MN_SKIP_INSTALL=1 (never call apt-get)
# Built on the recipe in the reference notes (multinode/README.md); its pitfalls are the
# comments below.
set -euo pipefail
LOG_TAG=multinode-up
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/multinode-lib.sh
source "$HERE/multinode-lib.sh"
CPUS=${MN_CPUS:-4}
MEM_MB=${MN_MEM_MB:-8192}
GPUS=${MN_GPUS:-4}

[ "$(id -u)" = 0 ] || { echo "multinode-up: run as root (namespaces, daemons)" >&2; exit 1; }
die() { log "ERROR: $*"; exit 1; }
# (bad settings stop here, before the trap below could touch a cluster that runs)
if ! [[ $NNODES =~ ^[0-9]+$ ]] || [ "$NNODES" -lt 1 ] || [ "$NNODES" -gt 50 ]; then die "MN_NODES must be 1..50"; fi
[[ $P =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "MN_PREFIX must be 1-8 characters [a-z0-9], starting with a letter"
[[ $NET =~ ^(10\.[0-9]+\.[0-9]+|172\.(1[6-9]|2[0-9]|3[01])\.[0-9]+|192\.168\.[0-9]+)$ ]] ||
    die "MN_SUBNET must be the first three octets of a private /24 (10.x.y, 172.16-31.y, 192.168.y)"
case $DIR in /*) ;; *) die "MN_DIR must be an absolute path" ;; esac

# ---- on failure: the daemons' logs, then take down what is there (by pid, ours only): a half-up
# cluster is of no use, and a re-run starts clean ------------------------------------------------
on_exit() {
    local rc=$? f
    [ $rc -eq 0 ] && return 0
    for f in "$DIR/munge/munged.log" "$DIR/log/slurmctld.log" "$DIR"/node/*/slurmd.log; do
        [ -s "$f" ] && { echo "----- tail $f" >&2; tail -n 15 "$f" >&2; }
    done
    log "FAILED (exit $rc): taking the cluster down"
    MN_DIR=$DIR timeout 120 bash "$HERE/multinode-down.sh" >&2 || true
}
trap on_exit EXIT

# ---- packages (Debian/Ubuntu), as slurm/local-cluster-up.sh ----------------------------------
PKGS=(slurmctld slurmd slurm-client munge libpmix-dev openmpi-bin libopenmpi-dev iproute2 util-linux)
ensure_packages() {
    local missing=() p policy=0 rc=0
    for p in "${PKGS[@]}"; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "${MN_SKIP_INSTALL:-0}" = 1 ] && die "missing packages: ${missing[*]}"
    log "installing ${missing[*]} (log: $DIR/log/apt.log)"
    # policy-rc.d exit 101: keep the packages from starting a system munged/slurmctld/slurmd
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\n# multinode-up temporary\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d; policy=1
    fi
    {
        export DEBIAN_FRONTEND=noninteractive
        timeout 600 apt-get -o DPkg::Lock::Timeout=300 -q update &&
        timeout 600 apt-get -o DPkg::Lock::Timeout=300 -q install -y --no-install-recommends "${missing[@]}"
    } >"$DIR/log/apt.log" 2>&1 || rc=$?
    [ $policy = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ $rc -eq 0 ] || { tail -n 20 "$DIR/log/apt.log" >&2; die "apt-get failed (exit $rc)"; }
}

# ---- network ------------------------------------------------------------------------------------
addr_of() { # host -> IPv4 address
    case $1 in "$CTL") echo "$NET.1" ;; *) echo "$NET.$((10 + ${1#"$P"}))" ;; esac
}
check_subnet_free() {
    # the root namespace must not use the subnet: no address in it, no route into it but our guard
    if ip -4 -o addr show | grep -qF " $NET."; then die "subnet $NET.0/24 is used by a root-namespace address"; fi
    local other
    other=$(ip -4 route show root "$NET.0/24" | sed 's/ *$//' | grep -vxF "unreachable $NET.0/24" || true)
    [ -z "$other" ] || die "subnet $NET.0/24 overlaps root-namespace routes: $other"
}
ensure_guard_route() { # a root-namespace client can never send this subnet's packets out of eth0
    ip -4 route show root "$NET.0/24" | sed 's/ *$//' | grep -qxF "unreachable $NET.0/24" ||
        ip route add unreachable "$NET.0/24"
}
ensure_ns() {
    [ -e "/run/netns/$1" ] || ip netns add "$1"
    grep -qxF "$1" "$DIR/netns.list" 2>/dev/null || echo "$1" >>"$DIR/netns.list"
    ip -n "$1" link set lo up
}
ensure_switch() {
    ensure_ns "$SW"
    ip -n "$SW" link show br0 >/dev/null 2>&1 || ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
}
ensure_uts() { # a persistent UTS namespace per host (a bind-mounted nsfs file): hostname = node
    # name. Without it every "node" is called the same, and Open MPI's shared-memory segments
    # (/dev/shm/vader_segment.<hostname>...) of different nodes overwrite each other: SIGSEGV.
    local f=$DIR/ns/$1.uts
    if findmnt -n "$f" >/dev/null 2>&1; then
        nsenter --uts="$f" hostname "$1"
    else
        : >"$f"
        unshare --uts="$f" hostname "$1"
    fi
}
ensure_host() {
    local h=$1
    ensure_ns "$h"
    # a veth pair, not a dummy device (this kernel has none): slurmd needs a non-loopback
    # address to bind ("Address family not supported by protocol" otherwise)
    if ! ip -n "$h" link show eth0 >/dev/null 2>&1; then
        ip -n "$SW" link del "p-$h" 2>/dev/null || true
        ip link add "p-$h" netns "$SW" type veth peer name eth0 netns "$h"
    fi
    ip -n "$SW" link set "p-$h" master br0 up
    ip -n "$h" addr replace "$(addr_of "$h")/24" dev eth0
    ip -n "$h" link set eth0 up
    ensure_uts "$h"
    mkdir -p "$DIR/node/$h/spool" "$DIR/node/$h/tmp" "$DIR/node/$h/shm"
    chmod 1777 "$DIR/node/$h/tmp" "$DIR/node/$h/shm"
}

# ---- wrappers: mn-exec, mn-rsh, mn-login --------------------------------------------------------
write_wrappers() {
    local h
    {
        echo "127.0.0.1 localhost"
        echo "$(addr_of "$CTL") $CTL"
        for h in "${NODES[@]}"; do echo "$(addr_of "$h") $h"; done
    } >"$DIR/etc/hosts"
    # mn-exec NODE [CMD...]: CMD in NODE's network and UTS namespaces and a private mount
    # namespace where /etc/hosts is the cluster's and /dev/shm is the node's own.
    # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05
    # then dies with "No filesystem mounted on /sys/fs/cgroup".
    cat >"$DIR/bin/mn-exec" <<EOF
#!/bin/bash
# generated by slurm/multinode-up.sh: mn-exec NODE [CMD ARGS...] runs CMD "on" NODE
set -euo pipefail
D=$DIR
EOF
    cat >>"$DIR/bin/mn-exec" <<'EOF'
if [ "${1:-}" = --in-mntns ]; then
    shift; node=$1; shift
    mount --bind "$D/etc/hosts" /etc/hosts
    mount --bind "$D/node/$node/shm" /dev/shm
    exec "$@"
fi
node=${1:?usage: mn-exec NODE [CMD ARGS...]}; shift
[ $# -gt 0 ] || set -- /bin/bash
if [ ! -e "/run/netns/$node" ] || [ ! -e "$D/ns/$node.uts" ] || [ ! -d "$D/node/$node" ]; then
    echo "mn-exec: unknown node '$node'" >&2; exit 255
fi
exec nsenter --net="/run/netns/$node" --uts="$D/ns/$node.uts" -- \
    unshare --mount --propagation private -- "$(readlink -f "$0")" --in-mntns "$node" "$@"
EOF
    # mn-rsh HOST CMDLINE: an ssh stand-in for Open MPI's plm/rsh (OMPI_MCA_plm_rsh_agent)
    cat >"$DIR/bin/mn-rsh" <<EOF
#!/bin/sh
# generated by slurm/multinode-up.sh: ssh-compatible agent, runs CMDLINE on HOST via mn-exec
D=$DIR
EOF
    cat >>"$DIR/bin/mn-rsh" <<'EOF'
while [ $# -gt 0 ]; do
    case $1 in
        -[oplicFEJLRDWbmw]) shift 2 ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=${1:?usage: mn-rsh HOST COMMAND...}; shift
exec "$D/bin/mn-exec" "$host" /bin/sh -c "$*"
EOF
    cat >"$DIR/bin/mn-login" <<EOF
#!/bin/bash
# generated by slurm/multinode-up.sh: mn-login [CMD...] runs CMD on the login node, env.sh sourced
exec "$DIR/bin/mn-exec" "$CTL" /bin/bash -c 'source "\$0"; [ \$# -gt 0 ] || set -- /bin/bash; exec "\$@"' "$DIR/env.sh" "\$@"
EOF
    chmod 755 "$DIR/bin/mn-exec" "$DIR/bin/mn-rsh" "$DIR/bin/mn-login"
}

write_env() {
    cat >"$DIR/env.sh" <<EOF
# generated by slurm/multinode-up.sh; source me inside a cluster namespace (mn-login does)
export MN_DIR=$DIR MN_LOGIN=$CTL MN_SWITCH=$SW MN_NODE_NAMES="${NODES[*]}" MN_SUBNET=$NET.0/24
export SLURM_CONF=$CONF
case :\$PATH: in *:$DIR/bin:*) ;; *) export PATH=$DIR/bin:\$PATH ;; esac
# mpirun as root; more ranks than cores: yield instead of busy-polling
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
# every byte between ranks over TCP on the cluster network (between hosts: the veth links)
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,tcp
export OMPI_MCA_btl_tcp_if_include=$NET.0/24 OMPI_MCA_oob_tcp_if_include=$NET.0/24
# plain 'mpirun --host ${NODES[0]}:2,...' starts its remote daemons through mn-rsh (no sshd)
export OMPI_MCA_plm_rsh_agent=$DIR/bin/mn-rsh
EOF
}

# ---- slurm.conf ---------------------------------------------------------------------------------
write_config() { # -> $CONF.new, gres.conf.new
    local h i gres=""
    [ "$GPUS" -gt 0 ] && gres=" Gres=gpu:$GPUS"
    {
        echo "# generated by slurm/multinode-up.sh: throwaway multi-host test cluster in namespaces"
        echo "ClusterName=wbmulti"
        # name(address): addresses are used, so nothing needs to resolve names
        echo "SlurmctldHost=$CTL($(addr_of "$CTL"))"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "SlurmctldPort=6817"
        echo "SlurmdPort=6818"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$MUNGE_SOCKET"
        echo "StateSaveLocation=$DIR/ctld"
        # %n = node name: per-node spool, pid, log and PMIx (TmpFS) directories
        echo "SlurmdSpoolDir=$DIR/node/%n/spool"
        echo "SlurmdPidFile=$DIR/node/%n/slurmd.pid"
        echo "SlurmdLogFile=$DIR/node/%n/slurmd.log"
        echo "TmpFS=$DIR/node/%n/tmp"
        echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SchedulerParameters=batch_sched_delay=0"
        echo "MpiDefault=pmix"
        # a node that comes back (link up again) returns to service by itself; a job on a node
        # that failed is not requeued (the test wants to see it end)
        echo "ReturnToService=2"
        echo "JobRequeue=0"
        echo "SlurmdParameters=config_overrides"
        echo "SlurmctldTimeout=30"
        echo "SlurmdTimeout=30"
        echo "InactiveLimit=0"
        echo "KillWait=5"
        echo "MinJobAge=300"
        # job ids (and so slurm/logs/stage-N-<id>.out) apart from the one-node test cluster's
        echo "FirstJobId=70001"
        echo "MailProg=/bin/true"
        [ "$GPUS" -gt 0 ] && echo "GresTypes=gpu"
        for h in "${NODES[@]}"; do
            echo "NodeName=$h NodeAddr=$(addr_of "$h") CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=${P}[1-$NNODES] Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF.new"
    write_fake_gpus "$GPUS" "${P}[1-$NNODES]" "$DIR/etc/gres.conf.new"
}

# ---- daemons ------------------------------------------------------------------------------------
ping_ctld() { on_node "$CTL" scontrol ping 2>/dev/null | grep -q 'is UP'; }
start_munged() {
    our_pid munged "$DIR/munge/munged.pid" >/dev/null && return 0
    [ -s "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    timeout "$TIMEOUT" munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed" || die "munged failed to start"
    for _ in $(seq $((TIMEOUT * 10))); do
        munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged is not answering on $MUNGE_SOCKET"
}
start_slurmctld() {
    our_pid slurmctld "$DIR/run/slurmctld.pid" >/dev/null && return 0
    # -c: forget the jobs and DOWN/DRAIN node states of an earlier run
    (cd "$DIR" && timeout "$TIMEOUT" "$DIR/bin/mn-exec" "$CTL" slurmctld -c -i) || die "slurmctld failed to start"
    for _ in $(seq $((TIMEOUT * 10))); do ping_ctld && return 0; sleep 0.1; done
    die "slurmctld is not answering"
}
start_slurmd() {
    local h=$1
    our_pid slurmd "$DIR/node/$h/slurmd.pid" >/dev/null && return 0
    (cd "$DIR" && timeout "$TIMEOUT" "$DIR/bin/mn-exec" "$h" slurmd -N "$h") || die "slurmd on $h failed to start"
    for _ in $(seq $((TIMEOUT * 10))); do
        our_pid slurmd "$DIR/node/$h/slurmd.pid" >/dev/null && return 0
        sleep 0.1
    done
    die "slurmd on $h did not come up"
}
stop_slurm() {
    local pid f
    for f in "$DIR"/node/*/slurmd.pid; do
        [ -e "$f" ] || continue
        if pid=$(our_pid slurmd "$f"); then stop_pid "$pid" "slurmd (${f#"$DIR"/node/})" || die "cannot stop slurmd"; fi
    done
    if pid=$(our_pid slurmctld "$DIR/run/slurmctld.pid"); then stop_pid "$pid" slurmctld || die "cannot stop slurmctld"; fi
}
wait_idle() { # every node idle (resume DOWN/DRAIN ones once)
    local i st="" bad resumed=0
    for i in $(seq $((TIMEOUT * 5))); do
        st=$(on_node "$CTL" sinfo -h -N -o '%N %T' 2>/dev/null || true)
        bad=$(awk '$2 !~ /^(idle|mixed|allocated|completing)$/' <<<"$st")
        if [ -n "$st" ] && [ -z "$bad" ] && [ "$(grep -c . <<<"$st")" -eq "$NNODES" ]; then return 0; fi
        if [ $resumed = 0 ] && [ "$i" -gt 10 ] && grep -qE 'drain|down|inval|fail' <<<"$bad"; then
            log "resuming: ${bad//$'\n'/ }"
            on_node "$CTL" scontrol update nodename="${P}[1-$NNODES]" state=resume 2>/dev/null || true
            resumed=1
        fi
        sleep 0.2
    done
    die "nodes not idle after ${TIMEOUT} s: ${st//$'\n'/ }"
}

# ---- main ---------------------------------------------------------------------------------------
T0=$(date +%s.%N)
mkdir -p "$DIR"/{etc,ctld,log,run,munge,ns,bin,node}
chmod 755 "$DIR" "$DIR/munge"
[ -e "$DIR/.multinode-cluster" ] || echo "created by slurm/multinode-up.sh" >"$DIR/.multinode-cluster"
ensure_packages
for c in slurmctld slurmd munged nsenter unshare ip mpirun; do
    command -v "$c" >/dev/null || die "$c is not on PATH"
done

TOPO="nodes=$NNODES prefix=$P subnet=$NET"
if [ -s "$DIR/topology" ] && [ "$(cat "$DIR/topology")" != "$TOPO" ]; then
    log "topology changed ($(cat "$DIR/topology") -> $TOPO): tearing down first"
    MN_DIR=$DIR timeout 120 bash "$HERE/multinode-down.sh" || die "multinode-down.sh failed"
    mkdir -p "$DIR"/{etc,ctld,log,run,munge,ns,bin,node}
fi
check_subnet_free
ensure_guard_route
echo "$TOPO" >"$DIR/topology"
ensure_switch
ensure_host "$CTL"
for h in "${NODES[@]}"; do ensure_host "$h"; done
write_wrappers
write_env

write_config
if ! cmp -s "$CONF.new" "$CONF" || ! cmp -s "$DIR/etc/gres.conf.new" "$DIR/etc/gres.conf"; then
    log "slurm.conf changed: (re)starting the slurm daemons"
    stop_slurm
    mv "$CONF.new" "$CONF"
    mv "$DIR/etc/gres.conf.new" "$DIR/etc/gres.conf"
else
    rm -f "$CONF.new" "$DIR/etc/gres.conf.new"
fi

start_munged
start_slurmctld
for h in "${NODES[@]}"; do start_slurmd "$h"; done
wait_idle
log "ready: $CTL + ${NODES[*]} in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s;" \
    "run commands with $DIR/bin/mn-login"
echo "$DIR/env.sh"
