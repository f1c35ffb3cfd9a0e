#!/usr/bin/env bash
# Stage 02 against stage 01 on configs/tiny.json, 40 steps:
#  - precision 32: bit-identical losses (stage 02 adds nothing when bf16 is off);
#  - bf16-mixed: every step's loss within 2% of stage 01's (measured: 1.0%, where the loss turns
#    around step 28; 0.04% over the first 16 steps), and not identical (the rounding is real);
#  - bf16 (no fp32 master weights): runs and stays within 5% (measured: 2.3%).
source "$(dirname "$0")/lib.sh"
args=(--config configs/tiny.json --stop_iteration=40 --eval_batches=1 --log_interval=100)

build/stage-1 "${args[@]}" --out_dir="$tmp/s1" >"$tmp/s1.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/s1.log")"
for p in 32 bf16-mixed bf16; do
    build/stage-2 "${args[@]}" --precision=$p --out_dir="$tmp/$p" >"$tmp/$p.log" 2>&1
    rc=$?; check '[ $rc -eq 0 ]' "stage 2 --precision=$p failed: $(tail -3 "$tmp/$p.log")"
done
check 'cmp -s <(grep -o "\"loss\": [^,]*" "$tmp/s1/metrics.jsonl") <(grep -o "\"loss\": [^,]*" "$tmp/32/metrics.jsonl")' \
    "precision 32 is not bit-identical to stage 01"
# the gradient norm strays further than the loss (measured: 9% bf16-mixed, 11% pure bf16), so it
# is held to 25%, which a gradient twice too large or half too small still exceeds
check 'compare_losses "$tmp/s1" "$tmp/bf16-mixed" 40 0.02 0.25' "bf16-mixed strays more than 2% from fp32"
check '! cmp -s <(grep -o "\"loss\": [^,]*" "$tmp/s1/metrics.jsonl") <(grep -o "\"loss\": [^,]*" "$tmp/bf16-mixed/metrics.jsonl")' \
    "bf16-mixed gives exactly the fp32 losses: the rounding is not happening"
check 'compare_losses "$tmp/s1" "$tmp/bf16" 40 0.05 0.25' "pure bf16 strays more than 5% from fp32"
check 'json_value "$tmp/bf16-mixed/stats.json" memory "parameters (bf16 copy)" >/dev/null &&
       json_value "$tmp/bf16-mixed/stats.json" fp32_activations_bytes >/dev/null' \
    "no memory report comparing bf16 with fp32 in stats.json: $(json_value "$tmp/bf16-mixed/stats.json" memory)"
finish test_stage2
