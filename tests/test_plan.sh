#!/usr/bin/env bash
# The planner (build/plan) against the runs it predicts:
#  - for DDP on 2 and 4 ranks, FSDP on 2, 3 and 4 (and its ladder: ZeRO-1, ZeRO-2, HSDP), the
#    ten tensor-parallel grids of test_stage5.sh (with the same switches), a few 16-bit layouts,
#    pipelines (phi's too), recomputation in tensor-parallel grids and pipelines, experts, and
#    context parallelism (the ring and Ulysses), the predicted memory report equals the run's
#    stats.json row for row, byte for byte, and the predicted
#    communication per step equals every step's comm_bytes in metrics.jsonl and, per group and
#    collective, stats.json's totals divided by the steps -- exactly. Sequences are cut at
#    max_seq_len=64, shorter than every record, so every batch is T = 64 tokens as planned;
#  - the compute and bubble times follow docs/PLANNER.md's model, recomputed from the shape;
#  - --inference (stage 06's memory per rank): Llama-3.1-8B on [1,1,1] and [2,1,1] against the
#    figures by hand, and a tiny Llama's KV cache blocks against those its server allocates;
#  - the shipped cluster descriptions load; --calibrate describes this machine (on stage 08 for a
#    mixture of experts) and --measure reads its runs back (bytes and memory as planned);
#  - a malformed cluster description, a layout that cannot run and a rank count no layout fits
#    are each one clear error.
# Measured step times are not checked here (timing belongs to make bench: scripts/bench.sh).
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
source tests/server_lib.sh
source tests/plan_lib.sh
steps=3
args=(--config configs/tiny.json --max_seq_len=64 --eval_batches=0 --log_interval=100)
cluster=configs/clusters/h100-sxm.json

same ddp2 2 ddp
same ddp4 4 ddp --overlap_communication=true --bucket_size_mb=0.1
same fsdp2 2 fsdp
same fsdp3 3 fsdp --global_batch_size=12 --overlap_communication=true
same fsdp4 4 fsdp --gradient_acc_steps=2
# the ladder's lower rungs and hybrid sharding (04_fsdp/fsdp.h): ZeRO-2 overlapped and in bf16,
# HSDP with ZeRO-3 prefetching and with ZeRO-1 (its all-reduce per unit)
same zero1 2 zero1
same zero2 4 zero2 --overlap_communication=true --gradient_acc_steps=2
same zero2h 2 zero2 --precision=bf16-mixed
same hsdp2 4 hsdp2 --overlap_communication=true
same zero1_hsdp2 4 zero1-hsdp2
# the grids of test_stage5.sh, with its switches
tp_grids same
# 16 bits: copies in the memory report; stage 05's depth gathers and FSDP's block gathers move them
# (FSDP with the fp32 biases and LayerNorms packed apart: 3 ranks cut them unevenly)
same ddp2h 2 ddp --precision=bf16-mixed
same fsdp2h 2 fsdp --precision=bf16-mixed --overlap_communication=true
same fsdp3h 3 fsdp --precision=16-mixed --global_batch_size=12
same g112h 2 1,1,2 --precision=16-mixed
# a config written for another strategy (stage 05's, with its grid) plans and runs every layout
same from_axonn 2 ddp --strategy=axonn --tp_dimensions=2,1,1
# pipelines: rank 0's sends, send-recvs (a send followed by a receive) and receives follow the schedule
same pp2_1f1b 2 pp2 --microbatches=4 --pp_schedule=1f1b
same pp2_gpipe 2 pp2 --microbatches=4 --pp_schedule=gpipe
same pp2_dp2 4 pp2 --microbatches=2
same pp4_gpipe 4 pp4 --microbatches=4 --pp_schedule=gpipe --n_layer=4 --precision=bf16-mixed
# ... with phi (its own lm_head on the last stage: no tied-wte all-reduce) and with recomputation
same pp2_phi 2 pp2 --microbatches=4 --arch=phi
same pp2_dp2_recompute 4 pp2 --microbatches=2 --activation_checkpointing=true
# recomputation repeats each block's forward collectives: x, y and z, fp32 and 16-bit gathers
same g221rc 4 2,2,1 --activation_checkpointing=true
same g112rc 2 1,1,2 --activation_checkpointing=true --precision=bf16-mixed --overlap_communication=true
same g211x2rc 4 2,1,2 --activation_checkpointing=true --gradient_acc_steps=2
# phi-1_5's block: one LayerNorm, its own lm_head (reduce-scattered apart from wte)
same phi221 4 2,2,1 --arch=phi
# sequence parallelism (a config of stage 05's strategy): all-gathers and reduce-scatters for the
# x all-reduces, the residual's activations 1/x (phi's block gathers less; recomputation again)
same g211sp 2 2,1,1 --strategy=axonn --sequence_parallel=true
same g211sp_phi_rc 2 2,1,1 --strategy=axonn --sequence_parallel=true --arch=phi --activation_checkpointing=true
same phi221rc 4 2,2,1 --arch=phi --activation_checkpointing=true
same phi112h 2 1,1,2 --arch=phi --precision=bf16-mixed
# experts (stage 08): every byte with ep 1; with ep > 1 the memory and everything but the rows'
# all-to-alls (whose bytes depend on the routing)
same ep1 4 ep1 --num_experts=4
same ep2 4 ep2 --num_experts=4 --moe_every=2 --n_layer=3
same ep4 4 ep4 --num_experts=4 --experts_per_token=1
# context parallelism: the ring (with overlap; phi), Ulysses
same cp2 4 cp2 --overlap_communication=true
same cp2phi 4 cp2 --arch=phi
same cp4u 4 cp4u

# ---- the shipped cluster descriptions load and plan every layout of 8 ranks ----
for c in configs/clusters/*.json; do
    build/plan --cluster="$c" --json="$tmp/shipped.json" "${args[@]}" >"$tmp/shipped.log" 2>&1
    rc=$?
    n=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['layouts']))" "$tmp/shipped.json" 2>/dev/null)
    check '[ $rc -eq 0 ] && [ "${n:-0}" -gt 2 ]' "$c: exit $rc, ${n:-no} layouts: $(tail -2 "$tmp/shipped.log")"
done

# ---- the compute model as docs/PLANNER.md writes it, recomputed here from the model's shape ----
# a one-rank step = FLOPs / (peak x efficiency): the matmuls at the peak, the rest between them;
# rows split both; tensor parallelism splits the matmuls over x y and the rest over x (3T+21 per
# C) or y (20 per C); ranks beyond the cores share them; a pipeline's bubble only where the
# critical path exceeds the shared compute (cores: 2), (pp-1)/m of a rank's work otherwise (GPUs)
cat >"$tmp/model.json" <<'JSON'
{"name": "model check", "source": "test_plan.sh", "nodes": 1, "gpus_per_node": 4,
 "peak_tflops": {"fp32": 1, "bf16": 2}, "efficiency": 0.4, "memory_gib": 8,
 "intra_node": {"bandwidth_GBps": 10, "latency_us": 1}, "inter_node": {"bandwidth_GBps": 10, "latency_us": 1},
 "overlaps_compute": false, "cores": 2}
JSON
sed 's/, "cores": 2}/}/' "$tmp/model.json" >"$tmp/model_gpu.json"
for m in model model_gpu; do
    build/plan --cluster="$tmp/$m.json" --ranks=4 --layout="ddp+fsdp+4,1,1+2,2,1+1,1,4+2,1,1+pp2" \
        --json="$tmp/$m.plan.json" "${args[@]}" >"$tmp/$m.log" 2>&1
    rc=$?
    why=$(python3 - "$tmp/$m.plan.json" $([ $m = model ] && echo 2 || echo 0) 2>&1 <<'PY'
import json, sys
cores = int(sys.argv[2])
L, C, T, Vp, P, tokens = 2, 128, 64, 384, 4, 16 * 64
flops = (6 * (12 * L * C * C + Vp * C) + 12 * L * C * T) * tokens
matmuls = flops / 1e12
between = flops / (1e12 * 0.4) - matmuls
share = cores / P if cores and P > cores else 1.0
bad = []
for p in json.load(open(sys.argv[1]))["layouts"]:
    if p["stage"] == 5:
        x, y, z = p["tp_dimensions"]
        own = matmuls / P + between * ((3 * T + 21) / x + 20 / y) / (3 * T + 41) / (z * p["dp"])
    else:
        own = (matmuls + between) / P
    compute = own / share
    bubble = max(0.0, own * (1 + (p["pp"] - 1) / p["microbatches"]) - compute) if p["stage"] == 7 else 0.0
    for key, want in (("compute_s", compute), ("bubble_s", bubble)):
        if abs(p[key] - want) > 1e-9 * max(want, 1e-3):
            bad.append(f"{p['name']}: {key} {p[key]:.9g}, want {want:.9g}")
print("; ".join(bad))
sys.exit(1 if bad else 0)
PY
)
    check '[ $rc -eq 0 ] && [ -z "$why" ]' "$m: compute and bubble not as documented: ${why:-$(tail -2 "$tmp/$m.log")}"
done

# ---- this machine: --calibrate describes it, --measure runs the plan and reads the runs back ----
PLAN_OUT="$tmp/runs" build/plan --calibrate="$tmp/here.json" --ranks=2 "${args[@]}" >"$tmp/calibrate.log" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "--calibrate failed: $(tail -3 "$tmp/calibrate.log")"
# (two passes: the second runs again where the first saved its checkpoint, and must start over,
# not resume it and leave the first pass's metrics to be read again)
PLAN_OUT="$tmp/runs" build/plan --cluster="$tmp/here.json" --ranks=2 --layout=ddp+1,2,1 --measure=3 --passes=2 \
    --json="$tmp/measured.json" "${args[@]}" >"$tmp/measure.log" 2>&1
rc=$?
python3 - "$tmp/measured.json" >"$tmp/measure.cmp" 2>&1 <<'PY'
import json, sys
layouts = json.load(open(sys.argv[1]))["layouts"]
bad = [l["name"] for l in layouts if not (l["measured"]["memory_agrees"] and l["measured"]["comm_bytes"] == l["comm_bytes"]
                                          and l["measured"]["step_s"] > 0 and l["step_s"] > 0
                                          and len(l["measured"]["passes_step_s"]) == 2
                                          and all(c >= 0 for c in l["measured"]["passes_others_cores"])
                                          and l["measured"]["step_s"] == min(l["measured"]["passes_step_s"]))]
print(f"{len(layouts)} layouts measured; differing: {bad}")
sys.exit(1 if bad or len(layouts) != 2 else 0)
PY
same_here=$?
check '[ $rc -eq 0 ] && [ $same_here -eq 0 ]' "--measure on this machine: exit $rc, $(cat "$tmp/measure.cmp") $(tail -3 "$tmp/measure.log")"
check '! grep -q "resuming" "$tmp/runs/ddp.log" "$tmp/runs/tp-1-2-1.log"' \
    "--measure's second pass resumed the first pass's run: $(grep -h resuming "$tmp/runs/"*.log)"
# a mixture of experts calibrates on stage 08, the one stage that runs it: its efficiency is the
# description's, and the plan of its layouts uses it
PLAN_OUT="$tmp/runs" build/plan --calibrate="$tmp/here_moe.json" --ranks=2 "${args[@]}" --num_experts=4 \
    >"$tmp/calibrate_moe.log" 2>&1
rc=$?
check '[ $rc -eq 0 ] && python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(0 if list(d[\"stage_efficiency\"]) == [\"8\"] and d[\"efficiency\"] == d[\"stage_efficiency\"][\"8\"] and 0 < d[\"efficiency\"] <= 1 else 1)
" "$tmp/here_moe.json"' "--calibrate with experts: exit $rc, $(tail -2 "$tmp/calibrate_moe.log") $(cat "$tmp/here_moe.json" 2>/dev/null | tr -d '\n' | head -c 400)"

# ---- make bench's order check (tools/plan_order.py), on made-up passes ----
# Two layouts are ordered by the measurement when their quiet passes do not overlap, by the
# prediction when it puts them more than the model's error (10%) apart; the order agrees when no
# pair ordered by both is ordered oppositely. A, B, C, D: A < B and C < D ordered by both,
# agreeing (A's third pass ran beside another job: left out); C and A 5% apart in the prediction
# (tied there), apart in the measurement; B and D overlapping (tied in the measurement).
# E: predicted 1.5x slower than A, measured faster: a disagreement. F: two quiet passes of three,
# too few to compare.
made_up() { # made_up <file> <name:predicted:pass,pass,...[:other jobs' cores in each pass]> ...
    local file=$1; shift
    python3 - "$file" "$@" <<'PY'
import json, sys
layouts = []
for arg in sys.argv[2:]:
    name, predicted, passes, *others = arg.split(":")
    passes = [float(x) for x in passes.split(",")]
    others = [float(x) for x in others[0].split(",")] if others else [0.0] * len(passes)
    layouts.append({"name": name, "step_s": float(predicted), "comm_bytes": 1,
                    "measured": {"step_s": min(passes), "passes_step_s": passes, "passes_others_cores": others,
                                 "comm_bytes": 1, "memory_agrees": True}})
json.dump({"layouts": layouts}, open(sys.argv[1], "w"))
PY
}
order_is() { # order_is <plan.json> <expected pairs as JSON> <what>: how plan_order.py sorted the pairs
    local want=$2
    python3 tools/plan_order.py "$1" --json="$tmp/pairs.json" >"$tmp/order.txt" 2>&1
    local rc=$?
    check '[ $rc -eq 0 ] && python3 -c "import json, sys; pairs = lambda d: {k: sorted(v) for k, v in d.items()}
sys.exit(pairs(json.load(open(sys.argv[1]))) != pairs(json.loads(sys.argv[2])))" "$tmp/pairs.json" "$want"' \
        "$3: exit $rc, $(tr -d ' \n' <"$tmp/pairs.json" 2>/dev/null) $(cat "$tmp/order.txt")"
}
abcd=(A:10:10,11,10.5,30:0,0.05,0,1.2 B:20:20,21,20.5 C:10.5:12,12.5,12.2 D:30:19,22,20)
made_up "$tmp/agree.json" "${abcd[@]}" F:12:9,40,9.5:0,1,0
order_is "$tmp/agree.json" '{"agree": [["A", "B"], ["A", "D"], ["C", "B"], ["C", "D"]], "disagree": [],
    "measured_tie": [["B", "D"]], "predicted_tie": [["A", "C"]],
    "disturbed": [["A", "F"], ["C", "F"], ["F", "B"], ["F", "D"]]}' "ties, agreements and a disturbed layout"
check 'grep -q "order agrees: yes" "$tmp/order.txt"' "no disagreement, but: $(cat "$tmp/order.txt")"
made_up "$tmp/disagree.json" "${abcd[@]}" E:15:8,9,8.5
order_is "$tmp/disagree.json" '{"agree": [["A", "B"], ["A", "D"], ["C", "B"], ["C", "D"], ["E", "B"], ["E", "D"]],
    "disagree": [["A", "E"], ["C", "E"]], "measured_tie": [["B", "D"]], "predicted_tie": [["A", "C"]],
    "disturbed": []}' "a disagreement"
check 'grep -q "order agrees: no" "$tmp/order.txt" && grep -q "DISAGREE: predicted A < E" "$tmp/order.txt"' \
    "a disagreement not reported: $(cat "$tmp/order.txt")"
made_up "$tmp/busy.json" A:10:10,11,10.5:1,1,1 B:20:20,21,20.5:0,1,1
python3 tools/plan_order.py "$tmp/busy.json" >"$tmp/busy.txt" 2>&1
check 'grep -q "order agrees: nothing to compare" "$tmp/busy.txt"' "a busy machine said to agree: $(cat "$tmp/busy.txt")"
made_up "$tmp/one_pass.json" A:10:10 B:20:20,21
python3 tools/plan_order.py "$tmp/one_pass.json" >"$tmp/one_pass.txt" 2>&1
rc=$?
check '[ $rc -ne 0 ] && grep -q "A: expected at least 2 measured passes" "$tmp/one_pass.txt"' \
    "one pass (no spread) compared anyway: exit $rc, $(cat "$tmp/one_pass.txt")"

# ---- --inference: stage 06's memory per rank ----
# Llama-3.1-8B on the tutorial's inference setting (configs/llama-3.1-8b.json: bf16-mixed, batch 8,
# context 1024), sized from its model_id (random_init: no checkpoint), against the figures by
# hand: 32 blocks of q and o (4096 x 4096), k and v (1024 x 4096: 8 key/value heads of 128),
# gate, up and down (14336 x 4096) and 2 RMSNorms (4096), the embedding and the untied lm_head
# (128256 x 4096), the final RMSNorm: 8,030,261,248 parameters, 4 bytes each and their bf16 copy
# 2; the cache 8 x 1024 positions x 32 layers x keys and values x 8 x 128 x 4 bytes = 2 GiB. On
# [2,1,1] each rank holds half of every matrix and every RMSNorm whole, and 4 key/value heads.
serve_plan=(build/plan --inference --cluster=$cluster --config configs/llama-3.1-8b.json --random_init=true --tokenizer_path=)
"${serve_plan[@]}" --json="$tmp/serve1.json" >"$tmp/serve1.log" 2>&1
"${serve_plan[@]}" --ranks=2 --layout=2,1,1 --json="$tmp/serve2.json" >"$tmp/serve2.log" 2>&1
check 'python3 - "$tmp/serve1.json" "$tmp/serve2.json" <<PY
import json, sys
C, kv, ffn, V, L = 4096, 1024, 14336, 128256, 32
norms = (2 * L + 1) * C
n = L * (2 * C * C + 2 * kv * C + 3 * ffn * C) + 2 * V * C + norms
assert n == 8030261248
cache = 8 * 1024 * L * 2 * kv * 4
half = (n - norms) // 2 + norms
want = [{"weights (fp32)": 4 * n, "weights (bf16 copy)": 2 * n, "KV cache (fp32)": cache},
        {"weights (fp32)": 4 * half, "weights (bf16 copy)": 2 * half, "KV cache (fp32)": cache // 2}]
got = [json.load(open(p))["layouts"] for p in sys.argv[1:]]
ok = all(len(g) == 1 and g[0]["memory"] == w and g[0]["memory_total"] == sum(w.values()) for g, w in zip(got, want))
sys.exit(0 if ok and got[0][0]["tp_dimensions"] == [1, 1, 1] and got[1][0]["kv_heads_per_rank"] == 4 else 1)
PY' "--inference, Llama-3.1-8B: not the figures by hand: $(tail -3 "$tmp/serve1.log") $(tail -3 "$tmp/serve2.log")"
# served with kv_cache_memory_fraction: the share of what the weights leave of the GPU (the
# cluster's memory_gib), in blocks of 16 positions x 32 layers x keys and values x the rank's
# key/value heads x 128 x 4 bytes; a share too small for one whole context (64 blocks) does not fit
for f in 0.9 0.0001; do
    "${serve_plan[@]}" --serve=true --kv_cache_memory_fraction=$f --ranks=2 --json="$tmp/share$f.json" >"$tmp/share$f.log" 2>&1
done
check 'python3 - "$cluster" "$tmp/share0.9.json" "$tmp/share0.0001.json" <<PY
import json, math, sys
capacity = json.load(open(sys.argv[1]))["memory_gib"] * 2**30
def right(g, f):
    per_block = 16 * 32 * 2 * (8 // g["tp_dimensions"][0]) * 128 * 4
    m = g["memory"]
    blocks = math.floor(f * (capacity - m["weights (fp32)"] - m["weights (bf16 copy)"]) / per_block)
    return g["kv_cache_blocks"] == blocks and m["KV cache (fp32)"] == blocks * per_block and g["fits"] == (blocks >= 64)
big, small = (json.load(open(p))["layouts"] for p in sys.argv[2:])
sys.exit(not (len(big) == len(small) == 2 and all(right(g, 0.9) and g["fits"] for g in big)
              and all(right(g, 0.0001) and not g["fits"] for g in small)))
PY' "--inference, Llama-3.1-8B with kv_cache_memory_fraction: not the share of what the weights leave: $(tail -4 "$tmp/share0.9.log")"
# and the blocks a server of a tiny Llama allocates for kv_cache_bytes, on one rank and [2,1,1]
tiny_llama=(--config configs/inference.json --random_init=true --model_id=custom --arch=llama --n_layer=2 --n_head=4
            --n_kv_head=2 --n_embd=64 --intermediate_size=172 --serve=true --kv_block_size=4 --kv_cache_bytes=300000)
for np in 1 2; do
    build/plan --inference --cluster=$cluster --ranks=$np --layout=$np,1,1 "${tiny_llama[@]}" --json="$tmp/tiny$np.json" \
        >"$tmp/tiny$np.log" 2>&1
    start_server "tiny$np" $np "${tiny_llama[@]}" --tp_dimensions=$np,1,1
    served=$(curl -s -m 10 "$url/metrics" | sed -n 's/^workbook_kv_cache_blocks //p')
    stop_server
    planned=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["layouts"][0]["kv_cache_blocks"])' \
        "$tmp/tiny$np.json" 2>/dev/null)
    check '[ -n "$served" ] && [ "$planned" = "$served" ]' "--inference on $np rank(s): $planned KV blocks planned, $served served"
done
expect_one_error "--inference: a grid the key/value heads do not split over" \
    "no grid \[x, y, 1\] of 16 ranks named 16,1,1 can run this model: .*n_kv_head 8, x 16" "${serve_plan[@]}" --ranks=16 --layout=16,1,1

# ---- bad input: one clear error each ----
plan=(build/plan --ranks=4 "${args[@]}")
echo '{"name": "x", "source": "y", "nodes": 1, "gpus_per_node": 8,' >"$tmp/truncated.json"
expect_one_error "truncated cluster JSON" "truncated.json: expected a JSON object" "${plan[@]}" --cluster="$tmp/truncated.json"
sed 's/"bandwidth_GBps": 450/"bandwidth_GBps": "fast"/' $cluster >"$tmp/words.json"
expect_one_error "a bandwidth in words" "words.json: key 'intra_node.bandwidth_GBps': expected a number from .* found \"fast\"" \
    "${plan[@]}" --cluster="$tmp/words.json"
grep -v '"memory_gib"' $cluster >"$tmp/nomemory.json"
expect_one_error "no memory_gib" "nomemory.json: key 'memory_gib': expected a number .* found nothing" \
    "${plan[@]}" --cluster="$tmp/nomemory.json"
sed 's/"nodes"/"node"/' $cluster >"$tmp/typo.json"
expect_one_error "a misspelt key" "typo.json: key 'node': expected one of" "${plan[@]}" --cluster="$tmp/typo.json"
expect_one_error "a missing cluster file" "nothere.json" "${plan[@]}" --cluster="$tmp/nothere.json"
expect_one_error "a grid that cannot run" "3,1,1 cannot run on 4 ranks: key 'tp_dimensions' \[3, 1, 1\] does not fit: x\*y\*z must divide" \
    "${plan[@]}" --cluster=$cluster --layout=3,1,1
expect_one_error "an unknown layout" "option '--layout': pipeline cannot run on 4 ranks: expected ddp, fsdp" \
    "${plan[@]}" --cluster=$cluster --layout=pipeline
expect_one_error "more stages than blocks" "pp4 cannot run on 4 ranks: key 'pp_size': 4 stages for 2 blocks" \
    "${plan[@]}" --cluster=$cluster --layout=pp4
# (sequences of 12 tokens: context parallelism over 7 ranks would need 14)
expect_one_error "a rank count no layout fits" "7 ranks: no layout can run this config" \
    build/plan --ranks=7 "${args[@]}" --max_seq_len=12 --cluster=$cluster
sed 's/"memory_gib": 74.5/"memory_gib": 0.002/' $cluster >"$tmp/small.json"
expect_one_error "no layout fits in memory" "small.json: no layout fits in 0.0 GiB per GPU on 4 ranks" \
    "${plan[@]}" --cluster="$tmp/small.json"
finish test_plan
