#!/usr/bin/env bash
# exercises/same_as_stage1.sh <stage> <ranks> <tolerance> [--key=value ...]: an exercise's check that
# stage <stage> on <ranks> MPI ranks (given the keys, e.g. a grid; the model's shape keys n_layer,
# n_embd and n_head go to stage 01 too) reproduces stage 01's per-step losses within the relative
# tolerance, on a tiny model for a few steps (tests/lib.sh's compare_losses, as the stages' own
# equivalence tests). Ends with its summary line and exits 0 only when both runs finish and agree;
# on a failure, first the run's lines that say why (a non-finite loss, an error), then its last lines.
source "$(dirname "$0")/../tests/lib.sh"
source tests/mpi_env.sh
stage=$1 np=$2 tol=$3
shift 3
steps=6
args=(--config configs/tiny.json --stop_iteration=$steps --eval_batches=1 --eval_interval=1000 --log_interval=100
      --n_layer=2 --n_embd=32 --n_head=4 --global_batch_size=4)
stage_args=()
for a in "$@"; do
    case $a in --n_layer=* | --n_embd=* | --n_head=*) args+=("$a") ;; *) stage_args+=("$a") ;; esac
done
set -- "${stage_args[@]}"
run_single 1 reference
if [ "$np" -eq 1 ] && [ "$stage" -le 2 ]; then run_single "$stage" stage "$@"; else run_ranks "$stage" stage "$np" "$@"; fi
check 'compare_losses "$tmp/reference" "$tmp/stage" $steps "$tol"' "stage $stage on $np ranks does not reproduce stage 01"
[ "$failed" -eq 0 ] || { grep -a -m3 -i -E "\bnan\b|\binf\b|error|fatal" "$tmp/stage.log"; tail -5 "$tmp/stage.log"; }
finish same_as_stage1
