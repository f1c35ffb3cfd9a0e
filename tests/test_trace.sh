#!/usr/bin/env bash
# Traces (trace: true, common/base/trace.h), read by tools/trace_check.py:
#  - stage 01, stage 03 on 2 ranks (overlap on and off) and stage 04 on 2 ranks write a
#    trace.json that parses, whose events all have ph, ts, pid, tid, non-negative durations and
#    nest on every track; every collective of a group appears on each rank with the same bytes,
#    and ends on every rank after the last rank started it (rank 0's clock, merged);
#  - trace_steps bounds it: one optimizer event per rank per traced step;
#  - stage 03 with overlap_communication: bucket all-reduces are in flight during block
#    backward compute; without it, none is;
#  - without trace: no file; trace_steps 0: one error.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny.json --stop_iteration=3 --eval_batches=1 --log_interval=100 --n_layer=2 --n_embd=64
      --trace=true --trace_steps=2)

valid() {
    local out
    out=$(python3 tools/trace_check.py valid "$tmp/$1/trace.json" 2>&1)
    check '[ $? -eq 0 ]' "$1: trace.json is not a valid timeline: $out"
}

build/stage-1 "${args[@]}" --trace_steps=3 --out_dir="$tmp/s1" >"$tmp/s1.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/s1.log")"
valid s1
blocks=$(python3 tools/trace_check.py count "$tmp/s1/trace.json" "block 1 backward")
check '[ "$blocks" = "0:3" ]' "stage 1: 'block 1 backward' per rank is '$blocks', want 0:3 (3 traced steps)"
for name in "data load" "embedding forward" "head forward" "loss" "embedding backward" "checkpoint write"; do
    n=$(python3 tools/trace_check.py count "$tmp/s1/trace.json" "$name")
    check '[ -n "$n" ]' "stage 1: no '$name' event in the trace"
done

run_ranks 3 overlap 2 --overlap_communication=true --bucket_size_mb=0.05
run_ranks 3 plain 2 --overlap_communication=false
run_ranks 4 fsdp 2
for name in overlap plain fsdp; do valid $name; done
steps=$(python3 tools/trace_check.py count "$tmp/plain/trace.json" optimizer)
check '[ "$steps" = "0:2 1:2" ]' "trace_steps=2 of 3 steps: optimizer events per rank '$steps', want '0:2 1:2'"
gathers=$(python3 tools/trace_check.py count "$tmp/fsdp/trace.json" all-gather)
check '[[ "$gathers" =~ ^0:[1-9][0-9]*\ 1:[1-9] ]]' "stage 4: all-gathers per rank '$gathers', want some on both ranks"

on=$(python3 tools/trace_check.py overlap "$tmp/overlap/trace.json")
off=$(python3 tools/trace_check.py overlap "$tmp/plain/trace.json")
check 'awk -v x="$on" "BEGIN { exit !(x > 0) }"' "overlap on: bucket all-reduces overlap backward compute for $on us, want > 0"
check '[ "$off" = "0.000" ]' "overlap off: the all-reduce overlaps backward compute for $off us, want 0"

build/stage-1 --config configs/tiny.json --stop_iteration=1 --eval_batches=1 --out_dir="$tmp/none" >/dev/null 2>&1
check '[ ! -e "$tmp/none/trace.json" ]' "trace off still wrote $tmp/none/trace.json"
expect_one_error "trace_steps 0" "trace_steps" build/stage-1 --config configs/tiny.json --trace_steps=0 --out_dir="$tmp/bad"
finish test_trace
