#!/usr/bin/env bash
# Stage 03 (DDP) under mpirun:
#  - fp32: 1, 2 and 4 ranks, 2 ranks x 2 accumulation steps, and the bucketed overlapped
#    all-reduce reproduce stage 01's per-step losses within 1e-5 relative over 20 steps;
#  - bf16-mixed: 2 ranks match stage 02 within 1e-3 (bf16 results depend on summation order);
#  - comm_bytes per step = 4 x parameters (counted by a formula written here), and the bus
#    bandwidth in stats.json is 2(P-1)/P times the algorithmic one;
#  - mismatched configs across ranks, and a rank killed mid-run, end the job with a message
#    within a bounded time.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
L=2 C=64
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=$L --n_embd=$C)


OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --out_dir="$tmp/single" >"$tmp/single.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/single.log")"
run_ranks 3 np1 1
run_ranks 3 np2 2
run_ranks 3 np4 4
run_ranks 3 np2acc2 2 --gradient_acc_steps=2
run_ranks 3 np4overlap 4 --overlap_communication=true --bucket_size_mb=0.05
for name in np1 np2 np4 np2acc2 np4overlap; do
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01"
done
# where the loss sees the gradient's scale (tests/lib.sh's SCALE_ARGS)
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" "${SCALE_ARGS[@]}" --out_dir="$tmp/single_scale" >"$tmp/single_scale.log" 2>&1
run_ranks 3 np2scale 2 "${SCALE_ARGS[@]}"
check 'compare_losses "$tmp/single_scale" "$tmp/np2scale" 20 1e-5' "2 ranks without clipping, eps 1e-3, do not reproduce stage 01"
check 'grep -q "replicas identical on all 4 ranks" "$tmp/np4.log"' "no replica check on 4 ranks"

# communication volume: every step all-reduces the whole fp32 gradient, 4 bytes per parameter
params=$(python3 -c "V=257; Vp=(V+127)//128*128; T=256; C=$C; L=$L; print(Vp*C + T*C + 2*C + L*(12*C*C + 13*C))")
bytes=$(python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$tmp/np4/metrics.jsonl")
check '[ "$bytes" = "[$((4 * params))]" ]' "comm_bytes per step is $bytes, want [$((4 * params))] (4 x $params parameters)"
bytes=$(python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$tmp/np4overlap/metrics.jsonl")
check '[ "$bytes" = "[$((4 * params))]" ]' "bucketed: comm_bytes per step is $bytes, want [$((4 * params))]"
# (the bounds are the ones the printed table's 4 significant digits needed)
busbw=$(comm_value "$tmp/np4/stats.json" world all-reduce busbw_GBps)
algbw=$(comm_value "$tmp/np4/stats.json" world all-reduce algbw_GBps)
ratio=$(awk -v b="$busbw" -v a="$algbw" 'BEGIN { if (a > 0) printf "%.4f", b / a }')
check 'awk -v r="$ratio" "BEGIN { exit !(r > 1.4990 && r < 1.5010) }"' "busbw / algbw on 4 ranks is $ratio, want 2(P-1)/P = 1.5"
calls=$(comm_value "$tmp/np4/stats.json" world all-reduce calls)
check '[ "$calls" = "20" ]' "one all-reduce per step: $calls calls in 20 steps"
calls=$(comm_value "$tmp/np2acc2/stats.json" world all-reduce calls)
check '[ "$calls" = "20" ]' "accumulation must not communicate on inner micro-batches: $calls calls in 20 steps"

# bf16: stage 3 on 2 ranks against stage 2
OMP_NUM_THREADS=2 build/stage-2 "${args[@]}" --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
run_ranks 3 np2bf16 2 --precision=bf16-mixed
check 'compare_losses "$tmp/s2bf16" "$tmp/np2bf16" 20 1e-3' "bf16 stage 3 strays from stage 2"

# ranks started with different configs stop at once, with a message
start=$SECONDS
bounded 120 mpirun --bind-to none -np 1 build/stage-3 "${args[@]}" --out_dir="$tmp/mm" : \
    -np 1 build/stage-3 "${args[@]}" --out_dir="$tmp/mm" --lr=0.1 >"$tmp/mismatch.log" 2>&1
rc=$?
check '[ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "do not agree on the config" "$tmp/mismatch.log"' \
    "mismatched configs: exit $rc after $((SECONDS - start)) s: $(tail -3 "$tmp/mismatch.log")"

# a rank killed mid-run ends the job, not a hang
killed_rank_ends_job 3 4 "${args[@]}" --out_dir="$tmp/kill"
finish test_stage3
