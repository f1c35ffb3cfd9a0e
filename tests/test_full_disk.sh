#!/usr/bin/env bash
# A checkpoint save onto a full disk: one error naming the file and the bytes needed, a non-zero
# exit, no temp file left, and the previous checkpoint intact (it resumes to the losses of a run
# that never hit the full disk). The disk is a tmpfs just larger than one checkpoint (needs root).
source "$(dirname "$0")/lib.sh"
args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --global_batch_size=8 --eval_batches=1
      --log_interval=5 --checkpoint_interval=5)

build/stage-1 "${args[@]}" --stop_iteration=5 --out_dir="$tmp/one" >"$tmp/one.log" 2>&1
check '[ $? -eq 0 ]' "the sizing run failed: $(tail -3 "$tmp/one.log")"
kib=$(( $(du -sk "$tmp/one" | cut -f1) + 1024 ))  # room for one checkpoint, not for a second
mkdir -p "$tmp/disk"
mount -t tmpfs -o size=${kib}k tmpfs "$tmp/disk"
check '[ $? -eq 0 ]' "cannot mount a ${kib} KiB tmpfs at $tmp/disk (this test needs root)"
trap 'end_test_processes; umount "$tmp/disk" 2>/dev/null; rm -rf "$tmp"' EXIT

build/stage-1 "${args[@]}" --stop_iteration=10 --out_dir="$tmp/disk/run" >"$tmp/full.log" 2>&1
rc=$?
check '[ $rc -ne 0 ]' "the run reported success on a full disk"
check '[ "$(grep -c "^error" "$tmp/full.log")" -eq 1 ] && grep -q "^error.*cannot write $tmp/disk/run/.*\.tmp ([0-9]* bytes needed): No space left on device" "$tmp/full.log"' \
    "not one error naming the file, the bytes and the full disk: $(grep -i error "$tmp/full.log")"
check '! ls "$tmp/disk/run" | grep -q "\.tmp$"' "a temp file was left on the full disk"
step=$(python3 -c "import json,struct,sys; d=open(sys.argv[1],'rb').read(); n=struct.unpack('<Q',d[:8])[0]; print(json.loads(d[8:8+n])['__metadata__']['step'])" "$tmp/disk/run/optimizer.safetensors")
check '[ "$step" = 5 ]' "the checkpoint left on the full disk is of step '$step', expected 5"

# the step-5 checkpoint is whole: resumed elsewhere it gives the losses of an unbroken run
cp -r "$tmp/disk/run" "$tmp/resumed"
build/stage-1 "${args[@]}" --stop_iteration=10 --out_dir="$tmp/straight" >"$tmp/straight.log" 2>&1
build/stage-1 "${args[@]}" --stop_iteration=10 --resume=true --out_dir="$tmp/resumed" >"$tmp/resumed.log" 2>&1
check '[ $? -eq 0 ]' "resuming the checkpoint left on the full disk failed: $(tail -3 "$tmp/resumed.log")"
check 'compare_losses "$tmp/straight" "$tmp/resumed" 10 0' "the resumed losses differ from the unbroken run"
finish test_full_disk
