#!/usr/bin/env bash
# Renders the timeline each stage README shows (0N_*/timeline.png): a short traced run of the
# stage on the tiny config, its report's timeline (tools/report.py) rendered by headless
# Chromium. Run after `make all`; needs chromium (tests/setup_browser.sh) and gnuplot.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
args=(--config configs/tiny.json --stop_iteration=2 --eval_batches=1 --log_interval=100 --trace=true --trace_steps=1)
mpi=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS)

shoot() { # shoot <stage dir> <command...>: runs it with --out_dir, renders its timeline into the stage's README picture
    local dir=$1; shift
    "$@" "${args[@]}" --out_dir="$out/$dir" >"$out/$dir.log" 2>&1 || { tail "$out/$dir.log"; exit 1; }
    python3 tools/report.py -o "$out/$dir-report" "$out/$dir" >/dev/null
    local svg="$out/$dir-report/timeline_0.svg" height
    height=$(sed -n 's/.*<svg[^>]* height="\([0-9]*\)".*/\1/p' "$svg")
    chromium --headless=new --no-sandbox --disable-gpu --window-size=1100,"$height" --screenshot="$dir/timeline.png" \
        "file://$svg" >/dev/null 2>&1
    echo "$dir/timeline.png"
}
shoot 01_single_gpu build/stage-1
shoot 02_mixed_precision build/stage-2 --precision=bf16-mixed
shoot 03_ddp "${mpi[@]}" -np 2 build/stage-3 --overlap_communication=true --bucket_size_mb=0.05
shoot 04_fsdp "${mpi[@]}" -np 2 build/stage-4 --overlap_communication=true
shoot 05_tensor_parallel "${mpi[@]}" -np 4 build/stage-5 --tp_dimensions=2,2,1
shoot 07_pipeline_parallel "${mpi[@]}" -np 4 build/stage-7 --pp_size=2 --num_microbatches=4
