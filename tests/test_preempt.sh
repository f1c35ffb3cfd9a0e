#!/usr/bin/env bash
# Preemption (stages 1, 3, 4, 5, 7): a run that gets SIGUSR1 (Slurm's warning) or SIGTERM (scancel) saves at the next
# step boundary and exits with 75 ("stopped to be resumed"); resumed, it logs per-step losses
# identical to a run that was never stopped, and no rank is left running. Stage 1 resumes with
# resume=true, the others by running the same command again (resume=auto, the default).
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/mpi_env.sh"
steps=30
args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --global_batch_size=8 --eval_batches=1
      --log_interval=5 --stop_iteration=$steps)

# logged_steps <out_dir>: how many steps metrics.jsonl holds so far
logged_steps() { cat "$1/metrics.jsonl" 2>/dev/null | wc -l; }

# stop_midway <signal> <name> <command...>: starts the command in the background, sends it the
# signal once it has logged 3 steps, and checks that it exits 75 early with a checkpoint saved
stop_midway() {
    local sig=$1 name=$2 pid rc; shift 2
    "$@" --out_dir="$tmp/$name" >"$tmp/$name.stop.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do [ "$(logged_steps "$tmp/$name")" -ge 3 ] && break; sleep 0.1; done
    kill -"$sig" "$pid"
    wait "$pid"; rc=$?
    check '[ $rc -eq 75 ]' "$name: SIGUSR/TERM gave exit $rc, expected 75: $(tail -3 "$tmp/$name.stop.log")"
    check 'grep -q "stopped by a signal after step .*checkpoint in $tmp/$name" "$tmp/$name.stop.log"' \
        "$name: no 'stopped by a signal' line saying where the checkpoint is"
    check '[ "$(logged_steps "$tmp/$name")" -lt $steps ] && [ -f "$tmp/$name/optimizer.safetensors" ]' \
        "$name: the run did not stop early with a checkpoint"
    check '! pgrep -f -- "--out_dir=$tmp/$name" >/dev/null' "$name: a rank is still running"
}

# the one-process stage, SIGTERM sent straight to it
build/stage-1 "${args[@]}" --out_dir="$tmp/s1_straight" >"$tmp/s1.log" 2>&1
check '[ $? -eq 0 ]' "stage 1 straight run failed: $(tail -3 "$tmp/s1.log")"
stop_midway TERM s1 build/stage-1 "${args[@]}"
build/stage-1 "${args[@]}" --resume=true --out_dir="$tmp/s1" >"$tmp/s1.resume.log" 2>&1
check '[ $? -eq 0 ]' "stage 1 resume failed: $(tail -3 "$tmp/s1.resume.log")"
check 'compare_losses "$tmp/s1_straight" "$tmp/s1" $steps 0' "stage 1: resumed losses differ from the straight run"

# DDP on 2 ranks, SIGUSR1 sent to mpirun, which forwards it to every rank
run_ranks 3 s3_straight 2
stop_midway USR1 s3 mpirun -np 2 --bind-to none build/stage-3 "${args[@]}"
run_ranks 3 s3 2
check 'compare_losses "$tmp/s3_straight" "$tmp/s3" $steps 0' "stage 3: resumed losses differ from the straight run"

# FSDP (2 ranks, sharded save), tensor parallelism on [2,2,1] (4 ranks) and the pipeline (2 stages)
for spec in "4 2" "5 4 --tp_dimensions=2,2,1" "7 2 --pp_size=2"; do
    read -r n np extra <<<"$spec"
    run_ranks "$n" "s${n}_straight" "$np" $extra
    stop_midway USR1 "s$n" mpirun -np "$np" --bind-to none "build/stage-$n" "${args[@]}" $extra
    run_ranks "$n" "s$n" "$np" $extra
    check 'compare_losses "$tmp/s${n}_straight" "$tmp/s$n" $steps 0' "stage $n: resumed losses differ from the straight run"
done
finish test_preempt
