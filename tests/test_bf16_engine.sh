#!/usr/bin/env bash
# The engine that multiplies bf16 inputs (common/ops/ops_cpu.c, choose_bf16_engine): oneDNN's bf16
# matmul, or its f32 matmul over the bf16 values widened to f32, chosen by measurement at start-up
# unless OPS_BF16_MATMUL (native, f32, auto) forces one. Both engines form the same products and
# differ only in the order of their sums: stage 02 in bf16-mixed gives the same losses with either
# (within 0.5% over 20 steps; measured 0.03%), every op test passes with either, and the banner
# says which runs and why. On a CPU without a fast bf16 matmul, forcing native is an error.
source "$(dirname "$0")/lib.sh"

run_bf16() { # run_bf16 <name> <OPS_BF16_MATMUL value>
    OPS_BF16_MATMUL=$2 "$STAGE_BIN/stage-2" --config configs/tiny.json --precision=bf16-mixed \
        --global_batch_size=2 --stop_iteration=20 --log_interval=1 --eval_batches=0 --checkpoint_interval=0 \
        --out_dir="$tmp/$1" >"$tmp/$1.log" 2>&1
}
banner() { grep -m1 "backend" "$tmp/$1.log"; }

run_bf16 auto auto
check '[ $? -eq 0 ] && banner auto | grep -q "measured: oneDNN.s bf16 matmul at [0-9.]*x its f32 rate\|oneDNN has .* bf16 matmul on this CPU"' \
    "auto: the banner does not say what was measured: $(banner auto)"
run_bf16 f32 f32
check '[ $? -eq 0 ] && banner f32 | grep -q "bf16 widened to f32 (OPS_BF16_MATMUL=f32): oneDNN .* f32 matmul"' \
    "OPS_BF16_MATMUL=f32: the banner does not name the widened engine: $(banner f32)"
OPS_BF16_MATMUL=f32 build/tests/test_ops >"$tmp/ops_f32.log" 2>&1
check '[ $? -eq 0 ]' "the op tests with bf16 widened to f32: $(tail -3 "$tmp/ops_f32.log")"

if banner auto | grep -q "on this CPU"; then  # no fast bf16 matmul here: native cannot be forced
    expect_one_error "OPS_BF16_MATMUL=native without a bf16 matmul" "OPS_BF16_MATMUL is 'native', but oneDNN has" \
        env OPS_BF16_MATMUL=native "$STAGE_BIN/stage-2" --config configs/tiny.json --precision=bf16-mixed --stop_iteration=1
else
    run_bf16 native native
    check '[ $? -eq 0 ] && banner native | grep -q "bf16 matmul (.*), [0-9]* threads; OPS_BF16_MATMUL=native"' \
        "OPS_BF16_MATMUL=native: the banner does not name oneDNN's bf16 matmul: $(banner native)"
    check 'compare_losses "$tmp/native" "$tmp/f32" 20 0.005 0.05' "the two engines' losses differ by more than 0.5%"
    OPS_BF16_MATMUL=native build/tests/test_ops >"$tmp/ops_native.log" 2>&1
    check '[ $? -eq 0 ]' "the op tests with oneDNN's bf16 matmul: $(tail -3 "$tmp/ops_native.log")"
fi
expect_one_error "OPS_BF16_MATMUL=fast" "environment variable OPS_BF16_MATMUL is 'fast': expected native, f32 or auto" \
    env OPS_BF16_MATMUL=fast "$STAGE_BIN/stage-2" --config configs/tiny.json --precision=bf16-mixed --stop_iteration=1
finish test_bf16_engine
