# slurm/common.sh - what every slurm/stage-N.sh shares (sourced by them, not run).
# shellcheck shell=bash
#
# A stage script sets STAGE, DEFAULT_CONFIG and MAX_TASKS, then calls run_stage "$@".
# run_stage checks the allocation, the binary and the config, prints what it will run,
# and launches build/stage-N on every task of the allocation.
#
# Knobs (environment, all optional; sbatch passes your environment into the job):
#   CONFIG_FILE=configs/x.json  config file (default: the stage's own)
#   EXTRA_ARGS="--stop_iteration=20 --out_dir=out/run1"   extra --key=value options
#                               (options after the script name, `sbatch slurm/stage-1.sh --lr=1e-3`,
#                               work too)
#   LAUNCHER=srun | mpirun      how ranks are started (default srun: Slurm starts every rank
#                               and Open MPI wires them up through PMIx)
#   SRUN_MPI=pmix               srun's --mpi plugin; `srun --mpi=list` shows yours (pmix,
#                               pmix_v4, ...). pmi2 cannot start Debian/Ubuntu's Open MPI.
#   MPIRUN_ARGS="--bind-to none" extra mpirun options
#   STAGE_BIN=build/stage-N     the program to run
#   OMP_NUM_THREADS             CPU threads per rank (default: --cpus-per-task, else 1)
#
# ---- settings clusters often need: uncomment / edit here, or export before sbatch ----------
# NCCL (GPU communication; see docs/CLUSTER.md "When NCCL hangs"):
# export NCCL_DEBUG=INFO                # print NCCL's setup: rings, transports, interfaces
# export NCCL_DEBUG_SUBSYS=INIT,NET     # ...only the init and network parts
# export NCCL_SOCKET_IFNAME=ib0         # the interface NCCL's sockets use (e.g. ib0, eth0,
#                                       # or "^lo,docker" to exclude); a wrong pick hangs init
# export NCCL_IB_DISABLE=1              # no InfiniBand (or broken): use TCP sockets instead
# export NCCL_IB_HCA=mlx5_0,mlx5_1      # which InfiniBand adapters to use
# export NCCL_IB_TIMEOUT=22             # InfiniBand retry timeout (bigger on congested fabrics)
# export NCCL_P2P_DISABLE=1             # GPUs whose peer-to-peer (PCIe/NVLink) path is broken
# export NCCL_NET_GDR_LEVEL=PHB         # when to use GPUDirect RDMA
# Open MPI (CPU communication and NCCL's bootstrap):
# export OMPI_MCA_btl_tcp_if_include=ib0   # the interface Open MPI's TCP traffic uses
# export OMPI_MCA_pml=ucx                  # use UCX (InfiniBand); pml=ob1 + btl=tcp,self,vader avoids it
# export UCX_NET_DEVICES=mlx5_0:1          # which adapter UCX uses
# export OMPI_MCA_mpi_yield_when_idle=1    # more ranks than cores: yield instead of busy-polling
# export PMIX_MCA_gds=hash                 # srun+PMIx fails with "gds_ds21"/shmem errors on some sites
# export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # mpirun as root (containers, CI)
# Modules, if your cluster uses them (names are site-specific):
# command -v module >/dev/null && module load openmpi cuda nccl
# ---------------------------------------------------------------------------------------------

job_die() { echo "stage-${STAGE:-?} job: ERROR: $*" >&2; exit 1; }

run_stage() {
    : "${STAGE:?}" "${DEFAULT_CONFIG:?}" "${MAX_TASKS:?}"
    [ -n "${SLURM_JOB_ID:-}" ] ||
        job_die "not inside a Slurm job: submit it with 'sbatch slurm/stage-$STAGE.sh' (or run it under salloc)"

    local ntasks=${SLURM_NTASKS:-1} launcher=${LAUNCHER:-srun}
    local bin=${STAGE_BIN:-build/stage-$STAGE}
    CONFIG_FILE=${CONFIG_FILE:-$DEFAULT_CONFIG}
    export CONFIG_FILE

    # Fail before launching anything: a typo should cost seconds, not a queue wait plus a hang.
    [ -x "$bin" ] || job_die "$bin not found in $PWD: build it with 'make stage-$STAGE' and submit from the repository root"
    [ -r "$CONFIG_FILE" ] || job_die "config file '$CONFIG_FILE' not readable (relative paths start at $PWD)"
    if [ "$MAX_TASKS" != any ] && [ "$ntasks" -gt "$MAX_TASKS" ]; then
        job_die "stage $STAGE runs $MAX_TASKS task(s), the job has $ntasks: keep --nodes=1 --ntasks-per-node=$MAX_TASKS"
    fi

    # OpenMP threads per rank: the CPUs Slurm gave each task (or 1). Since Slurm 22.05 srun
    # no longer inherits --cpus-per-task from the batch step unless SRUN_CPUS_PER_TASK is set.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK

    # shellcheck disable=SC2206  # EXTRA_ARGS / MPIRUN_ARGS are split on spaces on purpose
    local extra=(${EXTRA_ARGS:-}) mpirun_args=(${MPIRUN_ARGS:-})
    local cmd=("$bin" --config "$CONFIG_FILE" "${extra[@]}" "$@")
    # A requeued job runs this same command again: the stage resumes by itself from the
    # checkpoint its first run saved in out_dir (resume=auto). No --resume=true here: a job Slurm
    # requeues after a node failure, before its first checkpoint, must start, not fail.
    case $launcher in
        # --kill-on-bad-exit: one failing rank ends the step instead of leaving the others
        # waiting forever in a collective
        srun) cmd=(srun --mpi="${SRUN_MPI:-pmix}" --kill-on-bad-exit=1 "${cmd[@]}") ;;
        # mpirun reads the allocation from Slurm: -np = all tasks on all nodes
        mpirun) cmd=(mpirun -np "$ntasks" "${mpirun_args[@]}" "${cmd[@]}") ;;
        *) job_die "LAUNCHER must be srun or mpirun, not '$launcher'" ;;
    esac

    echo "=== stage $STAGE | job ${SLURM_JOB_ID} (${SLURM_JOB_NAME:-}) | $(date '+%F %T')"
    echo "=== nodes ${SLURM_JOB_NUM_NODES:-1} (${SLURM_JOB_NODELIST:-?}) | tasks $ntasks | GPUs/node ${SLURM_GPUS_PER_NODE:-0}" \
         "| CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} | OMP_NUM_THREADS=$OMP_NUM_THREADS"
    echo "=== config $CONFIG_FILE | launcher $launcher | cwd $PWD"
    echo "=== ${cmd[*]}"
    local t0=$SECONDS rc=0
    run_forwarding_signals "${cmd[@]}" || rc=$?
    if [ $rc -eq 75 ]; then  # EXIT_TO_BE_RESUMED: the ranks saved a checkpoint and stopped
        echo "=== stage $STAGE stopped to be resumed after $((SECONDS - t0)) s: requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || job_die "scontrol requeue $SLURM_JOB_ID failed; submit the job again: it resumes from its out_dir"
        exit 0
    fi
    if [ $rc -ne 0 ]; then
        echo "=== stage $STAGE FAILED: exit $rc after $((SECONDS - t0)) s" >&2
        exit $rc
    fi
    echo "=== stage $STAGE done in $((SECONDS - t0)) s"
}

# run_forwarding_signals <command...>: runs the launcher in the background and passes on the
# SIGUSR1 (--signal=B:USR1@N: "B:" sends it to this batch shell only) or SIGTERM the job gets, so
# that every rank saves and stops at its next step boundary. bash runs a trap only between
# commands, hence the background launcher and `wait`, which a trapped signal interrupts.
run_forwarding_signals() {
    "$@" &
    local pid=$! rc
    trap 'kill -USR1 $pid 2>/dev/null' USR1 TERM
    while :; do
        wait $pid && rc=0 || rc=$?
        kill -0 $pid 2>/dev/null || break  # wait returned for the launcher, not for a signal
    done
    trap - USR1 TERM
    return $rc
}
