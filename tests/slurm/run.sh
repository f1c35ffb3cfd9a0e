#!/usr/bin/env bash
# tests/slurm/run.sh - `make test-slurm`: the job scripts in slurm/ on a real Slurm cluster.
#
# Brings up the local one-node cluster (slurm/local-cluster-up.sh, as root), then submits with
# sbatch, exactly as a user would, and checks each job:
#   - launchers: slurm/stage-3.sh running tests/slurm/mpi_hello (4 MPI ranks) with srun (PMIx)
#     and with mpirun: every rank joins an all-reduce and sees $CONFIG_FILE and the arguments.
#     This proves the multi-rank path before (and independently of) the parallel stages.
#   - a job that must fail (missing config) fails at once with a clear message;
#   - every stage whose binary exists (build/stage-N) on configs/tiny.json, a short run:
#     COMPLETED, exit 0, progress lines in its log and a falling loss (stage 6: generation
#     output). Stage 3 runs with both launchers, stage 5 on the [2,2,1] grid. Missing stages are
#     listed as skipped.
#   - the preflight (slurm/preflight.sh, 4 ranks): COMPLETED, and no check in its preflight.json failed;
#   - preemption (stages 3, 4 and 5 on [2,2,1], 4 ranks): a job sent the warning signal mid-run
#     (scancel --signal=USR1 --batch, what --signal=B:USR1@N sends) saves, requeues itself,
#     resumes from its out_dir with no flag, and ends with the per-step losses of the
#     uninterrupted job above to the last digit; no rank of it is left running.
# A failing job prints its log tail. The cluster is torn down on every path (trap).
# Nothing can hang: the bring-up, each job and each Slurm command have time limits.
# Last line: "test-slurm: N passed, N failed"; exit status 1 if anything failed.
#
# Settings: SLURM_TEST_STEPS=6 (training steps per job), SLURM_TEST_PREEMPT_STEPS=20 (steps of
#           the jobs preempted and of the srun jobs of stages 3-5 they are compared with: room
#           for the signal to land mid-run), SLURM_TEST_JOB_TIMEOUT=180 (s per job),
#           SLURM_TEST_KEEP_CLUSTER=1 (leave the cluster up afterwards, for debugging)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
STEPS=${SLURM_TEST_STEPS:-6}
PREEMPT_STEPS=${SLURM_TEST_PREEMPT_STEPS:-20}
JOB_TIMEOUT=${SLURM_TEST_JOB_TIMEOUT:-180}
WORK=$ROOT/build/slurm-test
T_START=$SECONDS

TEST_NAME=test-slurm
slurm_cmd() { timeout --kill-after=10 30 "$@"; }
source tests/cluster_lib.sh   # counting, timing, submit, wait_job, log_tail

# ---- teardown on every path --------------------------------------------------------------------
cluster_started=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ ${#submitted[@]} -gt 0 ] && [ $cluster_started = 1 ]; then
        timeout --kill-after=10 10 scancel "${submitted[@]}" 2>/dev/null || true
    fi
    if [ $cluster_started = 1 ] && [ "${SLURM_TEST_KEEP_CLUSTER:-0}" != 1 ]; then
        timeout --kill-after=10 120 bash slurm/local-cluster-down.sh >"$WORK/cluster-down.log" 2>&1 ||
            { echo "WARNING: teardown failed:"; cat "$WORK/cluster-down.log"; }
    fi
    exit $rc
}
trap cleanup EXIT
trap 'echo "test-slurm: interrupted"; failed=$((failed + 1)); summary; exit 130' INT TERM

mkdir -p "$WORK" slurm/logs
if [ "$(id -u)" != 0 ]; then
    say "the local Slurm cluster needs root (it installs packages and starts daemons); run as root"
    fail "cluster: not root"; summary; exit 1
fi

# ---- the cluster ---------------------------------------------------------------------------------
say "bringing up the local Slurm cluster (slurm/local-cluster-up.sh)"
cluster_started=1
t0=$(now)
if ! env_file=$(timeout --kill-after=10 600 bash slurm/local-cluster-up.sh 2>"$WORK/cluster-up.log"); then
    cat "$WORK/cluster-up.log"
    fail "cluster: slurm/local-cluster-up.sh failed"; summary; exit 1
fi
# shellcheck source=/dev/null
source "$env_file"   # SLURM_CONF, mpirun-as-root, OMPI_MCA_mpi_yield_when_idle=1
say "cluster up in $(since "$t0") s: $(timeout --kill-after=10 10 sinfo -h -o '%P %T %c CPUs %G' | head -n1)"

# run_job NAME SCRIPT CHECK [sbatch options...]: submit, wait, COMPLETED 0:0, then CHECK (a
# function reading $LOG that prints why it failed). Logs of passing jobs are removed.
run_job() {
    local name=$1 script=$2 check=$3 t0 why; shift 3
    t0=$(now)
    if ! submit "$script" "$@"; then
        fail "$name: sbatch refused the job: $(cat "$WORK/sbatch.err")"; return
    fi
    wait_job
    if [ "$STATE" != COMPLETED ] || [ "$EXIT" != 0:0 ]; then
        fail "$name: job $JID ended $STATE (exit $EXIT) after $(since "$t0") s"; log_tail; return
    fi
    if ! why=$($check); then
        fail "$name: job $JID COMPLETED but $why"; log_tail; return
    fi
    pass "$name [job $JID, $(since "$t0") s]${why:+: $why}"
    rm -f "$LOG"
}

# ---- checks on a job's log ------------------------------------------------------------------------
check_hello() { # every rank: all-reduce right, CONFIG_FILE and the arguments arrived
    local n want="config=configs/tiny.json args=[--config configs/tiny.json --stop_iteration=$STEPS]"
    n=$(grep -c "allreduce_sum=10 expected=10 $want" "$LOG" 2>/dev/null)
    [ "$n" = 4 ] || { echo "expected 4 ranks reporting 'allreduce_sum=10 ... $want', found $n"; return 1; }
    echo "4 ranks agree"
}
check_training() { # progress lines "step k/N | loss X | ..." from rank 0, loss falling
    local losses n first last
    losses=$(grep -oE '^step +[0-9]+/[0-9]+ \| loss [0-9.eE+-]+' "$LOG" 2>/dev/null | awk '{print $NF}')
    n=$(grep -c . <<<"$losses")
    [ "$n" -ge 2 ] || { echo "its log has $n progress lines ('step k/N | loss X'), expected at least 2"; return 1; }
    first=$(head -n1 <<<"$losses"); last=$(tail -n1 <<<"$losses")
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
        { echo "the loss did not fall ($first -> $last over $n progress lines)"; return 1; }
    echo "$n progress lines, loss $first -> $last"
}
check_inference() { # generation finished and reported its speed
    grep -qiE 'tok(ens)?/s' "$LOG" 2>/dev/null || { echo "no tokens/s report in its log"; return 1; }
    echo "generated"
}

grid_of() { [ "$1" = 5 ] && echo "--tp_dimensions=2,2,1"; }  # stage 5's grid in sections 3 and 4

# ---- 1. the launch path, with a stand-in MPI program -----------------------------------------------
HELLO=$WORK/mpi_hello
if ! timeout --kill-after=10 60 mpicc -std=c11 -O2 -Wall -Wextra -Werror -o "$HELLO" tests/slurm/mpi_hello.c 2>"$WORK/mpicc.err"; then
    fail "launchers: mpicc tests/slurm/mpi_hello.c failed: $(cat "$WORK/mpicc.err")"
else
    for launcher in srun mpirun; do
        LAUNCHER=$launcher STAGE_BIN=$HELLO CONFIG_FILE=configs/tiny.json EXTRA_ARGS="--stop_iteration=$STEPS" \
            OMP_NUM_THREADS=1 run_job "launcher $launcher: slurm/stage-3.sh, 4 MPI ranks (tests/slurm/mpi_hello)" \
            slurm/stage-3.sh check_hello
    done
fi

# ---- 2. a job that cannot work fails at once, and says why ---------------------------------------------
t0=$(now)
if STAGE_BIN=$HELLO CONFIG_FILE=configs/no-such-config.json submit slurm/stage-3.sh; then
    wait_job
    if [ "$STATE" = FAILED ] && grep -q "config file 'configs/no-such-config.json' not readable" "$LOG"; then
        pass "missing config: job $JID FAILED at once with a clear message [$(since "$t0") s]"
        rm -f "$LOG"
    else
        fail "missing config: expected FAILED with 'config file ... not readable', got $STATE"; log_tail
    fi
else
    fail "missing config: sbatch refused the job: $(cat "$WORK/sbatch.err")"
fi

# ---- 3. every stage that exists, on the CPU build ---------------------------------------------------
# (make test-slurm builds BACKEND=cpu first; build/stage-N is the backend built last)
for n in 1 2 3 4 5 6 7 8 9 10; do
    if [ ! -x "build/stage-$n" ]; then
        skipped+=("stage-$n (build/stage-$n does not exist yet)")
        continue
    fi
    out=$WORK/out/stage-$n
    rm -rf "$out" "$out"-*  # each job starts: a checkpoint left by an earlier test-slurm would be resumed
    case $n in
        1 | 2) # one process: let OpenMP use the cores
            OMP_NUM_THREADS=$(nproc) CONFIG_FILE=configs/tiny.json \
                EXTRA_ARGS="--stop_iteration=$STEPS --log_interval=1 --out_dir=$out" \
                run_job "stage $n: slurm/stage-$n.sh, 1 task, $STEPS steps" slurm/stage-$n.sh check_training ;;
        3 | 4 | 5) # 4 ranks on few cores: one thread each. Stage 3 with both launchers.
            # The srun jobs are the uninterrupted runs the preemption jobs (section 4) match.
            launchers=srun; [ $n = 3 ] && launchers="srun mpirun"
            for launcher in $launchers; do
                steps=$STEPS; [ $launcher = srun ] && steps=$PREEMPT_STEPS
                LAUNCHER=$launcher OMP_NUM_THREADS=1 CONFIG_FILE=configs/tiny.json \
                    EXTRA_ARGS="--stop_iteration=$steps --log_interval=1 $(grid_of $n) --out_dir=$out-$launcher" \
                    run_job "stage $n: slurm/stage-$n.sh, 4 ranks, $launcher, $steps steps" slurm/stage-$n.sh check_training
            done ;;
        7) # 2 pipeline stages x 2 replicas, 4 micro-batches each
            OMP_NUM_THREADS=1 CONFIG_FILE=configs/tiny.json \
                EXTRA_ARGS="--pp_size=2 --num_microbatches=4 --stop_iteration=$STEPS --log_interval=1 --out_dir=$out" \
                run_job "stage 7: slurm/stage-7.sh, 4 ranks (pp 2 x dp 2), $STEPS steps" slurm/stage-7.sh check_training ;;
        8) # 4 experts over 2 expert ranks x 2 replicas
            OMP_NUM_THREADS=1 CONFIG_FILE=configs/moe.json \
                EXTRA_ARGS="--ep_size=2 --stop_iteration=$STEPS --log_interval=1 --out_dir=$out" \
                run_job "stage 8: slurm/stage-8.sh, 4 ranks (ep 2 x dp 2), $STEPS steps" slurm/stage-8.sh check_training ;;
        9) # each sequence over 2 ranks (the ring) x 2 replicas
            OMP_NUM_THREADS=1 CONFIG_FILE=configs/tiny.json \
                EXTRA_ARGS="--cp_size=2 --overlap_communication=true --stop_iteration=$STEPS --log_interval=1 --out_dir=$out" \
                run_job "stage 9: slurm/stage-9.sh, 4 ranks (cp 2 x dp 2), $STEPS steps" slurm/stage-9.sh check_training ;;
        10) # the composed mesh on 4 ranks: tensor pairs inside 2 pipeline stages (tp 2 x pp 2)
            OMP_NUM_THREADS=1 CONFIG_FILE=configs/tiny.json \
                EXTRA_ARGS="--tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2 --stop_iteration=$STEPS --log_interval=1 --out_dir=$out" \
                run_job "stage 10: slurm/stage-10.sh, 4 ranks (tp 2 x pp 2), $STEPS steps" slurm/stage-10.sh check_training \
                --ntasks-per-node=4 --gpus-per-node=4 ;;
        6) # generation from the checkpoint the stage-1 job wrote, if there is one
            init=""; [ -e "$WORK/out/stage-1/model.safetensors" ] && init="--init_from=$WORK/out/stage-1"
            OMP_NUM_THREADS=$(nproc) CONFIG_FILE=configs/tiny.json \
                EXTRA_ARGS="--tokens_to_generate=16 --out_dir=$out $init" \
                run_job "stage 6: slurm/stage-6.sh, 1 task, 16 tokens" slurm/stage-6.sh check_inference ;;
    esac
done

# ---- 3b. the preflight's sbatch form (slurm/preflight.sh) on 4 ranks: no check fails -----------------
# (its preflight.json, tools/preflight.py: MPI joined all 4 ranks, a step of every built stage ran)
check_preflight() {
    python3 - "slurm/logs/preflight-$JID/preflight.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"no preflight.json: {e}"); sys.exit(1)
checks = {c["check"]: c for c in r["checks"]}
bad = [f'{c["check"]}: {c["measured"]}' for c in r["checks"] if c["status"] == "fail"]
mpi = checks.get("mpi: init", {})
steps = [c for c in r["checks"] if c["check"].startswith("stage ") and c["status"] == "pass"]
if bad or mpi.get("status") != "pass" or not mpi["measured"].startswith("4 ranks") or not steps:
    print(f"failed: {bad}; mpi: init {mpi}; {len(steps)} stage steps passed"); sys.exit(1)
print(f'{r["pass"]} checks passed ({len(steps)} stage steps), {r["skipped"]} skipped, in {r["seconds"]} s')
PY
}
OMP_NUM_THREADS=1 EXTRA_ARGS="--out_dir=$WORK/out/preflight" \
    run_job "preflight: sbatch slurm/preflight.sh, 4 ranks" slurm/preflight.sh check_preflight
[ -e "$LOG" ] || rm -rf "slurm/logs/preflight-$JID"

# ---- 4. preemption: the warning signal, requeue, automatic resume ------------------------------------
# same_losses <reference out_dir> <out_dir>: every step's loss as metrics.jsonl writes it (17
# digits) is the same text in both; prints where they part
same_losses() {
    python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" <<'PY'
import re, sys
def losses(path):
    try:
        return [re.search(r'"loss": ([^,]+),', line).group(1) for line in open(path)]
    except OSError:
        return []
a, b = losses(sys.argv[1]), losses(sys.argv[2])
if not a or a != b:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    sys.exit(f"{len(b)} steps logged against {len(a)} uninterrupted; they part at step {at + 1}")
PY
}

# until_trained_a_step <out_dir>: waits (within the job's time) until the job has logged a step
until_trained_a_step() {
    local deadline=$((SECONDS + JOB_TIMEOUT))
    until [ -s "$1/metrics.jsonl" ] || [ $SECONDS -ge $deadline ]; do
        job_state
        case $STATE in PENDING | CONFIGURING | RUNNING | "") ;; *) return ;; esac
        sleep 0.1
    done
}

# release_requeued (a wait_job hook): Slurm holds a requeued job for about two minutes
# (Reason=BeginTime) so that the first run's job credential, revoked at the requeue, is not
# mistaken for the second's. The test starts it sooner, once both are safe:
#   - the first run's step daemons are gone (a step N.0 started again while the old one lingers
#     finds its PMIx socket taken, and srun then fails to launch yet exits 0);
#   - 2 s have passed since the test first saw the hold: slurmd compares the new credential's
#     creation time with the revocation in whole seconds, so one made in the same second is
#     refused as revoked and the batch script never starts (the job ends FAILED 1:0, its log
#     silent after the requeue).
release_requeued() {
    [ "$REASON" = Reason=BeginTime ] || return 0
    held_since=${held_since:-$SECONDS}
    if [ $((SECONDS - held_since)) -ge 2 ] && ! pgrep -f "slurmstepd: \[$JID\." >/dev/null; then
        slurm_cmd scontrol update jobid="$JID" StartTime=now 2>/dev/null
    fi
}

# daemon_log_lines: what slurmctld and slurmd logged about $JID (why a launch failed)
daemon_log_lines() {
    local logs
    logs=$(dirname "$(dirname "$SLURM_CONF")")/log
    echo "----- job $JID in $logs/slurmctld.log and slurmd.log:"
    grep -hE "(JobId=|job |StepId=|\[)$JID([^0-9]|$)" "$logs/slurmctld.log" "$logs/slurmd.log" 2>/dev/null |
        tail -n 30 | sed 's/^/    /'
    echo "-----"
}

# ranks_left <out_dir>: the processes of a stage still running with that out_dir (none, after a
# second's grace for the last ones to be reaped)
ranks_left() {
    local i
    for i in 1 2 3 4 5; do pgrep -f -- "--out_dir=$1" >/dev/null || return 0; sleep 0.2; done
    pgrep -af -- "--out_dir=$1"
}

preempt_job() { # preempt_job <stage>: section 4 for one stage
    local n=$1 ref=$WORK/out/stage-$1-srun out=$WORK/out/stage-$1-requeue name t0 restarts from why held_since
    name="preemption, stage $n ($([ "$n" = 5 ] && echo "[2,2,1], ")4 ranks): USR1 mid-run, requeued, resumed"
    [ -s "$ref/metrics.jsonl" ] || { fail "$name: no uninterrupted run to compare with ($ref)"; return; }
    rm -rf "$out"
    t0=$(now)
    if ! OMP_NUM_THREADS=1 CONFIG_FILE=configs/tiny.json \
        EXTRA_ARGS="--stop_iteration=$PREEMPT_STEPS --log_interval=1 $(grid_of "$n") --out_dir=$out" \
        submit slurm/stage-$n.sh; then
        fail "$name: sbatch refused the job: $(cat "$WORK/sbatch.err")"; return
    fi
    until_trained_a_step "$out"
    slurm_cmd scancel --signal=USR1 --batch "$JID"
    wait_job release_requeued
    restarts=$(slurm_cmd scontrol show job -o "$JID" | grep -oE 'Restarts=[0-9]+' | cut -d= -f2)
    from=$(sed -nE "s|^resuming the run saved in $out after step ([0-9]+)$|\1|p" "$LOG" 2>/dev/null)
    if [ "$STATE" != COMPLETED ] || [ "$EXIT" != 0:0 ] || [ "${restarts:-0}" != 1 ]; then
        fail "$name: job $JID ended $STATE (exit $EXIT) after ${restarts:-0} restarts, want COMPLETED 0:0 after 1"
        log_tail; daemon_log_lines; return
    fi
    if [ -z "$from" ] || [ "$from" -lt 1 ] || [ "$from" -ge "$PREEMPT_STEPS" ]; then
        fail "$name: job $JID did not resume mid-run (want 'resuming the run saved in $out after step K', 0 < K < $PREEMPT_STEPS)"
        log_tail; return
    fi
    if ! why=$(same_losses "$ref" "$out"); then fail "$name: job $JID: $why"; log_tail; return; fi
    if why=$(ranks_left "$out") && [ -n "$why" ]; then fail "$name: job $JID left ranks running: $why"; return; fi
    pass "$name [job $JID, $(since "$t0") s]: stopped after step $from, $PREEMPT_STEPS losses identical, no rank left"
    rm -f "$LOG"
}

for n in 3 4 5; do
    if [ -x "build/stage-$n" ]; then preempt_job "$n"; else skipped+=("preemption, stage $n (no build/stage-$n)"); fi
done

for s in "${skipped[@]}"; do say "SKIPPED $s"; done
say "took $((SECONDS - T_START)) s in all"
summary
[ $failed -eq 0 ]
