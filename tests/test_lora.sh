#!/usr/bin/env bash
# test_lora.sh: LoRA fine-tuning (common/run/lora.h) on the tiny Llama, in the stages (the op-level
# comparison with peft is tests/test_lora_oracle.sh). STAGE_BIN (tests/lib.sh) names the binaries,
# so that make test-cuda runs these on the CUDA build too.
#  - stage 01 with lora_rank: the base has no gradients and no AdamW state (stats.json's memory:
#    both the adapters' size), the run saves PEFT's two files and no model.safetensors, its losses
#    fall, activation_checkpointing gives the same losses, and a run starting from that adapter
#    (lora_adapter) goes on from where it stopped;
#  - stage 02: fp32 gives stage 01's losses, bf16-mixed (the base's bf16 copy, fp32 adapters) stays
#    within 1e-2 of them;
#  - the parallel stages that train adapters reproduce stage 01's LoRA losses within 1e-5 over 20
#    steps and save its adapter (the same tensors, names and shapes, values within 1e-5): 03 (DDP)
#    on 2 ranks with gradient buckets and on 4, whose all-reduce moves the adapters' gradients
#    only, 04 (FSDP, the base sharded and frozen, the adapters whole on every rank) on 2 ranks
#    with prefetching and on 4 as ZeRO-1 in 2 HSDP groups, which reduce-scatters no gradient and
#    all-reduces the adapters' only, 05 (tensor parallel, A and B split as their linear) on [2,2,1]
#    and [1,1,2], whose memory holds no gradient or moment of the base, 07 (pipeline, each stage its
#    blocks' adapters, the saved adapter put together from the stages') on 2 stages under 1f1b,
#    whose first stage holds two micro-batches in flight (backward recomputes x A^T), and on 2
#    stages x 2 replicas under gpipe, and 09 (context parallel) on 2;
#  - LoRA dropout (lora_dropout 0.3): stage 01's losses differ from its dropout-0 run's, and
#    activation_checkpointing reproduces them (the masks are recomputed); 03 on 2 ranks, 04 on 2, 05 on
#    [2,1,1] (a row-parallel linear's rank masks a column shard of the input), 07 on 2 stages under
#    1f1b (micro-batches out of order) and 09 on 2 (each rank two chunks of every sequence) reproduce
#    them within 1e-5, as each draws the masks of the global batch's elements; evaluation sees no
#    dropout: from one adapter, at a learning rate of 1e-9, runs with lora_dropout 0.5 and 0 train on
#    other losses and report one validation loss;
#  - refused by name: a target naming no linear, an adapter whose r differs from lora_rank, a stage
#    that does not train adapters, a pure bf16 precision (the adapters train in fp32), the zb-h1
#    pipeline schedule (it defers weight gradients).
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny_llama.json --stop_iteration=5 --eval_batches=1 --log_interval=100 --n_embd=64
      --intermediate_size=172 --lora_rank=4 --lora_alpha=8
      --lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)

# stage 01: the frozen base's memory, PEFT's files
run_single 1 lora
check 'python3 - "$tmp/lora" <<'"'PY'"'
import json, os, sys
d = sys.argv[1]
mem = json.load(open(os.path.join(d, "stats.json")))["memory"]
adapters = mem["gradients (fp32)"]  # the adapters only: the base has none
ok = mem["AdamW m and v (fp32)"] == 2 * adapters and 0 < adapters * 10 < mem["parameters (fp32)"] - adapters
ok = ok and os.path.exists(os.path.join(d, "adapter_model.safetensors")) and not os.path.exists(os.path.join(d, "model.safetensors"))
cfg = json.load(open(os.path.join(d, "adapter_config.json")))
ok = ok and cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8 and len(cfg["target_modules"]) == 7
losses = [json.loads(l)["loss"] for l in open(os.path.join(d, "metrics.jsonl"))]
sys.exit(0 if ok and len(losses) == 5 and losses[-1] < losses[0] else 1)
PY' "stage 01 LoRA: memory, files or losses wrong: $(cat "$tmp/lora/stats.json" | head -c 600)"

# recomputing the blocks' activations in backward recomputes the adapters' too: the same losses
run_single 1 recompute --activation_checkpointing=true
check 'compare_losses "$tmp/lora" "$tmp/recompute" 5 1e-6' "stage 01 LoRA with activation_checkpointing has other losses"

# stage 02: in fp32 the same losses as stage 01; in bf16-mixed (the base's matmuls read its bf16 copy,
# the adapters stay fp32) within bf16's rounding of stage 01's
run_single 2 lora32
check 'compare_losses "$tmp/lora" "$tmp/lora32" 5 1e-6' "stage 02 LoRA in fp32 strays from stage 01's losses"
run_single 2 lora16 --precision=bf16-mixed
check 'compare_losses "$tmp/lora" "$tmp/lora16" 5 1e-2 0.25' "stage 02 LoRA in bf16-mixed strays from stage 01's losses"

# from that adapter, the run goes on where it stopped: its first loss is below the first run's first
run_single 1 again --lora_adapter="$tmp/lora"
check 'python3 -c "
import json, sys
a = [json.loads(l)[\"loss\"] for l in open(sys.argv[1])]
b = [json.loads(l)[\"loss\"] for l in open(sys.argv[2])]
sys.exit(0 if b[0] < a[0] and b[0] < a[1] else 1)" "$tmp/lora/metrics.jsonl" "$tmp/again/metrics.jsonl"' \
    "stage 01 from its adapter does not start where it stopped"

# the parallel stages: stage 01's losses over 20 steps, its adapter's tensors
run_single 1 ref20 --stop_iteration=20
run_ranks 3 ddp2 2 --stop_iteration=20 --overlap_communication=true --bucket_size_mb=0.01
run_ranks 3 ddp4 4 --stop_iteration=20
run_ranks 4 fsdp2 2 --stop_iteration=20 --overlap_communication=true
run_ranks 4 fsdp4 4 --stop_iteration=20 --zero_stage=1 --hsdp_replicas=2
run_ranks 7 pp2 2 --stop_iteration=20 --pp_size=2 --num_microbatches=4
run_ranks 7 pp2dp2 4 --stop_iteration=20 --pp_size=2 --num_microbatches=2 --pp_schedule=gpipe
run_ranks 5 tp221 4 --stop_iteration=20 --tp_dimensions=2,2,1
run_ranks 5 tp112 2 --stop_iteration=20 --tp_dimensions=1,1,2 --overlap_communication=true
run_ranks 9 cp2 2 --stop_iteration=20 --cp_size=2
for run in ddp2 ddp4 fsdp2 fsdp4 tp221 tp112 pp2 pp2dp2 cp2; do
    check 'compare_losses "$tmp/ref20" "$tmp/$run" 20 1e-5' "LoRA run $run strays from stage 01's losses"
    check 'same_adapter "$tmp/ref20" "$tmp/$run"' "LoRA run $run saved another adapter than stage 01's"
done
# DDP's all-reduce: the adapters' gradients, once a step (stats.json: the bytes it moved)
check '[ "$(comm_value "$tmp/ddp4/stats.json" world all-reduce bytes)" -eq \
        $((20 * $(json_value "$tmp/ddp4/stats.json" memory "gradients (fp32)"))) ]' \
    "stage 03 LoRA all-reduced other than the adapters' gradients: $(comm_value "$tmp/ddp4/stats.json" world all-reduce bytes) bytes"
# FSDP's: the same, and no reduce-scatter (the base has no gradient); its memory holds a shard of
# the base, the adapters whole, and their gradients and moments only
check '[ "$(comm_value "$tmp/fsdp2/stats.json" world all-reduce bytes)" -eq \
        $((20 * $(json_value "$tmp/fsdp2/stats.json" memory "gradients (fp32)"))) ] &&
       ! comm_value "$tmp/fsdp2/stats.json" world reduce-scatter bytes >/dev/null' \
    "stage 04 LoRA moved other gradients than the adapters': $(grep -o '"communication".*' "$tmp/fsdp2/stats.json" | head -c 600)"
check 'python3 - "$tmp/fsdp2/stats.json" "$tmp/ddp2/stats.json" <<'"'PY'"'
import json, sys
fsdp, ddp = (json.load(open(p))["memory"] for p in sys.argv[1:])
adapters = fsdp["gradients (fp32)"]
ok = adapters == ddp["gradients (fp32)"] and fsdp["AdamW m and v (fp32)"] == 2 * adapters
# the parameters: half the base (2 shards) beside the whole adapters; DDP holds the whole base
sys.exit(0 if ok and abs(2 * (fsdp["parameters (fp32)"] - adapters) - (ddp["parameters (fp32)"] - adapters)) <= 8 * 4 else 1)
PY' "stage 04 LoRA's memory report is not a shard of the base and the adapters whole: $(head -c 600 "$tmp/fsdp2/stats.json")"

check 'python3 - "$tmp/tp221/stats.json" <<'"'PY'"'
import json, sys
mem = json.load(open(sys.argv[1]))["memory"]
adapters = mem["gradients (fp32)"]  # the slices of the adapters on this rank only
sys.exit(0 if mem["AdamW m and v (fp32)"] == 2 * adapters and 0 < adapters * 5 < mem["parameters (fp32)"] - adapters else 1)
PY' "stage 05 LoRA's memory report counts the base's gradients or moments: $(head -c 600 "$tmp/tp221/stats.json")"

# LoRA dropout: the masks act, and every layout draws stage 01's
run_single 1 drop --lora_dropout=0.3
check 'python3 -c "
import json, sys
a = [json.loads(l)[\"loss\"] for l in open(sys.argv[1])]
b = [json.loads(l)[\"loss\"] for l in open(sys.argv[2])]
sys.exit(0 if len(a) == len(b) == 5 and max(abs(x - y) for x, y in zip(a, b)) > 1e-4 else 1)" \
    "$tmp/lora/metrics.jsonl" "$tmp/drop/metrics.jsonl"' "stage 01 with lora_dropout 0.3 has the losses of lora_dropout 0"
run_single 1 droprecompute --lora_dropout=0.3 --activation_checkpointing=true
check 'compare_losses "$tmp/drop" "$tmp/droprecompute" 5 1e-6' \
    "stage 01 LoRA dropout with activation_checkpointing has other losses"
run_ranks 3 dropddp2 2 --lora_dropout=0.3
run_ranks 4 dropfsdp2 2 --lora_dropout=0.3
run_ranks 5 droptp211 2 --lora_dropout=0.3 --tp_dimensions=2,1,1
run_ranks 7 droppp2 2 --lora_dropout=0.3 --pp_size=2 --num_microbatches=4
run_ranks 9 dropcp2 2 --lora_dropout=0.3 --cp_size=2
for run in dropddp2 dropfsdp2 droptp211 droppp2 dropcp2; do
    check 'compare_losses "$tmp/drop" "$tmp/$run" 5 1e-5' "LoRA dropout run $run strays from stage 01's losses"
done
# evaluation without dropout: an adapter that moves the loss, one step of lr 1e-9 from it (the
# weights evaluated are the adapter's to ~1e-9) with and without dropout
run_single 1 strong --stop_iteration=3 --lr=1e-2 --warmup_steps=0
run_single 1 evalp0 --stop_iteration=1 --lr=1e-9 --min_lr=0 --lora_adapter="$tmp/strong"
run_single 1 evalp5 --stop_iteration=1 --lr=1e-9 --min_lr=0 --lora_adapter="$tmp/strong" --lora_dropout=0.5
check 'python3 -c "
import json, sys
a, b = (json.loads(open(p).readline()) for p in sys.argv[1:])
sys.exit(0 if abs(a[\"loss\"] - b[\"loss\"]) > 1e-3 and abs(a[\"val_loss\"] - b[\"val_loss\"]) < 1e-6 else 1)" \
    "$tmp/evalp0/metrics.jsonl" "$tmp/evalp5/metrics.jsonl"' \
    "lora_dropout 0.5 does not change training's loss, or changes the validation loss: $(head -c 300 "$tmp/evalp5/metrics.jsonl")"

expect_one_error "a LoRA target naming no linear" "lora_targets.*\"c_attn\" names no linear" \
    $STAGE_BIN/stage-1 "${args[@]}" --lora_targets=q_proj,c_attn --out_dir="$tmp/bad"
expect_one_error "an adapter of another rank" "adapter_config.json: r 4.*lora_rank" \
    $STAGE_BIN/stage-1 "${args[@]}" --lora_rank=8 --lora_adapter="$tmp/lora" --out_dir="$tmp/bad"
expect_one_error "LoRA in a stage without it" "lora_rank.*stage 08 does not train LoRA" \
    mpirun -np 2 --bind-to none $STAGE_BIN/stage-8 "${args[@]}" --out_dir="$tmp/bad"
expect_one_error "LoRA under zb-h1" "pp_schedule.*zb-h1.*LoRA" \
    mpirun -np 2 --bind-to none $STAGE_BIN/stage-7 "${args[@]}" --pp_size=2 --num_microbatches=2 --pp_schedule=zb-h1 \
    --comm_backend=mpi --out_dir="$tmp/bad"
expect_one_error "LoRA over a pure bf16 base" "precision.*bf16.*bf16-mixed" \
    $STAGE_BIN/stage-2 "${args[@]}" --precision=bf16 --out_dir="$tmp/bad"

finish test_lora
