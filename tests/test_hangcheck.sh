#!/usr/bin/env bash
# The flight recorder (common/comm/flight.h) and tools/hangcheck on stage 03, 4 ranks, a 3 s
# COMM_TIMEOUT: each hang the test-only COMM_FAULT injects on rank 3 at collective #6 of group
# world (a skipped collective, a mismatched one, a dead rank, a far slower rank, a send nobody
# receives) ends the job with every surviving rank's ring written, and the paragraph tools/hangcheck
# prints from them names the class, rank 3, the group and the operation, within 30 s of the moment
# the others began to wait plus the timeout. The jobs that time out print the same paragraph in
# their own log. SIGUSR2 writes every rank's ring and the run carries on to its end; on a pipeline
# (stage 07) the rings number each rank's sends to a peer and receives from it apart, 1, 2, 3 ...,
# and a send and the receive of the same number are the same message.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
TIMEOUT=3
args=(--config configs/tiny.json --stop_iteration=5 --eval_batches=1 --log_interval=100)

# the real-time second at which rank 0 began to wait in the operation it never finished
waited_since() {
    python3 -c 'import json, sys
ops = [o for o in json.load(open(sys.argv[1]))["ops"] if o["state"] != "completed"]
print(min(o["started_us"] or o["issued_us"] for o in ops) / 1e6 if ops else 0)' "$1"
}
# the diagnosis came no later than 30 s after the timeout (a dead rank ends the job before it)

# hang_class <class> <what the paragraph must say> <in the job's log too: yes|no>
hang_class() {
    local class=$1 want=$2 in_log=$3 out="$tmp/$1"
    COMM_FAULT=$class:3:world:6 COMM_TIMEOUT=$TIMEOUT mpirun_aborting 90 "$out.log" 4 build/stage-3 "${args[@]}" \
        --out_dir="$out"
    check '[ "$rc" = lingered ] || { [ $rc -ne 0 ] && [ $rc -ne 124 ]; }' \
        "$class: exit $rc (want a failed job, not the 90 s guard): $(tail -3 "$out.log")"
    local said; said=$(python3 tools/hangcheck "$out")
    local now; now=$(date +%s.%N)
    check 'echo "$said" | grep -qF "$want"' "$class: hangcheck does not say '$want': $said"
    local since; since=$(waited_since "$out/flight-rank0.json")
    check 'python3 -c "import sys; sys.exit(not $since > 0 and $now - $since - $TIMEOUT < 30)"' \
        "$class: the diagnosis came $(python3 -c "print(round($now - $since - $TIMEOUT))") s after the timeout"
    if [ "$in_log" = yes ]; then
        check 'grep -qF "$want" "$out.log"' "$class: the job's log does not hold the diagnosis: $(grep -A2 "flight recorder" "$out.log")"
    fi
}

hang_class skip "rank 3 never issued all-reduce #6 on group world (it is in no communication" yes
hang_class mismatch "rank 3 called a different collective at #6 on group world than the other ranks: ranks 0-2 call all-reduce of 24 bytes; rank 3 calls all-reduce of 4 bytes" no
hang_class dead "rank 3 wrote no flight record: dead (killed, crashed, or its host is gone); ranks 0-2 wait in all-reduce #6 on group world" no
hang_class slow "rank 3 is far slower than the rest: at the last" yes
grep -qF "has not yet issued all-reduce #6 on group world" "$tmp/slow.log"
check '[ $? -eq 0 ]' "slow: the operation the others wait in is not named: $(grep hangcheck "$tmp/slow.log")"
hang_class send "send #1 from rank 3 to rank 0 on group world has no matching receive: rank 0 has taken 0 message(s) from rank 3 (it is in all-reduce #6 on group world)" yes

# usr2_run <name> <ranks> <stage> [args...]: a 20-step run of the stage, sent SIGUSR2 (mpirun passes
# it on to every rank) at step 2: each rank writes its ring, and the run goes on to its end
usr2_run() {
    local name=$1 np=$2 stage=$3 job rc; shift 3
    COMM_TIMEOUT=$TIMEOUT timeout --kill-after=5 90 mpirun -np "$np" --bind-to none "build/stage-$stage" "${args[@]}" --stop_iteration=20 \
        --out_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 &
    job=$!
    for _ in $(seq 300); do grep -q '"step": *2\b' "$tmp/$name/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done
    kill -USR2 "$(pgrep -P $job mpirun)"  # timeout would die of it
    wait $job
    rc=$?
    check '[ $rc -eq 0 ] && grep -q "step    20/20" "$tmp/$name.log"' "SIGUSR2 ($name): the run did not carry on: exit $rc: $(tail -3 "$tmp/$name.log")"
    check '[ "$(grep -l "\"reason\":\"signal SIGUSR2\"" "$tmp/$name"/flight-rank*.json | wc -l)" -eq "$np" ]' \
        "SIGUSR2 ($name): not every rank wrote its ring: $(ls "$tmp/$name")"
}
usr2_run usr2 4 3

# the messages' numbers, on a pipeline (stage 07, 1F1B: each stage sends to and receives from the
# other): in every ring, the sends to a rank and the receives from it each count 1, 2, 3 ... in
# the order issued (on a group), and a send numbered n on one rank's ring and the receive numbered
# n from it on the other's are the same message (the same bytes), at least one such pair seen
usr2_run usr2_pp 2 7 --pp_size=2 --num_microbatches=4
check 'python3 - "$tmp/usr2_pp" <<'"'PY'"'
import glob, json, sys
sends, recvs, gaps = {}, {}, []
for path in glob.glob(sys.argv[1] + "/flight-rank*.json"):
    ring = json.load(open(path))
    me, groups, last = ring["rank"], ring["groups"], {}
    for op in sorted(ring["ops"], key=lambda o: o["ticket"]):
        parts = []
        if op["kind"] in ("send", "send-recv"):
            parts.append(("send", op["group"], me, groups[op["group"]]["members"][op["peer"]], op["seq"]))
        if op["kind"] == "recv":
            parts.append(("recv", op["group"], groups[op["group"]]["members"][op["peer"]], me, op["seq"]))
        if op["kind"] == "send-recv" and op["recv_peer"] >= 0:
            parts.append(("recv", op["group"], groups[op["group"]]["members"][op["recv_peer"]], me, op["recv_seq"]))
        for way, group, src, dst, seq in parts:
            key = (way, group, src, dst)
            if key in last and seq != last[key] + 1:
                gaps.append(f"rank {me}: {way} {src}->{dst} #{seq} after #{last[key]}")
            last[key] = seq
            (sends if way == "send" else recvs)[(group, src, dst, seq)] = op["bytes"]
pairs = set(sends) & set(recvs)
differ = [k for k in pairs if sends[k] != recvs[k]]
print(f"{len(pairs)} messages seen on both sides; gaps {gaps[:3]}; differing {differ[:3]}")
sys.exit(0 if pairs and not gaps and not differ else 1)
PY' "the flight recorder's message numbers on a pipeline do not count each way on its own"
finish test_hangcheck
