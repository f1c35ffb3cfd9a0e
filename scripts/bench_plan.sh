#!/usr/bin/env bash
# The planner's section of make bench (build/plan, docs/PLANNER.md): predicted step time against
# measured, 4 ranks here, on the tiny config and a mid-size one. Alone: bash scripts/bench_plan.sh
# [DIR] (DIR keeps the plans, the runs and their logs; a temporary directory by default).
#
# "This machine" is calibrated first (matmul peak, each stage's efficiency -- the best of 3
# interleaved passes -- and MPI links between 4 ranks); then the six candidate layouts are
# planned and each is run PASSES times for STEPS steps, interleaved (every layout, then every
# layout again). Bytes and memory equal the plan exactly (tests/test_plan.sh); here: do the
# orders by step time agree where the measurement and the model can each tell two layouts apart
# (tools/plan_order.py), and how far are the predicted times? Ranks outnumber the cores: one
# thread each, as the tests run them. Each config's line gives the load average before and after
# it: other jobs on the machine widen the passes' spread.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-}
if [ -z "$out" ]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
steps=${PLAN_BENCH_STEPS:-6} passes=${PLAN_BENCH_PASSES:-5} calibrate_passes=3

plan_bench() { # plan_bench <name> <label> <config args...>
    local name=$1 label=$2; shift 2
    local before
    before=$(cut -d' ' -f1-3 /proc/loadavg)
    (source tests/mpi_env.sh
     export OMP_NUM_THREADS=1 PLAN_OUT="$out/runs-$name"
     unset OPS_PEAK_FLOPS_F32 OPS_PEAK_FLOPS_BF16  # calibration measures the peak at one thread
     build/plan --calibrate="$out/machine-$name.json" --ranks=4 --passes="$calibrate_passes" "$@" \
         >"$out/calibrate-$name.log" 2>&1 &&
     build/plan --cluster="$out/machine-$name.json" --ranks=4 --layout="ddp+fsdp+4,1,1+2,2,1+1,1,4+pp2" \
         --measure="$steps" --passes="$passes" --json="$out/plan-$name.json" "$@" >"$out/plan-$name.log" 2>&1) ||
        { echo "bench: plan $label failed:"; tail "$out/calibrate-$name.log" "$out/plan-$name.log"; exit 1; }
    python3 tools/plan_order.py "$out/plan-$name.json" --label="$label"
    echo "    load average (1, 5, 15 min) before: $before; after: $(cut -d' ' -f1-3 /proc/loadavg)"
}

echo "planner (build/plan) on 4 ranks here: predicted against measured step time ($passes passes of $steps steps)"
plan_bench tiny "tiny.json T=64" --config configs/tiny.json --max_seq_len=64
plan_bench mid "mid L=4 C=256 T=128" --config configs/tiny.json --n_layer=4 --n_embd=256 --n_head=8 --max_seq_len=128
