#!/usr/bin/env bash
# The CUDA backend, as far as the machine running the tests can check it, in sections:
#   build:     the CUDA binaries build (warnings are errors, and none is printed) into build/cuda/,
#              leaving the CPU binaries in build/ alone: $CUDA_BINS (make test-cuda's list), else
#              stage 01 and test_ops; without a GPU, a CUDA binary prints one "no CUDA device"
#              error, exits 1 and writes nothing;
#   ops:       test_ops runs every op on the GPU against its double-precision reference;
#   stage1:    stage 01 (fp32) on the GPU follows the CPU backend's loss curve step by step; with
#              --tf32=true it follows the f32 curve within 1e-2, not to the bit;
#   graphs:    stage 06 records its decode step as a CUDA graph on two short prompts, replays it
#              after two longer ones grew the workspace (decode steps that replayed a graph are
#              counted, and must be some), and generates what it generates without graphs;
#   switched:  the kernels behind OPS_CUDA_KERNELS (docs/CUDA.md): test_ops' checks of each against
#              its model (the few-rows kernel: the bits of few_rows.h's order; the tensor-core
#              attention: flash_tiles.h's within 1e-2; the matmuls' gradients with bias_epilogue:
#              the f32 tolerances), memcheck clean over them; stage 06 decoding
#              greedily at batch 1 and 3 generates the same tokens with few_rows as without;
#              stages 01 and 02 with flash_bf16 follow their curves without it within 2%;
#   fp8:       stage 02 with fp8-tensorwise, 20 steps on the GPU against the CPU's emulation: the
#              losses within 2% at every step; on sm_89/sm_90 its linears multiply in cuBLASLt's FP8
#              GEMMs (the banner note says so; test_ops' test_matmul_fp8 holds each product to its
#              emulation), elsewhere the GPU emulates as the CPU does;
#   memcheck, racecheck, synccheck: compute-sanitizer's tools each find nothing in test_ops and in
#              two steps of stage 01 (SKIPPED where compute-sanitizer is missing).
# Without nvcc: says so and counts nothing (skipped, never passed); without a GPU, the sections
# after build say SKIPPED. make test-cuda runs the sections one by one within its time budget
# (tests/cuda_run.sh); every stage's equivalence tests on GPUs are tests/test_cuda_stages.sh.
# Usage: tests/test_ops_cuda.sh [section ...]   default: all of them
source "$(dirname "$0")/lib.sh"
name=test_ops_cuda
SECTIONS="build ops stage1 graphs switched fp8 memcheck racecheck synccheck"
[ $# -gt 0 ] || set -- $SECTIONS
for section in "$@"; do
    case " $SECTIONS " in
        *" $section "*) ;;
        *) echo "unknown section '$section': the sections are $SECTIONS" >&2; exit 2 ;;
    esac
done

if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
    echo "$name: SKIPPED: nvcc not found, so the CUDA backend was neither built nor checked here"
    finish "$name"
    exit
fi

# the error every CUDA binary gives on a machine without a GPU: one line, exit 1, no output files
expect_no_device() { # expect_no_device <what> <command...>
    local what=$1; shift
    "$@" >"$tmp/nodev.out" 2>"$tmp/nodev.err"
    local rc=$?
    check '[ $rc -eq 1 ] && grep -q "^error: no CUDA device" "$tmp/nodev.err" &&
           [ "$(wc -l <"$tmp/nodev.err")" -eq 1 ]' \
        "$what without a GPU: want one 'error: no CUDA device' line and exit 1; got exit $rc, stderr: $(cat "$tmp/nodev.err")"
}

section_build() {
    local targets=${CUDA_BINS:-build/cuda/stage-1 build/cuda/tests/test_ops} rc
    make -j"${BUILD_JOBS:-2}" --no-print-directory BACKEND=cuda $targets >"$tmp/build.log" 2>&1
    rc=$?  # taken at once: the $(...) in a check's message would reset $?
    check '[ $rc -eq 0 ]' "the CUDA build failed:
$(grep -E "error|undefined" "$tmp/build.log" | head -6)"
    grep -q "__cxa_guard\|__gxx_personality" "$tmp/build.log" &&
        echo "hint: nvcc's objects need libstdc++ when gcc links them: -lstdc++ in the Makefile's CUDA LDLIBS"
    check '! grep -Eqi "warning(:| #)" "$tmp/build.log"' "the CUDA build printed warnings:
$(grep -Ei "warning(:| #)" "$tmp/build.log" | head)"
    echo "built for: $(cat build/cuda/cuda-archs 2>/dev/null)"
    if [ "$gpus" -gt 0 ]; then  # section stage1's reference
        make -j"${BUILD_JOBS:-2}" --no-print-directory BACKEND=cpu build/cpu/stage-1 >"$tmp/build-cpu.log" 2>&1
        rc=$?
        check '[ $rc -eq 0 ]' "the CPU build of stage 01 failed: $(grep -m3 error "$tmp/build-cpu.log")"
        return
    fi
    echo "no GPU here: checking the CUDA binaries' error instead of running them"
    if [ -x build/cuda/stage-1 ]; then
        expect_no_device "stage 01" build/cuda/stage-1 --config configs/tiny.json --out_dir="$tmp/out"
        check '[ ! -e "$tmp/out" ]' "stage 01 without a GPU left $tmp/out behind"
    fi
    [ -x build/cuda/tests/test_ops ] && expect_no_device "test_ops" build/cuda/tests/test_ops
}

section_ops() {
    if [ ! -x build/cuda/tests/test_ops ]; then
        echo "$name: SKIPPED: build/cuda/tests/test_ops was not built, so the ops were not checked on the GPU"
        return
    fi
    build/cuda/tests/test_ops >"$tmp/ops.log" 2>&1
    local rc=$? line
    line=$(grep -E "^test_ops: [0-9]+ passed, [0-9]+ failed" "$tmp/ops.log" | tail -1)
    check '[ $rc -eq 0 ] && [ -n "$line" ]' "test_ops on the GPU: exit $rc
$(grep FAIL "$tmp/ops.log" | head -20; tail -5 "$tmp/ops.log")"
    [ -n "$line" ] && echo "on the GPU: $line"
}

# on_gpu_and_cpu <stage> <run> [args...]: the stage on the GPU (build/cuda) and on the CPU (build/cpu,
# built if missing), into $tmp/<run>_cuda and $tmp/<run>_cpu, each checked to finish
on_gpu_and_cpu() {
    local stage=$1 run=$2 side rc
    shift 2
    [ -x "build/cpu/stage-$stage" ] || make --no-print-directory BACKEND=cpu "build/cpu/stage-$stage" >/dev/null 2>&1
    for side in cuda cpu; do
        "build/$side/stage-$stage" "$@" --out_dir="$tmp/${run}_$side" >"$tmp/${run}_$side.log" 2>&1
        rc=$?
        check '[ $rc -eq 0 ]' "stage $stage $run on build/$side failed: $(tail -5 "$tmp/${run}_$side.log")"
    done
}

# stage 01, fp32, same config on the GPU and on the CPU: the same loss at every step, up to the
# different order of float sums (matmuls, reductions)
args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --stop_iteration=10 --log_interval=1 --global_batch_size=8)
section_stage1() {
    local rc
    on_gpu_and_cpu 1 s1 "${args[@]}"
    echo "stage 01, the GPU against the CPU:"
    check 'compare_losses "$tmp/s1_cpu" "$tmp/s1_cuda" 10 1e-4' "stage 01 on the GPU does not follow the CPU loss curve (rtol 1e-4)"
    # the tf32 lesson (01_single_gpu/README.md): TF32's 10-bit inputs move the curve, by about 1e-3
    # relative, not more than 1e-2; a GPU before compute capability 8.0 refuses the key
    build/cuda/stage-1 "${args[@]}" --tf32=true --out_dir="$tmp/tf32" >"$tmp/tf32.log" 2>&1
    rc=$?
    if [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | cut -d. -f1)" -lt 8 ]; then
        check '[ $rc -eq 1 ] && grep -q "^error: tf32: .* has no TF32 tensor cores" "$tmp/tf32.log"' \
            "stage 01 --tf32=true before compute capability 8.0: want one error; exit $rc: $(tail -2 "$tmp/tf32.log")"
        return
    fi
    check '[ $rc -eq 0 ] && grep -q "in TF32 on the tensor cores" "$tmp/tf32.log"' \
        "stage 01 --tf32=true on the GPU (exit $rc) did not say TF32 in its banner: $(tail -3 "$tmp/tf32.log")"
    echo "stage 01 --tf32=true against f32 on the GPU:"
    check 'compare_losses "$tmp/s1_cuda" "$tmp/tf32" 10 1e-2' "stage 01 --tf32=true strays more than 1e-2 from f32"
    check '! cmp -s <(grep -o "\"loss\": [^,]*" "$tmp/s1_cuda/metrics.jsonl") <(grep -o "\"loss\": [^,]*" "$tmp/tf32/metrics.jsonl")' \
        "stage 01 --tf32=true gives f32's losses to the last bit: TF32 did not run"
}

# stage 06 with CUDA graphs, on random weights (seeded): an untrained model rarely ends an answer
# at once, so decode steps happen, where a briefly trained one may answer every prompt with its
# end token. Sampled (temperature 1, seeded): a sampled token changes when the logits change by
# about a millionth, so the same answers say the replayed graph computed what the ops compute. The decode step is recorded on a batch of two short prompts, then replayed after a
# batch of two longer ones (same batch size: the same graph) whose prefill grows the ops'
# workspace; every prompt fits the 256-token context with room for the answer.
section_graphs() {
    local long="Explain, in three careful paragraphs, how a transformer block turns tokens into the next one"
    printf 'Hi.\nSort 3 1 2.\n%s, please.\n%s, again.\n' "$long" "$long" >"$tmp/prompts.txt"
    local compile replays
    for compile in false true; do
        build/cuda/stage-6 --config configs/tiny.json --random_init=true --seed=11 --temperature=1 --prompts_path="$tmp/prompts.txt" \
            --max_batch_size=2 --tokens_to_generate=24 --show_token_ids=true --compile=$compile \
            --out_dir="$tmp/gen-$compile" >"$tmp/gen-$compile.log" 2>&1
        echo $? >"$tmp/gen-$compile.rc"
    done
    check '[ "$(cat "$tmp/gen-false.rc")" = 0 ] && [ "$(cat "$tmp/gen-true.rc")" = 0 ]' \
        "stage 06 on the GPU failed: $(tail -3 "$tmp/gen-false.log" "$tmp/gen-true.log")"
    ids() { grep -a "answer ids:" "$1"; }
    check '[ "$(ids "$tmp/gen-true.log" | wc -l)" -eq 4 ] && [ "$(ids "$tmp/gen-false.log")" = "$(ids "$tmp/gen-true.log")" ]' \
        "stage 06: with CUDA graphs, other tokens than without (or not 4 answers): $(diff <(ids "$tmp/gen-false.log") <(ids "$tmp/gen-true.log") | head -4)"
    replays=$(sed -n 's/^compile: \([0-9]*\) decode steps replayed a CUDA graph$/\1/p' "$tmp/gen-true.log")
    check '[ -n "$replays" ] && [ "$replays" -gt 0 ]' "stage 06 --compile=true replayed no decode graph ('${replays:-no count}')"
    echo "stage 06: ${replays:-0} decode steps replayed a CUDA graph"
}

# the kernels behind OPS_CUDA_KERNELS (the default runs without them: sections ops and graphs):
# test_ops' checks of each against its model, memcheck over them, and each as the stages use it.
# Decode's answers are compared GPU against GPU, few_rows off and on: the kernel sums in another
# order than cuBLAS, which moves a greedy token only at a near tie of two logits; the CPU's answers
# are printed beside them (the same matmul bits, other ops' not). The tensor-core attention
# (flash_bf16) rounds q, k, v and the probabilities to bf16: stage 02 bf16-mixed with it follows
# stage 02 without it within bf16's 2%, and stage 01's backward, which reads its log-sum-exp, too.
# bias_epilogue changes only the bias gradients' summation order in f32 (stage 01: 1e-4, as the GPU
# against the CPU), and sums the 16-bit copy of dout in bf16-mixed (stage 02: 2%).
section_switched() {
    local rc line test batch switch sanitizer
    for test in matmul flash; do
        OPS_CUDA_KERNELS=all build/cuda/tests/test_ops $test >"$tmp/switched-$test.log" 2>&1
        rc=$?
        line=$(grep -E "^test_ops: [0-9]+ passed, [0-9]+ failed" "$tmp/switched-$test.log" | tail -1)
        check '[ $rc -eq 0 ] && [ -n "$line" ]' "test_ops $test on the GPU with OPS_CUDA_KERNELS=all: exit $rc
$(grep FAIL "$tmp/switched-$test.log" | head -20; tail -5 "$tmp/switched-$test.log")"
        echo "switched on, test_ops $test: $line"
        grep -E "worst \|difference\|" "$tmp/switched-$test.log"
    done
    check 'grep -q "few-rows kernel" "$tmp/switched-matmul.log"' \
        "test_ops with OPS_CUDA_KERNELS=all: the engine line does not name the few-rows kernel: $(grep -m1 'matmuls by' "$tmp/switched-matmul.log")"
    grep -m2 "note: OPS_CUDA_KERNELS=bias_epilogue" "$tmp/switched-matmul.log"  # where the epilogue did not run
    [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | cut -d. -f1)" -ge 8 ] &&
        check 'grep -q "attention_forward (the tensor-core kernel)" "$tmp/switched-flash.log"' \
            "test_ops flash with OPS_CUDA_KERNELS=all did not compare the tensor-core kernel (sm_80 on): $(grep -m2 attention_forward "$tmp/switched-flash.log")"
    # a name the backend does not know: one error naming the variable and the names it knows
    OPS_CUDA_KERNELS=few_rows,fast build/cuda/tests/test_ops few_rows >"$tmp/switched-bad.out" 2>"$tmp/switched-bad.err"
    rc=$?
    check '[ $rc -eq 1 ] && [ "$(grep -c "^error" "$tmp/switched-bad.err")" -eq 1 ] &&
           grep -q "OPS_CUDA_KERNELS is .few_rows,fast.: expected a comma-separated list of few_rows, flash_bf16 and bias_epilogue, or all; found .fast." "$tmp/switched-bad.err"' \
        "OPS_CUDA_KERNELS=few_rows,fast: want one error naming it; exit $rc: $(cat "$tmp/switched-bad.err")"
    sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    if [ -x "$sanitizer" ]; then
        for test in matmul flash; do
            OPS_CUDA_KERNELS=all "$sanitizer" --tool memcheck --error-exitcode 99 build/cuda/tests/test_ops $test \
                >"$tmp/switched-memcheck-$test.log" 2>&1
            rc=$?
            check '[ $rc -eq 0 ]' "compute-sanitizer memcheck over the switched kernels (test_ops $test): exit $rc
$(grep -m5 -E "=========|FAIL" "$tmp/switched-memcheck-$test.log")"
        done
    fi
    printf 'Hi.\nSort 3 1 2.\nName three colours.\n' >"$tmp/switched-prompts.txt"
    for batch in 1 3; do
        for switch in "" few_rows; do
            OPS_CUDA_KERNELS=$switch build/cuda/stage-6 --config configs/tiny.json --random_init=true --seed=7 \
                --prompts_path="$tmp/switched-prompts.txt" --max_batch_size=$batch --tokens_to_generate=24 \
                --show_token_ids=true --out_dir="$tmp/dec-$batch-$switch" >"$tmp/dec-$batch-${switch:-off}.log" 2>&1
            echo $? >"$tmp/dec-$batch-${switch:-off}.rc"
        done
        check '[ "$(cat "$tmp/dec-$batch-off.rc")" = 0 ] && [ "$(cat "$tmp/dec-$batch-few_rows.rc")" = 0 ]' \
            "stage 06 at batch $batch with and without OPS_CUDA_KERNELS=few_rows: $(tail -2 "$tmp/dec-$batch-off.log" "$tmp/dec-$batch-few_rows.log")"
        check '[ "$(grep -ac "answer ids:" "$tmp/dec-$batch-few_rows.log")" -eq 3 ] &&
               [ "$(grep -a "answer ids:" "$tmp/dec-$batch-off.log")" = "$(grep -a "answer ids:" "$tmp/dec-$batch-few_rows.log")" ]' \
            "stage 06 at batch $batch: other tokens with OPS_CUDA_KERNELS=few_rows: $(diff <(grep -a "answer ids:" "$tmp/dec-$batch-off.log") <(grep -a "answer ids:" "$tmp/dec-$batch-few_rows.log") | head -4)"
    done
    if [ -x build/cpu/stage-6 ]; then
        build/cpu/stage-6 --config configs/tiny.json --random_init=true --seed=7 --prompts_path="$tmp/switched-prompts.txt" \
            --max_batch_size=3 --tokens_to_generate=24 --show_token_ids=true --out_dir="$tmp/dec-cpu" >"$tmp/dec-cpu.log" 2>&1
        if [ "$(grep -a "answer ids:" "$tmp/dec-cpu.log")" = "$(grep -a "answer ids:" "$tmp/dec-3-few_rows.log")" ]; then
            echo "stage 06 at batch 3 with few_rows: the CPU's tokens"
        else
            echo "stage 06 at batch 3 with few_rows: not the CPU's tokens (for information; a near tie moves one)"
        fi
    fi
    # stage <stage> switched: the run's tolerance against the same stage without the switch
    local spec stage precision switch tol
    for spec in 1:flash_bf16:0.02 2:flash_bf16:0.02 1:bias_epilogue:1e-4 2:bias_epilogue:0.02; do
        IFS=: read -r stage switch tol <<<"$spec"
        precision=32
        [ "$stage" = 2 ] && precision=bf16-mixed
        for run in off "$switch"; do
            [ -e "$tmp/sw-$stage-$run" ] && continue  # each stage's run without a switch, once
            OPS_CUDA_KERNELS=${run#off} build/cuda/stage-$stage "${args[@]}" --stop_iteration=20 --precision=$precision \
                --out_dir="$tmp/sw-$stage-$run" >"$tmp/sw-$stage-$run.log" 2>&1
            rc=$?
            check '[ $rc -eq 0 ]' "stage 0$stage with OPS_CUDA_KERNELS='${run#off}' failed: $(tail -3 "$tmp/sw-$stage-$run.log")"
        done
        echo "stage 0$stage ($precision) with $switch against without:"
        check 'compare_losses "$tmp/sw-$stage-off" "$tmp/sw-$stage-$switch" 20 $tol 0.25' \
            "stage 0$stage with OPS_CUDA_KERNELS=$switch strays more than $tol from without"
    done
}

# compute-sanitizer <tool> over test_ops and two steps of stage 01: the op kernels alone, then as
# the model drives them. memcheck: out-of-bounds and misaligned accesses, failed CUDA calls;
# racecheck: shared-memory hazards between the threads of a block; synccheck: barriers and warp
# shuffles not reached by every thread they name.
# stage 02, fp8-tensorwise, on the GPU and on the CPU: the same FP8 numbers multiplied, summed in another
# order (and on sm_89/sm_90 within the FP8 tensor cores' shorter running sums, test_matmul_fp8's
# 2^-12), which now and then moves a value across an FP8 rounding boundary, a step of 1/8 (e4m3) or
# 1/4 (e5m2) of that value; the loss averages thousands of such values, so its curve stays within 2%
# over 20 steps, as flash_bf16's does (section switched). 16 sequences a micro-batch: every token
# count a multiple of 16, so each of the block's products is one the FP8 GEMMs take.
section_fp8() {
    local cc worst
    on_gpu_and_cpu 2 fp8 --config configs/tiny.json --n_embd=64 --global_batch_size=16 --stop_iteration=20 \
        --log_interval=100 --eval_batches=1 --precision=fp8-tensorwise
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    if [ "$cc" = 89 ] || [ "$cc" = 90 ]; then
        check 'grep -q "^note: fp8-tensorwise: the linears multiply on the FP8 tensor cores" "$tmp/fp8_cuda.log"' \
            "stage 02 fp8-tensorwise on sm_$cc did not say its linears ran on the FP8 tensor cores: $(grep -a '^note: fp8' "$tmp/fp8_cuda.log")"
    fi
    grep -a '^note: fp8' "$tmp/fp8_cuda.log"
    worst=$(python3 - "$tmp/fp8_cpu/metrics.jsonl" "$tmp/fp8_cuda/metrics.jsonl" <<'PY'
import json, sys
cpu, gpu = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:])
print(f"{max(abs(g - c) / abs(c) for c, g in zip(cpu, gpu)):.3g}" if len(cpu) == len(gpu) == 20 else "nan")
PY
)
    echo "stage 02 fp8-tensorwise, the GPU (sm_$cc) against the CPU's emulation over 20 steps: largest relative loss difference $worst"
    check 'python3 -c "import sys; sys.exit(not float(sys.argv[1]) <= 0.02)" "$worst"' \
        "stage 02 fp8-tensorwise on the GPU strays $worst from the CPU's losses (bound 0.02, or not 20 steps each)"
}

sanitize() {
    local tool=$1 sanitizer rc
    sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    if [ ! -x "$sanitizer" ]; then
        echo "$name: SKIPPED: compute-sanitizer not found (neither on PATH nor in ${CUDA_HOME:-/usr/local/cuda}/bin), so $tool did not run"
        return
    fi
    if [ -x build/cuda/tests/test_ops ]; then
        "$sanitizer" --tool "$tool" --error-exitcode 99 build/cuda/tests/test_ops >"$tmp/san-$tool.log" 2>&1
        rc=$?
        check '[ $rc -eq 0 ]' "compute-sanitizer --tool $tool over test_ops: exit $rc
$(grep -m5 -E "=========|FAIL" "$tmp/san-$tool.log")"
    else
        echo "$name: SKIPPED: compute-sanitizer --tool $tool over test_ops: build/cuda/tests/test_ops was not built"
    fi
    "$sanitizer" --tool "$tool" --error-exitcode 99 build/cuda/stage-1 "${args[@]}" --stop_iteration=2 \
        --out_dir="$tmp/san-stage1-$tool" >"$tmp/san-stage1-$tool.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "compute-sanitizer --tool $tool over two steps of stage 01: exit $rc
$(grep -m5 -E "=========" "$tmp/san-stage1-$tool.log")"
}
section_memcheck() { sanitize memcheck; }
section_racecheck() { sanitize racecheck; }
section_synccheck() { sanitize synccheck; }

gpus=$(visible_gpus)
[ "$gpus" -eq 0 ] || nvidia-smi -L | head -1
for section in "$@"; do
    if [ "$section" != build ] && [ "$gpus" -eq 0 ]; then
        echo "$name: SKIPPED: section $section: no GPU visible"
        continue
    fi
    "section_$section"
done
finish "$name"
