#!/usr/bin/env bash
# Exact resume: 20 steps straight, and 10 steps + resume + 10 steps, give bit-identical losses
# (the same metrics.jsonl values), and the checkpoint_interval saves happen.
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
finish test_resume
