#!/usr/bin/env bash
# A training step against its bound on this machine (tools/step_bound.py): GPT-2 124M at the bench
# shape (1 x 256 tokens), stage 01 in fp32 and stage 02 in bf16-mixed, each traced (trace: true,
# whose op spans carry every op's bytes and FLOPs), against the ceilings build/ceilings measures at
# those shapes (taken from the environment when scripts/bench.sh has measured them already).
# Prints the step, its bound and the ratio, and a table per op; the figures go to $BENCH_JSON
# under "step_bound". Runs alone too: `make bench-bound`.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
BENCH_JSON=${BENCH_JSON:-build/bench/bench.json}
mkdir -p "$(dirname "$BENCH_JSON")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ -z "${CEILING_MATMUL_F32_768x2304:-}" ]; then
    ceilings=$(build/ceilings 256 768 50304)
    eval "$ceilings"
fi

bound() { # bound <label> <stage> <args...>
    local label=$1 stage=$2; shift 2
    build/stage-$stage --config configs/bench_gpt2.json "$@" --trace=true --trace_steps=6 --out_dir="$out/$stage" \
        --eval_batches=0 --checkpoint_interval=0 >"$out/$stage.log" 2>&1 ||
        { echo "bench: $label failed:"; tail "$out/$stage.log"; exit 1; }
    if ! grep -q "cpu backend" "$out/$stage.log"; then  # the op spans are the CPU backend's
        echo "$label: skipped (only the CPU backend records its ops' bytes and FLOPs)"
        return
    fi
    grep -m1 "backend" "$out/$stage.log" | sed 's/^/  /'
    python3 tools/step_bound.py "$out/$stage" --label="$label" --json="$BENCH_JSON"
    echo
}
echo "step against its bound ($OMP_NUM_THREADS threads; $(uptime | sed 's/.*load/load/')):"
echo "an op's bound: the longer of its FLOPs at the matmul ceiling of its shape and precision and its"
echo "bytes (inputs and outputs once) at the read bandwidth; the step's: their sum (tools/step_bound.py)"
bound "stage-1 gpt2-124M fp32" 1
bound "stage-2 gpt2-124M bf16-mixed" 2 --precision=bf16-mixed
echo "figures: $BENCH_JSON (step_bound)"
