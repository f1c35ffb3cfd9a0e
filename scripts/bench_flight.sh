#!/usr/bin/env bash
# The flight recorder's cost (common/comm/flight.h): stage 07 on 4 ranks (2 pipeline stages x 2
# replicas, 4 micro-batches: a send or receive per micro-batch and stage boundary, and the
# replicas' all-reduce), tiny.json (n_embd 64: more of the step is communication), with the recorder on and off (FLIGHT_RECORDER=0), the runs
# interleaved so that a machine whose load changes slows both alike. Prints each run's median
# ms/step (the first step left out) and the medians of the medians. ROUNDS pairs (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/mpi_env.sh
rounds=${ROUNDS:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

step_ms() { # step_ms <label> <FLIGHT_RECORDER value>: the run's median ms/step
    FLIGHT_RECORDER=$2 mpirun_np 4 build/stage-7 --config configs/tiny.json --stop_iteration=15 --n_embd=64 --eval_batches=0 \
        --checkpoint_interval=0 --n_layer=2 --pp_size=2 --num_microbatches=4 --out_dir="$out/$1" >"$out/$1.log" 2>&1 ||
        { echo "bench_flight: $1 failed:" >&2; tail "$out/$1.log" >&2; exit 1; }
    python3 -c 'import json, statistics, sys
print(statistics.median(json.loads(l)["ms"] for l in list(open(sys.argv[1]))[1:]))' "$out/$1/metrics.jsonl"
}

on=() off=()
for i in $(seq "$rounds"); do
    on+=("$(step_ms on$i 1)")
    off+=("$(step_ms off$i 0)")
done
python3 - "${on[*]}" "${off[*]}" <<'PY'
import statistics, sys
on, off = ([float(x) for x in a.split()] for a in sys.argv[1:3])
print(f"flight recorder, stage-7 tiny.json n_embd 64, 4 ranks (pp 2 x dp 2, 4 micro-batches), median ms/step per run, interleaved:")
print(f"  on : {' '.join(f'{x:.1f}' for x in on)}  -> median {statistics.median(on):.1f}")
print(f"  off: {' '.join(f'{x:.1f}' for x in off)}  -> median {statistics.median(off):.1f}")
spread = max(max(on) - min(on), max(off) - min(off))
print(f"  on - off: {statistics.median(on) - statistics.median(off):+.1f} ms "
      f"({100 * (statistics.median(on) / statistics.median(off) - 1):+.1f}%); spread of one setting's runs up to {spread:.1f} ms")
PY
