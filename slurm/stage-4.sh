#!/bin/bash
# slurm/stage-4.sh - stage 04, fully sharded data parallel training (FSDP: 4 ranks) under Slurm.
# Submit from the repository root (the log directory slurm/logs/ is relative to it):
#   CONFIG_FILE=configs/fsdp.json sbatch slurm/stage-4.sh
# Log: slurm/logs/stage-4-<jobid>.out   Watch: squeue --me ; tail -f slurm/logs/stage-4-*.out
# Options: CONFIG_FILE, EXTRA_ARGS, LAUNCHER=srun|mpirun and the NCCL / Open MPI settings in
# slurm/common.sh. More nodes: change --nodes (or sbatch --nodes=2 ...); ranks = nodes x tasks per node.
#SBATCH --job-name=stage-4
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
STAGE=4
DEFAULT_CONFIG=configs/fsdp.json
MAX_TASKS=any
# the job runs a copy of this script from Slurm's spool directory: find common.sh from the
# directory sbatch was run in (the repository root)
source "${SLURM_SUBMIT_DIR:-.}/slurm/common.sh"
run_stage "$@"
