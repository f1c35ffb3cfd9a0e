#!/usr/bin/env bash
# The comm layer under mpirun: collectives, point-to-point, all-to-all and accounting on 1, 2, 3
# and 4 ranks (comm_check), directly and staged through host copies (comm_backend mpi-staged), and a stuck or dead rank ending the job with a message within the
# timeout (comm_hang), whether the others wait in a collective, a send, a receive or an
# all-to-all.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh

for np in 1 2 3 4; do
    # a deadlock among the checks ends after a minute instead of the default 300 s
    out=$(COMM_TIMEOUT=60 mpirun_np "$np" build/tests/mpi/comm_check 2>&1)
    check 'echo "$out" | grep -qE "^comm_check: [0-9]+ passed, 0 failed$"' \
        "comm_check on $np ranks: $(echo "$out" | tail -20)"
done
# the same through host copies: the MPI path of CUDA ranks that share a GPU, staging with memcpy
for np in 1 2 3 4; do
    out_staged=$(COMM_TIMEOUT=60 mpirun_np "$np" build/tests/mpi/comm_check mpi-staged 2>&1)
    check 'echo "$out_staged" | grep -qE "^comm_check: [0-9]+ passed, 0 failed$" &&
           echo "$out_staged" | grep -q "^communication: MPI, staged through host copies"' \
        "comm_check mpi-staged on $np ranks: $(echo "$out_staged" | tail -20)"
done
# comm_backend: a value outside the four is the config's error; nccl on the CPU build is refused
# with the reason, once, and the job ends on every rank
expect_one_error "comm_backend gloo" "^error: command line: key 'comm_backend': expected auto, nccl, mpi or mpi-staged" \
    build/stage-3 --config configs/tiny.json --comm_backend=gloo
out_nccl=$(MPI_GUARD=60 mpirun_np 2 build/stage-3 --config configs/tiny.json --comm_backend=nccl --out_dir="$tmp/nccl" 2>&1)
rc=$?
check '[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(echo "$out_nccl" | grep -c "^error: key .comm_backend. is \"nccl\" but this is the CPU build")" -eq 1 ]' \
    "comm_backend=nccl on the CPU build on 2 ranks: exit $rc: $(echo "$out_nccl" | head -3)"
# the table names every kind comm_check used (4 ranks use them all)
for kind in send recv send-recv all-to-all; do
    check 'echo "$out" | grep -qE "^  world +$kind +[0-9]+ "' "no '$kind' row in the table on 4 ranks"
done

# hang_case <ranks> <operation> [die]: the job ends, non-zero (not 127: it did not start), well
# before the 60 s guard; a stuck (not dead) rank's peers say which operation timed out
hang_case() {
    local np=$1 operation=$2 how=${3:-stuck}
    COMM_TIMEOUT=3 mpirun_aborting 60 "$tmp/hang.log" "$np" build/tests/mpi/comm_hang "$operation" ${3:+"$3"}
    out=$(cat "$tmp/hang.log")
    check '[ "$rc" = lingered ] || { [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 127 ]; } && [ $took -lt 45 ]' \
        "$operation with a $how rank: exit $rc after $took s (want non-zero, not the 60 s guard): $(echo "$out" | tail -5)"
    if [ "$how" = stuck ]; then
        check 'echo "$out" | grep -q "$operation on group .world. did not finish within 3 s"' \
            "$operation with a stuck rank: no timeout message: $(echo "$out" | tail -5)"
    fi
}
hang_case 4 all-reduce
hang_case 4 all-reduce die
hang_case 2 send
hang_case 2 recv
hang_case 3 all-to-all
finish test_comm
