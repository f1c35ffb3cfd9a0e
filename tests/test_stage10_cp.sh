#!/usr/bin/env bash
# Stage 10's cp dimension (10_composed/composed_cp.c: 09's ring attention inside 05's layers inside
# 07's stages) under mpirun:
#  - dp 1 x tp 2 x pp 2 x cp 2 (8 ranks) reproduces stage 01's per-step figures (loss, lr,
#    grad_norm, val_loss) within 1e-5 relative over 20 steps on GPT-2 (learned wpe at each chunk's
#    positions) and Llama (RoPE, grouped-query attention); dp 2 x tp 2 x pp 2 x cp 2 (16 ranks) over
#    5 steps; pp 2 x cp 7 (14 ranks, batches of 240 tokens in 14 chunks of 18: the last padded)
#    over 5; tp 2 x pp 2 x cp 3 (12 ranks, 6 chunks of 11 tokens) over 3 steps;
#  - per-tensor gradients after one step within 1e-5 of stage 01's on tp 2 x pp 2 x cp 2 (Llama);
#  - the mesh puts cp between dp and tp and says so; stats.json's layout holds cp;
#  - comm_bytes per step on rank 0, and the cp ring's and the replicas' (dp x cp) bytes, equal the
#    README's formula;
#  - a max_seq_len that 2 x cp_size chunks do not divide, and sequence_parallel beside cp: one
#    error naming the key and the number, every rank stops.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64
common=(--eval_batches=1 --log_interval=100 --n_embd=$C --n_layer=2)
mesh=(--tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2)

for family in tiny tiny_llama; do
    args=(--config configs/$family.json --stop_iteration=20 "${common[@]}")
    run_single 1 single_$family
    run_ranks 10 c2t2p2_$family 8 "${mesh[@]}" --cp_size=2
    check 'compare_losses "$tmp/single_$family" "$tmp/c2t2p2_$family" 20 1e-5' \
        "$family on tp 2 x pp 2 x cp 2 does not reproduce stage 01"
done
check 'grep -q "^mesh: pp 2 x dp 1 x ep 1 x cp 2 x tp 2 = 8 ranks" "$tmp/c2t2p2_tiny.log"' "the mesh with cp is not printed"
check 'grep -q "rank 0 holds chunks 0 and 3 of 4" "$tmp/c2t2p2_tiny.log"' "09's chunk plan is not printed"
check '[ "$(json_value "$tmp/c2t2p2_tiny/stats.json" layout cp)" = 2 ]' \
    "stats.json layout is $(json_value "$tmp/c2t2p2_tiny/stats.json" layout)"

# per-tensor gradients after one step on tp 2 x pp 2 x cp 2 (Llama: RoPE at each chunk's positions)
one_step_gradients_match 10 g_c2t2p2 8 "${mesh[@]}" --cp_size=2

args=(--config configs/tiny.json --stop_iteration=5 "${common[@]}")
run_single 1 single5
run_ranks 10 d2c2t2p2 16 "${mesh[@]}" --cp_size=2
check 'compare_losses "$tmp/single5" "$tmp/d2c2t2p2" 5 1e-5' "dp 2 x tp 2 x pp 2 x cp 2 does not reproduce stage 01"
check 'grep -q "replicas identical on all 4 ranks" "$tmp/d2c2t2p2.log"' "no replica check over dp x cp"

# a batch length the chunks do not divide: the tiny data's batches are 240 tokens long, cut by cp 7
# into 14 chunks of 18 tokens, the last padded by 12 (max_seq_len 252 keeps the pads inside wpe)
args=(--config configs/tiny.json --stop_iteration=5 "${common[@]}" --max_seq_len=252)
run_single 1 single252
run_ranks 10 c7p2 14 --pp_size=2 --num_microbatches=2 --cp_size=7
check 'compare_losses "$tmp/single252" "$tmp/c7p2" 5 1e-5' "pp 2 x cp 7, its last chunk padded, does not reproduce stage 01"

# communication on rank 0 (t 0, c 0 of replica 0 of stage 0) per step, T fixed by a short
# max_seq_len, cp 3: each micro-batch's r rows are 2 r chunks of c = T / 6 tokens on each cp rank,
# N = r T / cp rows; the x group and the pipeline move those rows (the README's 3-D rows with
# T / cp); the ring passes (cp - 1) key/value blocks a block forward, (cp - 1) and cp gradient
# blocks backward, each N x 2 C / tp floats (this t's heads); the replicas (dp x cp: here the cp
# ranks) sum the stage's share; stats.json's ring total adds the last step's validation forward
T=66
args=(--config configs/tiny.json --stop_iteration=3 "${common[@]}" --max_seq_len=$T)
run_single 1 single_bytes
run_ranks 10 bytes 12 "${mesh[@]}" --cp_size=3
check 'compare_losses "$tmp/single_bytes" "$tmp/bytes" 3 1e-5' "tp 2 x pp 2 x cp 3 does not reproduce stage 01"
formula() {
    python3 -c "
V=257; Vp=(V+127)//128*128; C=$C; T=$T; tp=2; p=2; cp=3; m=2; r=16//m; L0=1; N=r*T//cp
x = m * (1 + 4*L0) * N*C * 4
p2p = (m + min(m, p - 1)) * N*C * 4
wte = Vp//tp * C * 4
ring = m * L0 * N * 2*C//tp * (3*cp - 2) * 4
stage0 = Vp//tp*C + T*C + L0 * (12*C*C//tp + 7*C//tp + 6*C)  # wte shard, wpe, block 0's share
eval_ring = m * L0 * N * 2*C//tp * (cp - 1) * 4  # the last step's validation: forward only
print({'total': x + p2p + wte + ring + 4*stage0, 'ring': 3 * ring + eval_ring, 'replicas': 3 * 4*stage0}['$1'])"
}
bytes=$(python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$tmp/bytes/metrics.jsonl")
check '[ "$bytes" = "[$(formula total)]" ]' "comm_bytes per step on rank 0 is $bytes, want [$(formula total)]"
for row in "cp send-recv ring" "context all-reduce replicas"; do  # group, collective, formula row
    read -r group kind row <<<"$row"
    total=$(comm_value "$tmp/bytes/stats.json" "$group" "$kind" bytes)
    check '[ "$total" = "$(formula "$row")" ]' "$group $kind bytes over 3 steps: $total, want $(formula "$row")"
done

# bad input: one error naming the dimension and the number, every rank stops
args=(--config configs/tiny.json --stop_iteration=1 "${common[@]}")
bad() { local np=$1; shift; timeout --kill-after=5 120 mpirun -np "$np" --bind-to none build/stage-10 "${args[@]}" --out_dir="$tmp/bad" "$@"; }
expect_one_error "a max_seq_len 2 x cp_size does not divide" "2 x cp_size = 4 chunks.*expected a multiple of 4, found max_seq_len 66" \
    bad 4 --n_layer=2 --tp_dimensions=1,1,1 --pp_size=2 --num_microbatches=2 --cp_size=2 --max_seq_len=66
expect_one_error "sequence_parallel with cp" "key 'sequence_parallel' is true but cp_size is 2" \
    bad 4 --n_layer=2 --tp_dimensions=2,1,1 --cp_size=2 --sequence_parallel=true
finish test_stage10_cp
