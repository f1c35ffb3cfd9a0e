#!/usr/bin/env bash
# A step against its bound (tools/step_bound.py, `make bench`'s scripts/bench_bound.sh): the op
# spans a traced run writes carry every op's bytes and FLOPs (common/ops/ops_cpu.c, trace_op_end), and
# the tool adds them up against the ceilings. Checked against figures computed here from the model's
# shape: the matmul FLOPs of a step (6 N (12 L C^2 + Vp C), as MFU counts them), attention's
# causal products, LayerNorm's and AdamW's bytes; a bound made from given ceilings (a matmul's by
# its shape and direction, an op's bytes by the way it uses memory and its size); an op under its
# bound flagged with the ceiling measured too low, and none with ceilings no op reaches; the ops'
# time against the step's; build/ceilings' per-shape, per-direction and per-size lines; the errors.
source "$(dirname "$0")/lib.sh"

# tiny.json: L=2, C=128, the byte tokenizer's 257 tokens padded to Vp=384; 4 sequences cut at 64
# tokens (every record is longer: every step has the same shape)
L=2 C=128 Vp=384 B=4 T=64
"$STAGE_BIN/stage-1" --config configs/tiny.json --max_seq_len=$T --global_batch_size=$B --stop_iteration=4 --log_interval=1 \
    --eval_batches=0 --checkpoint_interval=0 --trace=true --trace_steps=4 --out_dir="$tmp/run" >"$tmp/run.log" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "the traced run failed: $(tail -3 "$tmp/run.log")"

# given ceilings, so that every bound below is known here: 10 GFLOP/s for every matmul but the
# qkv shape's forward (20) and backward (40), 5 GB/s streaming read; by the way an op uses memory:
# reading 6 GB/s from 64 KiB and 7 from 1.5 MiB, reading and writing 30 from 64 KiB, 8 from
# 512 KiB and 4 from 4 MiB, writing 9
ceilings=(CEILING_MATMUL_F32=1e10 CEILING_MATMUL_BF16=1e10 CEILING_MATMUL_F32_FWD_${C}x$((3 * C))=2e10
          CEILING_MATMUL_F32_BWD_${C}x$((3 * C))=4e10 CEILING_READ=5e9 CEILING_BW_READ_65536=6e9
          CEILING_BW_READ_1572864=7e9 CEILING_BW_UPDATE_65536=3e10 CEILING_BW_UPDATE_524288=8e9
          CEILING_BW_UPDATE_4194304=4e9 CEILING_BW_WRITE_65536=9e9)
# the same step run again: the figures are the fastest step of both runs
"$STAGE_BIN/stage-1" --config configs/tiny.json --max_seq_len=$T --global_batch_size=$B --stop_iteration=3 --log_interval=1 \
    --eval_batches=0 --checkpoint_interval=0 --trace=true --trace_steps=3 --out_dir="$tmp/again" >"$tmp/again.log" 2>&1
env "${ceilings[@]}" python3 tools/step_bound.py "$tmp/run" "$tmp/again" --label=tiny --json="$tmp/bench.json" >"$tmp/bound.txt" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "step_bound.py failed: $(cat "$tmp/bound.txt")"
python3 - "$tmp/bench.json" "$tmp/run" $L $C $Vp $B $T "$tmp/again" >"$tmp/checks.txt" 2>&1 <<'PY'
import json, statistics, sys
a = json.load(open(sys.argv[1]))["step_bound"]["tiny"]
L, C, Vp, B, T = map(int, sys.argv[3:8])
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
# the qkv forwards' bound: their FLOPs at their shape's own forward ceiling (2e10), not the others'
# (1e10); here the head (C x Vp) has the same shape, 128 x 384; the backwards' at the backward one
qkv = ops[f"matmul_forward {C}x{3 * C}"]
expect("the C x 3C forwards' bound", qkv["bound_ms"], 1e3 * 2.0 * N * C * 3 * C * (L + 1) / 2e10)
expect("the C x 3C backwards' bound", ops[f"matmul_backward {C}x{3 * C}"]["bound_ms"],
       1e3 * 4.0 * N * C * 3 * C * (L + 1) / 4e10)
# gelu forward reads and writes 1 MiB a call (8 bytes an element of N x 4C): the fastest of the
# measured sizes around 1 MiB, reading (6e9 at 64 KiB, 7e9 at 1.5 MiB) and reading+writing (8e9 at
# 512 KiB, 4e9 at 4 MiB); not 3e10, measured at 64 KiB, a set 16 times smaller than the call's
expect("gelu forward's bound (bytes at 8 GB/s)", ops["gelu_forward"]["bound_ms"], 1e3 * L * 8.0 * N * 4 * C / 8e9)
expect("gelu forward's ceiling", 0 if ops["gelu_forward"]["ceiling"] == "CEILING_BW_UPDATE_524288" else 1, 0)
# AdamW sweeps the parameters, gradients and moments a call per tensor (many far under 64 KiB): the
# sweep streams as a whole, its 28 bytes a parameter (past 4 MiB) at the faster of reading (7e9
# at 1.5 MiB) and reading+writing (4e9 at 4 MiB)
expect("AdamW's bound (the sweep's bytes at 7 GB/s)", ops["adamw_update"]["bound_ms"], 1e3 * 28.0 * params / 7e9)
# sum_squares (the gradient norm) only reads, the whole gradient (params x 4 bytes: 1.8 MB, past 1.5 MiB)
expect("sum_squares' bound (reads at 7 GB/s)", ops["sum_squares"]["bound_ms"], 1e3 * 4.0 * params / 7e9)
expect("the step's bound is its ops'", a["bound_ms"], sum(r["bound_ms"] for r in a["ops"]))
steps = [json.loads(l)["ms"] for run in (sys.argv[2], sys.argv[8]) for l in list(open(run + "/metrics.jsonl"))[1:]]
expect("the measured step (the fastest of both runs after each one's first)", a["step_ms"], min(steps))
expect("the steps' mean", a["mean_step_ms"], statistics.mean(steps))
expect("the step's tokens", a["step_tokens"], B * T)
expect("ratio", a["ratio"], a["step_ms"] / a["bound_ms"])
if not 0 <= a["outside_ops_ms"] < 0.2 * a["step_ms"]:
    bad.append(f"time outside the ops: {a['outside_ops_ms']:.1f} ms of a {a['step_ms']:.1f} ms step")
print("\n".join(bad) or "ok")
PY
check '[ "$(cat "$tmp/checks.txt")" = ok ]' "the bound's figures: $(cat "$tmp/checks.txt")"

# a ceiling measured too low: the qkv forward's at 1 MFLOP/s, which every such matmul beats, is
# flagged as a measurement error naming it; with ceilings no op reaches, nothing is
low=("${ceilings[@]/CEILING_MATMUL_F32_FWD_${C}x$((3 * C))=2e10/CEILING_MATMUL_F32_FWD_${C}x$((3 * C))=1e6}")
env "${low[@]}" python3 tools/step_bound.py "$tmp/run" --label=low --json="$tmp/low.json" >"$tmp/low.txt" 2>&1
check 'grep -q "measurement error: matmul_forward ${C}x$((3 * C)) took .* CEILING_MATMUL_F32_FWD_${C}x$((3 * C)) (1e+06 FLOP/s) was measured too low" "$tmp/low.txt" &&
       python3 -c "import json, sys; o = json.load(open(sys.argv[1]))[\"step_bound\"][\"low\"][\"over_bound\"]; sys.exit(not any(r[\"ceiling\"] == \"CEILING_MATMUL_F32_FWD_${C}x$((3 * C))\" for r in o))" "$tmp/low.json"' \
    "a matmul ceiling measured too low is not flagged: $(grep -i "error\|Traceback" "$tmp/low.txt" | head -3)"
high=(CEILING_MATMUL_F32=1e18 CEILING_MATMUL_BF16=1e18 CEILING_READ=1e18)
env "${high[@]}" python3 tools/step_bound.py "$tmp/run" --label=high --json="$tmp/high.json" >"$tmp/high.txt" 2>&1
check '! grep -q "measurement error" "$tmp/high.txt" && [ "$(python3 -c "import json, sys; print(len(json.load(open(sys.argv[1]))[\"step_bound\"][\"high\"][\"over_bound\"]))" "$tmp/high.json")" = 0 ]' \
    "ceilings no op reaches flag an op: $(grep "measurement error" "$tmp/high.txt" | head -2)"

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

# build/ceilings gives each linear's own ceilings, forward and backward, beside the set's, and
# each kind of memory use at each size from 256 KiB to 1 GiB, each with its spread
build/ceilings 64 32 64 >"$tmp/ceilings.txt" 2>&1
for shape in 32x96 32x32 32x128 128x32 32x64; do
    for dir in FWD BWD; do
        check 'grep -q "^export CEILING_MATMUL_F32_${dir}_$shape=[0-9.e+]* " "$tmp/ceilings.txt" && grep -q "^export CEILING_MATMUL_BF16_${dir}_$shape=" "$tmp/ceilings.txt"' \
            "build/ceilings 64 32 64: no $dir ceiling for the $shape linear: $(head -3 "$tmp/ceilings.txt")"
    done
done
for kind in READ WRITE UPDATE; do
    for size in 262144 1048576 4194304 16777216 67108864 1073741824; do
        check 'grep -q "^export CEILING_BW_${kind}_$size=[0-9.e+]* .*(spread [0-9]*%)" "$tmp/ceilings.txt"' \
            "build/ceilings: no $kind bandwidth at $size bytes with its spread: $(grep BW_ "$tmp/ceilings.txt" | head -3)"
    done
done
check 'grep -q "^export CEILING_READ=[0-9.e+]* " "$tmp/ceilings.txt"' "build/ceilings: no CEILING_READ line"

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
