#!/usr/bin/env bash
# The planner's section of make bench (build/plan, docs/PLANNER.md): predicted step time against
# measured, 4 ranks here, on the tiny config and a mid-size one. Alone: bash scripts/bench_plan.sh
# [DIR] (DIR keeps the plans, the runs and their logs; a temporary directory by default).
#
# "This machine" is calibrated first (matmul peak, each stage's efficiency -- the best of 3
# interleaved passes -- and MPI links between 4 ranks); then the eight candidate layouts (two of
# them stage 10's meshes: tp 2 x pp 2 and tp 2 x cp 2) are planned and each is run PASSES times for STEPS steps, interleaved (every layout, then every
# layout again). Bytes and memory equal the plan exactly (tests/test_plan.sh); here: do the
# orders by step time agree where the measurement and the model can each tell two layouts apart
# (tools/plan_order.py: from the passes during which other jobs left the cores alone), and how
# far are the predicted times? Ranks outnumber the cores: one thread each, as the tests run them.
# Each config's last line says how much of the cores other jobs took meanwhile: a disturbed run
# shows as one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-}
if [ -z "$out" ]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
steps=${PLAN_BENCH_STEPS:-8} passes=${PLAN_BENCH_PASSES:-6} calibrate_passes=3

# CPU time in clock ticks: the whole machine's busy time (/proc/stat), and this script's finished
# children's (/proc/$$/stat: cutime + cstime). Their difference over a run is what other jobs
# took from the cores meanwhile -- unlike the load average, which counts this bench's own 4 ranks.
# The two count ticks apart (a child's are added when it is reaped), so an idle machine can come
# out a hundredth of a core below zero: shown as 0.
machine_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
own_ticks() { awk '{print $16 + $17}' "/proc/$$/stat"; }
others_cores() { # others_cores <machine ticks before> <own ticks before> <seconds before>
    awk -v m="$1" -v m2="$(machine_ticks)" -v o="$2" -v o2="$(own_ticks)" -v t="$3" -v t2="$(date +%s.%N)" \
        -v hz="$(getconf CLK_TCK)" 'BEGIN { c = (m2 - m - (o2 - o)) / hz / (t2 - t); printf "%.2f", (c > 0 ? c : 0) }'
}

plan_bench() { # plan_bench <name> <label> <config args...>
    local name=$1 label=$2; shift 2
    local before machine0 own0 t0
    before=$(cut -d' ' -f1-3 /proc/loadavg) machine0=$(machine_ticks) own0=$(own_ticks) t0=$(date +%s.%N)
    (source tests/mpi_env.sh
     export OMP_NUM_THREADS=1 PLAN_OUT="$out/runs-$name"
     unset OPS_PEAK_FLOPS_F32 OPS_PEAK_FLOPS_BF16  # calibration measures the peak at one thread
     build/plan --calibrate="$out/machine-$name.json" --ranks=4 --passes="$calibrate_passes" "$@" \
         >"$out/calibrate-$name.log" 2>&1 &&
     build/plan --cluster="$out/machine-$name.json" --ranks=4 --layout="ddp+fsdp+4,1,1+2,2,1+1,1,4+pp2+tp2-pp2+tp2-cp2" \
         --measure="$steps" --passes="$passes" --json="$out/plan-$name.json" "$@" >"$out/plan-$name.log" 2>&1) ||
        { echo "bench: plan $label failed:"; tail "$out/calibrate-$name.log" "$out/plan-$name.log"; exit 1; }
    local others
    others=$(others_cores "$machine0" "$own0" "$t0")
    python3 tools/plan_order.py "$out/plan-$name.json" --label="$label"
    echo "    other jobs used $others of the $(nproc) cores meanwhile; load average (1, 5, 15 min) before: $before," \
         "after: $(cut -d' ' -f1-3 /proc/loadavg) (this bench's 4 ranks count 4)"
}

echo "planner (build/plan) on 4 ranks here: predicted against measured step time ($passes passes of $steps steps)"
plan_bench tiny "tiny.json T=64" --config configs/tiny.json --max_seq_len=64
plan_bench mid "mid L=4 C=256 T=128" --config configs/tiny.json --n_layer=4 --n_embd=256 --n_head=8 --max_seq_len=128
