#!/usr/bin/env bash
# The comm layer under mpirun: collectives and accounting on 1, 2, 3 and 4 ranks (comm_check),
# and a stuck or dead rank ending the job with a message within the timeout (comm_hang).
set -u
cd "$(dirname "$0")/.."
source tests/mpi_env.sh
passed=0 failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

for np in 1 2 3 4; do
    out=$(mpirun_np "$np" build/tests/mpi/comm_check 2>&1)
    line=$(echo "$out" | grep -E '^comm_check: [0-9]+ passed, 0 failed$')
    if [ -n "$line" ]; then ok; else fail "comm_check on $np ranks:"; echo "$out" | tail -20; fi
done

for how in stuck die; do
    start=$SECONDS
    arg=""; [ "$how" = die ] && arg=die
    out=$(COMM_TIMEOUT=3 timeout 60 mpirun -np 4 --bind-to none build/tests/mpi/comm_hang $arg 2>&1)
    rc=$?
    took=$((SECONDS - start))
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 45 ]; then ok; else
        fail "a $how rank: exit $rc after $took s (want non-zero, not the 60 s guard)"; echo "$out" | tail; fi
    if [ "$how" = stuck ]; then
        if echo "$out" | grep -q "did not finish within 3 s"; then ok; else
            fail "a stuck rank: no timeout message"; echo "$out" | tail; fi
    fi
done
echo "test_comm: $passed passed, $failed failed"
[ $failed -eq 0 ]
