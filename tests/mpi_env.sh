# Sourced by the MPI tests: how to start P ranks on a small machine. Open MPI refuses to run as
# root and to place more ranks than cores unless told; yield_when_idle stops waiting ranks from
# spinning on a core another rank needs.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=${MPI_OMP_THREADS:-1}
mpirun_np() { # mpirun_np <P> <program> [args...]
    local np=$1; shift
    mpirun -np "$np" --bind-to none "$@"
}
