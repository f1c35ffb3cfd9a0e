#!/usr/bin/env bash
# Stage 10 (data x tensor x pipeline parallelism on one mesh) under mpirun:
#  - dp 2 x tp 2 x pp 2 (8 ranks), dp 2 x tp 2 x pp 3 (12 ranks, 4 blocks split 2, 1, 1, gpipe)
#    and tp 4 x pp 2 reproduce stage 01's per-step figures (loss, lr, grad_norm, val_loss)
#    within 1e-5 relative over 20 steps; phi (an untied head with a bias, rotary) and Llama
#    (RMSNorm, SwiGLU, grouped-query attention) on dp 2 x tp 2 x pp 2 too; and with the loss
#    seeing the gradient's scale (SCALE_ARGS: no clipping), where a tied wte summed twice or not at
#    all, or a loss counted on every x rank, moves it; bf16-mixed and fp16 match stage 02 within 1e-3;
#  - the mesh (common/comm/mesh.h) puts tensor parallelism innermost and says so; stats.json's
#    layout holds dp, pp and tp_dimensions;
#  - per-tensor gradients after one step within 1e-5 of stage 01's on dp 2 x tp 2 x pp 2;
#  - comm_bytes per step on rank 0, and the tied wte's and the replicas' bytes, equal the README's
#    formula;
#  - a head count tp does not divide, a pipeline longer than the blocks, a mesh that does not
#    divide the ranks, y > 1: one error, every rank stops (the schedules: test_stage10_sched.sh);
#  - a run saved on dp 2 x tp 2 x pp 2 resumes on tp 4 x pp 2 with stage 01's losses, and its
#    checkpoint (the whole model, Hugging Face names) gives stage 01 the same first loss.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64
common=(--stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=$C)
args=(--config configs/tiny.json "${common[@]}")
mesh=(--tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2)

for L in 2 4; do run_single 1 single$L --n_layer=$L; done
run_ranks 10 d2t2p2 8 --n_layer=2 "${mesh[@]}"
run_ranks 10 d2t2p3_gpipe 12 --n_layer=4 --tp_dimensions=2,1,1 --pp_size=3 --num_microbatches=2 --pp_schedule=gpipe
run_ranks 10 t4p2 8 --n_layer=4 --tp_dimensions=4,1,1 --pp_size=2 --num_microbatches=4
check 'compare_losses "$tmp/single2" "$tmp/d2t2p2" 20 1e-5' "dp 2 x tp 2 x pp 2 does not reproduce stage 01"
for name in d2t2p3_gpipe t4p2; do
    check 'compare_losses "$tmp/single4" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01 (n_layer 4)"
done
check 'grep -q "^mesh: pp 2 x dp 2 x ep 1 x cp 1 x tp 2 = 8 ranks" "$tmp/d2t2p2.log" && grep -q "^mesh order, outermost first: pp, dp, ep, cp, tp" "$tmp/d2t2p2.log"' \
    "the mesh and its order are not printed"
check 'grep -q "stage 0: blocks 0-1 + embedding" "$tmp/d2t2p3_gpipe.log" && grep -q "stage 2: blocks 3-3 + final" "$tmp/d2t2p3_gpipe.log"' \
    "4 blocks over 3 stages are not split 2, 1, 1"
check '[ "$(json_value "$tmp/d2t2p2/stats.json" layout)" = "{\"tp_dimensions\": [2, 1, 1], \"pp\": 2, \"dp\": 2}" ]' \
    "stats.json layout is $(json_value "$tmp/d2t2p2/stats.json" layout)"
check 'grep -q "replicas identical on all 2 ranks" "$tmp/d2t2p2.log"' "no replica check on dp 2"

# communication on rank 0 (t 0 of replica 0 of stage 0) per step, T fixed by a short max_seq_len,
# the README's formula: per micro-batch of r rows, the x group all-reduces r x T x C floats once
# for the embedding and four times a block (attention's and the MLP's row-parallel outputs
# forward, their column-parallel inputs' gradients backward); the pipeline sends m activations
# and receives m gradients (min(m, p - 1) alone, the rest inside a send-recv, as in stage 07); the
# tied wte's vocabulary shard is all-reduced with the last stage; the stage's share with replica 1
T=64
run_ranks 10 bytes 8 --n_layer=2 "${mesh[@]}" --max_seq_len=$T --stop_iteration=3
formula() {
    python3 -c "
V=257; Vp=(V+127)//128*128; C=$C; T=$T; tp=2; p=2; dp=2; m=2; r=16//(dp*m); L0=1
x = m * (1 + 4*L0) * r*T*C * 4
p2p = (m + min(m, p - 1)) * r*T*C * 4
wte = Vp//tp * C * 4
stage0 = Vp//tp*C + T*C + L0 * (12*C*C//tp + 7*C//tp + 6*C)  # wte shard, wpe, block 0's share
print({'total': x + p2p + wte + 4*stage0, 'tied': 3 * wte, 'replicas': 3 * 4*stage0}['$1'])"
}
bytes=$(python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$tmp/bytes/metrics.jsonl")
check '[ "$bytes" = "[$(formula total)]" ]' "comm_bytes per step on rank 0 is $bytes, want [$(formula total)]"
check '[ "$(comm_value "$tmp/bytes/stats.json" tied-wte all-reduce bytes)" = "$(formula tied)" ]' \
    "tied-wte bytes over 3 steps: $(comm_value "$tmp/bytes/stats.json" tied-wte all-reduce bytes), want $(formula tied)"
check '[ "$(comm_value "$tmp/bytes/stats.json" replicas all-reduce bytes)" = "$(formula replicas)" ]' \
    "replicas bytes over 3 steps: $(comm_value "$tmp/bytes/stats.json" replicas all-reduce bytes), want $(formula replicas)"

# per-tensor gradients after one step on dp 2 x tp 2 x pp 2: the tied wte's two halves summed
# once between the first and the last stage, each x rank's shards, the replicas' sum
args=(--config configs/tiny.json "${common[@]}" --n_layer=2)
one_step_gradients_match 10 g_d2t2p2 8 "${mesh[@]}"

# where the loss sees the gradient's scale: a gradient summed over the wrong group moves it
args=(--config configs/tiny.json "${common[@]}" "${SCALE_ARGS[@]}")
run_single 1 single_scale --n_layer=2
run_ranks 10 d2t2p2_scale 8 --n_layer=2 "${mesh[@]}"
check 'compare_losses "$tmp/single_scale" "$tmp/d2t2p2_scale" 20 1e-5' \
    "dp 2 x tp 2 x pp 2 without clipping, eps 1e-3, does not reproduce stage 01"

# bf16-mixed and fp16 (16-mixed: its loss scale and skipped steps too) against stage 02, within
# stage 03's bound (16-bit sums depend on their order)
for precision in bf16-mixed 16-mixed; do
    args=(--config configs/tiny.json "${common[@]}" --precision=$precision)
    run_single 2 single_$precision --n_layer=2
    run_ranks 10 d2t2p2_$precision 8 --n_layer=2 "${mesh[@]}"
    check 'compare_losses "$tmp/single_$precision" "$tmp/d2t2p2_$precision" 20 1e-3' "$precision on dp 2 x tp 2 x pp 2 strays from stage 02"
done

# the other model families: phi (untied lm_head with a bias, partial rotary), Llama (RMSNorm,
# SwiGLU, 4 query heads on 2 key/value heads: one of each per x rank)
for family in phi llama; do
    args=(--config configs/tiny_$family.json "${common[@]}")
    run_single 1 single_$family
    run_ranks 10 d2t2p2_$family 8 "${mesh[@]}"
    check 'compare_losses "$tmp/single_$family" "$tmp/d2t2p2_$family" 20 1e-5' "$family on dp 2 x tp 2 x pp 2 does not reproduce stage 01"
done
args=(--config configs/tiny.json "${common[@]}")

# bad input: one error naming the dimension and the number, every rank stops
bad() { local np=$1; shift; timeout --kill-after=5 120 mpirun -np "$np" --bind-to none build/stage-10 "${args[@]}" --out_dir="$tmp/bad" "$@"; }
expect_one_error "a head count tp does not divide" "attention heads must divide by x.*n_head 4, x 3" \
    bad 6 --n_layer=2 --tp_dimensions=3,1,1 --pp_size=2
expect_one_error "more stages than blocks" "key 'pp_size': 3 stages for 2 blocks" \
    bad 3 --n_layer=2 --pp_size=3
expect_one_error "a mesh that does not divide the ranks" "mesh: dimension 'pp' is 2, which does not divide 3" \
    bad 6 --n_layer=2 "${mesh[@]}"
expect_one_error "a y split" "y must be 1" bad 4 --n_layer=2 --tp_dimensions=2,2,1
expect_one_error "a z split" "z must be 1" bad 4 --n_layer=2 --tp_dimensions=2,1,2

# checkpoints across meshes: 10 steps on dp 2 x tp 2 x pp 2, then 10 more resumed on tp 4 x pp 2,
# give the straight run's losses; the whole model it saved starts stage 01 at the same loss
run_ranks 10 moved 8 --n_layer=2 "${mesh[@]}" --stop_iteration=10
run_ranks 10 moved 8 --n_layer=2 --tp_dimensions=4,1,1 --pp_size=2 --num_microbatches=2 --resume=true
check 'compare_losses "$tmp/single2" "$tmp/moved" 20 1e-5' "a run resumed on another mesh strays from stage 01"
run_ranks 10 from_mesh 8 --n_layer=2 "${mesh[@]}" --init_from="$tmp/d2t2p2" --stop_iteration=1
stage1_starts_alike 10 "$tmp/d2t2p2" "$tmp/from_mesh" "$tmp/single2" --n_layer=2
finish test_stage10
