#!/usr/bin/env bash
# Stage 10's data dimension under ZeRO-1 (10_composed/composed_zero.c: AdamW's state sharded over
# the replicas, gradients reduce-scattered, updated shards all-gathered) under mpirun:
#  - dp 2 x tp 2 x pp 2 (8 ranks) reproduces stage 01's per-step figures within 1e-5 relative over
#    20 steps on GPT-2 (its tied wte summed over the pipeline before the reduce-scatter) and Llama;
#    tp 2 x pp 2 x cp 2 (the shards over the context group) over 5; dp 3 x tp 2 x pp 2 (12 ranks:
#    shards that do not divide the share, the last padded) over 3;
#  - memory per rank (stats.json) and the replicas' bytes per step equal the README's formula;
#  - a run saved on a ZeRO mesh resumes on dp 4 x tp 2 x pp 1 (another shard count) with stage
#    01's losses, and stage 01 loads its checkpoint;
#  - zero_stage 2 or 3, hsdp_replicas, and zero_stage 1 beside LoRA or experts are refused: one error,
#    every rank stops.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64
common=(--eval_batches=1 --log_interval=100 --n_embd=$C --n_layer=2)
mesh=(--tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2)

# zero_equals_stage1 <name> <config> <steps> <ranks> [mesh...]: stage 01 and ZeRO-1 stage 10 on
# the mesh log the same per-step figures within 1e-5 relative
zero_equals_stage1() {
    local name=$1 config=$2 steps=$3 np=$4
    shift 4
    args=(--config configs/$config.json --stop_iteration=$steps "${common[@]}")
    run_single 1 single_$name
    run_ranks 10 "$name" "$np" "$@" --zero_stage=1
    check 'compare_losses "$tmp/single_$name" "$tmp/$name" $steps 1e-5' "ZeRO-1 $name does not reproduce stage 01"
}
zero_equals_stage1 d2t2p2 tiny 20 8 "${mesh[@]}"
zero_equals_stage1 d2t2p2_llama tiny_llama 20 8 "${mesh[@]}"
zero_equals_stage1 t2p2c2 tiny 5 8 "${mesh[@]}" --cp_size=2  # the shards over the context group (dp 1 x cp 2)
check 'grep -q "^ZeRO-1 over 2 replicas" "$tmp/d2t2p2.log"' "the ZeRO-1 memory line is not printed"
check 'grep -q "replicas identical on all 2 ranks" "$tmp/d2t2p2.log"' "the all-gathered replicas differ"

# dp 3 (12 ranks): rank 0 (t 0 of replica 0 of stage 0) holds n0 = the stage's share (wpe's rows
# max_seq_len 254: n0 = 3 x 17909 + 1), in 3 shards of ceil(n0 / 3), the last padded; per step the
# replicas reduce-scatter and all-gather 3 x shard floats each (in place of DDP's all-reduce of
# n0); the other rows as in test_stage10, the data's batches T = 240 tokens long. Memory: AdamW's
# m and v are 2 x shard floats; the state (parameters and gradients padded to 3 shards, m, v and a
# scratch shard) (2 x 3 + 3) x shard floats.
W=254 T=240
args=(--config configs/tiny.json --stop_iteration=3 "${common[@]}" --max_seq_len=$W --global_batch_size=12)
run_single 1 single_d3
run_ranks 10 d3 12 "${mesh[@]}" --zero_stage=1
check 'compare_losses "$tmp/single_d3" "$tmp/d3" 3 1e-5' "ZeRO-1 dp 3 x tp 2 x pp 2 does not reproduce stage 01"
formula() {
    python3 -c "
V=257; Vp=(V+127)//128*128; C=$C; W=$W; T=$T; tp=2; p=2; dp=3; m=2; r=12//(dp*m); L0=1
n0 = Vp//tp*C + W*C + L0 * (12*C*C//tp + 7*C//tp + 6*C)  # wte shard, wpe, block 0's share
shard = -(-n0 // dp)
x = m * (1 + 4*L0) * r*T*C * 4
p2p = (m + min(m, p - 1)) * r*T*C * 4
wte = Vp//tp * C * 4
zero = dp * shard * 4  # one reduce-scatter, one all-gather
print({'total': x + p2p + wte + 2*zero, 'zero': 3 * zero, 'moments': 2*shard*4,
       'state': (2*dp + 3) * shard * 4, 'padded': n0 % dp != 0}['$1'])"
}
check '[ "$(formula padded)" = True ]' "the dp 3 case does not pad its last shard"
bytes=$(python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$tmp/d3/metrics.jsonl")
check '[ "$bytes" = "[$(formula total)]" ]' "comm_bytes per step on rank 0 is $bytes, want [$(formula total)]"
for kind in reduce-scatter all-gather; do
    total=$(comm_value "$tmp/d3/stats.json" replicas "$kind" bytes)
    check '[ "$total" = "$(formula zero)" ]' "replicas $kind bytes over 3 steps: $total, want $(formula zero)"
done
check '[ "$(json_value "$tmp/d3/stats.json" memory "AdamW m and v (fp32)")" = "$(formula moments)" ]' \
    "AdamW m and v per rank: $(json_value "$tmp/d3/stats.json" memory "AdamW m and v (fp32)"), want $(formula moments)"
check '[ "$(json_value "$tmp/d3/stats.json" state_bytes)" = "$(formula state)" ]' \
    "state bytes per rank: $(json_value "$tmp/d3/stats.json" state_bytes), want $(formula state)"

# checkpoints across meshes: 10 steps on ZeRO-1 dp 2 x tp 2 x pp 2, then 10 more resumed on ZeRO-1
# dp 4 x tp 2 x pp 1 (m and v gathered whole, sliced into 4 shards), give stage 01's 20 steps; the
# whole model the straight run saved starts stage 01 at that run's next loss
args=(--config configs/tiny.json --stop_iteration=20 "${common[@]}")
run_ranks 10 moved 8 "${mesh[@]}" --zero_stage=1 --stop_iteration=10
run_ranks 10 moved 8 --tp_dimensions=2,1,1 --pp_size=1 --num_microbatches=2 --zero_stage=1 --resume=true
check 'compare_losses "$tmp/single_d2t2p2" "$tmp/moved" 20 1e-5' "a ZeRO-1 run resumed on another mesh strays from stage 01"
run_ranks 10 from_zero 8 "${mesh[@]}" --init_from="$tmp/d2t2p2" --stop_iteration=1
stage1_starts_alike 10 "$tmp/d2t2p2" "$tmp/from_zero" "$tmp/single_d2t2p2"

args=(--config configs/tiny.json --stop_iteration=1 "${common[@]}")
bad() { timeout --kill-after=5 120 mpirun -np 8 --bind-to none build/stage-10 "${args[@]}" --out_dir="$tmp/bad" "$@"; }
expect_one_error "zero_stage 2" "key 'zero_stage' is 2 but stage 10 runs zero_stage 1" bad "${mesh[@]}" --zero_stage=2
expect_one_error "zero_stage 3" "key 'zero_stage' is 3 but stage 10 runs zero_stage 1" bad "${mesh[@]}" --zero_stage=3
expect_one_error "hsdp_replicas" "key 'hsdp_replicas' is 2 but stage 10's data dimension is one group" \
    bad "${mesh[@]}" --zero_stage=1 --hsdp_replicas=2
expect_one_error "zero_stage 1 with LoRA" "key 'zero_stage' is 1 but lora_rank is 4" bad "${mesh[@]}" --zero_stage=1 --lora_rank=4
expect_one_error "zero_stage 1 with experts" "key 'zero_stage' is 1 but num_experts is 4" bad "${mesh[@]}" --zero_stage=1 --num_experts=4
finish test_stage10_zero
