#!/usr/bin/env bash
# Runs every test program (build/tests/test_*) and test script (tests/test_*.sh), adds up their
# "name: N passed, N failed" lines and ends with the total on the last line. A test that crashes
# or exits non-zero without failing a check counts as one failure, so nothing fails silently; a
# test's "name: SKIPPED: why" lines are shown, so nothing is skipped silently either. A test that
# runs past TEST_TIMEOUT seconds (default 900; the longest, test_demo, takes about 5 minutes) is stopped with
# everything it started and fails with its log's tail, so a hang costs minutes, not the whole run.
# Each test runs under a tag of its own (tests/lib.sh's TEST_PROCESS_TAG), and whatever carries it
# when the test has ended is ended too; a Ctrl-C ends the run and everything its tests started.
# Usage: tests/run.sh [name-filter]; TEST_DIR=<dir> runs <dir>/test_*.sh instead of tests/'s
set -u
source "$(dirname "$0")/lib.sh"
# a defined standard input: mpirun forwards its own to rank 0, and with descriptor 0 closed (as
# under some CI harnesses) the shell's own pipes take that number: test_comm then hangs on 4 ranks
exec </dev/null
limit=${TEST_TIMEOUT:-900}
filter=${1:-}
log=$tmp/test.log

run_one() { # run_one <name> <command...>
    local name=$1; shift
    local start=$SECONDS
    TEST_PROCESS_TAG=$TEST_PROCESS_TAG/$name bounded "$limit" "$@" >"$log" 2>&1
    local rc=$?
    end_test_processes "$TEST_PROCESS_TAG/$name"  # what a test stopped with SIGKILL left running
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "$name: stopped after $limit s (TEST_TIMEOUT)" >>"$log"; fi
    local line p f
    line=$(grep -E "^$name: [0-9]+ passed, [0-9]+ failed" "$log" | tail -1)
    if [ -n "$line" ]; then
        p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
        f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    else
        p=0 f=0
    fi
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p)) failed=$((failed + f))
    if [ "$f" -ne 0 ]; then
        echo "FAILED $name (exit $rc, $((SECONDS - start)) s):"
        tail -n 40 "$log" | sed 's/^/    /'
    else
        printf '%-34s %4d passed  (%d s)\n' "$name" "$p" $((SECONDS - start))
    fi
    grep -E "^$name: SKIPPED" "$log" | sed 's/^/    /'
}

for prog in build/tests/test_*; do
    [ -x "$prog" ] || continue
    name=$(basename "$prog")
    [[ "$name" == *"$filter"* ]] || continue
    run_one "$name" "$prog"
done
for script in "${TEST_DIR:-tests}"/test_*.sh; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .sh)
    [[ "$name" == *"$filter"* ]] || continue
    run_one "$name" bash "$script"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
