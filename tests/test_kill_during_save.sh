#!/usr/bin/env bash
# A job killed in the middle of a checkpoint save (SIGKILL, as scancel sends after KillWait): the
# test hook CHECKPOINT_KILL_AT_BYTE stops the second save at points from its first bytes to its
# last, through all three files. Every time the process is gone, the checkpoint left is step 1's
# and whole, and the resumed run ends with the losses of a run that was never killed.
source "$(dirname "$0")/lib.sh"
steps=4
args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --global_batch_size=8 --eval_batches=1
      --log_interval=1 --checkpoint_interval=1 --stop_iteration=$steps)

build/stage-1 "${args[@]}" --out_dir="$tmp/straight" >"$tmp/straight.log" 2>&1
check '[ $? -eq 0 ]' "the uninterrupted run failed: $(tail -3 "$tmp/straight.log")"
# the bytes of one checkpoint: the first save writes these, the second save the same again
one=$(cat "$tmp/straight"/{model.safetensors,config.json,optimizer.safetensors} | wc -c)
saved_step() { python3 -c "import json,struct,sys; d=open(sys.argv[1],'rb').read(); n=struct.unpack('<Q',d[:8])[0]; print(json.loads(d[8:8+n])['__metadata__']['step'])" "$1/optimizer.safetensors"; }

for at in 100 $((one / 4)) $((one / 2)) $((one * 3 / 4)) $((one - 1)); do
    out="$tmp/killed_$at"
    CHECKPOINT_KILL_AT_BYTE=$((one + at)) build/stage-1 "${args[@]}" --out_dir="$out" >"$out.log" 2>&1
    rc=$?
    check '[ $rc -eq 137 ]' "kill at byte $at of the save: exit $rc, expected 137 (SIGKILL)"
    check '! pgrep -f -- "--out_dir=$out\$" >/dev/null' "kill at byte $at: the process is still running"
    check '[ "$(saved_step "$out")" = 1 ]' "kill at byte $at: the checkpoint left is of step $(saved_step "$out"), not 1"
    rm -f "$out"/*.tmp  # what docs/CLUSTER.md tells you to do after a kill mid-save
    build/stage-1 "${args[@]}" --resume=true --out_dir="$out" >"$out.resume.log" 2>&1
    check '[ $? -eq 0 ]' "kill at byte $at: the checkpoint left does not resume: $(tail -3 "$out.resume.log")"
    check 'compare_losses "$tmp/straight" "$out" $steps 0 >/dev/null' "kill at byte $at: resumed losses differ"
done
finish test_kill_during_save
