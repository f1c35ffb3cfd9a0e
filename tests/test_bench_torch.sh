#!/usr/bin/env bash
# PyTorch beside the bench (scripts/bench_torch.py, run by scripts/bench_bound.sh): on a small GPT-2
# (2 layers, C=64, 4 heads, 37 tokens, one timed step after the warm-up) it times fp32 and bf16
# autocast, adds its figures to a bench.json under "torch" beside the step_bound entries already
# there, and prints each stage's step beside PyTorch's best of the same precision; its attention
# written out for a torch before 2.0 (no scaled_dot_product_attention) is causal softmax(q k^T /
# sqrt(hs)) v against a loop in double, as is the attention the model runs on this torch.
# Skipped, saying so, where no python3 here imports torch.
source "$(dirname "$0")/lib.sh"

py=$(bash scripts/torch_python.sh)
if [ -z "$py" ]; then
    echo "test_bench_torch: SKIPPED: no python3 here imports torch (TORCH_PYTHON names one)"
    finish test_bench_torch
    exit
fi

echo '{"step_bound": {"stage-1 small fp32": {"step_ms": 10.0, "step_tokens": 30}, "stage-2 small bf16-mixed": {"step_ms": 4.0, "step_tokens": 37}}}' \
    >"$tmp/bench.json"
bounded 120 "$py" scripts/bench_torch.py --layers=2 --width=64 --heads=4 --vocab=320 --tokens=37 --steps=1 \
    --threads=1 --variants=eager-fp32,eager-bf16 --json="$tmp/bench.json" >"$tmp/torch.log" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "bench_torch.py failed: $(tail -3 "$tmp/torch.log")"
python3 - "$tmp/bench.json" "$tmp/torch.log" >"$tmp/checks.txt" 2>&1 <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
log = open(sys.argv[2]).read()
t = data.get("torch", {})
best = t.get("best_ms", {})
if sorted(best) != ["bf16", "fp32"]:
    print(f"best_ms holds {sorted(best)}, expected bf16 and fp32")
if [r["variant"] for r in t.get("results", [])] != ["eager-fp32", "eager-bf16"]:
    print(f"results: {t.get('results')}")
if sorted(data.get("step_bound", {})) != ["stage-1 small fp32", "stage-2 small bf16-mixed"]:
    print(f"step_bound entries lost: {sorted(data.get('step_bound', {}))}")
for label, precision in (("stage-1 small fp32", "fp32"), ("stage-2 small bf16-mixed", "bf16")):
    if precision in best:
        run = data["step_bound"][label]
        ours, theirs = 1e3 * run["step_tokens"] / run["step_ms"], t["best_tokens_per_sec"][precision]
        if abs(theirs - 37 / (best[precision] / 1e3)) > 1e-6 * theirs:
            print(f"{precision}: PyTorch's {theirs} tokens/s are not its 37 tokens in {best[precision]} ms")
        line = f"{label}: {run['step_ms']:.1f} ms a step of {run['step_tokens']} tokens, {ours:.1f} tokens/s; " \
               f"PyTorch {t['torch']}'s best {precision}: {best[precision]:.1f} ms a step of 37, {theirs:.1f} tokens/s " \
               f"(the workbook {ours / theirs:.2f}x as fast)"
        if line not in log:
            print(f"not printed: {line}")
PY
check '[ $? -eq 0 ] && [ ! -s "$tmp/checks.txt" ]' "bench_torch.py's figures: $(cat "$tmp/checks.txt")"

PYTHONPATH=scripts "$py" - >"$tmp/attention.txt" 2>&1 <<'PY'
import math
import torch
from bench_torch import causal_attention, written_out_attention
torch.manual_seed(1)
B, H, T, hs = 2, 3, 37, 8
q, k, v = (torch.randn(B, H, T, hs, dtype=torch.float64) for _ in range(3))
want = torch.zeros(B, H, T, hs, dtype=torch.float64)
for b in range(B):
    for h in range(H):
        for t in range(T):
            s = [float(q[b, h, t] @ k[b, h, j]) / math.sqrt(hs) for j in range(t + 1)]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            want[b, h, t] = sum(e[j] / sum(e) * v[b, h, j] for j in range(t + 1))
for name, f in (("written_out_attention", written_out_attention), ("causal_attention", causal_attention)):
    err = float((f(q, k, v) - want).abs().max())
    if not err < 1e-10:
        print(f"{name}: worst |error| {err:.3g} against the loop")
PY
check '[ $? -eq 0 ] && [ ! -s "$tmp/attention.txt" ]' "bench_torch.py's attention: $(cat "$tmp/attention.txt")"
finish test_bench_torch
