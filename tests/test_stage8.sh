#!/usr/bin/env bash
# Stage 08 (a mixture of experts, expert parallelism) under mpirun:
#  - without experts (num_experts 0) stage 08 on 2 ranks reproduces stage 01's losses within 1e-5;
#  - ep 2, ep 4 and ep 2 x dp 2 reproduce one rank's (ep 1) per-step losses within 1e-5 relative
#    over 20 steps, with the same dropped pairs and the same rows per expert at every step;
#  - the all-to-all bytes on rank 0 equal the formula from the rows it routed and the rows its
#    experts ran, and those rows equal the per-expert counts of metrics.jsonl (all ranks');
#  - a checkpoint holds the whole model: a run resumes from it on another grid, stage 08 starts
#    from it with any ep_size, and stage 06 generates with it (the same tokens with and without
#    its KV cache);
#  - the model learns: after 150 steps its loss is near a dense model's, and with the
#    load-balancing loss on no expert is ever left empty after the warm-up;
#  - bad input gives one error and a non-zero exit on every rank.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64 E=4
# capacity factor 1: pairs drop at every step, so the comparison covers dropping too
args=(--config configs/moe.json --stop_iteration=20 --eval_batches=0 --log_interval=100 --n_embd=$C --capacity_factor=1)

# no experts: the dense model of stage 01, data-parallel
dense=(--config configs/tiny.json --stop_iteration=20 --eval_batches=0 --log_interval=100 --n_embd=$C)
build/stage-1 "${dense[@]}" --out_dir="$tmp/single" >"$tmp/single.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/single.log")"
bounded 300 mpirun -np 2 --bind-to none build/stage-8 "${dense[@]}" --out_dir="$tmp/dense2" >"$tmp/dense2.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 8 without experts failed: $(tail -3 "$tmp/dense2.log")"
check 'compare_losses "$tmp/single" "$tmp/dense2" 20 1e-5' "stage 08 without experts does not reproduce stage 01"

run_ranks 8 ep1 1
run_ranks 8 ep2 2 --ep_size=2
run_ranks 8 ep4 4 --ep_size=4
run_ranks 8 ep2_dp2 4 --ep_size=2
for name in ep2 ep4 ep2_dp2; do
    check 'compare_losses "$tmp/ep1" "$tmp/$name" 20 1e-5' "$name does not reproduce one rank's losses"
    check 'same_routing "$tmp/ep1" "$tmp/$name"' "$name drops other pairs or loads the experts otherwise than one rank"
done
# where the loss sees the gradient's scale (tests/lib.sh's SCALE_ARGS): expert and data parallel
run_ranks 8 ep1scale 1 "${SCALE_ARGS[@]}"
run_ranks 8 ep2_dp2scale 4 --ep_size=2 "${SCALE_ARGS[@]}"
check 'compare_losses "$tmp/ep1scale" "$tmp/ep2_dp2scale" 20 1e-5' "ep 2 x dp 2 without clipping, eps 1e-3, does not reproduce one rank"
dropped=$(python3 -c "import json,sys; print(sum(json.loads(l)['dropped'] for l in open(sys.argv[1])))" "$tmp/ep1/metrics.jsonl")
check '[ "$dropped" -gt 0 ]' "capacity 1 dropped no pair in 20 steps: the comparison proves nothing about dropping"
check '[ "$(json_value "$tmp/ep2_dp2/stats.json" layout)" = "{\"ep\": 2, \"dp\": 2}" ]' \
    "stats.json layout is $(json_value "$tmp/ep2_dp2/stats.json" layout)"
check 'grep -q "replicas identical on all 2 ranks" "$tmp/ep2_dp2.log"' "no replica check on ep 2 x dp 2"

# communication on rank 0 of ep 2: each row it routed goes out and each row its experts ran comes
# back, in forward and again in backward, C floats each: 2 x (routed + ran) x C x 4 bytes
a2a=$(comm_value "$tmp/ep2/stats.json" experts all-to-all bytes)
to=$(json_value "$tmp/ep2/stats.json" rows_to_experts)
at=$(json_value "$tmp/ep2/stats.json" rows_at_experts)
check 'python3 -c "import sys; sys.exit(float($a2a) != 8 * ($to + $at) * $C)"' \
    "rank 0's all-to-all bytes $a2a, want 8 x ($to + $at) x $C"
# rank 0 holds experts 0 and 1: the rows they ran are theirs in every step's per-expert counts
ran=$(python3 -c "
import json, sys
print(sum(sum(block[:$E // 2]) for l in open(sys.argv[1]) for block in json.loads(l)['expert_load']))" "$tmp/ep2/metrics.jsonl")
check '[ "$ran" = "$at" ]' "rank 0's experts ran $at rows, metrics.jsonl counts $ran for experts 0-1"

# checkpoints hold the whole model: resume on another grid, start from it with any ep_size
run_ranks 8 resumed 2 --ep_size=2 --stop_iteration=10 --checkpoint_interval=5
run_ranks 8 resumed 4 --ep_size=4 --resume=true
check 'compare_losses "$tmp/ep1" "$tmp/resumed" 20 1e-5' "10 steps on ep 2 + 10 resumed on ep 4 differ from one rank's 20"
for ep in 1 4; do
    run_ranks 8 from_ep2_$ep $ep --ep_size=$ep --init_from="$tmp/ep2" --stop_iteration=1
done
check 'compare_losses "$tmp/from_ep2_1" "$tmp/from_ep2_4" 1 1e-6' "ep 1 and ep 4 start from ep 2's checkpoint with other losses"
names=$(python3 -c "
import json, struct, sys
with open(sys.argv[1], 'rb') as f:
    header = json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))
print(sum(1 for n in header if '.mlp.experts.' in n), 'gate' if 'transformer.h.1.mlp.gate.weight' in header else '')" \
    "$tmp/ep2/model.safetensors")
check '[ "$names" = "32 gate" ]' "the checkpoint holds '$names' expert tensors, want 2 blocks x $E experts x 2 layers x (weight, bias) = 32 and the gate"

# it learns (configs/moe.json's own capacity and aux loss weight), near the dense model of the
# same shape with the same schedule, and the aux loss keeps every expert busy after the warm-up
run_ranks 8 trained 1 --stop_iteration=150 --capacity_factor=2
build/stage-1 --config configs/tiny.json --num_epochs=1 --stop_iteration=150 --eval_batches=0 --n_embd=$C \
    --out_dir="$tmp/dense" >"$tmp/dense.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the dense stage-01 run failed: $(tail -3 "$tmp/dense.log")"
learned=$(python3 - "$tmp/trained/metrics.jsonl" "$tmp/dense/metrics.jsonl" <<'PY'
import json, sys
moe, dense = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
tail = lambda m: sum(x["loss"] for x in m[-20:]) / 20
empty = sum(1 for x in moe[10:] for block in x["expert_load"] for rows in block if rows == 0)
print(f"{tail(moe) < 0.5 * moe[0]['loss'] and tail(moe) < 1.5 * tail(dense)} {empty}"
      f" moe {moe[0]['loss']:.3f} -> {tail(moe):.3f}, dense -> {tail(dense):.3f}")
PY
)
check '[ "${learned%% *}" = True ]' "the experts did not learn as the dense model did: $learned"
check '[ "$(echo "$learned" | cut -d" " -f2)" = 0 ]' "an expert was left empty after the warm-up ($learned)"

# stage 06 generates with the experts (one rank, no capacity): the cache changes nothing
gen() { printf 'Sort the digits.\t52913\nFind the largest digit.\t4071\nCount the digits.\t8812\n' |
        build/stage-6 --config configs/inference.json --init_from="$tmp/trained" --show_token_ids=true \
        --prompts_path=- --tokens_to_generate=24 "$@" 2>&1 | grep "answer ids"; }
with=$(gen) without=$(gen --kv_cache=false)
check '[ -n "$with" ] && [ "$with" = "$without" ]' "stage 06 with the KV cache: '$with'; without: '$without'"
check 'echo "$with" | grep -q "[0-9] [0-9]"' "stage 06 generated nothing with the trained experts: '$with'"

# bad input: one error, every rank stops
bad=(bounded 120 mpirun -np 2 --bind-to none build/stage-8 "${args[@]}" --out_dir="$tmp/bad")
expect_one_error "experts_per_token > num_experts" "expected 1 to 4 experts per token, found 5" \
    "${bad[@]}" --experts_per_token=5
expect_one_error "num_experts not divisible by ep_size" "the experts must split evenly over the ranks, found 6 experts and ep_size 4" \
    bounded 120 mpirun -np 4 --bind-to none build/stage-8 "${args[@]}" --out_dir="$tmp/bad" --num_experts=6 --ep_size=4
expect_one_error "ep_size not dividing the ranks" "expert groups of 2 ranks do not divide the 3 ranks" \
    bounded 120 mpirun -np 3 --bind-to none build/stage-8 "${args[@]}" --out_dir="$tmp/bad" --ep_size=2 --global_batch_size=12
expect_one_error "a checkpoint with another expert count" "the checkpoint has 4 experts per mixture-of-experts block but key 'num_experts' is 8" \
    "${bad[@]}" --init_from="$tmp/ep2" --num_experts=8
expect_one_error "experts on stage 03" "a mixture of experts is strategy expert_parallel" \
    bounded 60 build/stage-3 "${args[@]}" --out_dir="$tmp/bad"
expect_one_error "bf16 experts" "stage 08's experts train in fp32" "${bad[@]}" --precision=bf16-mixed
expect_one_error "overlap_communication" "stage 08 all-reduces its gradients after backward" \
    "${bad[@]}" --overlap_communication=true
finish test_stage8
