#!/usr/bin/env bash
# Exact resume: 20 steps straight, and 10 steps + resume + 10 steps, give bit-identical losses
# (the same metrics.jsonl values), and the checkpoint_interval saves happen. The key resume
# (common/run/run_checkpoint.h): auto (the default) resumes a checkpoint of the same run with the same losses
# as resume=true; another run's checkpoint (a key that changes the numbers differs) or an
# incomplete one is refused with one error naming the out_dir, the key and both values, and its
# files stay byte for byte; resume=true on a directory without a checkpoint is an error;
# resume=false starts over.
source "$(dirname "$0")/lib.sh"
args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --global_batch_size=8 --eval_batches=1 --log_interval=5)

build/stage-1 "${args[@]}" --stop_iteration=20 --out_dir="$tmp/straight" >"$tmp/a.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the straight run failed: $(tail -3 "$tmp/a.log")"
build/stage-1 "${args[@]}" --stop_iteration=10 --checkpoint_interval=5 --out_dir="$tmp/resumed" >"$tmp/b.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the first half failed: $(tail -3 "$tmp/b.log")"
check '[ -f "$tmp/resumed/model.safetensors" ] && [ -f "$tmp/resumed/optimizer.safetensors" ]' "no checkpoint after 10 steps"
check '! ls "$tmp/resumed" | grep -q tmp' "a temporary file was left behind"
build/stage-1 "${args[@]}" --stop_iteration=20 --resume=true --out_dir="$tmp/resumed" >"$tmp/c.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the resumed half failed: $(tail -3 "$tmp/c.log")"

losses() { python3 -c "import json,sys; print('\n'.join(repr(json.loads(l)['loss']) for l in open(sys.argv[1])))" "$1"; }
check '[ "$(losses "$tmp/straight/metrics.jsonl" | wc -l)" -eq 20 ]' "the straight run logged $(losses "$tmp/straight/metrics.jsonl" | wc -l) steps"
check '[ "$(losses "$tmp/straight/metrics.jsonl")" = "$(losses "$tmp/resumed/metrics.jsonl")" ]' \
    "losses differ: $(diff <(losses "$tmp/straight/metrics.jsonl") <(losses "$tmp/resumed/metrics.jsonl") | head -6)"
# the tensor data after the safetensors header (whose metadata records each run's own config)
tensor_bytes() { python3 -c "import sys,struct; d=open(sys.argv[1],'rb').read(); n=struct.unpack('<Q',d[:8])[0]; sys.stdout.buffer.write(d[8+n:])" "$1" | md5sum; }
check '[ "$(tensor_bytes "$tmp/straight/model.safetensors")" = "$(tensor_bytes "$tmp/resumed/model.safetensors")" ]' "the final weights differ"

# resuming with another seed is refused with a message
build/stage-1 "${args[@]}" --stop_iteration=22 --resume=true --seed=7 --out_dir="$tmp/resumed" >"$tmp/d.log" 2>&1
rc=$?; check '[ $rc -ne 0 ] && grep -q "seed" "$tmp/d.log"' "resume with another seed was not refused"

# ---- resume=auto, the default: the same run continues without a flag ---------------------------
build/stage-1 "${args[@]}" --stop_iteration=10 --out_dir="$tmp/auto" >"$tmp/auto1.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the first half (auto) failed: $(tail -3 "$tmp/auto1.log")"
check '! grep -q "^resuming" "$tmp/auto1.log"' "a run in an empty out_dir said it resumed"
build/stage-1 "${args[@]}" --stop_iteration=20 --out_dir="$tmp/auto" >"$tmp/auto2.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the second half (auto) failed: $(tail -3 "$tmp/auto2.log")"
check 'grep -q "^resuming the run saved in $tmp/auto after step 10" "$tmp/auto2.log"' "the automatic resume did not say so"
check '[ "$(losses "$tmp/resumed/metrics.jsonl")" = "$(losses "$tmp/auto/metrics.jsonl")" ]' \
    "automatic resume differs from resume=true: $(diff <(losses "$tmp/resumed/metrics.jsonl") <(losses "$tmp/auto/metrics.jsonl") | head -6)"

# ---- another run's checkpoint is refused and left as it was -------------------------------------
sums() { (cd "$1" && md5sum ./* | sort); }
before=$(sums "$tmp/auto")
expect_one_error "another seed" \
    "^error: $tmp/auto holds the checkpoint of another run: key 'seed' was 123456 there but is 7 now (command line)" \
    build/stage-1 "${args[@]}" --stop_iteration=30 --seed=7 --out_dir="$tmp/auto"
expect_one_error "another model shape" "key 'n_embd' was 64 there but is 32 now (command line)" \
    build/stage-1 "${args[@]}" --n_embd=32 --stop_iteration=30 --out_dir="$tmp/auto"
expect_one_error "another global batch" "key 'global_batch_size' was 8 there but is 16 now" \
    build/stage-1 "${args[@]}" --global_batch_size=16 --stop_iteration=30 --out_dir="$tmp/auto"
expect_one_error "another learning rate, resume=true" "key 'lr' was 0.002 there but is 0.001 now" \
    build/stage-1 "${args[@]}" --lr=0.001 --stop_iteration=30 --resume=true --out_dir="$tmp/auto"
check '[ "$(sums "$tmp/auto")" = "$before" ]' "a refused run changed the files in its out_dir"
# what does not change the numbers is no other run: a longer stop_iteration continues it
build/stage-1 "${args[@]}" --stop_iteration=22 --eval_batches=2 --log_interval=1 --out_dir="$tmp/auto" >"$tmp/auto3.log" 2>&1
rc=$?; check '[ $rc -eq 0 ] && [ "$(losses "$tmp/auto/metrics.jsonl" | wc -l)" -eq 22 ]' \
    "continuing with another stop_iteration, eval_batches and log_interval failed: $(tail -3 "$tmp/auto3.log")"

# ---- an incomplete checkpoint is refused, not overwritten -------------------------------------
cp -r "$tmp/resumed" "$tmp/partial"
rm "$tmp/partial/optimizer.safetensors"
before=$(sums "$tmp/partial")
expect_one_error "incomplete checkpoint" "^error: $tmp/partial holds an incomplete checkpoint: optimizer.safetensors is missing" \
    build/stage-1 "${args[@]}" --stop_iteration=30 --out_dir="$tmp/partial"
check '[ "$(sums "$tmp/partial")" = "$before" ]' "a refused run changed the incomplete checkpoint"

# ---- resume=true needs a checkpoint; resume=false starts over -----------------------------------
expect_one_error "resume=true, nothing there" "^error: command line: key 'resume' is true but $tmp/empty holds no checkpoint" \
    build/stage-1 "${args[@]}" --resume=true --out_dir="$tmp/empty"
check '[ ! -e "$tmp/empty/metrics.jsonl" ]' "a refused resume=true wrote metrics"
expect_one_error "resume=maybe" "key 'resume': expected auto, true or false, found 'maybe'" \
    build/stage-1 "${args[@]}" --resume=maybe --out_dir="$tmp/empty"
build/stage-1 "${args[@]}" --stop_iteration=20 --seed=7 --out_dir="$tmp/seed7" >"$tmp/seed7.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the seed-7 run failed: $(tail -3 "$tmp/seed7.log")"
build/stage-1 "${args[@]}" --stop_iteration=20 --seed=7 --resume=false --out_dir="$tmp/resumed" >"$tmp/over.log" 2>&1
rc=$?; check '[ $rc -eq 0 ] && ! grep -q "^resuming" "$tmp/over.log"' "resume=false over another run failed: $(tail -3 "$tmp/over.log")"
check '[ "$(losses "$tmp/seed7/metrics.jsonl")" = "$(losses "$tmp/resumed/metrics.jsonl")" ]' \
    "resume=false did not start over: its losses are not those of a fresh seed-7 run"
finish test_resume
