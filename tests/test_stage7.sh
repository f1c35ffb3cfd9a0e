#!/usr/bin/env bash
# Stage 07 (pipeline parallelism) under mpirun:
#  - pp 1, 2, 3 (an uneven split of 4 blocks) and 4 stages, GPipe and 1F1B, 1, 4 and 8 (on 4
#    stages) micro-batches, pp 2 x dp 2, and recomputation reproduce stage 01's per-step figures
#    (loss, lr, grad_norm, val_loss) within 1e-5 relative over 20 steps (stage 01 run with the
#    same n_layer); bf16-mixed matches stage 02 within 1e-3;
#  - recomputation on and off give bit-identical losses, and keep fewer activations;
#  - GPipe holds m micro-batches' activations on stage 0, 1F1B min(m, p) (2 of 4; 4 of 8);
#  - the first step's op sequence of each schedule, and the bubble beside its theory, are printed;
#  - comm_bytes per step on rank 0 = the formula written here (activations, their gradients, the
#    tied wte and the data-parallel all-reduce);
#  - bad grids and mismatched configs give one error and a non-zero exit;
#  - a stage-07 run resumed from its checkpoint gives the straight run's losses bit for bit;
#  - a stage-07 checkpoint loads in stage 01 and gives stage 07's first loss.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=$C)

for L in 2 4; do
    OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --n_layer=$L --out_dir="$tmp/single$L" >"$tmp/single$L.log" 2>&1
    rc=$?; check '[ $rc -eq 0 ]' "stage 1 (n_layer $L) failed: $(tail -3 "$tmp/single$L.log")"
done
run_ranks 7 pp1 1 --n_layer=2
run_ranks 7 pp2_1f1b_m4 2 --n_layer=2 --pp_size=2 --num_microbatches=4 --pp_schedule=1f1b
run_ranks 7 pp2_gpipe_m4 2 --n_layer=2 --pp_size=2 --num_microbatches=4 --pp_schedule=gpipe
run_ranks 7 pp2_m1 2 --n_layer=2 --pp_size=2 --num_microbatches=1
run_ranks 7 pp2_L4 2 --n_layer=4 --pp_size=2 --num_microbatches=4
run_ranks 7 pp2_recompute 2 --n_layer=4 --pp_size=2 --num_microbatches=4 --activation_checkpointing=true
run_ranks 7 pp2_dp2 4 --n_layer=2 --pp_size=2 --num_microbatches=2
run_ranks 7 pp3_uneven 3 --n_layer=4 --pp_size=3 --num_microbatches=4
run_ranks 7 pp4_gpipe 4 --n_layer=4 --pp_size=4 --num_microbatches=4 --pp_schedule=gpipe
# 1F1B with more micro-batches than stages: stage 0 cycles through 4 activation slots
run_ranks 7 pp4_1f1b_m8 4 --n_layer=4 --pp_size=4 --num_microbatches=8 --pp_schedule=1f1b
for name in pp1 pp2_1f1b_m4 pp2_gpipe_m4 pp2_m1 pp2_dp2; do
    check 'compare_losses "$tmp/single2" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01"
done
for name in pp2_L4 pp2_recompute pp3_uneven pp4_gpipe pp4_1f1b_m8; do
    check 'compare_losses "$tmp/single4" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01 (n_layer 4)"
done
# where the loss sees the gradient's scale (tests/lib.sh's SCALE_ARGS): pipeline and data parallel
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --n_layer=2 "${SCALE_ARGS[@]}" --out_dir="$tmp/single_scale" >"$tmp/single_scale.log" 2>&1
run_ranks 7 pp2_dp2scale 4 --n_layer=2 --pp_size=2 --num_microbatches=2 "${SCALE_ARGS[@]}"
check 'compare_losses "$tmp/single_scale" "$tmp/pp2_dp2scale" 20 1e-5' "pp 2 x dp 2 without clipping, eps 1e-3, does not reproduce stage 01"
check 'grep -q "stage 0: blocks 0-1 + embedding" "$tmp/pp3_uneven.log" && grep -q "stage 2: blocks 3-3 + final" "$tmp/pp3_uneven.log"' \
    "4 blocks over 3 stages are not split 2, 1, 1"
check 'grep -q "replicas identical on all 2 ranks" "$tmp/pp2_dp2.log"' "no replica check on pp 2 x dp 2"
check '[ "$(json_value "$tmp/pp2_dp2/stats.json" layout)" = "{\"pp\": 2, \"dp\": 2}" ]' \
    "stats.json layout is $(json_value "$tmp/pp2_dp2/stats.json" layout)"

# bf16: the pipeline against stage 02 (bf16 results depend on summation order: 1e-3, as stage 03)
OMP_NUM_THREADS=2 build/stage-2 "${args[@]}" --n_layer=2 --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
run_ranks 7 pp2bf16 2 --n_layer=2 --pp_size=2 --num_microbatches=4 --precision=bf16-mixed
check 'compare_losses "$tmp/s2bf16" "$tmp/pp2bf16" 20 1e-3' "bf16 stage 7 strays from stage 2"

# recomputation (2 blocks a stage: with one there is nothing to save): the same arithmetic, so
# the same losses to the last bit, with less memory
losses() { python3 -c "import json,sys; print([json.loads(l)['loss'] for l in open(sys.argv[1])])" "$1/metrics.jsonl"; }
check '[ "$(losses "$tmp/pp2_L4")" = "$(losses "$tmp/pp2_recompute")" ]' "recomputation changed the losses"
act() { json_value "$1/stats.json" memory "activations (fp32)"; }
check '[ "$(act "$tmp/pp2_recompute")" -lt "$(act "$tmp/pp2_L4")" ]' \
    "recomputation keeps $(act "$tmp/pp2_recompute") bytes of activations, not fewer than $(act "$tmp/pp2_L4")"

# memory: stage 0 holds all 4 micro-batches under GPipe, p = 2 under 1F1B
check '[ "$(json_value "$tmp/pp2_gpipe_m4/stats.json" activation_slots)" = 4 ] && [ "$(json_value "$tmp/pp2_1f1b_m4/stats.json" activation_slots)" = 2 ]' \
    "activation slots on stage 0: gpipe $(json_value "$tmp/pp2_gpipe_m4/stats.json" activation_slots), 1f1b $(json_value "$tmp/pp2_1f1b_m4/stats.json" activation_slots)"
check '[ "$(json_value "$tmp/pp4_1f1b_m8/stats.json" activation_slots)" = 4 ]' \
    "1F1B on 4 stages with 8 micro-batches: $(json_value "$tmp/pp4_1f1b_m8/stats.json" activation_slots) activation slots on stage 0, not 4"
check '[ "$(act "$tmp/pp2_gpipe_m4")" -eq $((2 * $(act "$tmp/pp2_1f1b_m4"))) ]' \
    "GPipe's activations ($(act "$tmp/pp2_gpipe_m4")) are not twice 1F1B's ($(act "$tmp/pp2_1f1b_m4"))"

# the schedules made visible: each rank's first step, and the bubble's theory
check 'grep -q "rank 0 (stage 0, replica 0): .*| F0s F1s rB0 F2s rB1 F3s rB2 rB3 *$" "$tmp/pp2_1f1b_m4.log"' "1F1B's sequence on stage 0"
check 'grep -q "rank 1 (stage 1, replica 0): .*| rF0 B0s rF1 B1s rF2 B2s rF3 B3s *$" "$tmp/pp2_1f1b_m4.log"' "1F1B's sequence on stage 1"
check 'grep -q "rank 0 (stage 0, replica 0): .*| F0s F1s F2s F3s rB0 rB1 rB2 rB3 *$" "$tmp/pp2_gpipe_m4.log"' "GPipe's sequence on stage 0"
# on 4 stages the warm-up is pp - s - 1 forwards, not one: an order right on 2 stages only fails
check 'grep -q "rank 0 (stage 0, replica 0): .*| F0s F1s F2s F3s rB0 F4s rB1 F5s rB2 F6s rB3 F7s rB4 rB5 rB6 rB7 *$" "$tmp/pp4_1f1b_m8.log"' "1F1B's sequence on stage 0 of 4"
check 'grep -q "rank 1 (stage 1, replica 0): .*| rF0s rF1s rF2s rB0s rF3s rB1s rF4s rB2s rF5s rB3s rF6s rB4s rF7s rB5s rB6s rB7s *$" "$tmp/pp4_1f1b_m8.log"' "1F1B's sequence on stage 1 of 4"
check 'grep -q "theory (p-1)/(m+p-1) = 3/7 = 42.9%" "$tmp/pp4_gpipe.log"' "no bubble theory for p 4, m 4"

# communication on rank 0 (stage 0 of replica 0) per step, with T fixed by a short max_seq_len:
# m micro-batches' activations sent and their gradients received (rows/m x T x C floats each),
# the tied wte's gradient all-reduced with the last stage, and stage 0's gradient with replica 1.
# A send-recv counts the message sent: under 1F1B the gradients received together with an
# activation sent (the steady state, m - min(m, p - 1) of them) add nothing of their own.
T=64 rows=8 m=2 p=2
run_ranks 7 bytes 4 --n_layer=2 --pp_size=$p --num_microbatches=$m --max_seq_len=$T --stop_iteration=3
want=$(python3 -c "
V=257; Vp=(V+127)//128*128; C=$C; T=$T; rows=$rows; m=$m; p=$p
alone = min(m, p - 1)                       # gradients received on their own (warm-up's)
p2p = (m + alone) * (rows // m) * T * C * 4 # activations out, gradients in
wte = Vp * C * 4                            # the tied wte's gradient (all-reduce, 2 ranks)
stage0 = Vp*C + T*C + 1 * (12*C*C + 13*C)   # wte, wpe and block 0
print(p2p + wte + 4 * stage0)")
bytes=$(python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$tmp/bytes/metrics.jsonl")
check '[ "$bytes" = "[$want]" ]' "comm_bytes per step on rank 0 is $bytes, want [$want]"
calls=$(comm_value "$tmp/bytes/stats.json" pipeline send-recv calls)
check '[ "$calls" = 3 ]' "1F1B on stage 0 (p 2, m 2): $calls send-recv calls in 3 steps, want one a step"

# bad input: one error, every rank stops
bad=(bounded 120 mpirun -np 2 --bind-to none build/stage-7 "${args[@]}" --out_dir="$tmp/bad")
expect_one_error "pp_size > n_layer" "3 stages for 2 blocks" \
    bounded 120 mpirun -np 3 --bind-to none build/stage-7 "${args[@]}" --out_dir="$tmp/bad" --n_layer=2 --pp_size=3
expect_one_error "num_microbatches not dividing the rows" "3 micro-batches do not divide a replica's share" \
    "${bad[@]}" --n_layer=2 --pp_size=2 --num_microbatches=3
expect_one_error "pp_size not dividing the ranks" "2 stages do not divide the 3 ranks" \
    bounded 120 mpirun -np 3 --bind-to none build/stage-7 "${args[@]}" --out_dir="$tmp/bad" --n_layer=2 --pp_size=2
expect_one_error "gradient_acc_steps beside num_microbatches" "set num_microbatches instead" \
    "${bad[@]}" --pp_size=2 --gradient_acc_steps=2
expect_one_error "overlap_communication" "stage 07 has no overlapped variant" \
    "${bad[@]}" --pp_size=2 --overlap_communication=true
expect_one_error "pp_size on another stage" "strategy \"ddp\" runs no pipeline" \
    bounded 60 build/stage-3 "${args[@]}" --out_dir="$tmp/bad" --pp_size=2
bounded 120 mpirun --bind-to none -np 1 build/stage-7 "${args[@]}" --pp_size=2 --out_dir="$tmp/mm" : \
    -np 1 build/stage-7 "${args[@]}" --pp_size=2 --out_dir="$tmp/mm" --lr=0.1 >"$tmp/mismatch.log" 2>&1
rc=$?
check '[ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "do not agree on the config" "$tmp/mismatch.log"' \
    "mismatched configs: exit $rc: $(tail -3 "$tmp/mismatch.log")"

# a pipeline rank killed mid-step ends the job: its neighbours wait in a receive that never comes
killed_rank_ends_job 7 4 "${args[@]}" --n_layer=2 --pp_size=2 --num_microbatches=2 --out_dir="$tmp/kill"

# resume: 10 steps + resume + 10 steps give the straight run's losses to the last bit (the
# optimizer state goes through the whole-model checkpoint too)
run_ranks 7 resumed 2 --n_layer=2 --pp_size=2 --num_microbatches=4 --stop_iteration=10 --checkpoint_interval=5
run_ranks 7 resumed 2 --n_layer=2 --pp_size=2 --num_microbatches=4 --resume=true
check '[ "$(losses "$tmp/pp2_1f1b_m4")" = "$(losses "$tmp/resumed")" ]' "10 + resumed 10 steps differ from 20 straight ones"

# the checkpoint holds the whole model: stage 01 starts from it with stage 07's first loss
run_ranks 7 from_pp 2 --n_layer=2 --pp_size=2 --num_microbatches=2 --init_from="$tmp/pp2_1f1b_m4" --stop_iteration=1
stage1_starts_alike 07 "$tmp/pp2_1f1b_m4" "$tmp/from_pp" "$tmp/single2"
finish test_stage7
