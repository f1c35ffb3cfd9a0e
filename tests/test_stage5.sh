#!/usr/bin/env bash
# Stage 05 (3D tensor parallelism) under mpirun:
#  - fp32 equivalence: every grid of the issue, on 1, 2 and 4 ranks, reproduces stage 01's
#    per-step losses within 1e-5 relative over 20 steps (overlap, accumulation and the gathered
#    loss ride on some of them);
#  - bf16-mixed on [2,1,2] stays within 1e-3 of stage 02 (measured ~4e-5), and its depth
#    all-gathers move the weights' bf16 copies: half the bytes (the formula below, exactly);
#  - state_bytes: each rank holds 1/(x*y*z) of every parallel weight;
#  - communication per group and kind (stats.json) = the README's formulas, for [4,1,1], [2,2,1],
#    [1,1,4];
#  - checkpoints: the full format, loaded into another grid, continue like stage 01;
#  - grids that do not fit are refused before any work, naming the constraint.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
L=2 C=64 NH=4 G=8
args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=$L
      --n_embd=$C --n_head=$NH --global_batch_size=$G)


OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --out_dir="$tmp/single" >"$tmp/single.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/single.log")"

# ---- equivalence on every grid (tests/lib.sh's tp_grids) ----
reproduces_stage1() { # reproduces_stage1 <name> <ranks> <x,y,z> [switches]
    local name=$1 np=$2 dims=$3
    shift 3
    run_ranks 5 "$name" "$np" --tp_dimensions="$dims" "$@"
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "[$dims] on $np ranks does not reproduce stage 01"
}
tp_grids reproduces_stage1
# where the loss sees the gradient's scale (tests/lib.sh's SCALE_ARGS): tensor and data parallel
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" "${SCALE_ARGS[@]}" --out_dir="$tmp/single_scale" >"$tmp/single_scale.log" 2>&1
run_ranks 5 g212scale 4 --tp_dimensions=2,1,2 "${SCALE_ARGS[@]}"
check 'compare_losses "$tmp/single_scale" "$tmp/g212scale" 20 1e-5' "[2,1,2] without clipping, eps 1e-3, does not reproduce stage 01"

# ---- bf16-mixed (stage 02's scheme) against stage 02: rounding makes the bound looser ----
OMP_NUM_THREADS=2 build/stage-2 "${args[@]}" --precision=bf16-mixed --out_dir="$tmp/s2bf16" >"$tmp/s2bf16.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 bf16 failed: $(tail -3 "$tmp/s2bf16.log")"
run_ranks 5 bf16_212 4 --tp_dimensions=2,1,2 --precision=bf16-mixed --overlap_communication=true
check 'compare_losses "$tmp/s2bf16" "$tmp/bf16_212" 20 1e-3' "bf16 [2,1,2] strays from stage 02"

# ---- memory: 1/(x*y*z) of every parallel weight; the small tensors split over x or y ----
for spec in g411:4,1,1 g221:2,2,1 g122:1,2,2 g211d2:2,1,1; do
    IFS=: read -r name dims <<<"$spec"
    IFS=, read -r X Y Z <<<"$dims"
    want=$(python3 -c "
V=257; Vp=(V+127)//128*128; T=256; C=$C; L=$L; X=$X; Y=$Y; Z=$Z
weights = Vp*C + 12*L*C*C
small = T*C//Y + 2*C//Y + L*(6*C//Y + 7*C//X)
print(weights, weights//(X*Y*Z), 16*(small + weights//(X*Y*Z)))")
    read -r W w state <<<"$want"
    got="$(json_value "$tmp/$name/stats.json" parallel_weight_elements_per_rank) of $(json_value "$tmp/$name/stats.json" parallel_weight_elements)"
    check '[ "$got" = "$w of $W" ]' "[$dims]: want $w of $W weight elements per rank, stats.json has $got"
    got=$(python3 -c "import json,sys; print(sorted({int(json.loads(l)['state_bytes']) for l in open(sys.argv[1])}))" "$tmp/$name/metrics.jsonl")
    check '[ "$got" = "[$state]" ]' "[$dims]: state_bytes $got, want [$state]"
done

# ---- communication per group = the README's formulas (no evaluation: it would add forwards) ----
formula() { # formula <stats.json> X Y Z D acc steps vocab_parallel [16] -> checks every (group, kind)
    python3 - "$@" <<'PY'
import json, sys
path, X, Y, Z, D, acc, steps = sys.argv[1], *map(int, sys.argv[2:8])
vp = sys.argv[8] == "1"
half = len(sys.argv) > 9  # 16-bit matmul inputs: the depth gathers move 2-byte copies
V, T_max, C, L, G = 257, 256, 64, 2, 8
Vp = (V + 127) // 128 * 128
stats = json.load(open(path))
# tokens one rank pushes through the model, summed over the run: its row group's share (z x data
# row groups) of every global batch's tokens
N = stats["tokens_trained"] // (Z * D)
mb = steps * acc                   # micro-batches
small = T_max * C // Y + 2 * C // Y + L * (6 * C // Y + 7 * C // X)
local = small + (Vp * C + 12 * L * C * C) // (X * Y * Z)
want = {}  # (group, kind) -> elements (4 bytes each)
if Y > 1: want["y", "all-reduce"] = N * (12 * L * C // X + Vp // X + (2 * L + 1) * 4)
if X > 1:
    want["x", "all-reduce"] = N * (C // Y * (4 * L + 2) + (2 if vp else 0))
    want["x", "all-gather"] = N * X if vp else N * Vp
if Z > 1:
    block = lambda n: n // (X * Y)
    # wte three times a micro-batch (embedding, head forward and backward), each block's matrices
    # twice; in 16 bits only the embedding's gather (it reads wte in fp32) stays 4 bytes
    matmul_reads = 2 * block(Vp * C) + 2 * L * block(12 * C * C)
    want["z", "all-gather"] = mb * (block(Vp * C) + (matmul_reads / 2 if half else matmul_reads))
    want["z", "reduce-scatter"] = mb * (block(Vp * C) + L * block(12 * C * C))
    want["z", "all-reduce"] = steps * small
if D > 1: want["data", "all-reduce"] = steps * local
got = {(e["group"], e["kind"]): e["bytes"] / 1e6 for e in stats["communication"]
       if e["group"] in ("x", "y", "z", "data")}
ok = set(got) == set(want)
for k in sorted(set(got) | set(want)):
    w = 4 * want.get(k, 0) / 1e6
    g = got.get(k, -1)
    good = abs(g - w) <= 0.006
    ok &= good
    print(f"  {k[0]:5} {k[1]:15} measured {g:10.2f} MB  formula {w:10.2f} MB {'ok' if good else 'MISMATCH'}")
sys.exit(0 if ok else 1)
PY
}
cargs=(--stop_iteration=3 --eval_batches=0)
for spec in c411:4,1,1 c221:2,2,1 c114:1,1,4; do
    IFS=: read -r name dims <<<"$spec"
    IFS=, read -r X Y Z <<<"$dims"
    run_ranks 5 "$name" 4 --tp_dimensions="$dims" "${cargs[@]}"
    echo "[$dims] communication over 3 steps:"
    check 'formula "$tmp/$name/stats.json" $X $Y $Z 1 1 3 1' "[$dims] communication differs from the formula"
done
run_ranks 5 c212h 4 --tp_dimensions=2,1,2 --precision=bf16-mixed "${cargs[@]}"
echo "[2,1,2] bf16-mixed: the depth all-gathers move bf16 copies:"
check 'formula "$tmp/c212h/stats.json" 2 1 2 1 1 3 1 16' "[2,1,2] bf16-mixed: communication differs from the formula"
run_ranks 5 c211d2 4 --tp_dimensions=2,1,1 --gradient_acc_steps=2 --vocab_parallel_loss=false "${cargs[@]}"
echo "[2,1,1] x data 2, 2 micro-batches, gathered loss:"
check 'formula "$tmp/c211d2/stats.json" 2 1 1 2 2 3 0' "[2,1,1] x data 2 (gathered loss): communication differs from the formula"
# the total per step in metrics.jsonl is exact: the sum of the groups' payloads
python3 - "$tmp/c221/metrics.jsonl" "$tmp/c221/stats.json" >"$tmp/total" <<'PY'
import json, sys
steps = [json.loads(l)["comm_bytes"] for l in open(sys.argv[1])]
groups = sum(e["bytes"] for e in json.load(open(sys.argv[2]))["communication"] if e["group"] in ("x", "y")) / 1e6
print(sum(steps) / 1e6, groups)
sys.exit(0 if abs(sum(steps) / 1e6 - groups) < 0.02 else 1)
PY
check '[ $? -eq 0 ]' "[2,2,1]: the steps' comm_bytes do not add up to the run's totals: $(cat "$tmp/total")"

# ---- checkpoints: the full format; [2,2,1]'s loads into [1,2,2] and continues like stage 01 ----
check '[ -f "$tmp/g221/model.safetensors" ] && [ -f "$tmp/g221/optimizer.safetensors" ]' "[2,2,1] wrote no checkpoint"
OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" --init_from="$tmp/g221" --stop_iteration=3 --out_dir="$tmp/s1load" >"$tmp/s1load.log" 2>&1
run_ranks 5 load122 4 --tp_dimensions=1,2,2 --init_from="$tmp/g221" --stop_iteration=3
check 'compare_losses "$tmp/s1load" "$tmp/load122" 3 1e-5' "a [2,2,1] checkpoint loaded into [1,2,2] does not continue like stage 01"
python3 - "$tmp/single/model.safetensors" "$tmp/g221/model.safetensors" >"$tmp/ckpt" <<'PY'
import json, struct, sys
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    return {k: struct.unpack(f"<{(v['data_offsets'][1] - v['data_offsets'][0]) // 4}f",
            b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in h.items() if k != "__metadata__"}
a, b = load(sys.argv[1]), load(sys.argv[2])
worst = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
print(f"{len(a)} tensors, same names: {set(a) == set(b)}, largest difference {worst:.2e}")
sys.exit(0 if set(a) == set(b) and worst < 1e-4 else 1)
PY
check '[ $? -eq 0 ]' "[2,2,1]'s checkpoint differs from stage 01's: $(cat "$tmp/ckpt")"

# ---- grids that do not fit: one message naming the constraint, no output ----
refuse() { # refuse <ranks> <dims> <expected text> [extra args]
    local np=$1 dims=$2 want=$3; shift 3
    bounded 60 mpirun -np "$np" --bind-to none build/stage-5 "${args[@]}" --tp_dimensions="$dims" \
        --out_dir="$tmp/bad" "$@" >"$tmp/bad.log" 2>&1
    local rc=$?
    check '[ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "$want" "$tmp/bad.log" && [ ! -e "$tmp/bad" ]' \
        "[$dims] on $np ranks: exit $rc, want '$want': $(grep -m1 error "$tmp/bad.log")"
}
refuse 2 2,2,1 "x\*y\*z must divide the number of ranks"
refuse 3 3,1,1 "attention heads must divide by x"
refuse 3 1,3,1 "hidden size must divide by y"
refuse 4 1,1,4 "global_batch_size must divide by z \* data \* gradient_acc_steps" --gradient_acc_steps=4
finish test_stage5
