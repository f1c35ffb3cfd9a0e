#!/usr/bin/env bash
# Stage 04's sharding ladder (zero_stage 1, 2, 3) and hybrid sharding (hsdp_replicas) under mpirun:
#  - every rung with 4 and 8 micro-batches (gradient_acc_steps), and ZeRO-1 and ZeRO-3 as HSDP
#    2 x 2, reproduce stage 01's per-step figures within 1e-5 over 20 steps.
#    The global batch of 16 allows 8 micro-batches on 2 ranks, 4 on 4. Runs: ZeRO-1 on 2 ranks x 8
#    and HSDP 2x2 x 4; ZeRO-2 on 4 ranks x 4 (overlapped) and 2 ranks x 8; ZeRO-3 on 2 ranks x 8
#    and HSDP 2x2 x 4 (prefetching); test_stage4.sh covers ZeRO-3 on 2, 3 and 4 ranks otherwise;
#  - ZeRO-1 and ZeRO-2 on 3 ranks, whose blocks do not divide into 3 shards, reproduce stage 01 too;
#  - bf16-mixed: ZeRO-1 and ZeRO-2 on 2 ranks match stage 02 within 1e-3 (stage 03's bound);
#  - memory per rank from stats.json against a stage-3 run's rows (DDP): ZeRO-1's AdamW m and v are
#    1/P of them, its parameters and gradients equal; ZeRO-2's gradient shard is 1/P, and it holds
#    whole at most the root's gradient and one block's (two with overlap: one in flight); ZeRO-3
#    shards all three (the planner's prediction of every row: tests/test_plan.sh, exactly);
#  - communication per step exactly the textbook figures, computed here from the model's shape.
#    Psi counts each unit (the root, each block) padded to a multiple of the shard group's S ranks
#    (S = P / R), 4 bytes an element (fp32 gradients and gathers). stats.json and metrics.jsonl
#    count nccl-tests sizes (comm.h): all-gather the output, reduce-scatter the input, all-reduce
#    the buffer, no (n-1)/n; the bytes a rank puts on the wire are size x the bus factor, (S-1)/S
#    for the gathers and scatters, 2(R-1)/R for the all-reduce. Per step (acc micro-batches):
#      ZeRO-1  reduce-scatter Psi + all-gather Psi = 2 Psi       (wire 2(S-1)/S Psi, DDP's)
#      ZeRO-2  reduce-scatter acc Psi + all-gather Psi           (2 Psi at acc 1)
#      ZeRO-3  all-gather acc (root + 2 blocks) + reduce-scatter acc Psi (3 Psi at acc 1, less
#              the root's second gather: it stays gathered through the micro-batch)
#      HSDP    the rung's in the "shard" group, plus all-reduce Psi / S over "replicas"
#    checked per step (metrics.jsonl comm_bytes) and per group and kind (stats.json's totals: 20
#    steps and the final evaluation's gathers);
#  - bad input (zero_stage outside 1-3, hsdp_replicas not dividing the ranks, the ladder's keys on
#    another stage) is one clear error and a non-zero exit on every rank.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
L=2 C=64
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=$L --n_embd=$C)

OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --out_dir="$tmp/single" >"$tmp/single.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/single.log")"
# name ranks zero_stage hsdp_replicas micro-batches [args]
runs="z1_np2_a8 2 1 1 8
z1_h22_a4 4 1 2 4
z2_np4_a4 4 2 1 4 --overlap_communication=true
z2_np2_a8 2 2 1 8
z3_np2_a8 2 3 1 8
z3_h22_a4 4 3 2 4 --overlap_communication=true"
while read -r name np zero R acc extra; do
    run_ranks 4 "$name" "$np" --zero_stage="$zero" --hsdp_replicas="$R" --gradient_acc_steps="$acc" $extra </dev/null
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01"
done <<<"$runs"
# 3 ranks: a block's 12 C^2 + 13 C elements do not divide by 3, so the last shard ends in padding and
# a rank's slice of a whole unit starts at rank x the padded shard, not rank x numel / 3 (a global
# batch of 12: 4 sequences a rank, 2 micro-batches)
run_single 1 single12 --global_batch_size=12
for zero in 1 2; do
    run_ranks 4 "z${zero}_np3" 3 --zero_stage=$zero --global_batch_size=12 --gradient_acc_steps=2
    check 'compare_losses "$tmp/single12" "$tmp/z${zero}_np3" 20 1e-5' "ZeRO-$zero on 3 ranks does not reproduce stage 01"
done

# ---- communication: the textbook figures from the model's shape ---------------------------------
# prints: per-step bytes, the shard group's and the replicas' totals over the run, and the wire
# bytes per rank per step (size x bus factor) with the textbook's for them
formula() { # formula <ranks> <zero_stage> <replicas> <acc>
    python3 -c "
P, zero, R, acc, L, C, T, V = $1, $2, $3, $4, $L, $C, 256, 257
S = P // R
Vp = (V + 127) // 128 * 128
pad = lambda n: (n + S - 1) // S * S
root, block = pad(Vp * C + T * C + 2 * C), pad(12 * C * C + 13 * C)
psi = root + L * block                                 # elements, units padded to S
if zero == 1: ag, rs = psi, psi
if zero == 2: ag, rs = psi, acc * psi
if zero == 3: ag, rs = acc * (root + 2 * L * block), acc * psi
ar = psi // S if R > 1 else 0                          # this rank's shard, over the replicas
step = 4 * (ag + rs + ar)
evaluation = acc * 4 * (root + L * block) if zero == 3 else 0  # the final evaluation's, a micro-batch at a time
group_ag, group_rs, replicas_ar = 20 * 4 * ag + evaluation, 20 * 4 * rs, 20 * 4 * ar
wire = 4 * ((ag + rs) * (S - 1) / S + ar * 2 * (R - 1) / R)
units = {1: 2 * psi, 2: (acc + 1) * psi, 3: acc * (3 * psi - root)}[zero]
textbook = 4 * units * (S - 1) / S + 4 * ar * 2 * (R - 1) / R
print(step, group_ag, group_rs, replicas_ar, wire, textbook)"
}
field() { python3 -c "import json,sys; print(' '.join(sorted({'%.0f' % json.loads(l)[sys.argv[2]] for l in open(sys.argv[1])})))" "$1" "$2"; }
while read -r name np zero R acc extra; do
    read -r step group_ag group_rs replicas_ar wire textbook <<<"$(formula "$np" "$zero" "$R" "$acc")"
    got=$(field "$tmp/$name/metrics.jsonl" comm_bytes)
    check '[ "$got" = "$step" ]' "$name: comm_bytes per step $got, want $step"
    group=$([ "$R" -gt 1 ] && echo shard || echo world)
    ag=$(comm_value "$tmp/$name/stats.json" "$group" all-gather bytes)
    rs=$(comm_value "$tmp/$name/stats.json" "$group" reduce-scatter bytes)
    check '[ "$ag" = "$group_ag" ] && [ "$rs" = "$group_rs" ]' \
        "$name: $group all-gather $ag and reduce-scatter $rs bytes over the run, want $group_ag and $group_rs"
    if [ "$R" -gt 1 ]; then
        ar=$(comm_value "$tmp/$name/stats.json" replicas all-reduce bytes)
        check '[ "$ar" = "$replicas_ar" ]' "$name: replicas all-reduce $ar bytes over the run, want $replicas_ar"
    else
        check '! comm_value "$tmp/$name/stats.json" world all-reduce bytes >/dev/null' "$name all-reduces gradients"
    fi
    check 'python3 -c "import sys; sys.exit(0 if abs($wire - $textbook) < 1e-6 * $textbook else 1)"' \
        "$name: $wire wire bytes per rank per step, the textbook's $textbook"
done <<<"$runs"

# ---- memory per rank: stats.json against DDP's (a stage-3 run's rows) ---------------------------
run_ranks 3 ddp 2 --stop_iteration=1
row() { json_value "$1/stats.json" memory "$2"; }
P_ROW="parameters (fp32)" G_ROW="gradients (fp32)" M_ROW="AdamW m and v (fp32)" W_ROW="gathered units (fp32 w + grad)"
ddp_p=$(row "$tmp/ddp" "$P_ROW") ddp_g=$(row "$tmp/ddp" "$G_ROW") ddp_m=$(row "$tmp/ddp" "$M_ROW")
# (the tiny model's units split evenly over 2 and 4 ranks: no padding, so 1/P is exact)
mem() { echo "$(row "$tmp/$1" "$P_ROW") $(row "$tmp/$1" "$G_ROW") $(row "$tmp/$1" "$M_ROW") $(row "$tmp/$1" "$W_ROW")"; }
read -r p g m w <<<"$(mem z1_np2_a8)"
check '[ "$p" = "$ddp_p" ] && [ "$g" = "$ddp_g" ] && [ "$m" = "$((ddp_m / 2))" ] && [ "$w" = 0 ]' \
    "ZeRO-1 on 2 ranks: parameters $p, gradients $g, AdamW $m, gathered $w; want $ddp_p, $ddp_g, $((ddp_m / 2)), 0"
read -r p g m w <<<"$(mem z2_np4_a4)"
held=$(python3 -c "C=$C; print(4 * ((384 * C + 256 * C + 2 * C) + 2 * (12 * C * C + 13 * C)))")  # root + 2 blocks
check '[ "$p" = "$ddp_p" ] && [ "$g" = "$((ddp_g / 4))" ] && [ "$m" = "$((ddp_m / 4))" ] && [ "$w" = "$held" ]' \
    "ZeRO-2 on 4 ranks: parameters $p, gradients $g, AdamW $m, held whole $w; want $ddp_p, $((ddp_g / 4)), $((ddp_m / 4)), $held"
read -r p g m w <<<"$(mem z3_np2_a8)"
check '[ "$p" = "$((ddp_p / 2))" ] && [ "$g" = "$((ddp_g / 2))" ] && [ "$m" = "$((ddp_m / 2))" ]' \
    "ZeRO-3 on 2 ranks: parameters $p, gradients $g, AdamW $m; want half of $ddp_p, $ddp_g, $ddp_m"
# HSDP 2 x 2 shards over 2 ranks whatever the world: ZeRO-1's AdamW is half of DDP's, not a quarter
read -r p g m w <<<"$(mem z1_h22_a4)"
check '[ "$p" = "$ddp_p" ] && [ "$m" = "$((ddp_m / 2))" ]' "ZeRO-1 HSDP 2x2: parameters $p, AdamW $m; want $ddp_p, $((ddp_m / 2))"
read -r p g m w <<<"$(mem z3_h22_a4)"
check '[ "$p" = "$((ddp_p / 2))" ] && [ "$g" = "$((ddp_g / 2))" ] && [ "$m" = "$((ddp_m / 2))" ]' \
    "ZeRO-3 HSDP 2x2: parameters $p, gradients $g, AdamW $m; want half of $ddp_p, $ddp_g, $ddp_m"

# ---- bf16-mixed: the rungs that cast their whole parameters, against stage 2 ----------------------
OMP_NUM_THREADS=2 build/stage-2 "${args[@]}" --stop_iteration=10 --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
for zero in 1 2; do
    run_ranks 4 "z${zero}bf16" 2 --stop_iteration=10 --precision=bf16-mixed --zero_stage=$zero
    check 'compare_losses "$tmp/s2bf16" "$tmp/z${zero}bf16" 10 1e-3' "bf16 ZeRO-$zero strays from stage 2"
done

# ---- bad input: one error, every rank stops -------------------------------------------------------
bad=(bounded 120 mpirun -np 4 --bind-to none build/stage-4 "${args[@]}" --out_dir="$tmp/bad")
expect_one_error "zero_stage 0" "key 'zero_stage': expected 1, 2 or 3, found 0" "${bad[@]}" --zero_stage=0
expect_one_error "zero_stage 4" "key 'zero_stage': expected 1, 2 or 3, found 4" "${bad[@]}" --zero_stage=4
expect_one_error "hsdp_replicas 3 on 4 ranks" "key 'hsdp_replicas': expected a divisor of the 4 ranks (replica groups of equal size), found 3" \
    "${bad[@]}" --hsdp_replicas=3
expect_one_error "zero_stage on stage 03" "stage 03 shards nothing: the sharding ladder is strategy fsdp" \
    bounded 120 mpirun -np 2 --bind-to none build/stage-3 "${args[@]}" --out_dir="$tmp/bad" --zero_stage=1
finish test_zero
