#!/bin/bash
# slurm/preflight.sh - is this allocation ready for the session? The preflight (tools/preflight.py)
# on the nodes and ranks the stages will use: toolchain, libraries, GPUs and disk on every node,
# MPI (and NCCL) across every rank, bus bandwidth and the slowest pair of hosts, the session's
# model files, one step of every stage. Submit from the repository root, with the layout the
# session will use (any node count):
#   sbatch slurm/preflight.sh
#   sbatch --nodes=2 slurm/preflight.sh --cluster=configs/clusters/h100-sxm.json --configs=configs/ddp.json
# Log (the table): slurm/logs/preflight-<jobid>.out; the checks as data:
# slurm/logs/preflight-<jobid>/preflight.json. The job fails (exit 1) when a check failed.
# Options after the script name, or in EXTRA_ARGS, go to tools/preflight.py (python3 tools/preflight.py --help);
# LAUNCHER=srun|mpirun, SRUN_MPI, MPIRUN_ARGS and the settings in slurm/common.sh as for the stages.
#SBATCH --job-name=preflight
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --time=00:15:00
#SBATCH --output=slurm/logs/%x-%j.out
# Site-specific, if your cluster wants them:
##SBATCH --partition=gpu
##SBATCH --account=my_project
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/common.sh
[ -n "${SLURM_JOB_ID:-}" ] || job_die "not inside a Slurm job: submit it with 'sbatch slurm/preflight.sh'"
command -v python3 >/dev/null || job_die "python3 not found on $(hostname): the preflight is a python3 script"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
nodes=${SLURM_JOB_NUM_NODES:-1}
case ${LAUNCHER:-srun} in
    srun) launcher="srun --mpi=${SRUN_MPI:-pmix} --kill-on-bad-exit=1 -n {ranks}" ;;
    mpirun) launcher="mpirun -np {ranks} ${MPIRUN_ARGS:-}" ;;
    *) job_die "LAUNCHER must be srun or mpirun, not '$LAUNCHER'" ;;
esac
echo "=== preflight | job $SLURM_JOB_ID | nodes $nodes (${SLURM_JOB_NODELIST:-?}) | tasks ${SLURM_NTASKS:-1} | $(date '+%F %T')"
# shellcheck disable=SC2206  # EXTRA_ARGS: options, split on spaces
extra=(${EXTRA_ARGS:-})
python3 tools/preflight.py --ranks="${SLURM_NTASKS:-1}" --launcher="$launcher" \
    --per_node="srun -N $nodes -n $nodes --ntasks-per-node=1" --report="slurm/logs/preflight-$SLURM_JOB_ID" "${extra[@]}" "$@"
