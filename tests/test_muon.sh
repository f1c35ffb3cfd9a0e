#!/usr/bin/env bash
# Muon (optimizer muon) where the matrices are cut over ranks; stage 01's Muon against its float64
# reference is tests/test_train_oracle.sh's. Here, against stage 01's Muon run over 10 steps:
#  - stage 02: the same bits in fp32, within 1e-3 in bf16-mixed (measured 3.7e-5);
#  - stage 03 on 3 ranks (whole matrices on every replica): within 1e-5;
#  - stage 04 at zero_stage 1, 2 and 3 on 2, 3 and 4 ranks (blocks of 12C^2+13C elements: shards
#    that cut matrices anywhere), one owner per matrix or muon_redundant, and HSDP 2x2: within 1e-5;
#  - stage 05 on [2,1,1], [2,2,1] and [1,1,2]: within 1e-5;
#  - phi and Llama (grouped-query attention, SwiGLU: q, k, v and gate, up as matrices apart) on
#    ZeRO-3 over 3 ranks and on [2,2,1];
#  - the bytes Muon adds per step (metrics.jsonl comm_bytes, against AdamW on the same layout; nccl-
#    tests sizes, comm.h), the README's formulas: ZeRO with owners, an all-gather and a
#    reduce-scatter of every block, 2 x 4 x L x block (padded to P); muon_redundant, the
#    all-gather alone; stage 05, one all-reduce of the whole model, 4 x num_params (group muon);
#  - the orthogonalization's flops on the busiest rank (stats.json): within 5% of an even share
#    with owners, all of them with muon_redundant;
#  - the memory report's Muon row (stats.json) against its formula, and the planner's memory rows
#    and bytes per step for ZeRO-3 (owners) and ZeRO-1 (muon_redundant) against the runs;
#  - bad input: one clear error, every rank stopped.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
L=2 C=48
args=(--config configs/tiny.json --stop_iteration=10 --eval_batches=1 --log_interval=100 --n_layer=$L --n_embd=$C
      --global_batch_size=12 --optimizer=muon)

run_single 1 single
# stage 02 runs stage 01's lines: the same bits in fp32; bf16-mixed trains with Muon too
run_single 2 s2 --precision=32
check 'compare_losses "$tmp/single" "$tmp/s2" 10 0' "stage 02's Muon in fp32 is not stage 01's bit for bit"
run_single 2 s2_bf16 --precision=bf16-mixed
check 'compare_losses "$tmp/single" "$tmp/s2_bf16" 10 1e-3 1e-2' "stage 02's Muon in bf16-mixed strays more than 1e-3 from fp32"
run_single 1 phi --arch=phi
run_single 1 llama --arch=llama --n_kv_head=2 --intermediate_size=100

# ---- equivalence with stage 01 -----------------------------------------------------------------
# name ranks zero_stage hsdp_replicas [args]
zero_runs="z1_np2 2 1 1
z2_np3 3 2 1 --overlap_communication=true
z3_np3 3 3 1
z3_np4 4 3 1 --gradient_acc_steps=3
z1_np3_red 3 1 1 --muon_redundant=true
z3_np3_red 3 3 1 --muon_redundant=true
z3_h22 4 3 2"
while read -r name np zero R extra; do
    run_ranks 4 "$name" "$np" --zero_stage="$zero" --hsdp_replicas="$R" $extra </dev/null
    check 'compare_losses "$tmp/single" "$tmp/$name" 10 1e-5' "stage 04 $name does not reproduce stage 01's Muon"
done <<<"$zero_runs"
# stage 03: every replica holds whole matrices and the same gradients, so Muon runs as on one rank
run_ranks 3 ddp_np3 3
check 'compare_losses "$tmp/single" "$tmp/ddp_np3" 10 1e-5' "stage 03 on 3 ranks does not reproduce stage 01's Muon"
for grid in "g211 2 2,1,1" "g221 4 2,2,1" "g112 2 1,1,2"; do
    read -r name np dims <<<"$grid"
    run_ranks 5 "$name" "$np" --tp_dimensions="$dims"
    check 'compare_losses "$tmp/single" "$tmp/$name" 10 1e-5' "stage 05 [$dims] does not reproduce stage 01's Muon"
done
for family in "phi --arch=phi" "llama --arch=llama --n_kv_head=2 --intermediate_size=100"; do
    read -r name extra <<<"$family"
    run_ranks 4 "${name}_z3" 3 --zero_stage=3 $extra
    check 'compare_losses "$tmp/$name" "$tmp/${name}_z3" 10 1e-5' "$name: ZeRO-3 on 3 ranks does not reproduce stage 01's Muon"
    run_ranks 5 "${name}_g221" 4 --tp_dimensions=2,2,1 $extra
    check 'compare_losses "$tmp/$name" "$tmp/${name}_g221" 10 1e-5' "$name: [2,2,1] does not reproduce stage 01's Muon"
done

# ---- the bytes Muon adds per step ----------------------------------------------------------------
run_ranks 4 z3_np3_adamw 3 --zero_stage=3 --optimizer=adamw
run_ranks 5 g221_adamw 4 --tp_dimensions=2,2,1 --optimizer=adamw
# added <muon out_dir> <adamw out_dir>: the comm_bytes every step adds, when all steps agree
added() {
    python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["comm_bytes"] for l in open(p)] for p in sys.argv[1:])
gaps = {x - y for x, y in zip(a, b)}
print(gaps.pop() if len(gaps) == 1 and len(a) == len(b) else f"unequal: {sorted(gaps)}")
PY
}
# the model's elements, GPT-2 with the byte tokenizer: V 257 padded to 384, T 256
sizes() { python3 -c "
P, L, C = $1, $L, $C
pad = lambda n: (n + P - 1) // P * P
block = 12 * C * C + 13 * C
print(8 * L * pad(block), 4 * L * pad(block), 4 * (384 * C + 256 * C + 2 * C + L * block))"; }
read -r owners redundant model <<<"$(sizes 3)"
got=$(added "$tmp/z3_np3" "$tmp/z3_np3_adamw")
check '[ "$got" = "$owners" ]' "ZeRO-3 on 3 ranks: Muon adds $got bytes a step, the README's 2 x 4 x L x block: $owners"
got=$(added "$tmp/z3_np3_red" "$tmp/z3_np3_adamw")
check '[ "$got" = "$redundant" ]' "ZeRO-3 muon_redundant: Muon adds $got bytes a step, the README's 4 x L x block: $redundant"
got=$(added "$tmp/g221" "$tmp/g221_adamw")
check '[ "$got" = "$model" ]' "[2,2,1]: Muon adds $got bytes a step, the README's 4 x num_params: $model"
calls=$(comm_value "$tmp/g221/stats.json" muon all-reduce calls)
check '[ "$calls" = 10 ]' "[2,2,1]: $calls all-reduces in group muon, want one a step (10)"

# ---- the orthogonalization's flops per rank (stats.json): owners share them, largest matrix first
# to the least loaded rank; muon_redundant does all of them everywhere. A GPT-2 block's matrices,
# 5 iterations of 4 k^2 n + 2 k^3 flops each: qkv 14 C^3, attention projection 6, fc and its
# projection 18 each
read -r total <<<"$(python3 -c "print($L * 5 * 56 * $C ** 3)")"
busiest=$(json_value "$tmp/z3_np3/stats.json" muon_flops_per_rank_max)
check 'python3 -c "import sys; sys.exit(not $busiest <= 1.05 * $total / 3)"' \
    "ZeRO-3 on 3 ranks: the busiest rank orthogonalizes $busiest flops, more than 1.05 x a third of $total"
busiest=$(json_value "$tmp/z3_np3_red/stats.json" muon_flops_per_rank_max)
check 'python3 -c "import sys; sys.exit(not $busiest == $total)"' "muon_redundant: $busiest flops per rank, want all $total"

# ---- memory: the Muon row --------------------------------------------------------------------------
# scratch: the largest matrix (4C x C) and two Gram matrices (C x C); ZeRO adds one gathered block
# (two with owners: the one this rank orthogonalized apart), stage 05 the whole model
memory_row() { json_value "$1/stats.json" memory "$2"; }
read -r owners redundant model <<<"$(python3 -c "
P, L, C = 3, $L, $C
block = (12 * C * C + 13 * C + P - 1) // P * P
scratch = 4 * (4 * C * C + 2 * C * C)
print(scratch + 8 * block, scratch + 4 * block, scratch + 4 * (384 * C + 256 * C + 2 * C + L * (12 * C * C + 13 * C)))")"
got=$(memory_row "$tmp/z3_np3" "Muon: gathered block + scratch")
check '[ "$got" = "$owners" ]' "ZeRO-3 on 3 ranks: Muon's memory $got bytes, want $owners"
got=$(memory_row "$tmp/z1_np3_red" "Muon: gathered block + scratch")
check '[ "$got" = "$redundant" ]' "ZeRO-1 muon_redundant: Muon's memory $got bytes, want $redundant"
got=$(memory_row "$tmp/g221" "Muon: whole model + scratch")
check '[ "$got" = "$model" ]' "[2,2,1]: Muon's memory $got bytes, want $model"

# ---- the planner: Muon's memory row and bytes on stage 04's layouts, equal to the runs' ------------
# (build/plan built here too, a no-op after make test: a tree with a planted bug in the planner
# must test its own); plan_equals_run <run> <plan --layout> [args]: every memory row and the bytes
# of a step after the first
make --no-print-directory -s BACKEND=cpu build/plan >"$tmp/make.log" 2>&1
plan_equals_run() {
    local run=$1 layout=$2
    shift 2
    build/plan --cluster=configs/clusters/h100-sxm.json --ranks=3 --layout="$layout" --json="$tmp/$run.plan.json" \
        "${args[@]}" --strategy=fsdp "$@" >"$tmp/$run.plan.log" 2>&1
    local rc=$? verdict
    verdict=$(python3 - "$tmp/$run.plan.json" "$tmp/$run" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))["layouts"][0]
stats = json.load(open(sys.argv[2] + "/stats.json"))
step = [json.loads(l) for l in open(sys.argv[2] + "/metrics.jsonl")][1]
problems = [f"memory {k}: planned {plan['memory'].get(k)}, ran {stats['memory'].get(k)}"
            for k in set(plan["memory"]) | set(stats["memory"]) if plan["memory"].get(k) != stats["memory"].get(k)]
if plan["comm_bytes"] != step["comm_bytes"]:
    problems.append(f"comm_bytes: planned {plan['comm_bytes']}, ran {step['comm_bytes']}")
print("; ".join(problems) or "equal")
PY
)
    check '[ $rc -eq 0 ] && [ "$verdict" = equal ]' "plan of $run ($layout): $verdict $(tail -2 "$tmp/$run.plan.log")"
}
plan_equals_run z3_np3 fsdp
plan_equals_run z1_np3_red zero1 --muon_redundant=true

# ---- bad input: one error, every rank stops -------------------------------------------------------
bad=(timeout --kill-after=5 120 mpirun -np 2 --bind-to none)
expect_one_error "optimizer sgd" "key 'optimizer': expected adamw or muon, found 'sgd'" \
    "${bad[@]}" build/stage-4 "${args[@]}" --out_dir="$tmp/bad" --optimizer=sgd
expect_one_error "muon on stage 09" "key 'optimizer' is muon but stage 09 has no Muon" \
    "${bad[@]}" build/stage-9 "${args[@]}" --out_dir="$tmp/bad"
expect_one_error "muon_lr under adamw" "key 'muon_lr' is set but key 'optimizer' is adamw" \
    "${bad[@]}" build/stage-4 "${args[@]}" --out_dir="$tmp/bad" --optimizer=adamw --muon_lr=0.01
expect_one_error "muon_redundant on stage 05" "key 'muon_redundant' is true but stage 05 holds every matrix whole" \
    "${bad[@]}" build/stage-5 "${args[@]}" --out_dir="$tmp/bad" --tp_dimensions=2,1,1 --muon_redundant=true
expect_one_error "muon with LoRA" "key 'optimizer' is muon but lora_rank is 4: LoRA's adapters train with adamw" \
    "${bad[@]}" build/stage-4 "${args[@]}" --out_dir="$tmp/bad" --lora_rank=4
expect_one_error "muon_momentum 1" "key 'muon_momentum': expected a value in \[0, 1), found 1" \
    "${bad[@]}" build/stage-4 "${args[@]}" --out_dir="$tmp/bad" --muon_momentum=1
finish test_muon
