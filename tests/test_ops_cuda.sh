#!/usr/bin/env bash
# The CUDA backend, as far as the machine running the tests can check it.
#   no nvcc: says so and counts nothing (skipped, never passed);
#   nvcc:    stage 01 and test_ops build for BACKEND=cuda (warnings are errors) into build/cuda/,
#            leaving the CPU binaries in build/ alone;
#   no GPU:  a CUDA binary prints one "no CUDA device" error, exits 1 and writes nothing;
#   a GPU:   test_ops runs every op on the GPU against its double-precision reference, and stage
#            01 (fp32) on the GPU follows the CPU backend's loss curve step by step; stage 06
#            replays a CUDA graph after a longer prefill grew the workspace and generates what it
#            generates without graphs; compute-sanitizer's memcheck, racecheck and synccheck find
#            nothing in test_ops and in two steps of stage 01.
set -u
cd "$(dirname "$0")/.."
name=test_ops_cuda
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
check() { if eval "$1"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: $2"; fi; }

if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
    echo "$name: SKIPPED: nvcc not found, so the CUDA backend was neither built nor checked here"
    echo "$name: 0 passed, 0 failed"
    exit 0
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

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU here: checking the CUDA binaries' error instead of running them"
    if [ -x build/cuda/stage-1 ]; then
        expect_no_device "stage 01" build/cuda/stage-1 --config configs/tiny.json --out_dir="$tmp/out"
        check '[ ! -e "$tmp/out" ]' "stage 01 without a GPU left $tmp/out behind"
    fi
    [ -x build/cuda/tests/test_ops ] && expect_no_device "test_ops" build/cuda/tests/test_ops
else
    nvidia-smi -L | head -1
    if [ -x build/cuda/tests/test_ops ]; then
        build/cuda/tests/test_ops >"$tmp/ops.log" 2>&1
        rc=$?
        line=$(grep -E "^test_ops: [0-9]+ passed, [0-9]+ failed" "$tmp/ops.log" | tail -1)
        check '[ $rc -eq 0 ] && [ -n "$line" ]' "test_ops on the GPU: exit $rc
$(tail -30 "$tmp/ops.log")"
        [ -n "$line" ] && echo "on the GPU: $line"
    fi
    # stage 01, fp32, same config on the GPU and on the CPU: the same loss at every step, up to the
    # different order of float sums (matmuls, reductions)
    cpu=build/cpu/stage-1
    [ -x "$cpu" ] || make --no-print-directory BACKEND=cpu build/cpu/stage-1 >/dev/null 2>&1
    args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --stop_iteration=10 --log_interval=1
          --global_batch_size=8)
    build/cuda/stage-1 "${args[@]}" --out_dir="$tmp/gpu" >"$tmp/gpu.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "stage 01 on the GPU failed: $(tail -5 "$tmp/gpu.log")"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$cpu" "${args[@]}" --out_dir="$tmp/cpu" >"$tmp/cpu.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "stage 01 on the CPU failed: $(tail -5 "$tmp/cpu.log")"
    if [ -f "$tmp/gpu/metrics.jsonl" ] && [ -f "$tmp/cpu/metrics.jsonl" ]; then
        python3 - "$tmp/gpu/metrics.jsonl" "$tmp/cpu/metrics.jsonl" >"$tmp/cmp.log" 2>&1 <<'EOF'
import json, sys
gpu, cpu = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
worst = max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu))
print(f"stage 01 GPU vs CPU: {len(gpu)} steps, worst relative loss difference {worst:.2e}")
sys.exit(0 if len(gpu) == len(cpu) == 10 and worst <= 1e-4 else 1)
EOF
        rc=$?
        cat "$tmp/cmp.log"
        check '[ $rc -eq 0 ]' "stage 01 on the GPU does not follow the CPU loss curve (rtol 1e-4)"
    fi
fi
if nvidia-smi -L >/dev/null 2>&1 && [ -f "$tmp/gpu/model.safetensors" ]; then
    # stage 06 with CUDA graphs: the decode step is recorded on a batch of two short prompts, then
    # replayed after a batch of two long ones (same batch size: the same graph) whose prefill
    # grows the ops' workspace. Tokens must equal those of the run without graphs.
    make --no-print-directory BACKEND=cuda build/cuda/stage-6 >>"$tmp/build.log" 2>&1
    long="Explain, in three careful paragraphs, how a transformer block turns a sequence of tokens into the next token"
    printf 'Hi.\nSort 3 1 2.\n%s, please.\n%s, again.\n' "$long" "$long" >"$tmp/prompts.txt"
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
fi

# compute-sanitizer (CUDA's memcheck, racecheck, synccheck) over test_ops and two steps of stage 01
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if nvidia-smi -L >/dev/null 2>&1 && [ -x "$sanitizer" ] && [ -x build/cuda/tests/test_ops ]; then
    for tool in memcheck racecheck synccheck; do
        "$sanitizer" --tool $tool --error-exitcode 99 build/cuda/tests/test_ops >"$tmp/san-$tool.log" 2>&1
        rc=$?
        check '[ $rc -eq 0 ]' "compute-sanitizer --tool $tool over test_ops: exit $rc
$(grep -m5 -E "=========" "$tmp/san-$tool.log")"
    done
    "$sanitizer" --tool memcheck --error-exitcode 99 build/cuda/stage-1 "${args[@]}" --stop_iteration=2 \
        --out_dir="$tmp/san-stage1" >"$tmp/san-stage1.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "compute-sanitizer memcheck over stage 01: exit $rc
$(grep -m5 -E "=========" "$tmp/san-stage1.log")"
fi
echo "$name: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
