# Sourced by the MPI tests after tests/lib.sh: how to start P ranks on a small machine. Open MPI
# refuses to run as root and to place more ranks than cores unless told; yield_when_idle stops
# waiting ranks from spinning on a core another rank needs.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=${MPI_OMP_THREADS:-1}
# mpirun_np <P> <program> [args...]: bounded by MPI_GUARD seconds (default 300), then killed with
# everything it started (Open MPI 4.1's mpirun can hang in PMIx_server_finalize after its ranks
# exit); 124 or 137 then
mpirun_np() {
    local np=$1; shift
    bounded "${MPI_GUARD:-300}" mpirun -np "$np" --bind-to none "$@"
}

# mpirun_aborting <guard> <log> <P> <program> [args...]: a job expected to fail: runs it like
# mpirun_np, its output in <log>, and returns when mpirun ends, or when its ranks have ended, it has
# said it aborted the job, and it has not followed them within 5 s: Open MPI 4.1's mpirun can
# deadlock (or crash) in PMIx_server_finalize after a job it aborted: 8 hung and 3 crashed of 115
# runs of test_comm's 3-rank all-to-all with a stuck rank here. Such a mpirun is killed, and this
# says so. Sets rc (mpirun's exit status, or "lingered" when it was killed so) and took (seconds
# until mpirun ended, or until its ranks had).
mpirun_aborting() {
    local guard=$1 log=$2; shift 2
    local start=$SECONDS mpirun_pid alone=0
    MPI_GUARD=$guard mpirun_np "$@" >"$log" 2>&1 &
    local job=$!  # the shell running mpirun_np, whose child timeout runs mpirun
    took=
    while kill -0 "$job" 2>/dev/null; do
        sleep 0.5
        mpirun_pid=$(pgrep -P "$(pgrep -P "$job" -x timeout)" -x mpirun 2>/dev/null) || continue
        if [ "$(ps -o stat= --ppid "$mpirun_pid" | grep -vc '^Z')" -eq 0 ] &&
           grep -q 'exited with non-zero status\|exited on signal\|returned a non-zero exit code' "$log"; then
            [ -n "$took" ] || took=$((SECONDS - start))
            alone=$((alone + 1))
            if [ $alone -ge 10 ]; then
                kill -KILL "$mpirun_pid"
                wait "$job"
                echo "mpirun: its ranks ended after $took s and it did not (killed 5 s later)" | tee -a "$log"
                rc=lingered
                return
            fi
        else
            alone=0 took=
        fi
    done
    wait "$job"
    rc=$? took=$((SECONDS - start))
}
