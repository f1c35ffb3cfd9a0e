#!/usr/bin/env bash
# Stage 10's interleaved 1F1B and ZB-H1 schedules (07's, with 05's tensor-parallel layers inside
# each stage: the weight stream of one chunk's blocks, the split backward through 05's layers):
#  - interleaved (2 chunks a stage) on tp 2 x pp 2, dp 2 x tp 2 x pp 2 and tp 2 x pp 2 x cp 2,
#    zb-h1 on tp 2 x pp 2,
#    GPT-2 and Llama (RMSNorm, SwiGLU, grouped-query attention), reproduce stage 01's per-step
#    figures (loss, lr, grad_norm, val_loss) within 1e-5 relative over 20 steps; stats.json's
#    bubble_theory is the schedule's;
#  - zb-h1 in bf16-mixed on 2 blocks (the weight pass rounds its kept output gradients again)
#    matches stage 02 within stage 03's bound;
#  - zb-h1 beside sequence_parallel: one error naming the key, every rank stops.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64
common=(--stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=$C --n_layer=4)
mesh=(--tp_dimensions=2,1,1 --pp_size=2)
interleaved=(--pp_schedule=interleaved --virtual_stages=2 --num_microbatches=2)
zb=(--pp_schedule=zb-h1 --num_microbatches=4)

for family in tiny tiny_llama; do
    args=(--config configs/$family.json "${common[@]}")
    run_single 1 single_$family
    run_ranks 10 il_$family 4 "${mesh[@]}" "${interleaved[@]}"
    run_ranks 10 zb_$family 4 "${mesh[@]}" "${zb[@]}"
    for name in il zb; do
        check 'compare_losses "$tmp/single_$family" "$tmp/${name}_$family" 20 1e-5' \
            "$family: $name on tp 2 x pp 2 does not reproduce stage 01"
    done
done
args=(--config configs/tiny.json "${common[@]}")
run_ranks 10 il_d2 8 "${mesh[@]}" "${interleaved[@]}"
check 'compare_losses "$tmp/single_tiny" "$tmp/il_d2" 20 1e-5' "interleaved on dp 2 x tp 2 x pp 2 does not reproduce stage 01"
# cp's slots hold 2 B chunks of T / 2 cp tokens (composed_cp.c adapts each chunk's spec once)
run_ranks 10 il_c2 8 "${mesh[@]}" "${interleaved[@]}" --cp_size=2
check 'compare_losses "$tmp/single_tiny" "$tmp/il_c2" 20 1e-5' "interleaved on tp 2 x pp 2 x cp 2 does not reproduce stage 01"
# the schedules ran: (p - 1) / (v m + p - 1) = 1/5 interleaved, (p - 1) / (3 m + p - 1) = 1/13 zb-h1
check 'python3 -c "import sys; sys.exit(abs($(json_value "$tmp/il_tiny/stats.json" bubble_theory) - 1/5) > 1e-9)"' \
    "interleaved's bubble_theory is $(json_value "$tmp/il_tiny/stats.json" bubble_theory), want 1/5"
check 'python3 -c "import sys; sys.exit(abs($(json_value "$tmp/zb_tiny/stats.json" bubble_theory) - 1/13) > 1e-9)"' \
    "zb-h1's bubble_theory is $(json_value "$tmp/zb_tiny/stats.json" bubble_theory), want 1/13"

args=(--config configs/tiny.json "${common[@]}" --precision=bf16-mixed)
run_single 2 single_bf16 --n_layer=2
run_ranks 10 zb_bf16 4 "${mesh[@]}" "${zb[@]}" --n_layer=2
check 'compare_losses "$tmp/single_bf16" "$tmp/zb_bf16" 20 1e-3' "zb-h1 in bf16-mixed on tp 2 x pp 2 strays from stage 02"

args=(--config configs/tiny.json "${common[@]}")
bad() { timeout --kill-after=5 120 mpirun -np 4 --bind-to none "$STAGE_BIN/stage-10" "${args[@]}" --out_dir="$tmp/bad" "$@"; }
expect_one_error "zb-h1 with sequence_parallel" "key 'sequence_parallel' is true but pp_schedule is zb-h1" \
    bad "${mesh[@]}" "${zb[@]}" --sequence_parallel=true
finish test_stage10_sched
