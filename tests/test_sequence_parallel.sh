#!/usr/bin/env bash
# Stage 05's sequence parallelism (sequence_parallel, tp_sequence.h) on 3 ranks, [3, 1, 1]:
#  - fp32: GPT-2, phi and Llama reproduce stage 01's losses and gradient norms within 1e-5 over
#    20 steps (rows x T = 4 x 240 tokens, which 3 divides; T = 236, which 3 does not, with 3 rows);
#    [2, 1, 1] x data 2 with accumulation, overlap, the gathered loss and recomputation too;
#  - bf16-mixed stays within stage 02's 1e-3, as plain tensor parallelism does (test_stage5);
#  - communication (stats.json): each all-reduce over x becomes an all-gather and a reduce-scatter
#    of the same bus bytes, per the README's formula; the norms' gradients are summed over "tp";
#  - memory: the residual stream's activations are 1/3 of plain tensor parallelism's, exactly;
#  - per-tensor gradients after one step within 1e-5 of stage 01's (GPT-2);
#  - stage 10, tp 2 x pp 2: stage 01's losses, and the pipeline's messages half as large;
#  - refused with one error: 4 rows x T = 236 (3 does not divide 944), y > 1, stage 03.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=2
      --n_embd=48 --n_head=3 --global_batch_size=4 --max_seq_len=240)
sp=(--tp_dimensions=3,1,1 --sequence_parallel=true)

# ---- equivalence with stage 01, one model of each family ----
for spec in gpt2: phi:--arch=phi "llama:--arch=llama --n_head=6 --n_kv_head=3 --intermediate_size=96"; do
    IFS=: read -r name extra <<<"$spec"
    run_single 1 "s1_$name" $extra
    run_ranks 5 "sp_$name" 3 "${sp[@]}" $extra
    check 'compare_losses "$tmp/s1_$name" "$tmp/sp_$name" 20 1e-5' "$name: sequence parallel does not reproduce stage 01"
done
# [2, 1, 1] x data 2 with the switches that move 05's collectives: 2 micro-batches, overlap,
# the gathered loss, recomputation (which gathers and reduce-scatters again)
run_single 1 s1_d2 --n_head=4 --global_batch_size=8 --stop_iteration=10
run_ranks 5 sp_d2 4 --n_head=4 --global_batch_size=8 --stop_iteration=10 --tp_dimensions=2,1,1 --sequence_parallel=true \
    --gradient_acc_steps=2 --overlap_communication=true --vocab_parallel_loss=false --activation_checkpointing=true
check 'compare_losses "$tmp/s1_d2" "$tmp/sp_d2" 10 1e-5' "[2,1,1] x data 2 with the switches does not reproduce stage 01"

# ---- per-tensor gradients after one step (GPT-2) ----
one_step_gradients_match 5 g_sp 3 "${sp[@]}"

# T = 236 (the rows cut at max_seq_len), which 3 does not divide, with 3 rows: 708 tokens split evenly
run_single 1 s1_rows3 --global_batch_size=3 --max_seq_len=236 --stop_iteration=5
run_ranks 5 sp_rows3 3 "${sp[@]}" --global_batch_size=3 --max_seq_len=236 --stop_iteration=5
check 'compare_losses "$tmp/s1_rows3" "$tmp/sp_rows3" 5 1e-5' "3 rows x T 236: sequence parallel does not reproduce stage 01"

# ---- stage 10: tp 2 x pp 2 (dp 1), 2 micro-batches: the pipeline sends half the residual rows ----
p10=(--n_head=4 --tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2)
run_single 1 s1_h4 --n_head=4
run_ranks 10 c10_sp 4 "${p10[@]}" --sequence_parallel=true
check 'compare_losses "$tmp/s1_h4" "$tmp/c10_sp" 20 1e-5' "stage 10 with sequence parallelism does not reproduce stage 01"
run_ranks 10 c10_tp 4 "${p10[@]}"
sent() { python3 -c "import json,sys; print(sum(e['bytes'] for e in json.load(open(sys.argv[1]))['communication']
    if e['group'] == 'pipeline' and e['kind'] in ('send', 'send-recv')))" "$1/stats.json"; }
check '[ "$(sent "$tmp/c10_tp")" = "$(python3 -c "print(2 * $(sent "$tmp/c10_sp"))")" ]' \
    "stage 10: the pipeline sent $(sent "$tmp/c10_sp") bytes with sequence parallelism, $(sent "$tmp/c10_tp") without (want half)"

# ---- bf16-mixed against stage 02 ----
OMP_NUM_THREADS=2 bounded 300 build/stage-2 "${args[@]}" --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
check '[ $? -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
run_ranks 5 sp_bf16 3 "${sp[@]}" --precision=bf16-mixed
check 'compare_losses "$tmp/s2bf16" "$tmp/sp_bf16" 20 1e-3' "bf16-mixed sequence parallel strays from stage 02"

# ---- bytes and memory against plain [3, 1, 1] (no evaluation: it would add forwards) ----
cargs=(--stop_iteration=3 --eval_batches=0 --tp_dimensions=3,1,1)
run_ranks 5 c_tp 3 "${cargs[@]}"
run_ranks 5 c_sp 3 "${cargs[@]}" --sequence_parallel=true
python3 - "$tmp/c_tp/stats.json" "$tmp/c_sp/stats.json" >"$tmp/bytes" <<'PY'
import json, sys
tp, sp = (json.load(open(p)) for p in sys.argv[1:])
def got(stats, group, kind):
    return sum(e["bytes"] for e in stats["communication"] if e["group"] == group and e["kind"] == kind) / 4
X, L, C, steps = 3, 2, 48, 3
N = sp["tokens_trained"] // 1          # every x rank pushes every token through the model
# README: per micro-batch 4L + 2 activation collectives of N x C elements: all-reduces in plain
# TP, an all-gather and a reduce-scatter each with sequence parallelism; the loss adds 2N
# (all-reduce) and X N (all-gather) in both; the norms' gradients (2L + 1 LayerNorms of 2C) are
# summed over "tp" each step
want = {("x", "all-gather"): N * C * (4 * L + 2) + X * N, ("x", "reduce-scatter"): N * C * (4 * L + 2),
        ("x", "all-reduce"): 2 * N, ("tp", "all-reduce"): steps * (2 * L + 1) * 2 * C}
ok = True
for (g, k), w in want.items():
    ok &= got(sp, g, k) == w
    print(f"  sp {g:3} {k:15} {got(sp, g, k):12.0f} elements, formula {w}")
# bus bytes (nccl-tests: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n): the pair
# moves what the all-reduce it replaces moved
f = (X - 1) / X
ar = (got(tp, "x", "all-reduce") - 2 * N) * 2 * f
pair = (got(sp, "x", "all-gather") - X * N + got(sp, "x", "reduce-scatter")) * f
print(f"  bus elements: plain all-reduces {ar:.0f}, all-gathers + reduce-scatters {pair:.0f}")
ok &= abs(ar - pair) < 1e-6 * ar and ar > 0
sys.exit(0 if ok else 1)
PY
rc=$?
check '[ $rc -eq 0 ]' "communication differs from the formula: $(cat "$tmp/bytes")"
cat "$tmp/bytes"
res_tp=$(json_value "$tmp/c_tp/stats.json" residual_activation_bytes)
res_sp=$(json_value "$tmp/c_sp/stats.json" residual_activation_bytes)
check '[ -n "$res_sp" ] && [ "$((res_sp * 3))" = "$res_tp" ]' "residual activations: $res_sp with sequence parallelism, $res_tp without (want 1/3)"

# ---- refusals: rank 0's one error (the others may follow with theirs before mpirun ends them),
# every rank ending, none hanging ----
refused() { # refused <what> <ranks> <stage> <expected text> [args...]
    local what=$1 np=$2 stage=$3 want=$4; shift 4
    mpirun_aborting 60 "$tmp/refused.log" "$np" "build/stage-$stage" "${args[@]}" --out_dir="$tmp/refused" "$@"
    check '{ [ "$rc" = lingered ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; }; } &&
           [ "$(grep -c "^error: " "$tmp/refused.log")" -eq 1 ] && grep -qF -- "$want" "$tmp/refused.log"' \
        "$what: exit $rc, want one error reading '$want': $(grep "^error" "$tmp/refused.log" | head -3)"
}
refused "4 rows x T 236" 3 5 "4 rows x sequence length T = 236 is 944 tokens, which the x = 3" "${sp[@]}" --max_seq_len=236
refused "[1,3,1]" 3 5 "expected [x, 1, 1]" --tp_dimensions=1,3,1 --sequence_parallel=true
refused "stage 03" 2 3 "key 'sequence_parallel' is true but stage 03" --sequence_parallel=true
finish test_sequence_parallel
