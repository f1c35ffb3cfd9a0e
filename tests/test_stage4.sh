#!/usr/bin/env bash
# Stage 04 (FSDP) under mpirun:
#  - fp32: 2 and 4 ranks, 2 ranks x 2 accumulation steps with prefetching, 3 ranks (whose
#    shards end in padding) and prefetching on 3 and 4 ranks reproduce stage 01's per-step
#    figures (loss, lr, grad_norm, val_loss) within 1e-5 relative;
#  - bf16-mixed: 2 ranks match stage 02 within 1e-3 (stage 03's bound), and gather bf16 copies of the
#    blocks (their fp32 biases and LayerNorms packed apart): comm_bytes per step from the shape;
#  - state_bytes per rank = 16 x the rank's shard elements, at most DDP's / P + the units' padding
#    (DDP's computed here from the model's shape, not read from the program);
#  - per-step all-gather and reduce-scatter bytes and call counts match the README's formula;
#  - a stage-4 checkpoint loads in stage 01 with the same validation loss, and a run stopped on
#    4 ranks resumes on 2 (re-sharded) with stage 01's losses.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
L=2 C=64
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=$L --n_embd=$C)

OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --out_dir="$tmp/single" >"$tmp/single.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/single.log")"
run_ranks 4 np2 2
run_ranks 4 np4 4
run_ranks 4 np2acc2prefetch 2 --gradient_acc_steps=2 --overlap_communication=true
for name in np2 np4 np2acc2prefetch; do
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01"
done
# 3 ranks: a block (49984 elements here) does not split into 3, so the last shard ends in padding
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --stop_iteration=5 --global_batch_size=12 --out_dir="$tmp/single12" >"$tmp/single12.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 (batch 12) failed: $(tail -3 "$tmp/single12.log")"
run_ranks 4 np3 3 --stop_iteration=5 --global_batch_size=12
check 'compare_losses "$tmp/single12" "$tmp/np3" 5 1e-5' "3 ranks (padded shards) do not reproduce stage 01"
# prefetching on more than 2 ranks: a gather into the wrong slot shows on one layout, not another
run_ranks 4 np3prefetch 3 --stop_iteration=5 --global_batch_size=12 --overlap_communication=true
check 'compare_losses "$tmp/single12" "$tmp/np3prefetch" 5 1e-5' "3 ranks with prefetching do not reproduce stage 01"
run_ranks 4 np4prefetch 4 --overlap_communication=true
check 'compare_losses "$tmp/single" "$tmp/np4prefetch" 20 1e-5' "4 ranks with prefetching do not reproduce stage 01"
# where the loss sees the gradient's scale (tests/lib.sh's SCALE_ARGS)
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" "${SCALE_ARGS[@]}" --out_dir="$tmp/single_scale" >"$tmp/single_scale.log" 2>&1
run_ranks 4 np2scale 2 "${SCALE_ARGS[@]}"
check 'compare_losses "$tmp/single_scale" "$tmp/np2scale" 20 1e-5' "2 ranks without clipping, eps 1e-3, do not reproduce stage 01"

# ---- memory and communication, from the model's shape -----------------------------------------
# units: the root (wte padded to Vp rows, wpe, ln_f) and L blocks; a unit is padded to P shards
formula() { # formula <P> <acc> -> "state_bytes ddp_bytes comm_bytes_per_step allgather_per_step reducescatter_per_step"
    python3 -c "
P, acc, L, C, T, V = $1, $2, $L, $C, 256, 257
Vp = (V + 127) // 128 * 128
root, block = Vp * C + T * C + 2 * C, 12 * C * C + 13 * C
pad = lambda n: (n + P - 1) // P * P
state = 16 * (pad(root) + L * pad(block)) // P        # params, grads, m, v: 4 fp32 each
ddp = 16 * (root + L * block)
ag = 4 * acc * (pad(root) + 2 * L * pad(block))         # root once, each block before fwd and bwd
rs = 4 * acc * (pad(root) + L * pad(block))             # every unit's gradient once
print(state, ddp, ag + rs, ag, rs)"
}
field() { python3 -c "import json,sys; print(' '.join(sorted({'%.0f' % json.loads(l)[sys.argv[2]] for l in open(sys.argv[1])})))" "$1" "$2"; }
for run in "np2 2 1" "np4 4 1" "np3 3 1" "np2acc2prefetch 2 2"; do
    read -r name np acc <<<"$run"
    read -r state ddp comm ag rs <<<"$(formula "$np" "$acc")"
    got=$(field "$tmp/$name/metrics.jsonl" state_bytes)
    check '[ "$got" = "$state" ]' "$name: state_bytes $got, want $state"
    # the issue's bound: DDP's share plus at most P - 1 padding elements per unit (16 bytes each)
    bound=$((ddp / np + 16 * (L + 1) * (np - 1)))
    check '[ "$got" -le "$bound" ]' "$name: state_bytes $got above DDP's $ddp / $np + padding = $bound"
    got=$(field "$tmp/$name/metrics.jsonl" comm_bytes)
    check '[ "$got" = "$comm" ]' "$name: comm_bytes per step $got, want $comm (all-gather $ag + reduce-scatter $rs)"
done
# the run's totals per kind, over 20 steps plus the final evaluation's forward (root + L blocks)
read -r state ddp comm ag rs <<<"$(formula 4 1)"
world_totals() { # world_totals <stats.json> <kind> -> "calls MB" (MB to 2 decimals, as the table prints)
    local bytes
    bytes=$(comm_value "$1" world "$2" bytes)
    echo "$(comm_value "$1" world "$2" calls) $(awk -v b="$bytes" 'BEGIN { if (b != "") printf "%.2f", b / 1e6 }')"
}
read -r calls mb <<<"$(world_totals "$tmp/np4/stats.json" all-gather)"
eval_ag=$(python3 -c "P=4; pad=lambda n: (n + P - 1) // P * P; C=$C; L=$L; print(4 * (pad(384 * C + 256 * C + 2 * C) + L * pad(12 * C * C + 13 * C)))")
want_mb=$(python3 -c "print(f'{(20 * $ag + $eval_ag) / 1e6:.2f}')")
check '[ "$calls" = "$((20 * (1 + 2 * L) + 1 + L))" ] && [ "$mb" = "$want_mb" ]' \
    "all-gather on 4 ranks: $calls calls $mb MB, want $((20 * (1 + 2 * L) + 1 + L)) calls $want_mb MB"
read -r calls mb <<<"$(world_totals "$tmp/np4/stats.json" reduce-scatter)"
want_mb=$(python3 -c "print(f'{20 * $rs / 1e6:.2f}')")
check '[ "$calls" = "$((20 * (1 + L)))" ] && [ "$mb" = "$want_mb" ]' \
    "reduce-scatter on 4 ranks: $calls calls $mb MB, want $((20 * (1 + L))) calls $want_mb MB"
check '[ -f "$tmp/np4/stats.json" ] && ! comm_value "$tmp/np4/stats.json" world all-reduce calls >/dev/null' \
    "FSDP must not all-reduce gradients: $(comm_value "$tmp/np4/stats.json" world all-reduce calls) calls"

# ---- bf16: stage 4 on 2 ranks against stage 2 (10 steps keep the test short) ------------------
OMP_NUM_THREADS=2 build/stage-2 "${args[@]}" --stop_iteration=10 --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
run_ranks 4 np2bf16 2 --stop_iteration=10 --precision=bf16-mixed
check 'compare_losses "$tmp/s2bf16" "$tmp/np2bf16" 10 1e-3' "bf16 stage 4 strays from stage 2"
# in bf16 a block travels as its shards' bf16 copies (2 bytes an element), and the tensors that
# stay fp32 (biases, LayerNorms) as each rank's part packed to the largest part; the root, whose
# wte the embedding reads in fp32, and the gradients stay fp32
bf16_comm=$(python3 -c "
P, L, C, T, V = 2, $L, $C, 256, 257
Vp = (V + 127) // 128 * 128
root = Vp * C + T * C + 2 * C
# one block in layout order: (elements, read by a matmul in bf16?)
tensors = [(C, 0), (C, 0), (3 * C * C, 1), (3 * C, 0), (C * C, 1), (C, 0), (C, 0), (C, 0),
           (4 * C * C, 1), (4 * C, 0), (4 * C * C, 1), (C, 0)]
block = sum(n for n, _ in tensors)
pad = lambda n: (n + P - 1) // P * P
shard = pad(block) // P
def fp32_in(r):  # fp32 elements of shard r
    at, n = 0, 0
    for size, half in tensors:
        if not half: n += max(0, min(at + size, (r + 1) * shard) - max(at, r * shard))
        at += size
    return n
pack = max(fp32_in(r) for r in range(P))
ag = 4 * pad(root) + 2 * L * (2 * pad(block) + 4 * P * pack)
rs = 4 * (pad(root) + L * pad(block))
fp32_ag = 4 * pad(root) + 2 * L * 4 * pad(block)
print(ag + rs, ag, fp32_ag)")
read -r want ag fp32_ag <<<"$bf16_comm"
got=$(field "$tmp/np2bf16/metrics.jsonl" comm_bytes)
check '[ "$got" = "$want" ]' "bf16 on 2 ranks: comm_bytes per step $got, want $want (all-gather $ag, fp32's $fp32_ag)"

# ---- checkpoints: stage 4's loads in stage 1; a run resumes on another number of ranks --------
# an lr of 1e-30 leaves the loaded weights as they are (lr must be positive), so stage 1's
# validation loss after its one step is the checkpoint's
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --init_from="$tmp/np2" --stop_iteration=1 --lr=1e-30 --min_lr=0 \
    --out_dir="$tmp/load1" >"$tmp/load1.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 cannot load stage 4's checkpoint: $(tail -3 "$tmp/load1.log")"
check 'python3 -c "
import json, sys
a = json.loads(open(sys.argv[1]).readlines()[-1])[\"val_loss\"]
b = json.loads(open(sys.argv[2]).readlines()[-1])[\"val_loss\"]
print(f\"validation loss: stage 4 {a:.8f}, stage 1 from its checkpoint {b:.8f}\")
sys.exit(0 if abs(a - b) <= 1e-5 * abs(a) else 1)" "$tmp/np2/metrics.jsonl" "$tmp/load1/metrics.jsonl"' \
    "stage 1 gets another validation loss from stage 4's checkpoint"
run_ranks 4 resume 4 --stop_iteration=10
run_ranks 4 resume 2 --resume=true
check 'compare_losses "$tmp/single" "$tmp/resume" 20 1e-5' "stopped on 4 ranks at step 10, resumed on 2: not stage 01's losses"
finish test_stage4
