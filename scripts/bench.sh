#!/usr/bin/env bash
# make bench: tokens/s, ms/step and MFU of the training stages, as a table. Each run's first
# step (warm-up: page faults, primitive creation) is left out; the median of the rest is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() { # run <label> <stage> <args...>
    local label=$1 stage=$2; shift 2
    build/stage-$stage "$@" --out_dir="$out/$label" --eval_batches=0 --checkpoint_interval=0 >"$out/$label.log" 2>&1 ||
        { echo "bench: $label failed:"; tail "$out/$label.log"; exit 1; }
    python3 - "$label" "$out/$label/metrics.jsonl" "$out/$label.log" <<'PY'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[2])][1:]
med = lambda k: statistics.median(r[k] for r in rows)
# the memory report the stage printed before step 1: "  parameters (...)   12.34 MiB"
mib = {}
for line in open(sys.argv[3]):
    m = re.match(r"\s+(parameters|activations)\b.*?([0-9.]+) MiB$", line)
    if m: mib[m[1]] = mib.get(m[1], 0) + float(m[2])
print(f"| {sys.argv[1]:<28} | {med('tokens_per_sec'):>9.0f} | {med('ms'):>9.1f} | {100*med('mfu'):>6.1f}% "
      f"| {mib.get('parameters', 0):>10.1f} | {mib.get('activations', 0):>11.1f} |")
PY
}

# T=64 windows of the built-in data hold only prompt tokens (the byte-level template is longer),
# so the loss is 0 there; the work of a step (every matmul and op) is the same.
echo "$OMP_NUM_THREADS threads; MFU against the stated peak of each precision (ops_peak_flops)"
echo "| run                          |  tokens/s |   ms/step |    MFU | params MiB | activ. MiB  |"
echo "|------------------------------|-----------|-----------|--------|------------|-------------|"
run "stage-1 gpt2-124M B=4 T=64" 1 --config configs/bench_gpt2.json
run "stage-2 gpt2-124M bf16-mixed" 2 --config configs/bench_gpt2.json --precision=bf16-mixed
run "stage-1 tiny.json" 1 --config configs/tiny.json --stop_iteration=12
run "stage-2 tiny.json bf16-mixed" 2 --config configs/tiny.json --stop_iteration=12 --precision=bf16-mixed
