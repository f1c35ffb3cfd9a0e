#!/bin/bash
# slurm/stage-9.sh - stage 09, context parallelism (4 ranks: cp_size ranks per sequence x replicas) under Slurm.
# Submit from the repository root (the log directory slurm/logs/ is relative to it):
#   CONFIG_FILE=configs/context_parallel.json sbatch slurm/stage-9.sh
# Log: slurm/logs/stage-9-<jobid>.out   Watch: squeue --me ; tail -f slurm/logs/stage-9-*.out
# Options: CONFIG_FILE, EXTRA_ARGS, LAUNCHER=srun|mpirun and the NCCL / Open MPI settings in
# slurm/common.sh. More nodes: change --nodes; ranks = nodes x tasks per node, a multiple of cp_size
# (a replica's cp ranks are consecutive and pass keys and values in every block: keep cp_size <= tasks per node).
#SBATCH --job-name=stage-9
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
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
STAGE=9
DEFAULT_CONFIG=configs/context_parallel.json
MAX_TASKS=any
# the job runs a copy of this script from Slurm's spool directory: find common.sh from the
# directory sbatch was run in (the repository root)
source "${SLURM_SUBMIT_DIR:-.}/slurm/common.sh"
run_stage "$@"
