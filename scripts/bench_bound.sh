#!/usr/bin/env bash
# A training step against its bound on this machine (tools/step_bound.py): GPT-2 124M at the bench
# shape (1 x 256 tokens), stage 01 in fp32 and stage 02 in bf16-mixed, each traced (trace: true,
# whose op spans carry every op's bytes and FLOPs), against the ceilings build/ceilings measures at
# those shapes. Other work on the machine lowers a ceiling measured at a busy moment, and a bound
# from it would be too long, and a shared machine's memory and matmul rates move by tens of percent
# from one minute to the next: both stages run twice, the ceilings are measured before, between
# and after the two rounds, and each ceiling is the highest of the three (the first: the one
# scripts/bench.sh measured and exported, or this script's own), each step the fastest of both
# rounds. Prints the step, its bound and the ratio, and a table per op; an op that ran faster than
# its bound is flagged as a measurement error naming the ceiling measured too low. The figures go to
# $BENCH_JSON under "step_bound" (the flags under each label's "over_bound"). Then PyTorch on the same
# step and threads (scripts/bench_torch.py: eager and torch.compile, fp32 and bf16 autocast, each
# variant's best step) with the first Python that imports torch (scripts/torch_python.sh),
# printed beside the stages' steps and added under "torch"; skipped, saying so,
# where none does. Runs alone too: `make bench-bound`.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
BENCH_JSON=${BENCH_JSON:-build/bench/bench.json}
mkdir -p "$(dirname "$BENCH_JSON")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[ -n "${CEILING_MATMUL_F32_FWD_768x2304:-}" ] || eval "$(build/ceilings 256 768 50304)"
env | grep '^CEILING_' | sed 's/^/export /' >"$out/ceilings-before"

run() { # run <stage> <round> <args...>: 11 traced steps into $out/<stage><round>
    local stage=$1 dir=$out/$1$2; shift 2
    build/stage-$stage --config configs/bench_gpt2.json "$@" --trace=true --trace_steps=11 --stop_iteration=11 --out_dir="$dir" \
        --eval_batches=0 --checkpoint_interval=0 >"$dir.log" 2>&1 ||
        { echo "bench: stage-$stage failed:"; tail "$dir.log"; exit 1; }
}
bound() { # bound <label> <stage>: the fastest traced step of both rounds
    local label=$1 stage=$2
    if ! grep -q "cpu backend" "$out/${stage}a.log"; then  # the op spans are the CPU backend's
        echo "$label: skipped (only the CPU backend records its ops' bytes and FLOPs)"
        return
    fi
    grep -m1 "backend" "$out/${stage}a.log" | sed 's/^/  /'
    python3 tools/step_bound.py "$out/${stage}a" "$out/${stage}b" --label="$label" --json="$BENCH_JSON"
    echo
}
echo "step against its bound ($OMP_NUM_THREADS threads; $(uptime | sed 's/.*load/load/')):"
# two rounds of both stages, the ceilings measured before, between and after them
run 1 a
run 2 a --precision=bf16-mixed
build/ceilings 256 768 50304 >"$out/ceilings-between"
run 1 b
run 2 b --precision=bf16-mixed
build/ceilings 256 768 50304 >"$out/ceilings-after"
eval "$(python3 - "$out/ceilings-before" "$out/ceilings-between" "$out/ceilings-after" <<'PY'
import re, sys
best = {}
for path in sys.argv[1:]:
    for name, value in re.findall(r"^export (CEILING_\w+)=([0-9.e+-]+)", open(path).read(), re.M):
        best[name] = max(best.get(name, 0.0), float(value))
print("\n".join(f"export {k}={v:.4e}" for k, v in best.items()))
PY
)"
echo "an op's bound: the longer of its FLOPs at the matmul ceiling of its shape, precision and direction and"
echo "its bytes (inputs and outputs once) at the bandwidth measured the way it uses memory (read, write,"
echo "read+write) at the sizes around its working set (an optimizer's sweep: the whole sweep's); the step's:"
echo "their sum (tools/step_bound.py). The step: the fastest of 20 (10 in each of two runs) and its ops, as each"
echo "ceiling is the best of its timings. An op faster than its bound is a measurement error, printed with the"
echo "ceiling measured too low;"
echo "ceilings: the highest of three measurements, before, between and after the runs ($(uptime | sed 's/.*load/load/'))"
bound "stage-1 gpt2-124M fp32" 1
bound "stage-2 gpt2-124M bf16-mixed" 2
echo "figures: $BENCH_JSON (step_bound)"

# PyTorch beside the stages, in the same sitting
torch_python=$(bash scripts/torch_python.sh) || true
if [ -z "$torch_python" ]; then
    echo "PyTorch: skipped (no python3 here imports torch; TORCH_PYTHON=/path/to/python names one)"
else
    echo
    echo "PyTorch on the same step ($torch_python scripts/bench_torch.py; $(uptime | sed 's/.*load/load/')):"
    "$torch_python" scripts/bench_torch.py --threads="$OMP_NUM_THREADS" --json="$BENCH_JSON" >"$out/torch.log" 2>&1 ||
        echo "PyTorch: scripts/bench_torch.py failed"
    grep -v '^{' "$out/torch.log" || true
    echo "figures: $BENCH_JSON (torch)"
fi
