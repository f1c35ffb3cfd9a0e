#!/usr/bin/env bash
# The planner's stage-10 meshes (build/plan, plan_composed) against the runs it predicts:
#  - on tp 2 x pp 2 x dp 2 (8 ranks), tp 2 x pp 2 x cp 2 (8 ranks; fp32 and bf16-mixed), tp 2 x cp 2 x dp 2 (Llama: the
#    head on rank 0), tp 2 x pp 3 (phi, 4 blocks split 2, 1, 1, 3 micro-batches, gpipe), pp 2 x cp 3
#    (T 66: chunks of 11), tp 2 x pp 2 with sequence_parallel (GPT-2 and phi), interleaved on tp 2 x pp 2 x
#    dp 2 (5 blocks over 4 virtual stages) and zb-h1 on tp 2 x pp 2 (GPT-2) and x dp 2 (Llama, 3
#    micro-batches), with their per-chunk activations and deferred weight gradients, and ZeRO-1 as the
#    data dimension on tp 2 x pp 2 x dp 2, x cp 2 (over "context") and x dp 3 (T 66: shards of
#    ceil(n / 3), the last padded), with the moments' and scratch shard's rows, rank 0's memory
#    report equals the run's stats.json row for row, and the predicted bytes per step equal every
#    step's comm_bytes and, per group and collective, stats.json's totals divided by the steps --
#    exactly (stage 10's memory and bytes, 10_composed/README.md's table, are the planner's);
#  - the stage that holds the most decides: under gpipe (every stage keeps every micro-batch) the
#    last stage, with the head's logits, outweighs rank 0's stage 0;
#  - Llama-2-7B on 4 nodes of 4 A100s (the tutorial's model and cluster) ranks stage 10's meshes
#    with the tutorial's FSDP and [2, 2, 1] runs, and names its best mesh and why; on 4 nodes of 8,
#    where the best two meshes differ most in their bubble, the reason names the bubble;
#  - a mesh stage 10 does not run is one clear error.
# Measured step times are not compared here (make bench: scripts/bench.sh).
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
source tests/plan_lib.sh
steps=2
args=(--config configs/tiny.json --max_seq_len=64 --eval_batches=0 --log_interval=100)
cluster=configs/clusters/h100-sxm.json

same t2p2d2 8 tp2-pp2 --microbatches=2
same t2p2c2 8 tp2-pp2-cp2 --microbatches=2
same t2p2c2_bf16 8 tp2-pp2-cp2 --microbatches=2 --precision=bf16-mixed
same t2c2d2_llama 8 tp2-cp2 --microbatches=2 --arch=llama
same t2p3_phi 6 tp2-pp3 --microbatches=3 --n_layer=4 --global_batch_size=12 --arch=phi --pp_schedule=gpipe
same p2c3 6 pp2-cp3 --microbatches=2 --max_seq_len=66
same t2p2_sp 4 tp2-pp2 --microbatches=2 --strategy=composed --sequence_parallel=true
same t2p2_sp_phi 4 tp2-pp2 --microbatches=4 --strategy=composed --sequence_parallel=true --arch=phi
same t2p2d2_inter 8 tp2-pp2 --microbatches=2 --n_layer=5 --pp_schedule=interleaved --virtual_stages=2
same t2p2_zb 4 tp2-pp2 --microbatches=4 --n_layer=4 --pp_schedule=zb-h1
same t2p2d2_zb_llama 8 tp2-pp2 --microbatches=3 --global_batch_size=12 --pp_schedule=zb-h1 --arch=llama
same t2p2d2_zero 8 tp2-pp2 --microbatches=2 --strategy=composed --zero_stage=1
same t2p2c2_zero 8 tp2-pp2-cp2 --microbatches=2 --strategy=composed --zero_stage=1
same t2p2d3_zero 12 tp2-pp2 --microbatches=2 --global_batch_size=12 --max_seq_len=66 --strategy=composed --zero_stage=1

# the stage holding the most: with gpipe both stages keep both micro-batches, and the last one's
# activations hold the head's logits (r x T x Vp / tp floats each)
build/plan --cluster=$cluster --ranks=4 --layout=tp2-pp2 --microbatches=2 --pp_schedule=gpipe \
    --json="$tmp/heaviest.json" "${args[@]}" >"$tmp/heaviest.log" 2>&1
check 'python3 -c "
import json, sys
p = json.load(open(sys.argv[1]))[\"layouts\"][0]
sys.exit(0 if p[\"heaviest_stage\"] == 1 and p[\"heaviest_memory_total\"] > p[\"memory_total\"] else 1)
" "$tmp/heaviest.json"' "gpipe on tp 2 x pp 2: the last stage is not the heaviest: $(tail -2 "$tmp/heaviest.log")"

# ---- Llama-2-7B on 4 nodes of 4 A100s: the tutorial's runs beside stage 10's meshes ----
# (gradient_acc_steps 2: FSDP's and DDP's 16 replicas then split the batch of 32)
build/plan --cluster=configs/clusters/a100-40gb.json --nodes=4 --gpus_per_node=4 --config configs/llama-2-7b.json \
    --random_init=true --tokenizer_path= --init_from= --gradient_acc_steps=2 --json="$tmp/llama.json" >"$tmp/llama.log" 2>&1
rc=$?
check '[ $rc -eq 0 ] && python3 -c "
import json, sys
plan = json.load(open(sys.argv[1]))
layouts = {p[\"name\"]: p for p in plan[\"layouts\"]}
best = plan[\"layouts\"][0]
sys.exit(0 if best[\"stage\"] == 10 and best[\"fits\"] and plan[\"why\"].startswith(best[\"name\"] + \" wins\")
         and plan[\"ranks\"] == 16 and {\"FSDP\", \"TP [2,2,1] x 4\"} <= set(layouts)
         and best[\"step_s\"] < layouts[\"FSDP\"][\"step_s\"] and best[\"step_s\"] < layouts[\"TP [2,2,1] x 4\"][\"step_s\"] else 1)
" "$tmp/llama.json"' "Llama-2-7B on 4 x 4 A100s: no stage-10 mesh named best: exit $rc, $(tail -2 "$tmp/llama.log")"

# on 4 nodes of 8 A100s, without the cp meshes (a Ulysses cp, which stage 10 does not run), the best
# two meshes differ most in their pipeline's bubble: the reason says so
build/plan --cluster=configs/clusters/a100-80gb.json --nodes=4 --config configs/llama-2-7b.json --cp_impl=ulysses \
    --random_init=true --tokenizer_path= --init_from= --json="$tmp/llama32.json" >"$tmp/llama32.log" 2>&1
check 'python3 -c "
import json, sys
plan = json.load(open(sys.argv[1]))
a, b = plan[\"layouts\"][:2]
sys.exit(0 if b[\"bubble_s\"] - a[\"bubble_s\"] > abs(b[\"exposed_comm_s\"] - a[\"exposed_comm_s\"])
         and \"its pipeline idles\" in plan[\"why\"] else 1)
" "$tmp/llama32.json"' "Llama-2-7B on 4 x 8 A100s: the bubble decides, but not the reason: $(tail -1 "$tmp/llama32.log")"

# ---- a mesh stage 10 does not run ----
plan=(build/plan --cluster=$cluster --ranks=8 "${args[@]}")
expect_one_error "cp beside sequence parallelism" "tp2-cp2 cannot run on 8 ranks: stage 10: cp_size 2 runs as a ring without" \
    "${plan[@]}" --layout=tp2-cp2 --strategy=composed --sequence_parallel=true
expect_one_error "zb-h1 beside sequence parallelism" "tp2-pp2 cannot run on 8 ranks: stage 10: key 'pp_schedule' is 'zb-h1'" \
    "${plan[@]}" --layout=tp2-pp2 --pp_schedule=zb-h1 --strategy=composed --sequence_parallel=true
expect_one_error "ZeRO-1 over more than one data group" "tp2-pp2 cannot run on 8 ranks: stage 10: key 'hsdp_replicas' is 2" \
    "${plan[@]}" --layout=tp2-pp2 --strategy=composed --zero_stage=1 --hsdp_replicas=2
expect_one_error "tp that the heads do not split over" "tp3-pp2 cannot run on 8 ranks: .*" "${plan[@]}" --layout=tp3-pp2
finish test_plan_composed
