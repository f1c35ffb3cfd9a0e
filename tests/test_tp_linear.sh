#!/usr/bin/env bash
# Stage 05's parallel linear layer (forward, dX, dW, dbias) against the serial products on every
# grid of 1, 2 and 4 ranks, normal and transposed, overlap on and off (tests/mpi/tp_linear_check.c).
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
for np in 1 2 4; do
    out=$(bounded 120 mpirun -np $np --bind-to none build/tests/mpi/tp_linear_check 2>&1)
    rc=$?
    echo "$out" | grep -E "FAIL|tp_linear_check" | head -20
    line=$(echo "$out" | grep -E "^tp_linear_check on")
    p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
    f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    [ -n "$line" ] || { p=0; f=1; }
    [ $rc -ne 0 ] && [ "$f" -eq 0 ] && f=1
    passed=$((passed + p)) failed=$((failed + f))
done
echo "test_tp_linear: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
