#!/bin/bash
# slurm/stage-8.sh - stage 08, a mixture of experts with expert parallelism (4 ranks: ep_size expert ranks x replicas) under Slurm.
# Submit from the repository root (the log directory slurm/logs/ is relative to it):
#   CONFIG_FILE=configs/moe.json sbatch slurm/stage-8.sh
# Log: slurm/logs/stage-8-<jobid>.out   Watch: squeue --me ; tail -f slurm/logs/stage-8-*.out
# Options: CONFIG_FILE, EXTRA_ARGS, LAUNCHER=srun|mpirun and the NCCL / Open MPI settings in
# slurm/common.sh. More nodes: change --nodes; ranks = nodes x tasks per node, a multiple of ep_size
# (a replica's expert ranks are consecutive and trade tokens in every MoE block: keep ep_size <= tasks per node).
#SBATCH --job-name=stage-8
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
STAGE=8
DEFAULT_CONFIG=configs/moe.json
MAX_TASKS=any
# the job runs a copy of this script from Slurm's spool directory: find common.sh from the
# directory sbatch was run in (the repository root)
source "${SLURM_SUBMIT_DIR:-.}/slurm/common.sh"
run_stage "$@"
