# tests/cluster_lib.sh: what the two Slurm test harnesses share (tests/slurm/run.sh on one host,
# tests/multinode/run.sh across two): counting, timing, and submitting and waiting for jobs.
# Source it after setting TEST_NAME, JOB_TIMEOUT and WORK and defining slurm_cmd, which runs a
# Slurm command (sbatch, scontrol, scancel) where the cluster is: here, or on its login host.

passed=0 failed=0 skipped=() submitted=()
say() { echo "$TEST_NAME: $*"; }
pass() { passed=$((passed + 1)); echo "PASS $*"; }
fail() { failed=$((failed + 1)); echo "FAIL $*"; }
summary() { say "$passed passed, $failed failed"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }  # seconds since $1

# submit SCRIPT [sbatch options...]: with the job's environment in the caller's; sets JID and LOG.
# --time makes Slurm itself end a runaway job too.
submit() {
    local script=$1; shift
    JID=$(slurm_cmd sbatch --parsable --time=$(((JOB_TIMEOUT + 59) / 60)) "$@" "$script" 2>"$WORK/sbatch.err")
    JID=${JID%%;*}
    if ! [[ $JID =~ ^[0-9]+$ ]]; then JID=""; return 1; fi
    submitted+=("$JID")
    LOG=slurm/logs/$(basename "$script" .sh)-$JID.out
}

# job_state: sets STATE and EXIT of $JID (and REASON, why it still waits)
job_state() {
    local info
    info=$(slurm_cmd scontrol show job -o "$JID" 2>/dev/null)
    STATE=$(grep -oE 'JobState=[A-Z_]+' <<<"$info" | cut -d= -f2)
    EXIT=$(grep -oE ' ExitCode=[0-9:]+' <<<"$info" | cut -d= -f2)
    REASON=$(grep -oE 'Reason=[^ ]+' <<<"$info")
}

# wait_job [HOOK]: polls until the job ended (sbatch --wait only looks after 2, 10 and 42 s),
# through a requeue; past JOB_TIMEOUT cancels it and returns 1. HOOK, a function, runs at every
# poll while the job goes on.
wait_job() {
    local deadline=$((SECONDS + JOB_TIMEOUT)) hook=${1:-}
    while :; do
        job_state
        case $STATE in
            PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | REQUEUED | "") ;;
            *) return 0 ;;
        esac
        [ -n "$hook" ] && $hook
        if [ $SECONDS -ge $deadline ]; then
            STATE="TIMEOUT(test: still $STATE after $JOB_TIMEOUT s${REASON:+ $REASON})"
            slurm_cmd scancel "$JID" 2>/dev/null || true
            return 1
        fi
        sleep 0.2
    done
}

log_tail() {
    echo "----- job $JID: $STATE exit $EXIT; last lines of $LOG:"
    if [ -s "$LOG" ]; then tail -n 25 "$LOG" | sed 's/^/    /'; else echo "    (no log file)"; fi
    echo "-----"
}
