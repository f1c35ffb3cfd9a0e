#!/usr/bin/env bash
# The harness ends everything a test starts when the test ends, however it ends (tests/lib.sh's
# end_test_processes, tests/run.sh's run_one). A planted test hangs: a server that never answers
# (it listens, takes no connection and ignores SIGTERM and SIGINT), a helper waiting for its
# answer, and three MPI ranks of which one spins deaf to SIGTERM and SIGINT while the others wait.
# It is stopped as run.sh's TEST_TIMEOUT stops a test (also when the test's shell ignores
# SIGTERM, so that only run.sh's SIGKILL stops it), by a Ctrl-C on run.sh, by a Ctrl-C on the
# test run alone, and at tests/mutations.py's own time limit; each time no process of it may be
# left 15 s after the stop began, nor when run.sh starts the next test. The planted processes are
# found by their command lines (they all name this test's $tmp), not by the harness's own tag.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
bin=$tmp/bin suite=$tmp/suite
mkdir -p "$bin" "$suite"

# a timeout without --kill-after waits on whatever ignores its TERM: every test's may not
plain_timeouts() { grep -nE '(^|[^-])\btimeout [0-9]' tests/*.sh; }
check '! plain_timeouts >/dev/null' "a timeout without --kill-after: $(plain_timeouts)"

cat >"$bin/stage-6" <<'PY'
#!/usr/bin/env python3
import os, signal, socket, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
listener = socket.create_server(("127.0.0.1", 0))
print(f"server: model never answers at http://127.0.0.1:{listener.getsockname()[1]} (kill -TERM {os.getpid()})", flush=True)
while True:
    time.sleep(60)
PY
cat >"$bin/stage-3" <<'PY'
#!/usr/bin/env python3
import os, signal, time
if os.environ.get("OMPI_COMM_WORLD_RANK") == "2":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        pass
time.sleep(3600)
PY
cat >"$bin/client" <<'PY'
#!/usr/bin/env python3
import sys, urllib.request
urllib.request.urlopen(sys.argv[1])
PY
chmod +x "$bin"/*
cat >"$suite/test_victim1.sh" <<EOF
#!/usr/bin/env bash
source "$PWD/tests/lib.sh"
source tests/mpi_env.sh
source tests/server_lib.sh
STAGE_BIN="$bin"
[ -n "\${VICTIM_IGNORES_TERM:-}" ] && trap '' TERM
start_server silent 1
"$bin/client" "\$url" &
args=()
run_ranks 3 spin 3
finish test_victim1
EOF
cat >"$suite/test_victim2.sh" <<EOF
#!/usr/bin/env bash
source "$PWD/tests/lib.sh"
check '! pgrep -f "$bin/" >/dev/null' "the test before left \$(pgrep -af "$bin/")"
finish test_victim2
EOF

# from_a_terminal <command...>: the command in a session of its own with SIGINT at its default, as
# a shell on a terminal starts it (a command this script starts with & ignores SIGINT, and a bash
# that starts so cannot trap it); a Ctrl-C is then SIGINT to its process group
from_a_terminal() {
    exec python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.setsid()
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}

# planted: the planted processes still running, one per line
planted() { pgrep -af "$tmp/"; }

# wait_hung: waits (60 s at most) until the victim hangs: its server, its helper and its 3 ranks
wait_hung() {
    for _ in $(seq 600); do
        [ "$(pgrep -fc "$bin/stage-3")" -ge 3 ] && pgrep -f "$bin/client" >/dev/null && break
        sleep 0.1
    done
    check '[ "$(pgrep -fc "$bin/stage-3")" -ge 3 ] && pgrep -f "$bin/stage-6" >/dev/null && pgrep -f "$bin/client" >/dev/null' \
        "$scenario: the planted test did not start its server, helper and 3 ranks: $(planted)"
}

# expect_none_left <stop>: one check that no planted process is left within 15 s of <stop> (an
# $EPOCHREALTIME), which prints how long they took to go; then ends any left, so that the next
# scenario (and the machine) starts clean
expect_none_left() {
    local stop=$1 took
    while planted >/dev/null && [ "$(elapsed "$stop")" -lt 15000 ]; do sleep 0.1; done
    took=$(elapsed "$stop")
    check '! planted >/dev/null' "$scenario: still running $((took / 1000)) s after the stop: $(planted)"
    echo "$scenario: the planted processes were gone $took ms after the stop"
    pkill -KILL -f "$tmp/"
}
elapsed() { echo $(((${EPOCHREALTIME/./} - ${1/./}) / 1000)); }  # milliseconds since $1

# the ways a test is stopped
limit=15
for deaf in "" yes; do
    scenario="TEST_TIMEOUT${deaf:+, the test ignoring SIGTERM}"
    start=$EPOCHREALTIME
    VICTIM_IGNORES_TERM=$deaf TEST_TIMEOUT=$limit TEST_DIR=$suite bounded 120 bash tests/run.sh test_victim >"$tmp/run.out" 2>&1 &
    runner=$!
    wait_hung
    wait $runner
    rc=$?
    check '[ $rc -ne 0 ] && grep -q "test_victim1: stopped after $limit s (TEST_TIMEOUT)" "$tmp/run.out"' \
        "$scenario: run.sh exit $rc, want non-zero and the test stopped: $(tail -3 "$tmp/run.out")"
    check 'grep -q "^test_victim2  *1 passed" "$tmp/run.out"' "$scenario: the next test did not start clean: $(grep -A3 "FAILED test_victim2" "$tmp/run.out")"
    expect_none_left "$(awk -v s="$start" -v l="$limit" 'BEGIN { printf "%.6f", s + l }')"
done

scenario="Ctrl-C on run.sh"
TEST_DIR=$suite from_a_terminal bash tests/run.sh test_victim >"$tmp/run.out" 2>&1 &
runner=$!
wait_hung
stop=$EPOCHREALTIME
kill -INT -- -"$runner"
expect_none_left "$stop"

scenario="Ctrl-C on the test alone"
from_a_terminal bash "$suite/test_victim1.sh" >"$tmp/alone.out" 2>&1 &
runner=$!
wait_hung
stop=$EPOCHREALTIME
kill -INT -- -"$runner"
expect_none_left "$stop"

# tests/mutations.py's own time limit on a test: the test is ended with all it started, as run.sh's
scenario="a mutation's test past its time limit (tests/mutations.py)"
start=$EPOCHREALTIME
timeout --kill-after=5 120 python3 -c 'import sys; sys.path.insert(0, "tests"); import mutations
sys.exit(mutations.run(["bash", sys.argv[1]], ".", sys.argv[2], int(sys.argv[3])))' \
    "$suite/test_victim1.sh" "$tmp/mutation.log" "$limit" &
runner=$!
wait_hung
wait $runner
rc=$?
check '[ $rc -eq 124 ]' "$scenario: exit $rc, want 124 (stopped at its limit): $(tail -3 "$tmp/mutation.log")"
expect_none_left "$(awk -v s="$start" -v l="$limit" 'BEGIN { printf "%.6f", s + l }')"

finish test_harness
