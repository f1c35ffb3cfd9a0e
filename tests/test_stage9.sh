#!/usr/bin/env bash
# Stage 09 (context parallelism) under mpirun:
#  - fp32, cp_impl ring (overlap on and off) and ulysses, cp 2 x dp 2, cp 4 and cp 4 x dp 2,
#    GPT-2, phi and Llama, on sequences of 238 tokens (not a multiple of 2 x cp: the chunks are padded, and the last
#    one runs past GPT-2's 238 positions) reproduce stage 01's losses and gradient norms within 1e-5
#    over 20 steps;
#  - the backward, not only the loss: after one step, every tensor's gradient (AdamW's first
#    moment, (1 - beta1) x the gradient without clipping) equals stage 01's within 1e-5 of the
#    tensor's largest;
#  - bf16-mixed within stage 03's bound of stage 02 (1e-3);
#  - every rank's attention computes the same number of query-key scores, a cp-th of the whole
#    (stats.json), ring and ulysses;
#  - comm_bytes per step: the gradient all-reduce plus the ring's or the all-to-alls' bytes;
#  - memory: the ring's and Ulysses' activations a rank at cp 2 and 4 within 10% of stage 01's at
#    T / cp;
#  - the trace: the ring's transfers overlap its attention compute with overlap on, not off;
#  - bad grids are refused with one error on every rank: cp_size not dividing the ranks, sequences
#    shorter than 2 x cp_size tokens, ulysses with heads not divisible by cp_size.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
common=(--stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=2 --n_embd=64 --max_seq_len=238
        --global_batch_size=4)

# losses over 20 steps
args=(--config configs/tiny.json "${common[@]}")
run_single 1 single
run_ranks 9 cp2dp2 4 --cp_size=2 --overlap_communication=true
run_ranks 9 cp4 4 --cp_size=4
run_ranks 9 ulysses_cp2dp2 4 --cp_size=2 --cp_impl=ulysses
run_ranks 9 cp4dp2 8 --cp_size=4 --overlap_communication=true
run_ranks 9 ulysses_cp4dp2 8 --cp_size=4 --cp_impl=ulysses
for name in cp2dp2 cp4 ulysses_cp2dp2 cp4dp2 ulysses_cp4dp2; do
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "gpt2 $name does not reproduce stage 01"
done
check '[ "$(json_value "$tmp/cp2dp2/stats.json" layout)" = "{\"cp\": 2, \"dp\": 2}" ]' \
    "stats.json's layout: $(json_value "$tmp/cp2dp2/stats.json" layout)"
# equal work: the causal attention of a sequence padded to 2 cp chunks of c tokens (Tp = 2 cp c) is
# 4 heads x Tp (Tp + 1) / 2 query-key scores, and every rank computes a cp-th of them (the fewest and
# the most of any rank in stats.json); pairing chunk r with cp + r instead stays correct but not even
for run in cp2dp2:2 cp4:4 ulysses_cp2dp2:2 cp4dp2:4 ulysses_cp4dp2:4; do
    name=${run%:*} cp=${run#*:}
    Tp=$((2 * cp * ((238 + 2 * cp - 1) / (2 * cp))))
    most=$(json_value "$tmp/$name/stats.json" attention_scores_per_rank_max)
    fewest=$(json_value "$tmp/$name/stats.json" attention_scores_per_rank_min)
    check '[ -n "$most" ] && [ "$most" = "$fewest" ] && [ "$most" = "$((4 * Tp * (Tp + 1) / 2 / cp))" ]' \
        "$name: a rank's attention scores range from $fewest to $most, want $((4 * Tp * (Tp + 1) / 2 / cp)) on every rank"
done
args=(--config configs/tiny_phi.json "${common[@]}")
run_single 1 phi
run_ranks 9 phi_cp2dp2 4 --cp_size=2
run_ranks 9 phi_ulysses_cp4 4 --cp_size=4 --cp_impl=ulysses
for name in phi_cp2dp2 phi_ulysses_cp4; do
    check 'compare_losses "$tmp/phi" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01"
done
# Llama: grouped-query attention (its keys and values expanded to the heads before attention),
# RMSNorm, rotary over the whole head at the chunks' global positions
args=(--config configs/tiny_llama.json "${common[@]}")
run_single 1 llama
run_ranks 9 llama_cp2dp2 4 --cp_size=2 --overlap_communication=true
run_ranks 9 llama_ulysses_cp2dp2 4 --cp_size=2 --cp_impl=ulysses
for name in llama_cp2dp2 llama_ulysses_cp2dp2; do
    check 'compare_losses "$tmp/llama" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01"
done

# bf16-mixed against stage 02, within stage 03's bound
args=(--config configs/tiny.json "${common[@]}" --precision=bf16-mixed)
run_single 2 bf16
run_ranks 9 bf16_cp2dp2 4 --cp_size=2 --overlap_communication=true
check 'compare_losses "$tmp/bf16" "$tmp/bf16_cp2dp2" 20 1e-3' "bf16 cp2dp2 strays from stage 02"

# every tensor's gradient after one step, from optimizer.safetensors' first moment (its flat
# buffer cut into the layout's tensors: GPT-2's or phi's, in buffer order)
same_gradients() {
    python3 - "$1/optimizer.safetensors" "$2/optimizer.safetensors" "$3" <<'PY'
import json, struct, sys
def first_moment(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        lo, hi = header["m"]["data_offsets"]
        f.seek(8 + n + lo)
        data = f.read(hi - lo)
    return struct.unpack(f"<{len(data) // 4}f", data)
arch, C, L, Vp, T = sys.argv[3], 64, 2, 384, 238
if arch == "gpt2":
    root = [("wte", Vp * C), ("wpe", T * C), ("ln_f.w", C), ("ln_f.b", C)]
    block = [("ln1.w", C), ("ln1.b", C), ("qkv.w", 3 * C * C), ("qkv.b", 3 * C), ("proj.w", C * C),
             ("proj.b", C), ("ln2.w", C), ("ln2.b", C), ("fc.w", 4 * C * C), ("fc.b", 4 * C),
             ("fc_proj.w", 4 * C * C), ("fc_proj.b", C)]
else:
    root = [("embed", Vp * C), ("ln_f.w", C), ("ln_f.b", C), ("lm_head.w", Vp * C), ("lm_head.b", Vp)]
    block = [("ln1.w", C), ("ln1.b", C), ("qkv.w", 3 * C * C), ("qkv.b", 3 * C), ("dense.w", C * C),
             ("dense.b", C), ("fc1.w", 4 * C * C), ("fc1.b", 4 * C), ("fc2.w", 4 * C * C), ("fc2.b", C)]
tensors = root + [(f"h.{l}.{name}", n) for l in range(L) for name, n in block]
a, b = first_moment(sys.argv[1]), first_moment(sys.argv[2])
if len(a) != len(b) or len(a) != sum(n for _, n in tensors):
    sys.exit(f"{len(a)} and {len(b)} elements, the layout has {sum(n for _, n in tensors)}")
at, bad = 0, []
for name, n in tensors:
    x, y = a[at:at + n], b[at:at + n]
    scale = max(abs(v) for v in x)
    gap = max(abs(u - v) for u, v in zip(x, y)) / scale if scale else max(abs(v) for v in y)
    if not gap <= 1e-5:
        bad.append(f"{name} {gap:.2e}")
    at += n
print(f"{sys.argv[2]}: {len(tensors)} tensors" + (f", differing: {', '.join(bad[:6])}" if bad else " agree"))
sys.exit(1 if bad else 0)
PY
}
one_step=(--stop_iteration=1 --grad_clip=0 --eval_interval=1000)
args=(--config configs/tiny.json "${common[@]}")
run_single 1 grad_single "${one_step[@]}"
run_ranks 9 grad_cp4 4 --cp_size=4 --overlap_communication=true "${one_step[@]}"
run_ranks 9 grad_ulysses_cp2dp2 4 --cp_size=2 --cp_impl=ulysses "${one_step[@]}"
for name in grad_cp4 grad_ulysses_cp2dp2; do
    check 'same_gradients "$tmp/grad_single" "$tmp/$name" gpt2' "gpt2 $name: the gradients after one step differ from stage 01's"
done
args=(--config configs/tiny_phi.json "${common[@]}")
run_single 1 grad_phi "${one_step[@]}"
run_ranks 9 grad_phi_cp2dp2 4 --cp_size=2 "${one_step[@]}"
run_ranks 9 grad_phi_ulysses_cp4 4 --cp_size=4 --cp_impl=ulysses "${one_step[@]}"
for name in grad_phi_cp2dp2 grad_phi_ulysses_cp4; do
    check 'same_gradients "$tmp/grad_phi" "$tmp/$name" phi' "phi $name: the gradients after one step differ from stage 01's"
done

# communication per step, by a formula written here: the gradient all-reduce (4 bytes a parameter)
# plus, per block, the ring's (cp - 1) key/value blocks forward, (cp - 1) again and cp gradient
# blocks backward (N x 2C floats each, N = 2 rows x T / 2cp tokens a rank), or Ulysses' four
# all-to-alls (q|k|v and the output forward, their gradients backward: 8 N C floats). At
# max_seq_len 64 every batch is 64 tokens long (its records are longer).
step_bytes() {  # step_bytes <out_dir>: the distinct comm_bytes of its steps
    python3 -c "import json,sys; print(sorted({json.loads(l)['comm_bytes'] for l in open(sys.argv[1])}))" "$1/metrics.jsonl"
}
want_bytes() {  # want_bytes <impl> <cp> <dp>
    python3 - "$@" <<'PY'
import sys
impl, cp, dp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
V, C, L, T, G = 257, 64, 2, 64, 4
Vp = (V + 127) // 128 * 128
params = Vp * C + T * C + 2 * C + L * (12 * C * C + 13 * C)
N = 2 * (G // dp) * (T // (2 * cp))
attention = 4 * N * 2 * C * (3 * cp - 2) if impl == "ring" else 4 * 8 * N * C
print(f"[{4 * params + L * attention}]")
PY
}
args=(--config configs/tiny.json "${common[@]}" --max_seq_len=64 --stop_iteration=3)
run_ranks 9 bytes_ring 4 --cp_size=4 --overlap_communication=true
run_ranks 9 bytes_ulysses 4 --cp_size=4 --cp_impl=ulysses
check '[ "$(step_bytes "$tmp/bytes_ring")" = "$(want_bytes ring 4 1)" ]' \
    "ring cp4: comm_bytes per step $(step_bytes "$tmp/bytes_ring"), want $(want_bytes ring 4 1)"
check '[ "$(step_bytes "$tmp/bytes_ulysses")" = "$(want_bytes ulysses 4 1)" ]' \
    "ulysses cp4: comm_bytes per step $(step_bytes "$tmp/bytes_ulysses"), want $(want_bytes ulysses 4 1)"

# memory: the ring's and Ulysses' activations per rank (their own buffers included) at cp 2 and 4
# within 10% of stage 01's for sequences of T / cp (stats.json's memory report, allocated for
# max_seq_len)
activations() {  # activations <out_dir>: the memory report's activations row, in bytes
    python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['memory']; print([v for k, v in m.items() if k.startswith('activations')][0])" "$1/stats.json"
}
args=(--config configs/tiny.json "${common[@]}" --stop_iteration=1 --eval_interval=1000)
run_single 1 mem_128 --max_seq_len=128
run_single 1 mem_64 --max_seq_len=64
run_ranks 9 mem_cp2 2 --cp_size=2 --max_seq_len=256
run_ranks 9 mem_cp4 4 --cp_size=4 --max_seq_len=256
run_ranks 9 mem_ulysses_cp2 2 --cp_size=2 --cp_impl=ulysses --max_seq_len=256
run_ranks 9 mem_ulysses_cp4 4 --cp_size=4 --cp_impl=ulysses --max_seq_len=256
for pair in "mem_cp2 mem_128" "mem_cp4 mem_64" "mem_ulysses_cp2 mem_128" "mem_ulysses_cp4 mem_64"; do
    set -- $pair
    a=$(activations "$tmp/$1") b=$(activations "$tmp/$2")
    check 'awk -v a="$a" -v b="$b" "BEGIN { exit !(a <= 1.1 * b) }"' "$1: $a activation bytes a rank, stage 01 at T / cp $b"
done

# the trace (tools/trace_check.py): with overlap, the ring's transfers are in flight during its
# steps' attention compute; without, none is
args=(--config configs/tiny.json "${common[@]}" --max_seq_len=64 --stop_iteration=2 --trace=true --trace_steps=2)
run_ranks 9 trace_on 2 --cp_size=2 --overlap_communication=true
run_ranks 9 trace_off 2 --cp_size=2 --overlap_communication=false
for name in trace_on trace_off; do
    out=$(python3 tools/trace_check.py valid "$tmp/$name/trace.json" 2>&1)
    check '[ $? -eq 0 ]' "$name: trace.json is not a valid timeline: $out"
done
on=$(python3 tools/trace_check.py overlap "$tmp/trace_on/trace.json" " ring ")
off=$(python3 tools/trace_check.py overlap "$tmp/trace_off/trace.json" " ring ")
check 'awk -v x="$on" "BEGIN { exit !(x > 0) }"' "overlap on: ring transfers overlap attention compute for $on us, want > 0"
check '[ "$off" = "0.000" ]' "overlap off: ring transfers overlap attention compute for $off us, want 0"

# bad grids: one error, every rank stopped
args=(--config configs/tiny.json "${common[@]}" --stop_iteration=1)
expect_one_error "cp_size not dividing the ranks" "key 'cp_size': expected a divisor of the 3 ranks" \
    bounded 60 mpirun -np 3 --bind-to none build/stage-9 "${args[@]}" --out_dir="$tmp/bad1" --cp_size=2
expect_one_error "sequences shorter than 2 x cp" "max_seq_len must be at least 8, found 6" \
    bounded 60 mpirun -np 4 --bind-to none build/stage-9 "${args[@]}" --out_dir="$tmp/bad2" --cp_size=4 --max_seq_len=6
expect_one_error "ulysses with heads not divisible by cp_size" "n_head 4 must divide by cp_size, found 3" \
    bounded 60 mpirun -np 3 --bind-to none build/stage-9 "${args[@]}" --out_dir="$tmp/bad3" --cp_size=3 --cp_impl=ulysses
finish test_stage9
