#!/usr/bin/env bash
# Stage 07's interleaved 1F1B and ZB-H1 schedules under mpirun:
#  - interleaved (virtual_stages 2) on p = 2 (n_layer 4, a multiple of p v = 4, and 6, not) and
#    p = 4 (n_layer 8, a multiple of 8, and 9, not), ZB-H1 on p = 2, 3 (an uneven split) and 4,
#    with 4 and 8 micro-batches between them, reproduce stage 01's per-step figures within 1e-5
#    over 20 steps; bf16-mixed interleaved and ZB-H1 match stage 02 within stage 03's 1e-3;
#  - the bubble from stats.json: the first step replayed with the theory's unit times gives each
#    formula exactly (the orders are right); replayed with the first step's measured compute times
#    (on the CPU each op's thread CPU time, which the other processes on the cores do not inflate),
#    each op kind's median over the stages (bubble_first_step_balanced), interleaved lies within 10%
#    of (p-1)/(v m + p-1) and ZB-H1's is at most half of 1F1B's at the same p and m (with F = B = W
#    (m+p-1)/(3m+p-1) = 0.38). The model is wide and short, 16 blocks of n_embd 384 over 16 tokens,
#    so that the matmuls, which W splits off, dominate: W is matmuls alone, while F and B also run
#    GELU's exponentials and the other elementwise work, which grows as n_embd and the matmuls as
#    its square (at n_embd 256 the ratio measures 0.42-0.45 on a CPU, at 384 0.39-0.41);
#  - phi and Llama (tiny_phi, tiny_llama: grouped-query attention, SwiGLU 344 wide) on the alpaca
#    fixture, whose batches fill max_seq_len, under 1F1B, interleaved and ZB-H1 reproduce stage 01;
#  - ZB-H1 keeps, a block and slot, N rows of its linear layers' output widths added up of deferred
#    output gradients (stats.json memory): 9 C for GPT-2 and phi, (C + 2 C_kv) + C + 2 I + C for
#    Llama, which on tiny_llama (1200) is more than 9 C (1152);
#  - the planner's bubble for each schedule follows its formula, and its deferred memory the run's;
#  - bad input: virtual_stages with fewer blocks than p v, virtual_stages without interleaved,
#    interleaved micro-batches not a multiple of p, zb-h1 with recomputation, an unknown schedule.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=$C)

for L in 4 6 8 9; do
    OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --n_layer=$L --out_dir="$tmp/single$L" >"$tmp/single$L.log" 2>&1
    rc=$?; check '[ $rc -eq 0 ]' "stage 1 (n_layer $L) failed: $(tail -3 "$tmp/single$L.log")"
done
il=(--pp_schedule=interleaved --virtual_stages=2)
run_ranks 7 il_p2_L4_m4 2 --n_layer=4 --pp_size=2 --num_microbatches=4 "${il[@]}"
run_ranks 7 il_p2_L6_m8 2 --n_layer=6 --pp_size=2 --num_microbatches=8 "${il[@]}"
run_ranks 7 il_p4_L8_m8 4 --n_layer=8 --pp_size=4 --num_microbatches=8 "${il[@]}"
run_ranks 7 il_p4_L9_m4 4 --n_layer=9 --pp_size=4 --num_microbatches=4 "${il[@]}"
run_ranks 7 zb_p2_m4 2 --n_layer=4 --pp_size=2 --num_microbatches=4 --pp_schedule=zb-h1
run_ranks 7 zb_p3_m8 3 --n_layer=4 --pp_size=3 --num_microbatches=8 --pp_schedule=zb-h1
run_ranks 7 zb_p4_m4 4 --n_layer=4 --pp_size=4 --num_microbatches=4 --pp_schedule=zb-h1
run_ranks 7 zb_p2_m8 2 --n_layer=4 --pp_size=2 --num_microbatches=8 --pp_schedule=zb-h1
for run in il_p2_L4_m4:4 il_p2_L6_m8:6 il_p4_L8_m8:8 il_p4_L9_m4:9 zb_p2_m4:4 zb_p3_m8:4 zb_p4_m4:4 zb_p2_m8:4; do
    name=${run%:*} L=${run#*:}
    check 'compare_losses "$tmp/single$L" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01 (n_layer $L)"
done
check 'grep -q "stage 0: chunk 0: blocks 0-1 + embedding | chunk 1: blocks 4-4$" "$tmp/il_p2_L6_m8.log"' \
    "6 blocks over 2 x 2 virtual stages (2, 2, 1, 1 blocks): stage 0 does not hold virtual stages 0 and 2"

# bf16: against stage 02, as test_stage7 does
OMP_NUM_THREADS=2 build/stage-2 "${args[@]}" --n_layer=4 --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
run_ranks 7 il_bf16 2 --n_layer=4 --pp_size=2 --num_microbatches=4 "${il[@]}" --precision=bf16-mixed
run_ranks 7 zb_bf16 2 --n_layer=4 --pp_size=2 --num_microbatches=4 --pp_schedule=zb-h1 --precision=bf16-mixed
for name in il_bf16 zb_bf16; do
    check 'compare_losses "$tmp/s2bf16" "$tmp/$name" 20 1e-3' "$name strays from stage 2"
done

# every family at full length: the alpaca fixture's records fill max_seq_len (256), so the
# deferred buffer is used to its last row; 6 steps, 4 blocks, 2 stages
families() {
    local family=$1 schedule
    local args=(--config "configs/tiny_$family.json" --n_layer=4 --stop_iteration=6 --eval_batches=1 --log_interval=100
                --data_path=../shared/fixtures/alpaca/rasbt-LLMs-from-scratch_instruction-data.json)
    run_single 1 "single_$family"
    for schedule in 1f1b interleaved zb-h1; do
        run_ranks 7 "${schedule}_$family" 2 --pp_size=2 --num_microbatches=4 --pp_schedule=$schedule \
            $([ $schedule = interleaved ] && echo --virtual_stages=2)
        check 'compare_losses "$tmp/single_$family" "$tmp/${schedule}_$family" 6 1e-5' \
            "$family under $schedule does not reproduce stage 01 at full sequence length"
    done
}
families phi
families llama

# the orders: replayed with unit times (F 1, B 2; zb-h1 F = B = W = 1) each gives its formula
unit_gap() {
    python3 -c "import json,sys; s = json.load(open(sys.argv[1])); print(abs(s['bubble_unit_times'] - s['bubble_theory']) < 1e-9 and s['bubble_theory'] == float(sys.argv[2]))" \
        "$1/stats.json" "$2"
}
check '[ "$(unit_gap "$tmp/il_p4_L8_m8" "$(python3 -c "print(3 / (2 * 8 + 3))")")" = True ]' \
    "interleaved p 4, v 2, m 8: the unit-time replay or the theory is not 3/19"
check '[ "$(unit_gap "$tmp/zb_p3_m8" "$(python3 -c "print(2 / (3 * 8 + 2))")")" = True ]' \
    "zb-h1 p 3, m 8: the unit-time replay or the theory is not 2/26"

# zero bubble's price: a row's output widths x N floats a block and slot (N = 4 rows x T tokens),
# T = the longest sequence (256), stage 0 of p 2 holding 2 blocks, and p + 1 = 3 slots (each until
# its W). A row: GPT-2 and phi qkv 3C, attn_proj C, fc 4C, fc_proj C; tiny_llama (C 128, 2 of 4
# heads for keys and values: C_kv 64, intermediate 344) q C + k, v 2 C_kv, attn_proj C, gate and up
# 2 x 344, down C
llama_row=$(((128 + 2 * 64) + 128 + 2 * 344 + 128))
for run in zb_p2_m4:$((9 * C)) zb-h1_phi:$((9 * 128)) zb-h1_llama:$llama_row; do
    name=${run%:*} row=${run#*:}
    slots=$(json_value "$tmp/$name/stats.json" activation_slots)
    deferred=$(json_value "$tmp/$name/stats.json" memory "deferred weight gradients")
    check '[ "$slots" = 3 ] && [ "$deferred" = "$((3 * 2 * row * 4 * 256 * 4))" ]' \
        "$name: deferred weight gradients on stage 0: $deferred bytes in $slots slots, want $row floats a row"
done

# the bubble on the first step's timeline, measured compute times: a wide, short model, 2 steps
wide=(--n_embd=384 --max_seq_len=16 --stop_iteration=2 --n_layer=16 --pp_size=2 --num_microbatches=4)
run_ranks 7 bubble_il 2 "${wide[@]}" "${il[@]}"
run_ranks 7 bubble_zb 2 "${wide[@]}" --pp_schedule=zb-h1
run_ranks 7 bubble_1f1b 2 "${wide[@]}" --pp_schedule=1f1b
bubble() { json_value "$1/stats.json" bubble_first_step_balanced; }
check 'python3 -c "import sys; b = float(sys.argv[1]); t = 1 / (2 * 4 + 1); sys.exit(abs(b - t) > 0.1 * t)" "$(bubble "$tmp/bubble_il")"' \
    "interleaved p 2, v 2, m 4: measured bubble $(bubble "$tmp/bubble_il"), not within 10% of 1/9"
check 'python3 -c "import sys; sys.exit(float(sys.argv[1]) > float(sys.argv[2]) / 2)" "$(bubble "$tmp/bubble_zb")" "$(bubble "$tmp/bubble_1f1b")"' \
    "zb-h1's measured bubble $(bubble "$tmp/bubble_zb") is more than half of 1F1B's $(bubble "$tmp/bubble_1f1b") (p 2, m 4)"

# the planner (a GPU cluster: a core each): compute x (1 + bubble / (1 - bubble)) is the critical
# path, so bubble_s / compute_s is (p-1)/m for 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1
cat >"$tmp/gpus.json" <<'JSON'
{"name": "schedules", "source": "test_pp_schedules.sh", "nodes": 1, "gpus_per_node": 2,
 "peak_tflops": {"fp32": 1, "bf16": 2}, "efficiency": 0.4, "memory_gib": 8,
 "intra_node": {"bandwidth_GBps": 10, "latency_us": 1}, "inter_node": {"bandwidth_GBps": 10, "latency_us": 1},
 "overlaps_compute": false}
JSON
for s in 1f1b interleaved zb-h1; do
    build/plan --cluster="$tmp/gpus.json" --ranks=2 --layout=pp2 --microbatches=4 --json="$tmp/plan_$s.json" \
        "${args[@]}" --n_layer=8 --pp_schedule=$s --virtual_stages=$([ $s = interleaved ] && echo 2 || echo 1) \
        >"$tmp/plan_$s.log" 2>&1
    rc=$?; check '[ $rc -eq 0 ]' "plan with $s failed: $(tail -2 "$tmp/plan_$s.log")"
done
plan_bubble() { python3 -c "import json,sys; p = json.load(open(sys.argv[1]))['layouts'][0]; print(p['bubble_s'] / p['compute_s'])" "$1"; }
check 'python3 -c "import sys; a, b, c = map(float, sys.argv[1:]); sys.exit(not (abs(a - 1 / 4) < 1e-9 and abs(b - 1 / 8) < 1e-9 and abs(c - 1 / 12) < 1e-9))" "$(plan_bubble "$tmp/plan_1f1b.json")" "$(plan_bubble "$tmp/plan_interleaved.json")" "$(plan_bubble "$tmp/plan_zb-h1.json")"' \
    "planner's bubble / compute (1f1b, interleaved, zb-h1): $(plan_bubble "$tmp/plan_1f1b.json") $(plan_bubble "$tmp/plan_interleaved.json") $(plan_bubble "$tmp/plan_zb-h1.json"), want 1/4, 1/8, 1/12"

# and its memory for zb-h1: stage 0's 4 of 8 blocks in p + 1 = 3 slots of deferred output gradients
plan_deferred=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['layouts'][0]['memory']['deferred weight gradients'])" "$tmp/plan_zb-h1.json")
check '[ "$plan_deferred" = "$((3 * 4 * 9 * 4 * 256 * C * 4))" ]' "the planner's deferred weight gradients: $plan_deferred bytes"
# on tiny_llama, whose row is wider than 9 C
build/plan --cluster="$tmp/gpus.json" --ranks=2 --layout=pp2 --microbatches=4 --json="$tmp/plan_llama.json" \
    --config configs/tiny_llama.json --n_layer=8 --pp_schedule=zb-h1 >"$tmp/plan_llama.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "plan of tiny_llama with zb-h1 failed: $(tail -2 "$tmp/plan_llama.log")"
plan_deferred=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['layouts'][0]['memory']['deferred weight gradients'])" "$tmp/plan_llama.json")
check '[ "$plan_deferred" = "$((3 * 4 * llama_row * 4 * 256 * 4))" ]' "the planner's deferred weight gradients on tiny_llama: $plan_deferred bytes"

# bad input: one error, every rank stops
bad=(bounded 120 mpirun -np 2 --bind-to none build/stage-7 "${args[@]}" --out_dir="$tmp/bad" --pp_size=2)
expect_one_error "virtual_stages with fewer blocks than p v" "2 chunks on each of 2 stages need at least 4 blocks, n_layer is 3" \
    "${bad[@]}" --n_layer=3 "${il[@]}"
expect_one_error "virtual_stages without interleaved" "only pp_schedule interleaved" "${bad[@]}" --virtual_stages=2
expect_one_error "interleaved micro-batches not a multiple of p" "1 is not a multiple of it" \
    "${bad[@]}" --n_layer=4 "${il[@]}" --num_microbatches=1
expect_one_error "zb-h1 with recomputation" "pp_schedule zb-h1 computes each weight gradient" \
    "${bad[@]}" --pp_schedule=zb-h1 --activation_checkpointing=true
expect_one_error "an unknown schedule" "expected gpipe, 1f1b, interleaved or zb-h1, found 'zb-v'" "${bad[@]}" --pp_schedule=zb-v
finish test_pp_schedules
