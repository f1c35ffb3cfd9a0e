# Sourced by the MPI tests: how to start P ranks on a small machine. Open MPI refuses to run as
# root and to place more ranks than cores unless told; yield_when_idle stops waiting ranks from
# spinning on a core another rank needs.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=${MPI_OMP_THREADS:-1}
# mpirun_np <P> <program> [args...]: bounded by MPI_GUARD seconds (default 300), then killed with
# everything it started (Open MPI 4.1's mpirun can hang in PMIx_server_finalize after its ranks
# exit); 124 or 137 then
mpirun_np() {
    local np=$1; shift
    timeout -k 5 "${MPI_GUARD:-300}" mpirun -np "$np" --bind-to none "$@"
}
