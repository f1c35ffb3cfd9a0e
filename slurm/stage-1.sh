#!/bin/bash
# slurm/stage-1.sh - stage 01, single-GPU training (1 task, 1 GPU) under Slurm.
# Submit from the repository root (the log directory slurm/logs/ is relative to it):
#   CONFIG_FILE=configs/single_gpu.json sbatch slurm/stage-1.sh
# Log: slurm/logs/stage-1-<jobid>.out   Watch: squeue --me ; tail -f slurm/logs/stage-1-*.out
# Options: CONFIG_FILE, EXTRA_ARGS, LAUNCHER=srun|mpirun and the NCCL / Open MPI settings in
# slurm/common.sh. More nodes: change --nodes (or sbatch --nodes=2 ...); this stage is one process.
#SBATCH --job-name=stage-1
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
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
STAGE=1
DEFAULT_CONFIG=configs/single_gpu.json
MAX_TASKS=1
# the job runs a copy of this script from Slurm's spool directory: find common.sh from the
# directory sbatch was run in (the repository root)
source "${SLURM_SUBMIT_DIR:-.}/slurm/common.sh"
run_stage "$@"
