#!/usr/bin/env bash
# The CUDA backend, as far as the machine running the tests can check it.
#   no nvcc: says so and counts nothing (skipped, never passed);
#   nvcc:    stage 01 and test_ops build for BACKEND=cuda (warnings are errors) into build/cuda/,
#            leaving the CPU binaries in build/ alone;
#   no GPU:  a CUDA binary prints one "no CUDA device" error, exits 1 and writes nothing; what
#            needs a GPU is listed as SKIPPED;
#   a GPU:   test_ops runs every op on the GPU against its double-precision reference, and stage
#            01 (fp32) on the GPU follows the CPU backend's loss curve step by step; stage 06
#            replays a CUDA graph after a longer prefill grew the workspace and generates what it
#            generates without graphs; compute-sanitizer's memcheck, racecheck and synccheck each
#            find nothing in test_ops and in two steps of stage 01 (SKIPPED where it is missing).
# Every stage's equivalence tests on GPUs are tests/test_cuda_stages.sh.
source "$(dirname "$0")/lib.sh"
name=test_ops_cuda

if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
    echo "$name: SKIPPED: nvcc not found, so the CUDA backend was neither built nor checked here"
    finish "$name"
    exit
fi

# test_ops for CUDA needs the Makefile's build/cuda/tests/ rule (see docs/CUDA.md); without it,
# only stage 01 is built
targets="build/cuda/stage-1"
if make -n --no-print-directory BACKEND=cuda build/cuda/tests/test_ops >/dev/null 2>&1; then
    targets="$targets build/cuda/tests/test_ops"
else
    echo "note: the Makefile has no rule for build/cuda/tests/test_ops; test_ops not built for CUDA"
fi
make --no-print-directory BACKEND=cuda $targets >"$tmp/build.log" 2>&1
rc=$?  # taken at once: the $(...) in a check's message would reset $?
check '[ $rc -eq 0 ]' "the CUDA build failed:
$(grep -E "error|undefined" "$tmp/build.log" | head -6)"
grep -q "__cxa_guard\|__gxx_personality" "$tmp/build.log" &&
    echo "hint: nvcc's objects need libstdc++ when gcc links them: -lstdc++ in the Makefile's CUDA LDLIBS"
check '! grep -Eqi "warning(:| #)" "$tmp/build.log"' "the CUDA build printed warnings:
$(grep -Ei "warning(:| #)" "$tmp/build.log" | head)"

# the error every CUDA binary gives on a machine without a GPU: one line, exit 1, no output files
expect_no_device() { # expect_no_device <what> <command...>
    local what=$1; shift
    "$@" >"$tmp/nodev.out" 2>"$tmp/nodev.err"
    local rc=$?
    check '[ $rc -eq 1 ] && grep -q "^error: no CUDA device" "$tmp/nodev.err" &&
           [ "$(wc -l <"$tmp/nodev.err")" -eq 1 ]' \
        "$what without a GPU: want one 'error: no CUDA device' line and exit 1; got exit $rc, stderr: $(cat "$tmp/nodev.err")"
}

no_gpu() {
    echo "no GPU here: checking the CUDA binaries' error instead of running them"
    if [ -x build/cuda/stage-1 ]; then
        expect_no_device "stage 01" build/cuda/stage-1 --config configs/tiny.json --out_dir="$tmp/out"
        check '[ ! -e "$tmp/out" ]' "stage 01 without a GPU left $tmp/out behind"
    fi
    [ -x build/cuda/tests/test_ops ] && expect_no_device "test_ops" build/cuda/tests/test_ops
    echo "$name: SKIPPED: no GPU visible, so test_ops, stage 01 against the CPU, stage 06's CUDA graphs and compute-sanitizer did not run"
}

gpu_test_ops() {
    if [ ! -x build/cuda/tests/test_ops ]; then
        echo "$name: SKIPPED: build/cuda/tests/test_ops was not built, so the ops were not checked on the GPU"
        return
    fi
    build/cuda/tests/test_ops >"$tmp/ops.log" 2>&1
    local rc=$? line
    line=$(grep -E "^test_ops: [0-9]+ passed, [0-9]+ failed" "$tmp/ops.log" | tail -1)
    check '[ $rc -eq 0 ] && [ -n "$line" ]' "test_ops on the GPU: exit $rc
$(tail -30 "$tmp/ops.log")"
    [ -n "$line" ] && echo "on the GPU: $line"
}

# stage 01, fp32, same config on the GPU and on the CPU: the same loss at every step, up to the
# different order of float sums (matmuls, reductions)
args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --stop_iteration=10 --log_interval=1 --global_batch_size=8)
gpu_stage1_follows_cpu() {
    local cpu=build/cpu/stage-1 rc
    [ -x "$cpu" ] || make --no-print-directory BACKEND=cpu build/cpu/stage-1 >/dev/null 2>&1
    build/cuda/stage-1 "${args[@]}" --out_dir="$tmp/gpu" >"$tmp/gpu.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "stage 01 on the GPU failed: $(tail -5 "$tmp/gpu.log")"
    "$cpu" "${args[@]}" --out_dir="$tmp/cpu" >"$tmp/cpu.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "stage 01 on the CPU failed: $(tail -5 "$tmp/cpu.log")"
    echo "stage 01, the GPU against the CPU:"
    check 'compare_losses "$tmp/cpu" "$tmp/gpu" 10 1e-4' "stage 01 on the GPU does not follow the CPU loss curve (rtol 1e-4)"
}

# stage 06 with CUDA graphs: the decode step is recorded on a batch of two short prompts, then
# replayed after a batch of two long ones (same batch size: the same graph) whose prefill grows
# the ops' workspace. Tokens must equal those of the run without graphs.
gpu_stage6_graph_replays() {
    [ -f "$tmp/gpu/model.safetensors" ] || return
    make --no-print-directory BACKEND=cuda build/cuda/stage-6 >>"$tmp/build.log" 2>&1
    local long="Explain, in three careful paragraphs, how a transformer block turns a sequence of tokens into the next token"
    printf 'Hi.\nSort 3 1 2.\n%s, please.\n%s, again.\n' "$long" "$long" >"$tmp/prompts.txt"
    local compile
    for compile in false true; do
        build/cuda/stage-6 --config configs/inference.json --init_from="$tmp/gpu" --prompts_path="$tmp/prompts.txt" \
            --max_batch_size=2 --tokens_to_generate=24 --compile=$compile >"$tmp/gen-$compile.log" 2>&1
        echo $? >"$tmp/gen-$compile.rc"
    done
    check '[ "$(cat "$tmp/gen-false.rc")" = 0 ] && [ "$(cat "$tmp/gen-true.rc")" = 0 ]' \
        "stage 06 on the GPU failed: $(tail -3 "$tmp/gen-true.log")"
    answers() { sed -n '/User:/,/^prompt | in tokens/p' "$1" | grep -v '^prompt | in tokens'; }
    check '[ -n "$(answers "$tmp/gen-true.log")" ] && [ "$(answers "$tmp/gen-false.log")" = "$(answers "$tmp/gen-true.log")" ]' \
        "stage 06: a replayed CUDA graph generated other tokens than the run without graphs"
}

# compute-sanitizer: memcheck (out-of-bounds and misaligned accesses, failed CUDA calls),
# racecheck (shared-memory hazards between the threads of a block) and synccheck (barriers and
# warp shuffles not reached by every thread they name), each over test_ops and two steps of stage
# 01: the op kernels alone, then as the model drives them
gpu_sanitizer() {
    local sanitizer tool rc
    sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    if [ ! -x "$sanitizer" ]; then
        echo "$name: SKIPPED: compute-sanitizer not found (neither on PATH nor in ${CUDA_HOME:-/usr/local/cuda}/bin), so memcheck, racecheck and synccheck did not run"
        return
    fi
    [ -x build/cuda/tests/test_ops ] ||
        echo "$name: SKIPPED: compute-sanitizer over test_ops: build/cuda/tests/test_ops was not built"
    for tool in memcheck racecheck synccheck; do
        if [ -x build/cuda/tests/test_ops ]; then
            "$sanitizer" --tool $tool --error-exitcode 99 build/cuda/tests/test_ops >"$tmp/san-$tool.log" 2>&1
            rc=$?
            check '[ $rc -eq 0 ]' "compute-sanitizer --tool $tool over test_ops: exit $rc
$(grep -m5 -E "=========" "$tmp/san-$tool.log")"
        fi
        "$sanitizer" --tool $tool --error-exitcode 99 build/cuda/stage-1 "${args[@]}" --stop_iteration=2 \
            --out_dir="$tmp/san-stage1-$tool" >"$tmp/san-stage1-$tool.log" 2>&1
        rc=$?
        check '[ $rc -eq 0 ]' "compute-sanitizer --tool $tool over two steps of stage 01: exit $rc
$(grep -m5 -E "=========" "$tmp/san-stage1-$tool.log")"
    done
}

if [ "$(visible_gpus)" -eq 0 ]; then
    no_gpu
else
    nvidia-smi -L | head -1
    gpu_test_ops
    gpu_stage1_follows_cpu
    gpu_stage6_graph_replays
    gpu_sanitizer
fi
finish "$name"
