#!/usr/bin/env bash
# A step against its bound (tools/step_bound.py, `make bench`'s scripts/bench_bound.sh): the op
# spans a traced run writes carry every op's bytes and FLOPs (common/ops/ops_cpu.c, trace_op_end), and
# the tool adds them up against the ceilings. Checked against figures computed here from the model's
# shape: the matmul FLOPs of a step (6 N (12 L C^2 + Vp C), as MFU counts them), attention's
# causal products, LayerNorm's and AdamW's bytes; a bound made from given ceilings; the ops' time
# against the step's; build/ceilings' per-shape lines; and the errors.
source "$(dirname "$0")/lib.sh"

# tiny.json: L=2, C=128, the byte tokenizer's 257 tokens padded to Vp=384; 4 sequences cut at 64
# tokens (every record is longer: every step has the same shape)
L=2 C=128 Vp=384 B=4 T=64
"$STAGE_BIN/stage-1" --config configs/tiny.json --max_seq_len=$T --global_batch_size=$B --stop_iteration=4 --log_interval=1 \
    --eval_batches=0 --checkpoint_interval=0 --trace=true --trace_steps=4 --out_dir="$tmp/run" >"$tmp/run.log" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "the traced run failed: $(tail -3 "$tmp/run.log")"

# given ceilings, so that every bound below is known here: 10 GFLOP/s for every matmul but the
# qkv shape (20), 5 GB/s read
ceilings=(CEILING_MATMUL_F32=1e10 CEILING_MATMUL_BF16=1e10 CEILING_MATMUL_F32_${C}x$((3 * C))=2e10 CEILING_READ=5e9)
env "${ceilings[@]}" python3 tools/step_bound.py "$tmp/run" --label=tiny --json="$tmp/bench.json" >"$tmp/bound.txt" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "step_bound.py failed: $(cat "$tmp/bound.txt")"
python3 - "$tmp/bench.json" "$tmp/run" $L $C $Vp $B $T >"$tmp/checks.txt" 2>&1 <<'PY'
import json, statistics, sys
a = json.load(open(sys.argv[1]))["step_bound"]["tiny"]
L, C, Vp, B, T = map(int, sys.argv[3:])
N = B * T
ops = {r["op"]: r for r in a["ops"]}
bad = []
def expect(what, got, want, rel=1e-9):
    if abs(got - want) > rel * abs(want):
        bad.append(f"{what}: {got:.6g}, expected {want:.6g}")
matmul_flops = sum(r["flops"] for k, r in ops.items() if k.startswith("matmul"))
expect("matmul FLOPs of a step", matmul_flops, 6.0 * N * (12 * L * C * C + Vp * C))
expect("attention FLOPs", ops["attention_forward"]["flops"] + ops["attention_backward"]["flops"],
       L * 6.0 * B * T * (T + 1) * C)
expect("LayerNorm forward bytes", ops["layernorm_forward"]["bytes"], (2 * L + 1) * 4.0 * (2 * N * C + 2 * C + 2 * N))
params = json.load(open(sys.argv[2] + "/stats.json"))["memory"]["parameters (fp32)"] / 4
expect("AdamW bytes (28 a parameter)", ops["adamw_update"]["bytes"], 28.0 * params)
# the qkv forwards' bound: their FLOPs at their shape's own ceiling (2e10), not the others' (1e10);
# here the head (C x Vp) has the same shape, 128 x 384
qkv = ops[f"matmul_forward {C}x{3 * C}"]
expect("the C x 3C forwards' bound", qkv["bound_ms"], 1e3 * 2.0 * N * C * 3 * C * (L + 1) / 2e10)
expect("gelu forward's bound (bytes at 5 GB/s)", ops["gelu_forward"]["bound_ms"], 1e3 * L * 8.0 * N * 4 * C / 5e9)
expect("the step's bound is its ops'", a["bound_ms"], sum(r["bound_ms"] for r in a["ops"]))
steps = [json.loads(l)["ms"] for l in open(sys.argv[2] + "/metrics.jsonl")][1:]
expect("the measured step (mean after the first)", a["step_ms"], statistics.mean(steps))
expect("ratio", a["ratio"], a["step_ms"] / a["bound_ms"])
if not 0 <= a["outside_ops_ms"] < 0.2 * a["step_ms"]:
    bad.append(f"time outside the ops: {a['outside_ops_ms']:.1f} ms of a {a['step_ms']:.1f} ms step")
print("\n".join(bad) or "ok")
PY
check '[ "$(cat "$tmp/checks.txt")" = ok ]' "the bound's figures: $(cat "$tmp/checks.txt")"

# bf16-mixed: the same matmul FLOPs, now in 16-bit matmuls
"$STAGE_BIN/stage-2" --config configs/tiny.json --max_seq_len=$T --precision=bf16-mixed --global_batch_size=$B --stop_iteration=3 \
    --log_interval=1 --eval_batches=0 --checkpoint_interval=0 --trace=true --trace_steps=3 --out_dir="$tmp/bf16" >"$tmp/bf16.log" 2>&1
env "${ceilings[@]}" python3 tools/step_bound.py "$tmp/bf16" --label=bf16 --json="$tmp/bench.json" >"$tmp/bound16.txt" 2>&1
python3 -c 'import json, sys
a = json.load(open(sys.argv[1]))["step_bound"]
ops = a["bf16"]["ops"]
assert "tiny" in a, "the fp32 figures were kept"
assert sum(r["flops"] for r in ops if r["op"].startswith("matmul_") and "_16 " in r["op"]) == sum(
    r["flops"] for r in a["tiny"]["ops"] if r["op"].startswith("matmul"))
assert any(r["op"] == "cast_to_16" for r in ops)' "$tmp/bench.json" 2>"$tmp/bf16check.txt"
rc=$?
check '[ $rc -eq 0 ]' "bf16-mixed: the matmul FLOPs are not all in 16-bit matmuls, or no casts: $(cat "$tmp/bf16check.txt" "$tmp/bound16.txt" | tail -3)"

# build/ceilings gives each linear's own ceiling beside the set's
build/ceilings 64 32 64 >"$tmp/ceilings.txt" 2>&1
for shape in 32x96 32x32 32x128 128x32 32x64; do
    check 'grep -q "^export CEILING_MATMUL_F32_$shape=[0-9.e+]* " "$tmp/ceilings.txt" && grep -q "^export CEILING_MATMUL_BF16_$shape=" "$tmp/ceilings.txt"' \
        "build/ceilings 64 32 64: no ceiling for the $shape linear: $(cat "$tmp/ceilings.txt")"
done

# errors: no ceilings; a run traced without op spans (trace off: no trace at all)
python3 tools/step_bound.py "$tmp/run" --label=x >"$tmp/err.txt" 2>&1
rc=$?
check '[ $rc -ne 0 ] && grep -q "CEILING_MATMUL_F32 is not in the environment" "$tmp/err.txt"' "no ceilings: $(cat "$tmp/err.txt")"
"$STAGE_BIN/stage-1" --config configs/tiny.json --max_seq_len=$T --global_batch_size=$B --stop_iteration=2 --eval_batches=0 \
    --checkpoint_interval=0 --out_dir="$tmp/untraced" >/dev/null 2>&1
env "${ceilings[@]}" python3 tools/step_bound.py "$tmp/untraced" --label=x >"$tmp/err.txt" 2>&1
rc=$?
check '[ $rc -ne 0 ] && grep -q "trace.json" "$tmp/err.txt"' "an untraced run: $(cat "$tmp/err.txt")"
finish test_step_bound
