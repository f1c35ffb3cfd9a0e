#!/usr/bin/env bash
# The mesh of composed runs (common/comm/mesh.h) under mpirun (tests/mpi/mesh_check.c): on 8, 12 and
# 16 ranks, every dimension's group and groups over several dimensions hold exactly the ranks an
# independent numbering (nested loops, pp outermost, tp innermost) says, and an all-reduce over
# each sums exactly those. Sizes other than 2 (3 replicas, 3 tensor ranks) and a 4-D mesh reveal
# a stride or an order that 2 x 2 x 2 hides. Bad sizes: one error naming the dimension and the
# number, and every rank stops.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh

mesh_case() {  # mesh_case <ranks> <description>
    local np=$1 mesh=$2 out
    out=$(COMM_TIMEOUT=60 MPI_GUARD=120 mpirun_np "$np" build/tests/mpi/mesh_check "$mesh" 2>&1)
    check 'echo "$out" | grep -qE "^mesh_check $mesh: [0-9]+ passed, 0 failed$"' "mesh $mesh on $np ranks: $(echo "$out" | grep -v "^mesh" | tail -12)"
    check '[ "$(echo "$out" | grep -c "^mesh: .* = $np ranks; rank = ")" -eq 1 ] && echo "$out" | grep -q "^mesh order, outermost first: pp, dp, ep, cp, tp. Tensor parallelism is innermost"' \
        "mesh $mesh on $np ranks: rank 0 did not print the mesh, its order and the reason once: $(echo "$out" | head -5)"
}
mesh_case 8 dp=2,pp=2,tp=2
mesh_case 12 dp=3,pp=2,tp=2
mesh_case 12 tp=3,ep=2
mesh_case 16 dp=2,pp=2,cp=2,tp=2

# refused_mesh <ranks> <description> <pattern>: the job ends non-zero with one error line on
# stderr, which matches <pattern>
refused_mesh() {
    local np=$1 mesh=$2 want=$3
    mpirun_aborting 60 "$tmp/refused.log" "$np" build/tests/mpi/mesh_check "$mesh"
    check '{ [ "$rc" = lingered ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; }; } &&
           [ "$(grep -c "^error" "$tmp/refused.log")" -eq 1 ] && grep -qF -- "error: $want" "$tmp/refused.log"' \
        "mesh $mesh on $np ranks: exit $rc, want one error reading '$want': $(grep -v "^mesh" "$tmp/refused.log" | head -5)"
}
refused_mesh 8 tp=3 "command line: mesh: dimension 'tp' is 3, which does not divide the 8 ranks"
refused_mesh 8 tp=4,pp=4 "command line: mesh: dimension 'pp' is 4, which does not divide 2: the 8 ranks over the dimensions inside it (ep 1 x cp 1 x tp 4)"
refused_mesh 8 dp=3,tp=2 "command line: mesh: dimension 'dp' is 3, expected 4: the 8 ranks over pp 1 x ep 1 x cp 1 x tp 2 leave 4 replicas"
refused_mesh 4 tp=0 "command line: mesh: dimension 'tp': expected a whole number of at least 1, found '0'"
refused_mesh 4 tp=2,xp=2 "command line: mesh: 'xp=2': expected <dimension>=<size>, the dimension pp, dp, ep, cp or tp"
refused_mesh 4 tp=2,tp=2 "command line: mesh: dimension 'tp' is given twice"
finish test_mesh
