#!/usr/bin/env bash
# make test-cuda: the CUDA tests section by section, within one time budget, most important first.
# Each section is one run of tests/test_ops_cuda.sh or tests/test_cuda_stages.sh with a section
# name, started only when its estimated time still fits the budget left and stopped when the
# budget is spent: a section that would not fit, or did not finish, is reported as "not run",
# never as passed (its failures before the stop still count). Writes every section's log to
# build/cuda/test-cuda/<section>.log and one JSON summary, build/cuda/test-cuda.json (gpu,
# budget_s, elapsed_s, checks: [{check, result, figure}]), and ends with "N passed, N failed".
#   TEST_CUDA_BUDGET  seconds for everything, the build included (default 600: 10 minutes, which
#                     holds every section's estimate but racecheck's)
#   CUDA_ARCHS        what to build for (the Makefile passes the present GPU's, from nvidia-smi)
#   STAGE_BIN=build/cpu TEST_GPUS=G   a dry run without a GPU (below)
# The estimates below are the seconds each section took on one H100 (16 cores) on 2026-11-26,
# rounded up (docs/CUDA.md), but the switched kernels', stage 09's and fp8's, which no GPU has run yet
# (guesses from their work against the sections measured); the build's is a guess for a cold build for one architecture (with
# every binary already built it took 17 s).
set -u
cd "$(dirname "$0")/.."
budget=${TEST_CUDA_BUDGET:-600}
logs=build/cuda/test-cuda
summary=build/cuda/test-cuda.json
mkdir -p "$logs"
rm -f "$logs"/*.log
export BUILD_JOBS=${BUILD_JOBS:-$(nproc)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "test-cuda: ${gpu:-no GPU}; budget ${budget} s including the build; built for CUDA_ARCHS=${CUDA_ARCHS:-the Makefile default}"

# estimate (s) | check | command: the order is the priority
plan=(
    "120|build|tests/test_ops_cuda.sh build"
    "5|ops|tests/test_ops_cuda.sh ops"
    "5|stage 01 against the CPU|tests/test_ops_cuda.sh stage1"
    "5|stage 06 CUDA graphs|tests/test_ops_cuda.sh graphs"
    "30|kernels behind OPS_CUDA_KERNELS|tests/test_ops_cuda.sh switched"
    "10|stage 02 fp8-tensorwise against the CPU|tests/test_ops_cuda.sh fp8"
    "5|ranks sharing a GPU choose MPI|tests/test_cuda_stages.sh share"
    "15|stage 03 equivalence|tests/test_cuda_stages.sh 3"
    "15|stage 04 equivalence|tests/test_cuda_stages.sh 4"
    "40|stage 05 equivalence|tests/test_cuda_stages.sh 5"
    "25|stage 07 equivalence|tests/test_cuda_stages.sh 7"
    "15|stage 08 equivalence|tests/test_cuda_stages.sh 8"
    "25|stage 06 equivalence|tests/test_cuda_stages.sh 6"
    "30|stage 09 equivalence (ring blocks)|tests/test_cuda_stages.sh 9"
    "10|compute-sanitizer memcheck|tests/test_ops_cuda.sh memcheck"
    "5|stage 01 twice, same bits|tests/test_cuda_stages.sh 1"
    "10|stage 02 precisions|tests/test_cuda_stages.sh 2"
    "10|traces on the GPU|tests/test_cuda_stages.sh trace"
    "30|phi on every stage|tests/test_cuda_stages.sh phi"
    "10|compute-sanitizer synccheck|tests/test_ops_cuda.sh synccheck"
    "60|serving engine (tests/test_paged.sh)|tests/test_cuda_stages.sh paged"
    "50|Llama (tests/test_llama_*.sh)|tests/test_cuda_stages.sh llama"
    "45|LoRA (tests/test_lora.sh)|tests/test_cuda_stages.sh lora"
    "70|compute-sanitizer racecheck|tests/test_ops_cuda.sh racecheck"
)

# A dry run (STAGE_BIN=build/cpu TEST_GPUS=G, no GPU needed) runs the stage sections' plan with the
# CPU binaries, the layouts that would share a GPU through the staged MPI path; the CUDA binaries
# are neither built nor run
if [ -n "${TEST_GPUS:-}" ]; then
    echo "dry run: $TEST_GPUS pretended GPU(s), binaries in ${STAGE_BIN:-build/cuda}/; the test_ops_cuda.sh sections are left out"
    dry=()
    for item in "${plan[@]}"; do [[ "$item" == *test_ops_cuda* ]] || dry+=("$item"); done
    plan=("${dry[@]}")
fi

passed=0 failed=0
entries=$(mktemp)
trap 'rm -f "$entries"' EXIT
# record <check> <result> <figure>: one entry of the JSON summary (tab-separated until the end)
record() { printf '%s\t%s\t%s\n' "$@" >>"$entries"; }

# run_within <seconds> <log> <command...>: the command in a session of its own, all of which (the
# stages' own `timeout` process groups included) is stopped when the seconds are up; returns its
# exit status, or 124 when stopped
run_within() {
    local limit=$1 log=$2 pid end
    shift 2
    end=$((SECONDS + limit))
    setsid "$@" >"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$SECONDS" -ge "$end" ]; then
            pkill -TERM -s "$pid"
            sleep 2
            pkill -KILL -s "$pid"
            wait "$pid" 2>/dev/null
            return 124
        fi
        sleep 1
    done
    wait "$pid"
}

for item in "${plan[@]}"; do
    IFS='|' read -r estimate check command <<<"$item"
    left=$((budget - SECONDS))
    if [ "$estimate" -gt "$left" ]; then
        echo "NOT RUN  $check: estimated $estimate s, $left s of the budget left"
        record "$check" "not run" "estimated $estimate s, $left s of the budget left"
        continue
    fi
    log="$logs/$(tr -c 'a-zA-Z0-9\n' _ <<<"$check").log"
    start=$SECONDS
    run_within "$((left > 3 ? left - 3 : 1))" "$log" bash $command  # 3 s to stop it in
    rc=$? took=$((SECONDS - start))
    script=$(basename "${command%% *}" .sh)
    line=$(grep -E "^$script: [0-9]+ passed, [0-9]+ failed" "$log" | tail -1)
    fails=$(grep -c "^FAIL" "$log")
    if [ $rc -eq 124 ]; then
        failed=$((failed + fails))
        echo "NOT RUN  $check: stopped at the end of the budget after $took s, $fails failure(s) before that"
        record "$check" "not run" "stopped by the budget after $took s, $fails failure(s) before"
        grep "^FAIL" "$log" | sed 's/^/    /'
        continue
    fi
    p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"${line:-: 0 passed}")
    f=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"${line:-0 failed}")
    [ -z "$line" ] && f=$((fails > 0 ? fails : 1))  # ended without its count line: a crash
    [ $rc -ne 0 ] && [ "$f" -eq 0 ] && f=1
    passed=$((passed + p)) failed=$((failed + f))
    if [ "$f" -gt 0 ]; then
        result=failed
        echo "FAILED   $check ($took s, exit $rc): $p passed, $f failed; log $log"
        { grep -E "^FAIL" "$log" || tail -n 20 "$log"; } | head -20 | sed 's/^/    /'
    elif [ "$p" -eq 0 ]; then
        result=skipped
        echo "SKIPPED  $check ($took s): $(grep -m1 -o 'SKIPPED: .*' "$log")"
    else
        result=passed
        printf 'passed   %-36s %4d checks (%d s)\n' "$check" "$p" "$took"
        grep -o "SKIPPED: .*" "$log" | head -5 | sed 's/^/    /'
    fi
    record "$check" "$result" "$p passed, $f failed in $took s"
done

python3 - "$summary" "$gpu" "$budget" "$SECONDS" "$entries" <<'PY'
import json, sys
path, gpu, budget, elapsed, entries = sys.argv[1:]
checks = [dict(zip(("check", "result", "figure"), line.rstrip("\n").split("\t"))) for line in open(entries)]
json.dump({"gpu": gpu or None, "budget_s": int(budget), "elapsed_s": int(elapsed), "checks": checks},
          open(path, "w"), indent=1)
PY
echo "summary: $summary (logs in $logs/), $SECONDS s of the $budget s budget"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
