#!/bin/bash
# slurm/stage-10.sh - stage 10, data x tensor x pipeline parallelism on one mesh (8 ranks: dp x pp_size x tp) under Slurm.
# Submit from the repository root (the log directory slurm/logs/ is relative to it):
#   CONFIG_FILE=configs/composed.json sbatch slurm/stage-10.sh
# Log: slurm/logs/stage-10-<jobid>.out   Watch: squeue --me ; tail -f slurm/logs/stage-10-*.out
# Options: CONFIG_FILE, EXTRA_ARGS, LAUNCHER=srun|mpirun and the NCCL / Open MPI settings in
# slurm/common.sh. More nodes: change --nodes; ranks = nodes x tasks per node, a multiple of
# tp x pp_size. A tensor-parallel group is tp consecutive ranks: keep tp <= tasks per node, so its
# all-reduces (every layer) stay inside a host; the pipeline's stages, outermost, cross the nodes.
#SBATCH --job-name=stage-10
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=01:00:00
# 120 s before the time limit (or a preemption) Slurm sends SIGUSR1: the ranks save, stop, and
# the job requeues itself and resumes (docs/CLUSTER.md "Preemption and requeue")
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --output=slurm/logs/%x-%j.out
# Site-specific, if your cluster wants them:
##SBATCH --partition=gpu
##SBATCH --account=my_project
##SBATCH --cpus-per-task=8
##SBATCH --exclusive
set -euo pipefail
STAGE=10
DEFAULT_CONFIG=configs/composed.json
MAX_TASKS=any
# the job runs a copy of this script from Slurm's spool directory: find common.sh from the
# directory sbatch was run in (the repository root)
source "${SLURM_SUBMIT_DIR:-.}/slurm/common.sh"
run_stage "$@"
