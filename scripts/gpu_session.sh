#!/usr/bin/env bash
# One GPU session's checks and measurements of the kernels behind OPS_CUDA_KERNELS (docs/CUDA.md,
# "Kernels behind a switch"), prepared so that a short loan of a GPU runs them in one go:
#   1. the CUDA build for the GPU present (one architecture), warnings as errors;
#   2. test_ops on the GPU with the default kernels (fp8-tensorwise's FP8 GEMMs against their emulation
#      among them), then tests/test_ops_cuda.sh switched: each
#      switched kernel against its model (few_rows: bits; flash_bf16's forward and backward;
#      bias_epilogue's gradients), memcheck, stage 06's tokens with few_rows and without, stages
#      01 and 02 with flash_bf16 and bias_epilogue against their runs without;
#   3. stage 02 fp8-tensorwise on the GPU (cuBLASLt's FP8 GEMMs on sm_89/sm_90) against the CPU's
#      emulation over 20 steps (tests/test_ops_cuda.sh fp8);
#   4. stage 09's ring blocks on the GPU (tests/test_cuda_stages.sh 9);
#   5. make bench-cuda's figures, decode with and without the switched kernels.
# Each step has a time limit of its own (14 minutes in all at worst); the whole should take about
# 8 minutes on an H100-class machine (16 cores), so a 15-minute loan leaves room for a rerun of
# the steps after the build on the still-warm machine: GPU_SESSION_STEPS="ops fp8 stage9 bench".
# Logs and a summary go to $OUT when set (the device machine's folder that comes back), else
# build/gpu-session/.
#   GPU_SESSION_STEPS   the steps to run (default "build ops fp8 stage9 bench")
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu-session}
mkdir -p "$out"
steps=${GPU_SESSION_STEPS:-build ops fp8 stage9 bench}
summary="$out/gpu-session.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
if [ -z "$cc" ]; then
    note "gpu-session: SKIPPED: no GPU visible (nvidia-smi lists none): nothing checked or measured"
    exit 0
fi
note "gpu-session on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) (sm_$cc), $(git rev-parse --short HEAD 2>/dev/null)"
export CUDA_ARCHS=$cc CUDA_PTX= BUILD_JOBS=$(nproc)

step() { # step <name> <seconds> <command...>: runs it within the seconds, logs, notes the outcome
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    note "$name: exit $rc in $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (stopped at its limit of $limit s)"); $(grep -E '^[a-z_]+: [0-9]+ passed, [0-9]+ failed' "$out/$name.log" | tail -1)"
    grep -E '^FAIL' "$out/$name.log" | head -10 | tee -a "$summary"
    return $rc
}

for s in $steps; do
    case $s in
        build)
            step build 240 make -j"$BUILD_JOBS" --no-print-directory BACKEND=cuda build/cuda/tests/test_ops \
                $(printf 'build/cuda/stage-%s ' 1 2 3 4 5 6 7 8 9) build/cuda/peak_flops build/cuda/ceilings || { note "gpu-session: the CUDA build failed; nothing else runs"; exit 1; }
            # the CPU binaries the comparisons read (stage 01's and stage 02 fp8's references, stage 06's tokens)
            step build-cpu 180 make -j"$BUILD_JOBS" --no-print-directory BACKEND=cpu build/cpu/stage-1 build/cpu/stage-2 build/cpu/stage-6 ;;
        ops) step ops 120 bash tests/test_ops_cuda.sh ops switched ;;
        fp8) step fp8 60 bash tests/test_ops_cuda.sh fp8 ;;
        stage9) step stage9 90 bash tests/test_cuda_stages.sh 9 ;;
        bench) step bench 150 bash scripts/bench_cuda.sh && grep -E '^\||^anchors|^MFU|^bench-cuda' "$out/bench.log" >>"$summary" ;;
        *) note "gpu-session: unknown step '$s': the steps are build ops fp8 stage9 bench"; exit 2 ;;
    esac
done
note "gpu-session: $SECONDS s; summary $summary"
