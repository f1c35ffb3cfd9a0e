#!/usr/bin/env bash
# plot.sh [-o DIR] RUN_DIR...: gnuplot plots of training runs, every run one curve, overlaid:
#   DIR/loss.{png,svg}            training loss (lines) and validation loss (points) vs step
#   DIR/tokens_per_sec.{png,svg}  throughput vs step
#   DIR/memory.{png,svg}          device memory in use (metrics' mem_bytes) vs step
# DIR defaults to plots/. Reads each run's metrics.jsonl; a run without one is an error naming it.
set -euo pipefail
out=plots
if [ "${1:-}" = "-o" ]; then out=$2; shift 2; fi
if [ $# -eq 0 ]; then echo "usage: scripts/plot.sh [-o DIR] RUN_DIR..." >&2; exit 2; fi
for run in "$@"; do
    if [ ! -s "$run/metrics.jsonl" ]; then
        echo "error: $run/metrics.jsonl: no metrics in run directory '$run' (expected a training run's out_dir)" >&2
        exit 1
    fi
done
command -v gnuplot >/dev/null || { echo "error: gnuplot not found (scripts/setup.sh installs gnuplot-nox)" >&2; exit 1; }
mkdir -p "$out"
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT

# one table per run: step loss val_loss tokens_per_sec mem_MiB ("NaN" where a step has no value)
i=0
for run in "$@"; do
    python3 - "$run/metrics.jsonl" >"$data/$i.dat" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    cells = [m["step"], m["loss"], m.get("val_loss", "NaN"), m["tokens_per_sec"], m["mem_bytes"] / 2**20]
    print(" ".join(str(c) for c in cells))
PY
    i=$((i + 1))
done

# plot <file stem> <y label> <gnuplot "using" columns> [validation columns]
plot() {
    local stem=$1 ylabel=$2 cols=$3 valcols=${4:-} curves="" j=0 range=""
    [ "$stem" != loss ] && range="set yrange [0:*];"  # throughput and memory from zero
    for run in "${runs[@]}"; do
        curves+="${curves:+, }'$data/$j.dat' using $cols with lines lw 2 lc $((j + 1)) title '$run'"
        [ -n "$valcols" ] && curves+=", '$data/$j.dat' using $valcols with points pt 7 lc $((j + 1)) title '$run (validation)'"
        j=$((j + 1))
    done
    for term in "pngcairo size 900,500" "svg size 900,500 dynamic"; do
        local ext=${term%% *}; ext=${ext%cairo}
        gnuplot -e "set terminal $term; set output '$out/$stem.$ext'; set grid; set key outside right top;
                    set xlabel 'step'; set ylabel '$ylabel'; $range set datafile missing 'NaN'; plot $curves"
    done
}
runs=("$@")
plot loss "loss (cross-entropy)" "1:2" "1:3"
plot tokens_per_sec "tokens/s" "1:4"
plot memory "device memory in use (MiB)" "1:5"
echo "plots: $out/{loss,tokens_per_sec,memory}.{png,svg} for ${#runs[@]} run(s)"
